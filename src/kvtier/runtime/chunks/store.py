"""One kvtier tier behind opaque engine keys: lookups from memory, engine jobs run as tier jobs.

An engine job moves several chunks at once (rows of the engine's shared region, see
:mod:`~kvtier.runtime.chunks.rows`); a kvtier tier moves one block per job. :class:`ChunkStore`
submits one tier job per chunk and reports each engine job once, when all of its chunks are done
(:class:`JobOutcome`: which chunks succeeded; a chunk that failed is a miss).

A store job of any size is taken whole. vLLM hands a whole step's chunks over at once (an 8k-token
prefill in 16-token chunks: ~512) and never retries; the tier bounds only its writes in flight
(:meth:`~kvtier.tiers.base.SecondaryTier.write_room`). Chunks beyond that wait here, in order,
and go to the tier as its writes complete (on :meth:`ChunkStore.poll`); their rows stay pinned by
the engine until the job's outcome is reported. The job then takes as long as the tier needs, which
is what vLLM's backpressure detector measures (seconds per byte of a successful job): its cascade
slows instead of losing chunks. Only a tier that takes no writes at all (closed, server down) fails
the chunks still waiting (``stores_dropped``).

Recency. A chunk offered for storing that the tier already holds is a use of it: the tier touches
it (the disk tier's LRU; Redis: EXPIRE or TOUCH) and the job succeeds without I/O. vLLM 0.32's
connector never calls a secondary tier's ``touch``; it offers every chunk of a request, hits
included, to tiers that ask for request-level offloading (see :mod:`kvtier.vllm.native.tiers`).

Keys. An engine key (vLLM: block hash + group index) becomes a 32-byte kvtier key bound to the
namespace (:func:`chunk_key`), so a record is found only in the namespace that wrote it, and its
header (namespace digest, key, checksum) is checked on every read by the tier itself: a record of
another namespace, or one that fails its checksum, is a failed read (``rejected``, counted), never
data. The tier forgets such a record, so it is not offered again. After a reset of the engine's
cache the keys hang under a new epoch's root (:meth:`ChunkStore.new_epoch`): nothing stored before
is found again (the weights may have changed in place); the namespace in the headers stays.

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

from kvtier.core.keys import BlockKey, epoch_root
from kvtier.core.residency import ChangeKind
from kvtier.runtime.chunks.rows import Rows
from kvtier.tiers.base import (IoError, IoKind, IoResult, Presence, SecondaryTier, TierUsage, read_failure,
                               write_failure)
from kvtier.tiers.outbox import wait_for_any
from kvtier.tiers.stack import RefreshClock, WriteBacklog

_KEY_DOMAIN = b"kvtier/vllm-offload-key\0"
MAX_REMEMBERED_KEYS = 1 << 20
"""Engine key -> kvtier key pairs a store remembers (~200 MB at most) before it starts over."""
_PRESENT, _UNKNOWN = Presence.PRESENT, Presence.UNKNOWN
DRAIN_WAIT_S = 1.0
"""The longest :meth:`ChunkStore.drain` sleeps between checks (it wakes when the tier posts)."""


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


class ChunkStore:
    """``tier`` holding the chunks of one namespace (``namespace_digest``); ``rows`` the engine's region."""

    def __init__(self, tier: SecondaryTier, rows: Rows, *, namespace_digest: bytes, chunk_tokens: int,
                 record_residency: bool = False,
                 answers: tuple[object, object, object] = (Answer.HIT, Answer.MISS, Answer.RETRY)):
        """``answers``: what :meth:`lookup` returns for a hit, a miss and "ask again" (an engine's own
        values, so that its hot path needs no translation)."""
        self.tier = tier
        self._hit, self._miss, self._retry = answers
        self._refresh = RefreshClock()  # the core's period (TierStack's too)
        self._rows = rows
        self._digest = bytes(namespace_digest)  # the records' namespace (their headers)
        self._root = self._digest  # what keys hang under: the digest, or a reset epoch's root (new_epoch)
        self._chunk_tokens = chunk_tokens
        self._ids = itertools.count(1)
        self._keys: dict[bytes, BlockKey] = {}  # engine key -> kvtier key (see key_of)
        self._presence = tier.presence
        self._held = tier.held_keys
        self._knows_absence = tier.knows_absence
        self._subs: dict[int, tuple[int, bytes]] = {}  # tier job id -> (engine job id, engine key)
        self._jobs: dict[int, _OpenJob] = {}
        # chunks taken but not yet given to the tier (no room): (engine job id, engine key, row), in order
        self._waiting: WriteBacklog[tuple[int, bytes, int]] = WriteBacklog(tier)
        self._ready: list[JobOutcome] = []
        self.counts: Counter[str] = Counter()
        # kvtier key -> engine key, for residency changes (kept only while they are recorded)
        self._names: dict[BlockKey, bytes] | None = {} if record_residency else None
        if record_residency:
            tier.residency.enable()

    def key_of(self, engine_key: bytes) -> BlockKey:
        """The kvtier key of ``engine_key``, derived once and remembered (a deferred request asks
        for the same keys on every step: a dict lookup instead of a BLAKE3 each time)."""
        key = self._keys.get(engine_key)
        if key is None:
            if len(self._keys) >= MAX_REMEMBERED_KEYS:
                self._keys.clear()
            key = self._keys[engine_key] = chunk_key(self._root, engine_key)
        return key

    def new_epoch(self, epoch: bytes) -> None:
        """From now on derive every key under ``epoch``'s root (:func:`~kvtier.core.keys.epoch_root`):
        what the tier holds from before is never found again by this store. Call with no job in
        flight (after :meth:`drain`). Deletes nothing. The blocks this store named are forgotten
        without residency events: the engine announces its reset itself (vLLM: ``AllBlocksCleared``)."""
        self._root = epoch_root(self._digest, epoch)
        self._keys.clear()
        if self._names is not None:
            self.tier.residency.take()  # changes of the old epoch's blocks: not this engine's any more
            self._names.clear()

    # ------------------------------------------------------------------ lookups

    def lookup(self, engine_key: bytes, _context: object = None) -> object:
        """From memory: hit, miss, or "ask again" while a remote tier asks its server (probe
        queued), as the ``answers`` given at construction. The scheduler's hot path (once per chunk
        per lookup pass): kept flat; ``_context`` (ignored) lets an engine call it as its own lookup."""
        key = self._keys.get(engine_key)
        if key is None:
            key = self.key_of(engine_key)
        held = self._held
        if held is not None:  # the keys the tier vouches for (a local tier: its index), without a call
            if key in held:
                if self._names is not None:
                    self._names[key] = engine_key
                return self._hit
            if self._knows_absence:
                return self._miss
        presence = self._presence(key)
        if presence is _PRESENT:
            if self._names is not None:
                self._names[key] = engine_key
            return self._hit
        if presence is _UNKNOWN:
            self.tier.probe([key])
            return self._retry
        return self._miss

    def touch(self, engine_keys: Sequence[bytes]) -> None:
        self.tier.touch([self.key_of(k) for k in engine_keys])

    # ------------------------------------------------------------------ jobs

    def submit_store(self, job_id: int, engine_keys: Sequence[bytes], rows: Sequence[int]) -> None:
        """Write each chunk's row under its key: every chunk is taken (see the module docstring);
        those beyond the tier's room wait here, in order, and are submitted by later polls. A chunk
        not stored is counted by its reason (:data:`~kvtier.tiers.base.WRITE_FAILURES`)."""
        job = self._open(job_id, IoKind.WRITE)
        waiting, held = self._waiting, []
        for engine_key, row in zip(engine_keys, rows, strict=True):
            key = self.key_of(engine_key)
            if self._presence(key) is _PRESENT:  # held already: a use of it (recency), no I/O
                held.append(key)
                job.done.append(engine_key)
                continue
            job.pending += 1
            waiting.add((job_id, engine_key, int(row)))
        if held:
            self.tier.touch(held)
            self.counts["stores_held"] += len(held)
        self._feed()
        self._settle_if_done(job_id, job)

    def submit_load(self, job_id: int, engine_keys: Sequence[bytes], rows: Sequence[int]) -> None:
        """Read each chunk into its row; a chunk that fails is a miss, counted by its reason
        (:data:`~kvtier.tiers.base.READ_FAILURES`)."""
        job = self._open(job_id, IoKind.READ)
        for engine_key, row in zip(engine_keys, rows, strict=True):
            sub = next(self._ids)
            self._subs[sub] = (job_id, engine_key)
            job.pending += 1
            self.tier.submit_read(sub, self.key_of(engine_key), self._rows.payloads(int(row)))
        self.tier.flush()
        self._settle_if_done(job_id, job)

    def flush(self) -> None:
        """Have the tier send what it buffered (probes of a lookup pass): see
        :meth:`~kvtier.tiers.base.SecondaryTier.flush`. The engine calls it once per step."""
        self.tier.flush()

    def poll(self) -> list[JobOutcome]:
        """Engine jobs finished since the last call. Never blocks. Every
        :data:`~kvtier.tiers.stack.REFRESH_INTERVAL_S` (:class:`~kvtier.tiers.stack.RefreshClock`, as
        :class:`~kvtier.tiers.stack.TierStack`) it also has the tier look for records other engines
        stored (a shared disk root: a background scan, merged by a later poll)."""
        if self._refresh.due():
            self.tier.refresh()
        self._collect()
        ready, self._ready = self._ready, []
        return ready

    @property
    def busy(self) -> bool:
        """Whether a job is still in flight (chunks waiting for room included)."""
        return bool(self._jobs)

    @property
    def reading(self) -> bool:
        """Whether a load job is in flight (a request of the engine waits for it)."""
        return any(job.kind is IoKind.READ for job in self._jobs.values())

    def wait_for_outcome(self, timeout_s: float) -> bool:
        """Block until the tier posts its next outcome, at most ``timeout_s``; True if one came.
        Only for a caller with nothing better to do (see :mod:`kvtier.tiers.outbox`)."""
        outbox = self.tier.outbox
        return wait_for_any([outbox], outbox.bell, timeout_s)

    @property
    def waiting(self) -> int:
        """Chunks taken but not yet given to the tier (waiting for room)."""
        return len(self._waiting)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Block until every job submitted so far is done (their outcomes come out of the next
        :meth:`poll`); a copy in flight is never cut. False if ``timeout_s`` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        outbox = self.tier.outbox
        while True:
            self._collect()
            if not self._jobs:
                return True
            left = DRAIN_WAIT_S if deadline is None else min(DRAIN_WAIT_S, deadline - time.monotonic())
            if left <= 0:
                return False
            wait_for_any([outbox], outbox.bell, left)  # until the tier posts an outcome

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
        if self._waiting:
            self._feed()

    def _feed(self) -> None:
        """Give waiting chunks to the tier while it has room; fail them all if it takes no writes."""
        self._waiting.feed(self._write, self._drop)
        self.tier.flush()

    def _write(self, tier: SecondaryTier, chunk: tuple[int, bytes, int]) -> bool:
        job_id, engine_key, row = chunk
        sub, key = next(self._ids), self.key_of(engine_key)
        if not tier.submit_write(sub, key, self._digest, self._chunk_tokens, self._rows.payloads(row)):
            return False
        self._subs[sub] = (job_id, engine_key)
        self._name(key, engine_key)
        return True

    def _drop(self, tier: SecondaryTier, chunk: tuple[int, bytes, int]) -> None:
        self.counts[write_failure(IoError.DROPPED).reason] += 1  # the tier takes no writes (closed, server down)
        job_id, engine_key, _row = chunk
        job = self._jobs[job_id]
        job.pending -= 1
        job.failed.append(engine_key)
        self._settle_if_done(job_id, job)

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
                self.counts[read_failure(result.error).reason] += 1
            else:
                self.counts[write_failure(result.error).reason] += 1
                if self._names is not None:
                    self._names.pop(result.key, None)
        self._settle_if_done(job_id, job)

    def _settle_if_done(self, job_id: int, job: _OpenJob) -> None:
        if job.pending or self._jobs.pop(job_id, None) is None:  # running, or reported already
            return
        ok = not job.failed
        self._ready.append(JobOutcome(job_id, ok, None if ok else tuple(job.done), job.num_bytes,
                                      time.monotonic() - job.started))
