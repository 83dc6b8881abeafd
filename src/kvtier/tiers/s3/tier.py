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
network I/O, except the constructor (one LIST page: the credentials are checked at start-up; none
when told what the start-up check found, ``reachable``) and
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
lifecycle rule removed it). A key this tier removed (``delete``, ``clear``, a bad object) after a
listing began is not taken from that listing: it may have listed the object before the DELETE. A
removal counts from when it is asked until its DELETE is over (a listing may begin in between), and
while a clear runs, or if it ends after a listing began, that listing's keys are not taken at all.
A block gone since costs a NOT_FOUND read: a counted miss.

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
import math
import threading
import time
from collections.abc import Sequence

from kvtier.core.keys import BlockKey
from kvtier.core.priority import become_background_thread
from kvtier.core.tier_config import S3TierConfig
from kvtier.tiers.base import IoResult, Medium, Presence, TierUsage
from kvtier.tiers.presence import ABSENT_TTL, MAX_ENTRIES, PRESENT_TTL
from kvtier.tiers.remote import ReadJob, RemoteTier, WriteJob
from kvtier.tiers.s3.client import Access, check_access, credentials, make_store
from kvtier.tiers.s3.jobs import MSG_CLEARED, MSG_FAULT, MSG_LISTED, MSG_REMOVED, ObjectPath, Throttle
from kvtier.tiers.s3.keys import ObjectKeys
from kvtier.tiers.s3.monitor import Listing, Monitor
from kvtier.tiers.s3.stats import S3TierStats
from kvtier.tiers.sealing import Sealer
from kvtier.tiers.workers import JobQueue, WorkerPool

logger = logging.getLogger(__name__)

PROBE_THREADS = 4
_PRESENT, _UNKNOWN = Presence.PRESENT, Presence.UNKNOWN
_COUNTED_FAULTS = {"throttled", "refused"}  # a job's fault counted here; "unreachable" is RemoteTier's


class S3Tier(RemoteTier):
    """Blocks in an S3 bucket prefix; see the module docstring for threading, presence and failures.
    The caller-side bookkeeping (presence, writes in flight, poll) is :class:`~kvtier.tiers.remote.RemoteTier`'s."""

    medium = Medium.S3
    stats_type = S3TierStats

    def __init__(self, config: S3TierConfig, *, model_name: str, engine_digest: bytes,
                 rank_digests: Sequence[bytes], namespace_json: str, payload_bytes: int, where: str = "s3 tier",
                 presence_ttl: float = PRESENT_TTL, absent_ttl: float = ABSENT_TTL,
                 presence_entries: int = MAX_ENTRIES, reachable: bool | None = None) -> None:
        """``reachable``: what the start-up check (:func:`kvtier.tiers.factory.check_tier`: the same
        LIST) found of the store, not asked again: False, the tier starts off (its monitor tries
        in the background); True, it starts on. None (not checked): the constructor LISTs."""
        self.config = config
        # Caller-thread state (presence, counters, writes in flight): RemoteTier's, changed only in
        # the submit methods and poll(); and what the listings found, below.
        super().__init__(
            medium=Medium.S3, rank_digests=rank_digests, payload_bytes=payload_bytes,
            max_pending_writes=config.max_pending_writes, reconnect_max_s=config.reconnect_max_s,
            presence_ttl=presence_ttl, absent_ttl=absent_ttl, presence_entries=presence_entries)
        self._keys = ObjectKeys.of(config.prefix, model_name, engine_digest)
        self._listed: set[BlockKey] = set()  # the latest listing's keys, less those found gone since
        # Removals since the latest listing began: when their DELETE was over (inf: asked, not over yet).
        self._removed_at: dict[BlockKey, float] = {}
        self._clearing = 0  # clear() runs asked and not over
        self._cleared_at = -math.inf  # when the latest clear() run was over
        self._listed_bytes = 0  # the last listing's bytes ...
        self._written_since = 0  # ... and what this tier wrote after it began
        self._blocks = 0
        self._sweep_asked = False
        self._clears_asked = self._clears_done = 0  # clear()'s LIST + DELETE runs (close() runs a dropped one)

        source = credentials(config, where)  # ConfigError: a named profile missing or unusable
        self._store = make_store(config, where, source)  # ConfigError: an unreadable ca_bundle
        if reachable is None:
            reachable = check_access(config, where, self._store, source) is not Access.UNREACHABLE  # ConfigError
            if not reachable:
                logger.warning("kvtier s3: %s does not answer at start-up; starting with the S3 tier off "
                               "(misses), trying again in the background", config.location)
        if not reachable:
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

    def presence(self, key: BlockKey) -> Presence:
        """From memory only: what this process wrote, read and probed, else the latest listing;
        ABSENT while the breaker is open."""
        answer = super().presence(key)
        if answer is _UNKNOWN and key in self._listed:
            self._presence.found(key)
            return _PRESENT
        return answer

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

    def _queue_read(self, job: ReadJob) -> None:
        self._reads.submit(job)

    def _queue_write(self, job: WriteJob) -> None:
        self._writes.submit(job)

    def _remove_again(self, key: BlockKey) -> None:
        self._removed_at[key] = math.inf
        self._remove_pool.submit(self._path.remove, [self._keys.block(key)])

    def write_room(self) -> int | None:
        room = super().write_room()
        if room is not None and self._throttle.active:  # the store asked to slow down: hold writes back
            return 0
        return room

    def _apply_other(self, msg: tuple) -> None:
        """Apply one message of the S3 workers' own kinds (:mod:`~kvtier.tiers.s3.jobs`)."""
        kind, counts = msg[0], self._counts
        if kind == MSG_REMOVED:
            keys, removed, failed, evicted, kept = msg[1], msg[2], msg[3], msg[4], msg[5]
            now = time.monotonic()  # the DELETEs were over before now: a listing begun earlier may hold them
            for key in keys:
                self._listed.discard(key)
                self._removed_at[key] = now
                if key not in self._writing:
                    self._presence.missing(key)
            for key in kept:  # the DELETE failed: the object may stay, later listings say
                self._removed_at[key] = now
            counts["removed"] += removed
            counts["io_errors"] += failed
            if evicted:
                counts["evicted"] += removed
        elif kind == MSG_CLEARED:
            self._clearing -= 1
            self._cleared_at = time.monotonic()
        elif kind == MSG_LISTED:
            self._listing(msg[1])
        elif kind == MSG_FAULT:
            if msg[1] in counts:
                counts[msg[1]] += 1

    def _read_failed(self, result: IoResult, detail: str | None) -> None:
        if detail in _COUNTED_FAULTS:
            self._counts[detail] += 1

    _write_failed = _read_failed

    def _gone(self, key: BlockKey) -> None:
        self._listed.discard(key)

    def _written(self, result: IoResult) -> None:
        self._written_since += result.num_bytes
        self._blocks += 1
        self._ask_sweep_if_full()

    def _listing(self, listing: Listing) -> None:
        """Take a listing, less the keys removed since it began (or being removed). Removals over
        before it began are behind every listing from now on (the monitor lists one at a time):
        forgotten. A listing that a clear may have overlapped gives no keys and finds none gone."""
        self._counts["listings"] += 1
        self._listed_bytes, self._written_since, self._blocks = listing.used_bytes, 0, listing.blocks
        self._sweep_asked = False
        self._removed_at = {key: at for key, at in self._removed_at.items() if at >= listing.started}
        if self._clearing or self._cleared_at >= listing.started:
            self._listed = set()
            return
        self._listed = listing.keys.difference(self._removed_at) if self._removed_at else listing.keys
        self._presence.reconcile(self._listed, listing.started)

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
            if not self._closed:
                self._removed_at[key] = math.inf
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
            self._clearing += 1
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
        self._cancelled_posts(self._reads.cancel(), self._writes.cancel(), self._probes.cancel())

    # ------------------------------------------------------------------ extras

    @property
    def keys(self) -> ObjectKeys:
        """This namespace's object keys."""
        return self._keys

    @property
    def store(self):
        """The obstore client (thread-safe; for tools and tests)."""
        return self._store

    # ------------------------------------------------------------------ caller-thread helpers

    def _sync_breaker(self) -> None:
        super()._sync_breaker()
        if self._breaker.closed:  # back after an outage: the store may have lost or changed anything
            self._listed = set()

    def _ask_sweep_if_full(self) -> None:
        capacity = self.config.capacity_bytes
        if (capacity is not None and not self._sweep_asked and self._monitor is not None
                and self._listed_bytes + self._written_since > capacity):
            self._sweep_asked = True
            self._monitor.ask_listing()
