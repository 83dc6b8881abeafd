"""What the tiers behind a shared server (Redis, S3) do alike on the caller's thread.

:class:`RemoteTier` is the caller-side half of such a tier: the presence cache
(:mod:`~kvtier.tiers.presence`) and the circuit breaker (:mod:`~kvtier.tiers.breaker`) answering
lookups from memory, the accounting of writes in flight (``max_pending_writes``: ``write_room``),
writes of a block known present or being written completed at once (content addressed), writes
that race a :meth:`~kvtier.tiers.base.SecondaryTier.delete` or ``clear`` removed again when they
land, reads and writes refused at once while the breaker is open, and :meth:`RemoteTier.poll`,
which applies what the workers posted on the tier's :class:`~kvtier.tiers.outbox.Outbox` (each
post a list of messages) and counts it. A subclass runs the requests (:meth:`RemoteTier._queue_read`,
:meth:`RemoteTier._queue_write`, its probes, on its own threads), applies its own kinds of message
(:meth:`RemoteTier._apply_other`) and removes what must go (:meth:`RemoteTier._remove_again`).

Messages every such tier's workers post: ``(MSG_IO, IoResult, detail[, WriteJob])`` for a job
(``detail``: None, ``"breaker"`` refused while the breaker was open, ``"dedup"`` completed at once,
:data:`UNREACHABLE` its request found the server unreachable, or a tier's own word for the failure)
and ``(MSG_PROBE, keys, found)`` for a probe (``found[i]`` None where that key got no answer).

Unavailability is counted here, alike for every such tier: reads and writes whose request found the
server unreachable (``unreachable``) and reads refused while the breaker was open
(``breaker_rejects``) make :attr:`RemoteTier.unavailable` (``kvtier_offload_unavailable``).

Threading: every method runs on the caller's (orchestrator's) thread; the state here is that
thread's alone, so it needs no lock. Workers only post.
"""

from __future__ import annotations

import queue
from collections.abc import Container, Sequence
from dataclasses import dataclass, fields
from typing import Any

from kvtier.core.keys import KEY_BYTES, BlockKey
from kvtier.core.residency import Medium, ResidencyLog
from kvtier.tiers.base import IoError, IoKind, IoResult, Presence, SecondaryTier
from kvtier.tiers.breaker import CircuitBreaker
from kvtier.tiers.disk.files import byte_views
from kvtier.tiers.outbox import Outbox
from kvtier.tiers.presence import ABSENT_TTL, MAX_ENTRIES, PRESENT_TTL, PresenceCache
from kvtier.tiers.value import value_bytes

MSG_IO = "io"  # (MSG_IO, IoResult, detail[, the WriteJob of a write])
MSG_PROBE = "probe"  # (MSG_PROBE, keys, found: list[bool | None]  (None: the probe of that key failed))
UNREACHABLE = "unreachable"  # MSG_IO detail: the job's request found the server unreachable (no answer)
_ABSENT, _PRESENT = Presence.ABSENT, Presence.PRESENT


def counted_fields(stats_type: type) -> tuple[str, ...]:
    """The counters a tier keeps itself: every field of its stats dataclass but ``breaker_opens``
    (the breaker's own)."""
    return tuple(f.name for f in fields(stats_type) if f.name != "breaker_opens")


@dataclass(slots=True)
class ReadJob:
    job_id: int
    key: BlockKey
    dests: list[memoryview]


@dataclass(slots=True)
class WriteJob:
    job_id: int
    key: BlockKey
    parent: BlockKey
    num_tokens: int
    sources: list[memoryview]
    epoch: int = 0  # the tier's clear() count when it was submitted


class RemoteTier(SecondaryTier):
    """The caller's side of a tier behind a shared server; see the module docstring."""

    knows_absence = False  # the server may hold what this process never heard of

    _monitor: Any = None  # the tier's monitor thread (``wake()``: the breaker opened), once started
    stats_type: type  # the tier's frozen counters dataclass (with ``breaker_rejects`` and ``unreachable``): its
    # fields, less ``breaker_opens``, are counted here

    def __init__(self, *, medium: Medium, rank_digests: Sequence[bytes],
                 payload_bytes: int, max_pending_writes: int, reconnect_max_s: float,
                 presence_ttl: float = PRESENT_TTL, absent_ttl: float = ABSENT_TTL,
                 presence_entries: int = MAX_ENTRIES) -> None:
        """The tier's counters (:attr:`stats_type`'s fields) start at 0; ``rank_digests``: each
        rank's namespace digest (ValueError when malformed), ``payload_bytes`` one rank's payload;
        ``reconnect_max_s``: the breaker's longest back-off (it starts at 1 s, or at that if less)."""
        if not rank_digests:
            raise ValueError("rank_digests must name at least one rank (one digest per rank)")
        for rank, digest in enumerate(rank_digests):
            if len(digest) != KEY_BYTES:
                raise ValueError(f"rank_digests[{rank}] must be {KEY_BYTES} bytes, got {len(digest)}")
        if not isinstance(payload_bytes, int) or payload_bytes < 1:
            raise ValueError(f"payload_bytes must be an int >= 1, got {payload_bytes!r}")
        self._rank_digests = tuple(bytes(d) for d in rank_digests)
        self._world = len(self._rank_digests)
        self._payload_bytes = payload_bytes
        self._value_bytes = value_bytes(self._world, payload_bytes)
        self._max_pending_writes = max_pending_writes
        self._closed = False
        self._residency = ResidencyLog(medium)
        self._presence = PresenceCache(self._residency, present_ttl=presence_ttl, absent_ttl=absent_ttl,
                                       max_entries=presence_entries)
        self._presence_get = self._presence.get
        self._counts: dict[str, float] = dict.fromkeys(counted_fields(self.stats_type), 0)
        self._writing: dict[BlockKey, int] = {}  # key -> writes in flight
        self._pending_writes = 0
        self._cancelled: set[BlockKey] = set()  # deleted while a write of it was in flight
        self._clear_epoch = 0
        self._done = Outbox()  # workers' posts, each a list of messages
        self._waited: list[tuple] | None = None  # taken off _done by wait(), applied by the next poll()
        self._breaker = CircuitBreaker(on_open=self._wake_monitor, base_backoff=min(1.0, reconnect_max_s),
                                       max_backoff=reconnect_max_s)
        self._seen_generation = self._breaker.generation

    # ------------------------------------------------------------------ what a subclass provides

    def _queue_read(self, job: ReadJob) -> None:
        """Hand ``job`` to the worker threads (its result comes back as a MSG_IO)."""
        raise NotImplementedError

    def _queue_write(self, job: WriteJob) -> None:
        """Hand ``job`` to the worker threads (its result comes back as a MSG_IO with the job)."""
        raise NotImplementedError

    def _remove_again(self, key: BlockKey) -> None:
        """Remove ``key`` from the server in the background (a write that raced a delete or clear)."""
        raise NotImplementedError

    def _apply_other(self, msg: tuple) -> None:
        """Apply a message of the tier's own kind (usage, removals, listings...)."""

    def _read_failed(self, result: IoResult, detail: str | None) -> None:
        """A read failed with an I/O error (``detail``: the worker's word): more counters, if any."""

    def _gone(self, key: BlockKey) -> None:
        """A read found ``key`` missing or bad: whatever else the tier remembers of it goes too."""

    def _written(self, result: IoResult) -> None:
        """A write landed and ``key`` is present (not raced by a delete or clear)."""

    def _write_failed(self, result: IoResult, detail: str | None) -> None:
        """A write failed (``detail``: the worker's word): more counters, if any."""

    # ------------------------------------------------------------------ contract

    @property
    def outbox(self) -> Outbox:  # type: ignore[override]
        return self._done

    @property
    def residency(self) -> ResidencyLog:  # type: ignore[override]
        return self._residency

    def presence(self, key: BlockKey) -> Presence:
        """From memory only (see :mod:`~kvtier.tiers.presence`); ABSENT while the breaker is open."""
        if self._closed or not self._breaker.closed:
            return _ABSENT
        if self._breaker.generation != self._seen_generation:
            self._sync_breaker()
        return self._presence_get(key)

    def contains(self, key: BlockKey) -> bool:
        return self.presence(key) is _PRESENT

    @property
    def held_keys(self) -> Container[BlockKey]:
        """The keys answered PRESENT now (emptied while the breaker is open, expired each poll);
        a key not in it may still be on the server: ask :meth:`presence`."""
        return self._presence.present_keys

    def submit_read(self, job_id: int, key: BlockKey, dests: Sequence[memoryview]) -> None:
        views = byte_views(dests, count=self._world, nbytes=self._payload_bytes, writable=True, what="dests")
        if len(key) != KEY_BYTES:
            raise ValueError(f"key must be {KEY_BYTES} bytes, got {len(key)}")
        if self._closed or not self._breaker.closed:
            self._done.put([(MSG_IO, IoResult(job_id, IoKind.READ, key, False, error=IoError.IO), "breaker")])
            return
        self._queue_read(ReadJob(job_id, key, views))

    def submit_write(self, job_id: int, key: BlockKey, parent: BlockKey, num_tokens: int,
                     sources: Sequence[memoryview], *, tail: bool = False) -> bool:
        """Queue the write (False: dropped, counted, while ``max_pending_writes`` are in flight or
        the breaker is open); a block known present, or being written, completes at once."""
        views = byte_views(sources, count=self._world, nbytes=self._payload_bytes, writable=False, what="sources")
        if len(key) != KEY_BYTES or len(parent) != KEY_BYTES:
            raise ValueError(f"key and parent must be {KEY_BYTES} bytes, got {len(key)} and {len(parent)}")
        if not 0 <= num_tokens < 2**32:
            raise ValueError(f"num_tokens must fit in a u32, got {num_tokens}")
        if self._closed or not self._breaker.closed or self._pending_writes >= self._max_pending_writes:
            self._counts["writes_dropped"] += 1
            return False
        if (key in self._writing and key not in self._cancelled) or self.presence(key) is _PRESENT:
            # Content addressed: the bytes stored (or on their way) are these bytes. Offered again:
            # the prefix is in use, a use the tier's recency may see.
            self.touch((key,))
            self._done.put([(MSG_IO, IoResult(job_id, IoKind.WRITE, key, True), "dedup")])
            return True
        self._writing[key] = self._writing.get(key, 0) + 1
        self._pending_writes += 1
        self._queue_write(WriteJob(job_id, key, parent, num_tokens, views, self._clear_epoch))
        return True

    def write_room(self) -> int | None:
        if self._closed or not self._breaker.closed:
            return None
        return max(0, self._max_pending_writes - self._pending_writes)

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
        kind = msg[0]
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
            self._counts["probes"] += len(keys)
            self._counts["probe_failures"] += sum(1 for f in found if f is None)
            for key, there in zip(keys, found):
                if there is False:
                    self._gone(key)
        else:
            self._apply_other(msg)

    def wait(self, timeout: float) -> bool:
        """Block the calling thread up to ``timeout`` seconds until a worker has posted an outcome
        (a job done, a probe answered...); True if one is ready for :meth:`poll`. For a caller
        with nothing else to do (a benchmark or a tool driving the tier); the engine's step never
        calls it. The caller's thread, like :meth:`poll`."""
        if self._waited is not None:
            return True
        try:
            self._waited = self._done.get(timeout)
        except queue.Empty:
            return False
        return True

    def _cancelled_posts(self, reads: list[ReadJob], writes: list[WriteJob], probes: list[list[BlockKey]]) -> None:
        """Post the outcomes of jobs a closing tier never ran: reads IO, writes ``error`` failed, probes unanswered."""
        cancelled = ([(MSG_IO, IoResult(job.job_id, IoKind.READ, job.key, False, error=IoError.IO), None)
                      for job in reads]
                     + [(MSG_IO, IoResult(job.job_id, IoKind.WRITE, job.key, False, error=IoError.IO), None, job)
                        for job in writes]
                     + [(MSG_PROBE, keys, [None] * len(keys)) for keys in probes])
        if cancelled:
            self._done.put(cancelled)

    @property
    def breaker(self) -> CircuitBreaker:
        """The circuit breaker (state, back-off; for tests and metrics)."""
        return self._breaker

    @property
    def unavailable(self) -> int:  # type: ignore[override]
        """Reads and writes whose request found the server unreachable (``unreachable``), and reads
        refused at once while the breaker was open (``breaker_rejects``): each a miss or a store lost."""
        return int(self._counts["unreachable"] + self._counts["breaker_rejects"])

    @property
    def stats(self) -> Any:
        """A snapshot of the tier's counters (its :attr:`stats_type`)."""
        return self.stats_type(**self._counts, breaker_opens=self._breaker.opens)

    @property
    def value_bytes(self) -> int:
        """Bytes of one stored value (every rank's header and payload)."""
        return self._value_bytes

    # ------------------------------------------------------------------ caller-thread helpers

    def _wake_monitor(self) -> None:
        """The breaker opened (on the thread that opened it): the monitor tries again sooner."""
        if self._monitor is not None:
            self._monitor.wake()

    def _sync_breaker(self) -> None:
        """The breaker opened or closed since we last looked."""
        self._seen_generation = self._breaker.generation
        if self._breaker.closed:  # back after an outage: the server may have lost everything
            self._presence.invalidate()
        else:  # down: nothing is vouched for (presence() answers ABSENT meanwhile)
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
            counts["unreachable"] += detail == UNREACHABLE
            self._read_failed(result, detail)
            self._presence.failed(result.key)
            return
        self._presence.missing(result.key)
        self._gone(result.key)

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
            if key in self._cancelled or (job is not None and job.epoch != self._clear_epoch):
                if not self._closed:
                    self._remove_again(key)  # deleted or cleared while it was being written
            else:
                self._presence.found(key)
                self._written(result)
        elif result.error is IoError.DROPPED:
            counts["writes_dropped"] += 1
            self._write_failed(result, detail)
        else:
            counts["io_errors"] += 1
            counts["unreachable"] += detail == UNREACHABLE
            self._write_failed(result, detail)
        if key not in self._writing:
            self._cancelled.discard(key)
