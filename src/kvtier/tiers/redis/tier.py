"""The Redis tier: :class:`RedisTier`, blocks in a Redis / Valkey server or cluster shared by engines.

Modules: :mod:`~kvtier.tiers.redis.codec` (key names, the value format and its verification),
:mod:`~kvtier.tiers.redis.client` (redis-py connections and pipelines; one round trip per server
and batch), :mod:`~kvtier.tiers.breaker` (the circuit breaker),
:mod:`~kvtier.tiers.presence` (what the tier knows without asking),
:mod:`~kvtier.tiers.redis.batcher` (jobs submitted together go out together),
:mod:`~kvtier.tiers.redis.jobs` (what the worker threads do; :mod:`~kvtier.tiers.redis.reads` how
they read values), :mod:`~kvtier.tiers.redis.monitor`
(recovery and usage) and this one (the contract, submission, :meth:`RedisTier.poll`).

Threading. Every public method runs on the caller's (orchestrator's) thread and never does
network I/O, except the constructor (connects, PINGs and writes the namespace's config key: each
an exchange with a deadline, :mod:`~kvtier.tiers.redis.deadline`; none when told the server was
found unreachable, ``reachable=False``) and :meth:`close` (waits for the
batches in flight, each bounded by its exchanges' deadlines, and in all at most ``timeout_s`` plus
a full batch's deadline). The I/O runs on
the tier's own threads: ``kvtier-redis-read`` (reads), ``kvtier-redis-write`` (writes, UNLINKs,
EXPIREs, clear sweeps; background priority), ``kvtier-redis-probe`` (EXISTS probes) and
``kvtier-redis-monitor`` (recovery, ``INFO memory``). Workers never touch the caller-side state
(presence cache, counters, writes in flight): they post outcomes on an :class:`~kvtier.tiers.outbox.Outbox`
(one list of messages per batch) and :meth:`poll` applies them, so that state needs no lock.
Threads per pool: ``max(1, min(4, (max_connections - 2) // 2))`` readers and as many writers, so that every
thread can hold a connection (3 + 3 + 1 + 1 = 8 with the default ``max_connections`` 8). Below
4 connections threads wait for one (up to ``timeout_s``; a cluster node's pool refuses instead,
which counts as a failed batch), so keep ``max_connections`` >= 4.

Batching. Jobs submitted together are coalesced by the worker into one batch, bounded by
``batch_bytes`` (64 MiB of values; one value larger than that goes alone), so a lookup's run of
reads is one pipeline: one round trip per server. See :mod:`~kvtier.tiers.redis.batcher`.

Buffers. A read's value arrives as one ``bytes`` reply (redis-py), or, for one rank and values of
2 MiB or more, as ``GETRANGE`` pieces of about 1 MiB (:mod:`~kvtier.tiers.redis.reads`); as soon
as a reply is read (while the server sends the next one) its length and headers are checked,
then its payloads are copied into the caller's buffers (one per rank, each exactly
``payload_bytes``), each checksummed as it lands, and the reply is dropped. A read that is not
``ok`` may have written its buffers (a payload that failed its checksum, or a batch whose
connection failed after that value landed): the caller discards them, as for the disk tier. A
write's value is its records sent as they are (each rank's header, then the caller's buffer,
uncopied: :mod:`~kvtier.tiers.redis.wire`), so the caller's buffers must stay unchanged until
the write's result is polled (the orchestrator keeps them pinned). Each read thread holds one reply at a
time, and each connection that read a block keeps a reader buffer of about one reply (a value, or
one piece of a value read in pieces: :data:`~kvtier.tiers.redis.reads.PIECE_BYTES`)
(:func:`~kvtier.tiers.redis.wire.reply_parser`). ``submit_write`` returns False (nothing queued,
counted in ``writes_dropped``) when ``max_pending_writes`` writes are in flight, or while the
breaker is open.

Failures never raise into the caller and never stall it: see :mod:`~kvtier.tiers.breaker`
(3 consecutive failed batches open it; presence is then ABSENT, reads and probes fail at once,
writes are dropped; back-off 1 s doubling to 30 s, then one PING from the monitor thread) and
:mod:`~kvtier.tiers.redis.client` (timeouts, deadlines, no retries, reconnects). A server unreachable at
start-up is not an error: the tier starts with the breaker open and connects when it can. A
server that is full (``maxmemory`` with ``noeviction``: OOM) drops writes (``writes_oom``); reads
still work and the breaker stays closed. Logs never contain value bytes or passwords.

What the tier does not see: the server evicts and expires blocks by itself (``maxmemory-policy``,
``ttl_seconds``); ``evictions`` stays 0 and no REMOVED change is recorded for them until a read or
probe finds the block gone. ``usage()`` is the server's ``used_memory`` and ``maxmemory``
(summed over a cluster's primaries), refreshed every 5 s; the tier keeps no byte accounting of
its own. Writes that race a :meth:`~RedisTier.delete` or :meth:`~RedisTier.clear` of the same
key are removed again when they complete; a write from another engine is not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from redis.exceptions import NoPermissionError

from kvtier.core.keys import BlockKey
from kvtier.core.priority import become_background_thread
from kvtier.core.tier_config import RedisTierConfig
from kvtier.core.values import ConfigError
from kvtier.tiers.base import IoResult, Medium, Presence, TierUsage
from kvtier.tiers.redis.batcher import Batcher, WorkerPool
from kvtier.tiers.redis.client import RedisClient
from kvtier.tiers.redis.deadline import FLOOR_BYTES_PER_S
from kvtier.tiers.redis.errors import describe, is_connection_failure, safe_text
from kvtier.tiers.redis.codec import KeySpace
from kvtier.tiers.redis.heap import raise_mmap_threshold
from kvtier.tiers.redis.jobs import MSG_BATCH, MSG_REMOVED, MSG_USAGE, DataPath
from kvtier.tiers.redis.monitor import USAGE_INTERVAL, Monitor
from kvtier.tiers.redis.reads import PIECE_BYTES, read_reply_bytes
from kvtier.tiers.presence import ABSENT_TTL, MAX_ENTRIES, PRESENT_TTL
from kvtier.tiers.redis.stats import RedisTierStats
from kvtier.tiers.remote import ReadJob, RemoteTier, WriteJob
from kvtier.tiers.sealing import Sealer

logger = logging.getLogger(__name__)

BATCH_BYTES = 64 << 20
"""Most value bytes in one batch (replies of a read batch, values of a write batch)."""
PROBE_BATCH_KEYS = 4096
"""Most keys in one EXISTS batch."""
REMOVE_BATCH_KEYS = 1000
TOUCH_INTERVAL_S = 30.0
"""A key is touched on the server at most once per this many seconds (see :meth:`RedisTier.touch`)."""
"""Most keys in one UNLINK / EXPIRE batch."""


class RedisTier(RemoteTier):
    """Blocks in Redis / Valkey; see the module docstring for threading, batching and failures.
    The caller-side bookkeeping (presence, writes in flight, poll) is :class:`~kvtier.tiers.remote.RemoteTier`'s."""

    medium = Medium.REMOTE
    stats_type = RedisTierStats

    def __init__(
        self,
        config: RedisTierConfig,
        *,
        engine_digest: bytes,
        rank_digests: Sequence[bytes],
        namespace_json: str,
        payload_bytes: int,
        presence_ttl: float = PRESENT_TTL,
        absent_ttl: float = ABSENT_TTL,
        presence_entries: int = MAX_ENTRIES,
        batch_bytes: int = BATCH_BYTES,
        usage_interval: float = USAGE_INTERVAL,
        piece_bytes: int = PIECE_BYTES,
        reachable: bool | None = None,
    ) -> None:
        """``reachable``: what the start-up check (:func:`kvtier.tiers.factory.check_tier`)
        found of the server: False, the tier starts off without asking it again (its monitor
        connects in the background); True or None (not checked): it connects now."""
        self.config = config
        # Caller-thread state (presence, counters, writes in flight): RemoteTier's, changed only in
        # the submit methods and poll().
        super().__init__(
            medium=Medium.REMOTE, rank_digests=rank_digests, payload_bytes=payload_bytes,
            max_pending_writes=config.max_pending_writes, reconnect_max_s=config.reconnect_max_s,
            presence_ttl=presence_ttl, absent_ttl=absent_ttl, presence_entries=presence_entries)
        self._keys = KeySpace.of(config.key_prefix, engine_digest)
        raise_mmap_threshold(self._value_bytes)  # replies on the heap, not one mmap each (heap.py)
        self._namespace_json = namespace_json
        self._sweeps_asked = self._sweeps_done = 0  # clear()'s sweeps (close() runs a dropped one)
        self._touched: set[BlockKey] = set()  # keys touched since _touch_epoch_ends - TOUCH_INTERVAL_S
        self._touch_epoch_ends = 0.0
        self._usage = (0, 0)
        # close() waits this long for the worker threads: a pool wait and the deadline of the
        # longest exchange (a full batch); every exchange ends by its deadline, so they are done by then.
        self._close_wait_s = config.timeout_s + (
            config.connect_timeout_s + config.timeout_s + batch_bytes / FLOOR_BYTES_PER_S)
        # Each connection's reader keeps a buffer for the largest reply reads expect (a value, or a piece).
        reply_bytes = read_reply_bytes(self._world, payload_bytes, piece_bytes)
        self._client = RedisClient(config, reply_bytes=reply_bytes)  # ConfigError: password_env unset
        self._path = DataPath(
            client=self._client,
            keys=self._keys,
            rank_digests=self._rank_digests,
            payload_bytes=payload_bytes,
            ttl_seconds=config.ttl_seconds,
            breaker=self._breaker,
            post=self._done.put,
            piece_bytes=piece_bytes,
            sealer=Sealer(config.auth),
        )
        if reachable is False:  # the start-up check waited for it (and said so): not asked again
            self._breaker.trip()
        else:
            try:
                self._client.connect()
                self._write_config()
            except ConfigError:
                self._client.close()
                raise
            except Exception as exc:
                logger.warning(
                    "kvtier redis: %s is not reachable at start-up (%s); starting with the Redis tier off "
                    "(misses), reconnecting in the background",
                    config.redacted_url(),
                    describe(exc),
                )
                self._breaker.trip()

        n_threads = max(1, min(4, (config.max_connections - 2) // 2))
        self._read_pool = WorkerPool(n_threads, "kvtier-redis-read")
        self._write_pool = WorkerPool(n_threads, "kvtier-redis-write", initializer=become_background_thread)
        self._probe_pool = WorkerPool(1, "kvtier-redis-probe")
        self._reads = Batcher(self._read_pool, self._path.read_batch, max_bytes=batch_bytes)
        self._writes = Batcher(self._write_pool, self._path.write_batch, max_bytes=batch_bytes)
        self._probes = Batcher(self._probe_pool, self._path.probe_batch, max_bytes=PROBE_BATCH_KEYS)
        self._unlinks = Batcher(self._write_pool, self._path.remove, max_bytes=REMOVE_BATCH_KEYS)
        self._expires = Batcher(self._write_pool, self._path.expire, max_bytes=REMOVE_BATCH_KEYS)
        self._monitor = Monitor(
            client=self._client,
            breaker=self._breaker,
            post=self._done.put,
            on_recovered=self._after_recovery,
            usage_interval=usage_interval,
        )
        self._monitor.start()

    # ------------------------------------------------------------------ contract

    def probe(self, keys: Sequence[BlockKey]) -> None:
        """Queue one EXISTS batch for the keys without a fresh answer and no probe in flight."""
        if self._closed or not self._breaker.closed:
            return
        wanted = self._presence.to_probe(keys)
        if wanted:
            self._probes.submit(wanted, len(wanted))

    def _queue_read(self, job: ReadJob) -> None:
        self._reads.submit(job, self._value_bytes)

    def _queue_write(self, job: WriteJob) -> None:
        self._writes.submit(job, self._value_bytes)

    def _remove_again(self, key: BlockKey) -> None:
        self._unlinks.submit(key, 1)

    def _apply_other(self, msg: tuple) -> None:
        """Apply one message of the Redis workers' own kinds (:mod:`~kvtier.tiers.redis.jobs`)."""
        kind, counts = msg[0], self._counts
        if kind == MSG_BATCH:
            counts[f"{msg[1]}_batches"] += msg[2]
        elif kind == MSG_REMOVED:
            counts["removed"] += msg[1]
            counts["io_errors"] += msg[2]
        elif kind == MSG_USAGE:
            self._usage = (msg[1], msg[2])

    def _write_failed(self, result: IoResult, detail: str | None) -> None:
        self._counts["writes_oom"] += detail == "oom"

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Mark ``keys`` used on the server, in the background: EXPIRE (their TTL starts again) when
        ``ttl_seconds`` is set, else TOUCH (the server's LRU/LFU eviction sees the use). A key is
        sent at most once per :data:`TOUCH_INTERVAL_S` (a hot prefix is offered on every request)."""
        if self._closed or not self._breaker.closed:
            return
        now = time.monotonic()
        if now >= self._touch_epoch_ends:
            self._touched.clear()
            self._touch_epoch_ends = now + TOUCH_INTERVAL_S
        for key in keys:
            if key not in self._touched:
                self._touched.add(key)
                self._expires.submit(key, 1)

    def delete(self, keys: Sequence[BlockKey]) -> int:
        """UNLINK ``keys`` in the background. Returns how many of them were known PRESENT (an
        UNLINK is queued for every key: one may exist without this process knowing)."""
        present = 0
        for key in keys:
            present += self._presence.get(key) is Presence.PRESENT
            self._presence.missing(key)
            if key in self._writing:
                self._cancelled.add(key)
            if not self._closed:
                self._unlinks.submit(key, 1)
        return present

    def clear(self) -> int:
        """Remove every block of this namespace, whoever stored it: SCAN + UNLINK on every server,
        in the background (the config key stays). Returns how many blocks were known PRESENT; the
        number actually removed is added to ``stats.removed`` when the sweep is done. Writes in
        flight are removed again when they complete."""
        count = self._presence.forget_all()
        self._clear_epoch += 1
        if not self._closed:
            self._sweeps_asked += 1
            self._write_pool.submit(self._sweep)
        return count

    def _sweep(self) -> None:
        """A write thread's (or, at close, the caller's) sweep for :meth:`clear`."""
        self._path.sweep()
        self._sweeps_done += 1

    def usage(self) -> TierUsage:
        """The server's ``used_memory`` and ``maxmemory`` (0: unlimited) as of the last refresh."""
        used, capacity = self._usage
        return TierUsage(medium=Medium.REMOTE, used_bytes=used, capacity_bytes=capacity, num_blocks=None)

    @property
    def evictions(self) -> int:
        """Always 0: the server evicts (``maxmemory-policy``) and expires blocks; the tier cannot see it."""
        return 0

    def refresh(self) -> None:
        """Nothing: a remote tier learns about other engines' blocks by probing."""

    def close(self) -> None:
        """Stop the threads (batches in flight finish, each by its exchanges' deadlines; queued
        jobs complete as failed), then disconnect. Idempotent. Results can still be polled.

        Bounded even if a thread were stuck: it waits for the threads at most ``timeout_s`` plus
        the deadline of a full batch's exchange (``connect_timeout_s + timeout_s + batch_bytes /
        4 MiB/s``, about 21 s by default) in all, then logs the threads still running and goes on
        (they are daemons; their batches fail on the closed client and post as usual). A clear()
        whose sweep the shutdown dropped is swept here (each SCAN page and UNLINK batch one
        exchange)."""
        if self._closed:
            return
        self._closed = True
        self._presence.present_keys.clear()
        deadline = time.monotonic() + self._close_wait_s
        if self._monitor is not None:
            self._monitor.stop(timeout=self._close_wait_s)
        pools = (self._probe_pool, self._read_pool, self._write_pool)
        for pool in pools:
            pool.shutdown(timeout=0)  # every pool told to stop before any is waited for
        busy = [
            pool.name for pool in pools if not pool.shutdown(timeout=max(0.1, deadline - time.monotonic()))
        ]
        if busy:
            logger.warning(
                "kvtier redis: closing with threads of %s still busy after %.1f s; not waiting for them",
                ", ".join(busy), self._close_wait_s,
            )
        if self._write_pool.name not in busy and self._sweeps_done < self._sweeps_asked:
            self._sweep()  # a clear() whose sweep the shutdown dropped
        self._cancelled_posts(self._reads.cancel(), self._writes.cancel(), self._probes.cancel())
        self._client.close()

    # ------------------------------------------------------------------ extras

    @property
    def keys(self) -> KeySpace:
        """This namespace's Redis key names."""
        return self._keys

    # ------------------------------------------------------------------ caller-thread helpers

    def _write_config(self) -> None:
        """Store the namespace's config.json under the config key (start-up; after a recovery)."""
        (reply,) = self._client.run([(b"SET", self._keys.config, self._namespace_json.encode())])
        if isinstance(reply, NoPermissionError):
            raise self._client.config_error(reply, f"SET {self._keys.config.decode()}")
        if isinstance(reply, BaseException):
            if is_connection_failure(reply):
                raise reply
            logger.warning("kvtier redis: storing the namespace key failed: %s", describe(reply))
        elif reply != b"OK" and reply is not True:
            logger.warning(
                "kvtier redis: storing the namespace key: unexpected reply %s", safe_text(repr(reply))
            )

    def _after_recovery(self) -> None:
        """On the monitor thread, when the server answers again (before the breaker closes): store the
        namespace key again (the server may have restarted empty, or start-up could not store it)."""
        try:
            self._write_config()
        except Exception as exc:
            logger.warning("kvtier redis: storing the namespace key failed: %s", describe(exc))
