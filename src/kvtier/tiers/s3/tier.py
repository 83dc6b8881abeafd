"""The S3 tier: :class:`S3Tier`, blocks as objects in an S3-compatible store shared by the fleet.

Modules: :mod:`~kvtier.tiers.s3.keys` (the object key layout), :mod:`~kvtier.tiers.s3.client`
(the obstore client, credentials, what an error means), :mod:`~kvtier.tiers.s3.jobs` (what the
worker threads do), :mod:`~kvtier.tiers.s3.monitor` (listing, capacity sweep, recovery),
:mod:`~kvtier.tiers.presence` (what the tier knows without asking), :mod:`~kvtier.tiers.breaker`
(the circuit breaker, shared with the Redis tier), :mod:`~kvtier.tiers.s3.stats` (counters) and
this one (the contract, submission, :meth:`S3Tier.poll`). Values are the Redis tier's
(:mod:`kvtier.tiers.value`): one object per block, every rank's record, sealed with the fleet key
when the entry has one.

Threading. Every public method runs on the caller's (orchestrator's) thread and never does
network I/O, except the constructor (one LIST page: the credentials are checked at start-up) and
:meth:`close` (waits for the requests in flight, each bounded by ``timeout_s``). The I/O runs on
the tier's own threads: ``kvtier-s3-read`` and ``kvtier-s3-write`` (``max_concurrency`` each: at
most that many GETs and that many PUTs in flight), ``kvtier-s3-probe`` (HEADs), ``kvtier-s3-remove``
(DELETEs) and ``kvtier-s3-monitor``. Workers never touch the caller-side state (presence, counters,
writes in flight): they post outcomes on an :class:`~kvtier.tiers.outbox.Outbox` and :meth:`poll`
applies them, so that state needs no lock.

Presence, from memory only: what this process wrote and read, what its HEAD probes found (a key
not known is probed in the background and answered UNKNOWN: the caller asks again), and the
monitor's latest LIST of the namespace (:class:`~kvtier.tiers.s3.monitor.Listing`, at start-up and
every ``list_interval_s``): a key the listing holds is PRESENT; a key answered PRESENT before a
listing began that the listing lacks is forgotten (another engine's sweep, ``kvtier purge`` or a
lifecycle rule removed it). A block gone since costs a NOT_FOUND read: a counted miss.

Buffers. A read lands in the caller's buffers (one per rank, each exactly ``payload_bytes``),
checked as it lands; a read that is not ``ok`` may have written them (the caller discards them). A
write sends the caller's buffers (obstore copies them into the request), so they must stay
unchanged until the write's result is polled (the orchestrator keeps them pinned).
``submit_write`` returns False (nothing queued, counted in ``writes_dropped``) when
``max_pending_writes`` writes are in flight, or while the breaker is open; :meth:`write_room` is 0
while the store throttles (503 SlowDown), so callers hold their writes back instead of piling them up.

Failures never raise into the caller and never stall it: 3 consecutive requests without an
answer open the breaker (presence ABSENT, reads fail at once, writes dropped; one LIST trial after
1 s, doubling up to ``reconnect_max_s``). A store unreachable at start-up is not an error (the
tier starts with the breaker open); one that refuses the credentials or lacks the bucket is (a
ConfigError naming the key). Logs never contain value bytes or credentials.

Bounded: see :mod:`~kvtier.tiers.s3.monitor` (the sweep). ``usage()`` is the listing's bytes
(the prefix's with a ``capacity_bytes``, else this namespace's) plus what this tier wrote since.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Container, Sequence

from kvtier.core.keys import KEY_BYTES, BlockKey
from kvtier.core.priority import become_background_thread
from kvtier.core.residency import ResidencyLog
from kvtier.core.tier_config import S3TierConfig
from kvtier.tiers.base import IoError, IoKind, IoResult, Medium, Presence, SecondaryTier, TierUsage
from kvtier.tiers.breaker import CircuitBreaker
from kvtier.tiers.disk.files import byte_views
from kvtier.tiers.outbox import Outbox
from kvtier.tiers.presence import ABSENT_TTL, MAX_ENTRIES, PRESENT_TTL, PresenceCache
from kvtier.tiers.s3.client import Access, check_access, credentials, make_store
from kvtier.tiers.s3.jobs import (
    MSG_FAULT,
    MSG_IO,
    MSG_LISTED,
    MSG_PROBE,
    MSG_REMOVED,
    ObjectPath,
    ReadJob,
    Throttle,
    WriteJob,
)
from kvtier.tiers.s3.keys import ObjectKeys
from kvtier.tiers.s3.monitor import Listing, Monitor
from kvtier.tiers.s3.stats import COUNTED, S3TierStats
from kvtier.tiers.sealing import Sealer
from kvtier.tiers.value import value_bytes
from kvtier.tiers.workers import JobQueue, WorkerPool

logger = logging.getLogger(__name__)

PROBE_THREADS = 4
_ABSENT, _PRESENT, _UNKNOWN = Presence.ABSENT, Presence.PRESENT, Presence.UNKNOWN
_COUNTED_FAULTS = {"throttled", "refused", "unreachable"}


class S3Tier(SecondaryTier):
    """Blocks in an S3 bucket prefix; see the module docstring for threading, presence and failures."""

    medium = Medium.S3
    knows_absence = False  # the store may hold what this process never heard of

    def __init__(self, config: S3TierConfig, *, model_name: str, engine_digest: bytes,
                 rank_digests: Sequence[bytes], namespace_json: str, payload_bytes: int, where: str = "s3 tier",
                 presence_ttl: float = PRESENT_TTL, absent_ttl: float = ABSENT_TTL,
                 presence_entries: int = MAX_ENTRIES) -> None:
        if not rank_digests:
            raise ValueError("rank_digests must name at least one rank (one digest per rank)")
        for rank, digest in enumerate(rank_digests):
            if len(digest) != KEY_BYTES:
                raise ValueError(f"rank_digests[{rank}] must be {KEY_BYTES} bytes, got {len(digest)}")
        if not isinstance(payload_bytes, int) or payload_bytes < 1:
            raise ValueError(f"payload_bytes must be an int >= 1, got {payload_bytes!r}")
        self.config = config
        self._keys = ObjectKeys.of(config.prefix, model_name, engine_digest)
        self._world = len(rank_digests)
        self._payload_bytes = payload_bytes
        self._value_bytes = value_bytes(self._world, payload_bytes)
        self._closed = False

        # Caller-thread state: changed only here and in poll().
        self._residency = ResidencyLog(Medium.S3)
        self._presence = PresenceCache(self._residency, present_ttl=presence_ttl, absent_ttl=absent_ttl,
                                       max_entries=presence_entries)
        self._presence_get = self._presence.get
        self._listed: set[BlockKey] = set()  # the latest listing's keys, less those found gone since
        self._counts: dict[str, float] = dict.fromkeys(COUNTED, 0)
        self._writing: dict[BlockKey, int] = {}  # key -> writes in flight
        self._pending_writes = 0
        self._cancelled: set[BlockKey] = set()  # deleted while a write of it was in flight
        self._clear_epoch = 0
        self._listed_bytes = 0  # the last listing's bytes ...
        self._written_since = 0  # ... and what this tier wrote after it began
        self._blocks = 0
        self._sweep_asked = False
        self._clears_asked = self._clears_done = 0  # clear()'s LIST + DELETE runs (close() runs a dropped one)
        self._done = Outbox()
        self._waited: list[tuple] | None = None  # taken off _done by wait(), applied by the next poll()

        source = credentials(config, where)  # ConfigError: a named profile missing or unusable
        self._store = make_store(config, where, source)  # ConfigError: an unreadable ca_bundle
        self._breaker = CircuitBreaker(on_open=self._wake_monitor, base_backoff=min(1.0, config.reconnect_max_s),
                                       max_backoff=config.reconnect_max_s)
        self._seen_generation = self._breaker.generation
        self._monitor: Monitor | None = None
        if check_access(config, where, self._store, source) is Access.UNREACHABLE:  # ConfigError: refused
            logger.warning("kvtier s3: %s does not answer at start-up; starting with the S3 tier off (misses), "
                           "trying again in the background", config.location)
            self._breaker.trip()
        self._stop = threading.Event()
        self._throttle = Throttle()
        self._remove_pool = WorkerPool(1, "kvtier-s3-remove", initializer=become_background_thread)
        self._path = ObjectPath(store=self._store, keys=self._keys, rank_digests=rank_digests,
                                payload_bytes=payload_bytes, value_bytes=self._value_bytes, breaker=self._breaker,
                                throttle=self._throttle, post=self._done.put, stop=self._stop,
                                remove=lambda paths: self._remove_pool.submit(self._path.remove, paths),
                                sealer=Sealer(config.auth))
        self._read_pool = WorkerPool(config.max_concurrency, "kvtier-s3-read")
        self._write_pool = WorkerPool(config.max_concurrency, "kvtier-s3-write", initializer=become_background_thread)
        self._probe_pool = WorkerPool(min(PROBE_THREADS, config.max_concurrency), "kvtier-s3-probe")
        self._reads: JobQueue[ReadJob] = JobQueue(self._read_pool, self._path.read)
        self._writes: JobQueue[WriteJob] = JobQueue(self._write_pool, self._path.write)
        self._probes: JobQueue[list[BlockKey]] = JobQueue(self._probe_pool, self._path.probe)
        self._monitor = Monitor(path=self._path, prefix=config.prefix, value_bytes=self._value_bytes,
                                capacity_bytes=config.capacity_bytes, list_interval_s=config.list_interval_s,
                                namespace_json=namespace_json, breaker=self._breaker, post=self._done.put,
                                stop=self._stop)
        self._monitor.start()

    # ------------------------------------------------------------------ contract

    @property
    def outbox(self) -> Outbox:  # type: ignore[override]
        return self._done

    @property
    def residency(self) -> ResidencyLog:  # type: ignore[override]
        return self._residency

    def presence(self, key: BlockKey) -> Presence:
        """From memory only; ABSENT while the breaker is open."""
        if self._closed or not self._breaker.closed:
            return _ABSENT
        if self._breaker.generation != self._seen_generation:
            self._sync_breaker()
        answer = self._presence_get(key)
        if answer is _UNKNOWN and key in self._listed:
            self._presence.found(key)
            return _PRESENT
        return answer

    def contains(self, key: BlockKey) -> bool:
        return self.presence(key) is _PRESENT

    @property
    def held_keys(self) -> Container[BlockKey]:
        """The keys answered PRESENT now; a key not in it may still be in the store (or in the
        latest listing): ask :meth:`presence`."""
        return self._presence.present_keys

    def probe(self, keys: Sequence[BlockKey]) -> None:
        """HEAD the keys without a fresh answer and no probe in flight, spread over the probe threads."""
        if self._closed or not self._breaker.closed:
            return
        wanted = self._presence.to_probe(keys)
        if not wanted:
            return
        lanes = min(len(wanted), PROBE_THREADS)
        for lane in range(lanes):
            self._probes.submit(wanted[lane::lanes])

    def submit_read(self, job_id: int, key: BlockKey, dests: Sequence[memoryview]) -> None:
        views = byte_views(dests, count=self._world, nbytes=self._payload_bytes, writable=True, what="dests")
        if len(key) != KEY_BYTES:
            raise ValueError(f"key must be {KEY_BYTES} bytes, got {len(key)}")
        if self._closed or not self._breaker.closed:
            self._done.put([(MSG_IO, IoResult(job_id, IoKind.READ, key, False, error=IoError.IO), "breaker")])
            return
        self._reads.submit(ReadJob(job_id, key, views))

    def submit_write(self, job_id: int, key: BlockKey, parent: BlockKey, num_tokens: int,
                     sources: Sequence[memoryview], *, tail: bool = False) -> bool:
        views = byte_views(sources, count=self._world, nbytes=self._payload_bytes, writable=False, what="sources")
        if len(key) != KEY_BYTES or len(parent) != KEY_BYTES:
            raise ValueError(f"key and parent must be {KEY_BYTES} bytes, got {len(key)} and {len(parent)}")
        if not 0 <= num_tokens < 2**32:
            raise ValueError(f"num_tokens must fit in a u32, got {num_tokens}")
        if self._closed or not self._breaker.closed or self._pending_writes >= self.config.max_pending_writes:
            self._counts["writes_dropped"] += 1
            return False
        if (key in self._writing and key not in self._cancelled) or self.presence(key) is _PRESENT:
            # Content addressed: the bytes stored (or on their way) are these bytes.
            self._done.put([(MSG_IO, IoResult(job_id, IoKind.WRITE, key, True), "dedup")])
            return True
        self._writing[key] = self._writing.get(key, 0) + 1
        self._pending_writes += 1
        self._writes.submit(WriteJob(job_id, key, parent, num_tokens, views, self._clear_epoch))
        return True

    def write_room(self) -> int | None:
        if self._closed or not self._breaker.closed:
            return None
        if self._throttle.active:  # the store asked to slow down: hold writes back, do not drop them
            return 0
        return max(0, self.config.max_pending_writes - self._pending_writes)

    def poll(self) -> list[IoResult]:
        results: list[IoResult] = []
        posted, self._waited = self._waited, None
        while True:
            if posted is None:
                try:
                    posted = self._done.get_nowait()
                except queue.Empty:
                    break
            for msg in posted:
                self._apply(msg, results)
            posted = None
        if self._breaker.generation != self._seen_generation:
            self._sync_breaker()
        self._presence.expire()
        return results

    def _apply(self, msg: tuple, results: list[IoResult]) -> None:
        kind, counts = msg[0], self._counts
        if kind == MSG_IO:
            result: IoResult = msg[1]
            if result.kind is IoKind.READ:
                self._finish_read(result, msg[2])
            else:
                self._finish_write(result, msg[2], msg[3] if len(msg) > 3 else None)
            results.append(result)
        elif kind == MSG_PROBE:
            keys, found = msg[1], msg[2]
            self._presence.probed(keys, found)
            for key, there in zip(keys, found):
                if there is False:
                    self._listed.discard(key)
            counts["probes"] += len(keys)
            counts["probe_failures"] += sum(1 for f in found if f is None)
        elif kind == MSG_REMOVED:
            keys, removed, failed, evicted = msg[1], msg[2], msg[3], msg[4]
            for key in keys:
                self._listed.discard(key)
                if key not in self._writing:
                    self._presence.missing(key)
            counts["removed"] += removed
            counts["io_errors"] += failed
            if evicted:
                counts["evicted"] += removed
        elif kind == MSG_LISTED:
            self._listing(msg[1])
        elif kind == MSG_FAULT:
            if msg[1] in counts:
                counts[msg[1]] += 1

    def _listing(self, listing: Listing) -> None:
        self._counts["listings"] += 1
        self._listed = listing.keys
        self._presence.reconcile(listing.keys, listing.started)
        self._listed_bytes, self._written_since, self._blocks = listing.used_bytes, 0, listing.blocks
        self._sweep_asked = False

    def wait(self, timeout: float) -> bool:
        """Block the calling thread up to ``timeout`` seconds until a worker has posted an outcome;
        True if one is ready for :meth:`poll`. For a caller with nothing else to do (a benchmark or a
        tool driving the tier); the engine's step never calls it."""
        if self._waited is not None:
            return True
        try:
            self._waited = self._done.get(timeout)
        except queue.Empty:
            return False
        return True

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Nothing: an object store keeps no access time, and the sweep goes by last write (a hot
        block stays in the faster tiers; docs/object-store.md)."""

    def delete(self, keys: Sequence[BlockKey]) -> int:
        """DELETE ``keys`` in the background. Returns how many were known PRESENT."""
        present, paths = 0, []
        for key in keys:
            present += self.presence(key) is _PRESENT
            self._presence.missing(key)
            self._listed.discard(key)
            if key in self._writing:
                self._cancelled.add(key)
            paths.append(self._keys.block(key))
        if paths and not self._closed:
            self._remove_pool.submit(self._path.remove, paths)
        return present

    def clear(self) -> int:
        """Remove every block of this namespace, whoever stored it (LIST + DELETE in the background;
        the config.json stays). Returns how many were known PRESENT; writes in flight are removed again
        when they complete."""
        count = self._presence.forget_all()
        self._listed = set()
        self._clear_epoch += 1
        if not self._closed:
            self._clears_asked += 1
            self._remove_pool.submit(self._clear)
        return count

    def _clear(self) -> None:
        """The removal thread's (or, at close, the caller's) run of :meth:`clear`."""
        self._path.clear()
        self._clears_done += 1

    def usage(self) -> TierUsage:
        """The last listing's bytes plus this tier's writes since; ``capacity_bytes`` (0: unbounded)."""
        return TierUsage(medium=Medium.S3, used_bytes=self._listed_bytes + self._written_since,
                         capacity_bytes=self.config.capacity_bytes or 0, num_blocks=self._blocks)

    @property
    def evictions(self) -> int:
        """Objects this tier's capacity sweeps deleted (other engines' sweeps are theirs)."""
        return int(self._counts["evicted"])

    @property
    def unavailable(self) -> int:  # type: ignore[override]
        """Requests that found the store unreachable, and reads refused while the breaker was open."""
        return int(self._counts["unreachable"] + self._counts["breaker_rejects"])

    def refresh(self) -> None:
        """Nothing: the monitor lists the namespace every ``list_interval_s`` by itself."""

    def close(self) -> None:
        """Stop the threads (requests in flight finish, each within about ``timeout_s``; queued jobs
        complete as failed). Idempotent. Results can still be polled."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._presence.present_keys.clear()
        if self._monitor is not None:
            self._monitor.join()
        for pool in (self._probe_pool, self._read_pool, self._write_pool, self._remove_pool):
            pool.shutdown()
        if self._clears_done < self._clears_asked:  # a clear() whose run the shutdown dropped
            self._stop.clear()
            self._clear()
            self._stop.set()
        cancelled = (
            [(MSG_IO, IoResult(job.job_id, IoKind.READ, job.key, False, error=IoError.IO), None)
             for job in self._reads.cancel()]
            + [(MSG_IO, IoResult(job.job_id, IoKind.WRITE, job.key, False, error=IoError.DROPPED), None, job)
               for job in self._writes.cancel()]
            + [(MSG_PROBE, keys, [None] * len(keys)) for keys in self._probes.cancel()]
        )
        if cancelled:
            self._done.put(cancelled)

    # ------------------------------------------------------------------ extras

    @property
    def stats(self) -> S3TierStats:
        return S3TierStats(**self._counts, breaker_opens=self._breaker.opens)

    @property
    def breaker(self) -> CircuitBreaker:
        return self._breaker

    @property
    def keys(self) -> ObjectKeys:
        """This namespace's object keys."""
        return self._keys

    @property
    def value_bytes(self) -> int:
        """Bytes of one stored object (every rank's header and payload)."""
        return self._value_bytes

    @property
    def store(self):
        """The obstore client (thread-safe; for tools and tests)."""
        return self._store

    # ------------------------------------------------------------------ caller-thread helpers

    def _sync_breaker(self) -> None:
        self._seen_generation = self._breaker.generation
        if self._breaker.closed:  # back after an outage: the store may have lost or changed anything
            self._presence.invalidate()
            self._listed = set()
        else:
            self._presence.present_keys.clear()

    def _finish_read(self, result: IoResult, detail: str | None) -> None:
        counts = self._counts
        if result.ok:
            counts["reads_ok"] += 1
            counts["bytes_read"] += result.num_bytes
            counts["read_seconds"] += result.seconds
            self._presence.found(result.key)
            return
        if result.error is IoError.NOT_FOUND:
            counts["read_misses"] += 1
        elif result.error is IoError.CORRUPT:
            counts["corrupt"] += 1
        elif result.error is IoError.UNAUTHENTICATED:
            counts["unauthenticated"] += 1
        else:
            counts["io_errors"] += 1
            counts["breaker_rejects"] += detail == "breaker"
            if detail in _COUNTED_FAULTS:
                counts[detail] += 1
            self._presence.failed(result.key)
            return
        self._presence.missing(result.key)
        self._listed.discard(result.key)

    def _finish_write(self, result: IoResult, detail: str | None, job: WriteJob | None) -> None:
        counts = self._counts
        if detail == "dedup":
            counts["writes_deduped"] += 1
            return
        key = result.key
        if job is not None:
            self._pending_writes -= 1
            left = self._writing.get(key, 1) - 1
            if left:
                self._writing[key] = left
            else:
                self._writing.pop(key, None)
        if result.ok:
            counts["writes_ok"] += 1
            counts["bytes_written"] += result.num_bytes
            counts["write_seconds"] += result.seconds
            self._written_since += result.num_bytes
            if key in self._cancelled or (job is not None and job.epoch != self._clear_epoch):
                if not self._closed:
                    self._remove_pool.submit(self._path.remove, [self._keys.block(key)])
            else:
                self._presence.found(key)
                self._blocks += 1
            self._ask_sweep_if_full()
        elif result.error is IoError.DROPPED:
            counts["writes_dropped"] += 1
        else:
            counts["io_errors"] += 1
            if detail in _COUNTED_FAULTS:
                counts[detail] += 1
        if key not in self._writing:
            self._cancelled.discard(key)

    def _ask_sweep_if_full(self) -> None:
        capacity = self.config.capacity_bytes
        if (capacity is not None and not self._sweep_asked and self._monitor is not None
                and self._listed_bytes + self._written_since > capacity):
            self._sweep_asked = True
            self._monitor.ask_listing()

    def _wake_monitor(self) -> None:
        if self._monitor is not None:
            self._monitor.wake()

