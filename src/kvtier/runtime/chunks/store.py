"""One kvtier tier behind opaque engine keys: lookups from memory, engine jobs run as tier jobs.

An engine job moves several chunks at once (rows of the engine's shared region, see
:mod:`~kvtier.runtime.chunks.rows`); a kvtier tier moves one block per job. :class:`ChunkStore`
submits one tier job per chunk and reports each engine job once, when all of its chunks are done
(:class:`JobOutcome`: which chunks succeeded; a chunk that failed is a miss).

Keys. An engine key (vLLM: block hash + group index) becomes a 32-byte kvtier key bound to the
namespace (:func:`chunk_key`), so a record is found only in the namespace that wrote it, and its
header (namespace digest, key, checksum) is checked on every read by the tier itself: a record of
another namespace, or one that fails its checksum, is a failed read (``rejected``, counted), never
data. The tier forgets such a record, so it is not offered again.

Threading: every method runs on the caller's thread (vLLM: the scheduler's, under its offloading
manager's lock); never blocks on I/O except :meth:`ChunkStore.drain` and :meth:`ChunkStore.close`.
Buffers: the rows of a job stay pinned by the caller until the job's outcome is returned.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import blake3

from kvtier.core.keys import BlockKey
from kvtier.core.residency import ChangeKind
from kvtier.runtime.chunks.rows import Rows
from kvtier.runtime.orchestrator import REFRESH_INTERVAL_S
from kvtier.tiers.base import IoError, IoKind, IoResult, Presence, SecondaryTier, TierUsage

_KEY_DOMAIN = b"kvtier/vllm-offload-key\0"
DRAIN_POLL_S = 0.001


def chunk_key(namespace_digest: bytes, engine_key: bytes) -> BlockKey:
    """The kvtier key of ``engine_key`` in a namespace: BLAKE3(domain, namespace digest, length,
    engine key). ``tests/test_native_chunks.py`` pins its value for known inputs."""
    return blake3.blake3(_KEY_DOMAIN + bytes(namespace_digest) + len(engine_key).to_bytes(2, "little")
                         + bytes(engine_key)).digest()


class Answer(enum.Enum):
    """A lookup's answer, from memory."""

    HIT = "hit"
    MISS = "miss"
    RETRY = "retry"  # a remote tier is being asked; ask again later


@dataclass(frozen=True, slots=True)
class JobOutcome:
    """One engine job, done. ``ok_keys``: the engine keys that succeeded when some failed (None:
    all share ``ok``)."""

    job_id: int
    ok: bool
    ok_keys: tuple[bytes, ...] | None
    num_bytes: int
    seconds: float


@dataclass
class _OpenJob:
    kind: IoKind
    started: float
    pending: int = 0
    num_bytes: int = 0
    done: list[bytes] = field(default_factory=list)
    failed: list[bytes] = field(default_factory=list)


READ_FAILURES = {IoError.CORRUPT: "rejected", IoError.NOT_FOUND: "vanished", IoError.IO: "io_error"}
"""How a failed read is counted: ``rejected`` (bad checksum, short or foreign record: quarantined or
deleted), ``vanished`` (evicted or deleted since the lookup), ``io_error``."""


class ChunkStore:
    """``tier`` holding the chunks of one namespace (``namespace_digest``); ``rows`` the engine's region."""

    def __init__(self, tier: SecondaryTier, rows: Rows, *, namespace_digest: bytes, chunk_tokens: int,
                 record_residency: bool = False, refresh_interval_s: float = REFRESH_INTERVAL_S):
        self.tier = tier
        self._refresh_interval_s = refresh_interval_s
        self._next_refresh = time.monotonic() + refresh_interval_s
        self._rows = rows
        self._digest = bytes(namespace_digest)
        self._chunk_tokens = chunk_tokens
        self._ids = itertools.count(1)
        self._subs: dict[int, tuple[int, bytes]] = {}  # tier job id -> (engine job id, engine key)
        self._jobs: dict[int, _OpenJob] = {}
        self._ready: list[JobOutcome] = []
        self.counts: Counter[str] = Counter()
        # kvtier key -> engine key, for residency changes (kept only while they are recorded)
        self._names: dict[BlockKey, bytes] | None = {} if record_residency else None
        if record_residency:
            tier.residency.enable()

    def key_of(self, engine_key: bytes) -> BlockKey:
        return chunk_key(self._digest, engine_key)

    # ------------------------------------------------------------------ lookups

    def lookup(self, engine_key: bytes) -> Answer:
        """From memory: HIT, MISS, or RETRY while a remote tier asks its server (probe queued)."""
        key = self.key_of(engine_key)
        presence = self.tier.presence(key)
        if presence is Presence.PRESENT:
            self._name(key, engine_key)
            return Answer.HIT
        if presence is Presence.UNKNOWN:
            self.tier.probe([key])
            return Answer.RETRY
        return Answer.MISS

    def touch(self, engine_keys: Sequence[bytes]) -> None:
        self.tier.touch([self.key_of(k) for k in engine_keys])

    # ------------------------------------------------------------------ jobs

    def submit_store(self, job_id: int, engine_keys: Sequence[bytes], rows: Sequence[int]) -> None:
        """Write each chunk's row under its key (a queue that is full drops the chunk: counted)."""
        job = self._open(job_id, IoKind.WRITE)
        for engine_key, row in zip(engine_keys, rows, strict=True):
            sub, key = next(self._ids), self.key_of(engine_key)
            if self.tier.submit_write(sub, key, self._digest, self._chunk_tokens, self._rows.payloads(int(row))):
                self._subs[sub] = (job_id, engine_key)
                job.pending += 1
                self._name(key, engine_key)
            else:
                self.counts["stores_dropped"] += 1
                job.failed.append(engine_key)
        self._settle_if_done(job_id, job)

    def submit_load(self, job_id: int, engine_keys: Sequence[bytes], rows: Sequence[int]) -> None:
        """Read each chunk into its row; a chunk that fails (see :data:`READ_FAILURES`) is a miss."""
        job = self._open(job_id, IoKind.READ)
        for engine_key, row in zip(engine_keys, rows, strict=True):
            sub = next(self._ids)
            self._subs[sub] = (job_id, engine_key)
            job.pending += 1
            self.tier.submit_read(sub, self.key_of(engine_key), self._rows.payloads(int(row)))
        self._settle_if_done(job_id, job)

    def poll(self) -> list[JobOutcome]:
        """Engine jobs finished since the last call. Never blocks. Every ``refresh_interval_s`` it
        also has the tier look for records other engines stored (a shared disk root: a background
        scan, merged by a later poll)."""
        now = time.monotonic()
        if now >= self._next_refresh:
            self._next_refresh = now + self._refresh_interval_s
            self.tier.refresh()
        self._collect()
        ready, self._ready = self._ready, []
        return ready

    @property
    def busy(self) -> bool:
        """Whether a job is still in flight."""
        return bool(self._jobs)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Block until every job submitted so far is done (their outcomes come out of the next
        :meth:`poll`); a copy in flight is never cut. False if ``timeout_s`` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._collect()
            if not self._jobs:
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(DRAIN_POLL_S)

    # ------------------------------------------------------------------ residency, usage, shutdown

    def take_residency(self) -> list[tuple[bool, list[bytes]]]:
        """Changes since the last call as runs of ``(removed, engine keys)``, oldest first. Records
        this process never named (found on disk from an earlier run) are left out."""
        if self._names is None:
            return []
        runs: list[tuple[bool, list[bytes]]] = []
        for change in self.tier.residency.take():
            removed = change.kind is ChangeKind.REMOVED
            name = self._names.pop(change.key, None) if removed else self._names.get(change.key)
            if name is None:
                continue
            if runs and runs[-1][0] == removed:
                runs[-1][1].append(name)
            else:
                runs.append((removed, [name]))
        return runs

    def usage(self) -> TierUsage:
        return self.tier.usage()

    def close(self, *, clear: bool = False) -> None:
        """Finish the jobs in flight, remove every record of the namespace first if ``clear``, and
        release the tier's threads and this store's view of the region. Once only."""
        if clear:
            self.tier.clear()
        self.tier.close()
        self._collect()
        self._rows.release()

    # ------------------------------------------------------------------ internals

    def _open(self, job_id: int, kind: IoKind) -> _OpenJob:
        if job_id in self._jobs:
            raise ValueError(f"job {job_id} is already in flight")
        job = self._jobs[job_id] = _OpenJob(kind, time.monotonic())
        return job

    def _name(self, key: BlockKey, engine_key: bytes) -> None:
        if self._names is not None:
            self._names[key] = engine_key

    def _collect(self) -> None:
        for result in self.tier.poll():
            self._apply(result)

    def _apply(self, result: IoResult) -> None:
        owner = self._subs.pop(result.job_id, None)
        if owner is None:  # not ours (cannot happen: the tier is this store's alone)
            return
        job_id, engine_key = owner
        job = self._jobs[job_id]
        job.pending -= 1
        job.num_bytes += result.num_bytes
        if result.ok:
            job.done.append(engine_key)
        else:
            job.failed.append(engine_key)
            if result.kind is IoKind.READ:
                self.counts[READ_FAILURES.get(result.error, "io_error")] += 1
            else:
                self.counts["stores_dropped" if result.error is IoError.DROPPED else "store_errors"] += 1
                if self._names is not None:
                    self._names.pop(result.key, None)
        self._settle_if_done(job_id, job)

    def _settle_if_done(self, job_id: int, job: _OpenJob) -> None:
        if job.pending:
            return
        del self._jobs[job_id]
        ok = not job.failed
        self._ready.append(JobOutcome(job_id, ok, None if ok else tuple(job.done), job.num_bytes,
                                      time.monotonic() - job.started))
