"""The pool of a ``kvtier node`` service as a :class:`~kvtier.tiers.base.SecondaryTier` (``kvtier_node``).

Behind vLLM's own offloading, the native adapter (:mod:`kvtier.vllm.native.tiers`) wraps this tier
exactly as it wraps the disk and Redis tiers: one :class:`~kvtier.runtime.chunks.store.ChunkStore`
turns vLLM's chunk jobs into one tier job per chunk, under the same namespaced keys. What differs
is where the bytes go: slots of the node's shared pool, which this process maps (the memfd comes
with the hello) and copies vLLM's CPU-tier rows into and out of itself. Bytes never cross the
socket; it carries lookups, reservations, commits and pins only.

Threads and ownership:

- the **caller's thread** (vLLM's scheduler) calls every public method. Nothing here does I/O on
  it: :meth:`probe`, :meth:`submit_read` and :meth:`submit_write` buffer; :meth:`flush` hands the
  buffer to the worker as one batch; :meth:`poll` applies what the worker posted (presence answers,
  job results) to the presence cache, which only this thread touches;
- ONE **worker thread** owns the :class:`~kvtier.node.NodeClient` and the pool's mapping: every
  round trip and every copy happens on it, so a reconnect (which unmaps the old pool) can never
  happen during a copy. A batch costs one ``lookup`` per request probed (all its keys; the leading
  run is the hit), one pinned ``lookup`` for all the reads (plus one per key found missing), one
  ``unpin``, one ``reserve`` for all the writes and one ``commit``. A service that hangs blocks
  this thread (at most ``timeout_s`` per call), never the caller.

Buffers: the sources and destinations of a job are the caller's (vLLM's pinned rows) until the
job's result comes out of :meth:`poll`. A reservation's slots are written only through the mapping
of the attachment that made it, and committed on the same connection: if the service died in
between, the commit fails and the reservation died with the connection, so a copy can never land
in another pool (a restarted service has another ``pool_id``). A read copies from slots pinned by
its own lookup, then unpins them.

Presence (:class:`~kvtier.tiers.presence.PresenceCache`): a key not asked about recently is
UNKNOWN; the caller probes it (vLLM: "ask again") and the next lookup pass finds the answer. The
adapter names the request a probe belongs to (:attr:`NodeTier.group`) so that one lookup round
trip covers a request's keys. Keys stored or read here are known at once. Another engine's store
is seen within ``ABSENT_TTL``; a block evicted by the service is found missing when read (a miss,
counted ``vanished``).

Failures are misses, never errors: a service that is gone or restarting answers every probe
"absent", fails reads (``io_error``) and drops writes (``stores_dropped``), each call counted in
:attr:`unavailable`; the client reattaches by itself every ``retry_interval_s``, and on a new
attachment every cached answer is made stale (the new pool is empty). A request the service
refuses (another block size, a cap below one slot) is logged once per message and handled the same.

Not offered by the service: deleting blocks (they are shared by every engine of the namespace;
:meth:`delete` and :meth:`clear` forget this process's answers only) and explicit recency
(:meth:`touch` does nothing: lookups and reads are the service's uses).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Container, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.core.keys import BlockKey
from kvtier.core.residency import Medium, ResidencyLog
from kvtier.core.tier_config import NodeTierConfig
from kvtier.node.client import NodeClient, NodeError, NodeUnavailable
from kvtier.node.protocol import Reservation, Role
from kvtier.tiers.base import IoError, IoKind, IoResult, Presence, SecondaryTier, TierUsage
from kvtier.tiers.outbox import Outbox
from kvtier.tiers.presence import PresenceCache

logger = logging.getLogger(__name__)

PRESENT_TTL = 10.0
"""How long a block found in the pool is answered PRESENT without asking again (another engine's
pressure may evict it meanwhile: the read then fails as ``vanished``, a miss)."""
ABSENT_TTL = 0.5
"""How long a block the pool lacked is answered ABSENT (another engine may store it any moment)."""
_PRESENT = Presence.PRESENT


@dataclass
class _Batch:
    """Work handed to the worker in one go (caller's thread builds it, the worker owns it after)."""

    probes: list[list[BlockKey]] = field(default_factory=list)
    reads: list[tuple[int, BlockKey, Sequence[memoryview]]] = field(default_factory=list)
    writes: list[tuple[int, BlockKey, Sequence[memoryview], bool]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.probes or self.reads or self.writes)


@dataclass(frozen=True)
class _Probed:
    keys: list[BlockKey]
    found: list[bool] | None  # None: the service could not be asked


@dataclass(frozen=True)
class _Attached:
    generation: int
    pool_bytes: int


def copy_bytes(dest: memoryview, src: memoryview) -> None:
    """``dest[:] = src`` through numpy, which releases the GIL for the copy."""
    np.copyto(np.frombuffer(dest, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


class NodeTier(SecondaryTier):
    """The node pool for one engine (``engine``: its name in the service's stats) whose blocks are
    ``width`` payloads of ``payload_bytes`` (one per stored rank; a slot each). See the module
    docstring for threads, buffers and failures."""

    medium = Medium.HOST
    knows_absence = False

    def __init__(self, config: NodeTierConfig, *, engine: str, payload_bytes: int, width: int) -> None:
        self.config = config
        self.width = width
        self.payload_bytes = payload_bytes
        self.residency = ResidencyLog(Medium.HOST)
        self.outbox = Outbox()
        self.group: Hashable = None
        """The request the next probes belong to (set by the caller before each lookup): one lookup
        round trip per group."""
        self.counts: Counter[str] = Counter()  # duplicates (held once), refused, round trips, ...
        self.unavailable = 0
        self._cache = PresenceCache(self.residency, present_ttl=PRESENT_TTL, absent_ttl=ABSENT_TTL)
        self._probes: dict[Hashable, list[BlockKey]] = {}
        self._batch = _Batch()
        self._writes_in_flight = 0
        self._down = False  # the last call found the service gone: writes are dropped until it answers
        self._pool_bytes = 0
        self._closed = False
        self._client = NodeClient(config.socket, engine=engine, role=Role.SCHEDULER, slot_bytes=payload_bytes,
                                  cap_bytes=config.cap_bytes, map_pool=True, timeout_s=config.timeout_s,
                                  retry_interval_s=config.retry_interval_s, node_uid=config.node_uid)
        self._generation = 0  # the worker's: the client's attachment last announced
        self._worker_down = False  # the worker's: the last call failed
        self._refusals: set[str] = set()
        self._work: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvtier-node-tier", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ presence (caller's thread)

    def contains(self, key: BlockKey) -> bool:
        return self._cache.get(key) is _PRESENT

    def presence(self, key: BlockKey) -> Presence:
        return Presence.ABSENT if self._closed else self._cache.get(key)

    @property
    def held_keys(self) -> Container[BlockKey]:
        return self._cache.present_keys

    def probe(self, keys: Sequence[BlockKey]) -> None:
        if self._closed:
            return
        wanted = self._cache.to_probe(keys)
        if wanted:
            self._probes.setdefault(self.group, []).extend(wanted)

    @property
    def probing(self) -> bool:
        """Whether a probe is buffered or in flight (its answer comes out of a later :meth:`poll`)."""
        return bool(self._cache.probing)

    # ------------------------------------------------------------------ jobs (caller's thread)

    def submit_read(self, job_id: int, key: BlockKey, dests: Sequence[memoryview]) -> None:
        self._batch.reads.append((job_id, key, dests))

    def submit_write(self, job_id: int, key: BlockKey, parent: BlockKey, num_tokens: int,
                     sources: Sequence[memoryview], *, tail: bool = False) -> bool:
        if not self.write_room():
            return False
        self._writes_in_flight += 1
        self._batch.writes.append((job_id, key, sources, tail))
        return True

    def write_room(self) -> int | None:
        if self._closed or self._down:
            return None
        return max(0, self.config.max_pending_writes - self._writes_in_flight)

    def flush(self) -> None:
        batch, self._batch = self._batch, _Batch()
        batch.probes = list(self._probes.values())
        self._probes.clear()
        if batch:
            self._work.put(batch)

    def poll(self) -> list[IoResult]:
        results: list[IoResult] = []
        cache = self._cache
        cache.expire()
        while True:
            try:
                item = self.outbox.get_nowait()
            except queue.Empty:
                return results
            if isinstance(item, IoResult):
                results.append(item)
                if item.kind is IoKind.WRITE:
                    self._writes_in_flight -= 1
                    if item.ok:
                        cache.found(item.key)
                elif item.ok:
                    cache.found(item.key)
                elif item.error is IoError.NOT_FOUND:
                    cache.missing(item.key)
                else:
                    cache.failed(item.key)
            elif isinstance(item, _Probed):
                cache.probed(item.keys, item.found)
            elif isinstance(item, _Attached):
                cache.invalidate()  # a new attachment: maybe a new, empty pool
                self._pool_bytes = item.pool_bytes
                self._down = False
            else:  # a bool: the service is gone (True) or answers again (False)
                self._down = item

    # ------------------------------------------------------------------ the rest of the contract

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Nothing: the service takes lookups and reads as uses; it has no separate touch."""

    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Forget this process's answers for ``keys`` (the pool's blocks are every engine's)."""
        for key in keys:
            self._cache.failed(key)
        return 0

    def clear(self) -> int:
        self._cache.forget_all()
        return 0

    def usage(self) -> TierUsage:
        """The pool's size; its use is the service's to report (``kvtier inspect SOCKET``)."""
        return TierUsage(Medium.HOST, 0, self._pool_bytes, None)

    @property
    def evictions(self) -> int:
        return 0  # the service evicts, and counts them (kvtier_node_evictions_total)

    def close(self) -> None:
        """Send what is buffered, let the worker finish it, and disconnect. Idempotent."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._work.put(None)
        self._thread.join(timeout=max(5.0, 4 * self.config.timeout_s))

    # ------------------------------------------------------------------ the worker thread

    def _run(self) -> None:
        try:
            while True:
                batch = self._work.get()
                if batch is None:
                    return
                while True:  # everything queued meanwhile, in one go
                    try:
                        more = self._work.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        self._serve(batch)
                        return
                    batch.probes += more.probes
                    batch.reads += more.reads
                    batch.writes += more.writes
                self._serve(batch)
        finally:
            self._client.close()

    def _serve(self, batch: _Batch) -> None:
        """One batch: probes first (a request waits on them), then reads, then writes. A bug here
        must not hang vLLM's jobs: whatever a phase had not reported yet fails (logged)."""
        for keys in batch.probes:
            self._lookup(keys)
        for phase, jobs, kind in ((self._read, batch.reads, IoKind.READ), (self._write, batch.writes, IoKind.WRITE)):
            if not jobs:
                continue
            posted: set[int] = set()
            try:
                phase(jobs, posted)
            except Exception:
                logger.exception("kvtier_node: %s of %d chunks failed", kind.value, len(jobs))
                self._client.close()  # the service releases what this session held
                for job_id, key, *_ in jobs:
                    if job_id not in posted:
                        self.outbox.put(IoResult(job_id, kind, key, False, error=IoError.IO))

    def _call(self, name: str, *args, **kwargs):
        """One client call; None when the service is gone or refused (counted, posted)."""
        self.counts["round_trips"] += 1
        try:
            reply = getattr(self._client, name)(*args, **kwargs)
        except NodeUnavailable:
            self._gone()
            return None
        except NodeError as exc:
            message = str(exc)
            if message not in self._refusals:
                self._refusals.add(message)
                logger.error("kvtier_node: the service at %s refused this engine: %s (misses until fixed)",
                             self.config.socket, message)
            self._gone()
            return None
        if self._worker_down:
            self._worker_down = False
            self.outbox.put(False)  # answers again: writes are taken again
        generation = self._client.generation
        if generation != self._generation:
            self._generation = generation
            attachment = self._client.attachment
            self.outbox.put(_Attached(generation, attachment.pool_bytes if attachment else 0))
            logger.info("kvtier_node: attached to the service at %s (pool %s)", self.config.socket,
                        attachment.pool_id if attachment else "?")
        return reply

    def _gone(self) -> None:
        self.unavailable += 1
        if not self._worker_down:
            self._worker_down = True
            self.outbox.put(True)

    def _poster(self, posted: set[int]):
        def post(result: IoResult) -> None:
            posted.add(result.job_id)
            self.outbox.put(result)
        return post

    def _lookup(self, keys: list[BlockKey]) -> None:
        hit = self._call("lookup", keys, pin=False, width=self.width)
        self.outbox.put(_Probed(keys, None if hit is None else [i < hit.hits for i in range(len(keys))]))

    def _read(self, reads: list[tuple[int, BlockKey, Sequence[memoryview]]], posted: set[int]) -> None:
        """Pinned lookups of the leading runs, copies out of the pinned slots, one unpin per run;
        the key that ends a run is missing (NOT_FOUND) and the rest are asked again."""
        post = self._poster(posted)
        while reads:
            started = time.monotonic()
            hit = self._call("lookup", [key for _, key, _ in reads], pin=True, width=self.width)
            pool = self._client.pool
            if hit is None or pool is None:
                for job_id, key, _ in reads:
                    post(IoResult(job_id, IoKind.READ, key, False, error=IoError.IO))
                return
            width = self.width
            for index in range(hit.hits):
                job_id, key, dests = reads[index]
                slots = hit.slots[index * width:(index + 1) * width]
                for dest, slot in zip(dests, slots, strict=True):
                    copy_bytes(dest, pool.slot(slot))
                post(IoResult(job_id, IoKind.READ, key, True, self.payload_bytes * width,
                              time.monotonic() - started))
            if hit.pin:
                self._call("unpin", [hit.pin])
            if hit.hits < len(reads):
                job_id, key, _ = reads[hit.hits]
                post(IoResult(job_id, IoKind.READ, key, False, error=IoError.NOT_FOUND))
            reads = reads[hit.hits + 1:]

    def _write(self, writes: list[tuple[int, BlockKey, Sequence[memoryview], bool]], posted: set[int]) -> None:
        """One reservation for every write, copies into the reserved slots, one commit. A block the
        pool holds already (another engine stored it) is a success with nothing copied: held once."""
        post = self._poster(posted)
        started = time.monotonic()
        tails = [i for i, write in enumerate(writes) if write[3]]
        answers = self._call("reserve", [key for _, key, _, _ in writes], self.width, tails)
        pool = self._client.pool
        if answers is None or pool is None:
            for job_id, key, _, _ in writes:
                post(IoResult(job_id, IoKind.WRITE, key, False, error=IoError.DROPPED))
            return
        reserved: list[int] = []
        for index, ((job_id, key, sources, _), (status, slots)) in enumerate(zip(writes, answers, strict=True)):
            if status is Reservation.RESERVED:
                for source, slot in zip(sources, slots, strict=True):
                    copy_bytes(pool.slot(slot), source)
                reserved.append(index)
                continue
            ok = status is Reservation.PRESENT
            self.counts["duplicates" if ok else "refused"] += 1
            post(IoResult(job_id, IoKind.WRITE, key, ok, error=None if ok else IoError.DROPPED))
        if not reserved:
            return
        unknown = self._call("commit", [writes[i][1] for i in reserved])
        # None: the connection (and with it the reservation) is gone; unknown > 0: the service no
        # longer knew some of them (cannot happen on one connection): all counted as dropped.
        ok = unknown == 0
        for index in reserved:
            job_id, key, _, _ = writes[index]
            post(IoResult(job_id, IoKind.WRITE, key, ok, self.payload_bytes * self.width if ok else 0,
                          time.monotonic() - started, None if ok else IoError.DROPPED))
