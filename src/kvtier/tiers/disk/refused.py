"""Writes the usage ledger refused: the namespace is full across the processes sharing the root.

What :class:`RefusedWrites` does with such a write (a ``NO_ROOM`` post from the write pool):

1. give way: evict this process's least recently used block (not being read) and retry the write
   after that unlink (``no_room_retries``; at most :data:`NO_ROOM_RETRIES` tries in all);
2. with nothing of its own left to evict, start an early ("starved") rescan, paced
   (:meth:`RefusedWrites.rescan_if_starved`), and *park* the write, its space still reserved,
   until that scan is merged (:meth:`RefusedWrites.after_scan`): a block the scan found on disk
   (another process published it) is stored already (ok, 0 bytes written); any other is retried
   once the blocks the merge evicted (the reservations must fit beside what it indexed) are
   unlinked, or, with nothing evicted, handled as a new refusal;
3. otherwise (retries spent, deleted or cleared meanwhile, tier closed) complete it ``DROPPED``
   (``writes_no_room``), giving way once more, and start a starved rescan if one is due.

A parked write always ends: the scan under way posts its result (even a failed one), and the
tier's ``close()`` drops what a shutdown left parked (:meth:`RefusedWrites.drop_parked`).

Threads: the tier's caller thread only (like :class:`~kvtier.tiers.disk.index.DiskIndex`, whose
state it changes); no I/O here: retries go through the ``resubmit`` callback (the tier's write
pool) and rescans through ``rescan`` (the tier's :meth:`~kvtier.tiers.disk.DiskTier.rescan`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future

from kvtier.tiers.base import IoError, IoKind, IoResult
from kvtier.tiers.disk.index import DiskIndex
from kvtier.tiers.disk.layout import ScanResult
from kvtier.tiers.disk.messages import WriteJob, distinct_futures
from kvtier.tiers.disk.writer import WriteOutcome

STARVED_RESCAN_S = 0.25
"""Least time between the last scan and one started because writes found no room and nothing to evict."""
NO_ROOM_RETRIES = 4
"""How often a write the usage ledger refuses is retried, each time after this process evicted its
least recently used block (engines sharing a root evict the same blocks from their shared view
of it, so one eviction of a pair often frees nothing)."""

Resubmit = Callable[[WriteJob, tuple[Future, ...]], None]
"""``resubmit(job, wait_for)``: queue ``job`` again on the write pool, after the ``wait_for`` removals."""


class RefusedWrites:
    """The refused writes of one disk tier and the pace of its scans; see the module docstring."""

    def __init__(self, state: DiskIndex, resubmit: Resubmit, rescan: Callable[[], None]) -> None:
        self._state = state
        self._resubmit = resubmit
        self._rescan = rescan
        self._parked: list[WriteJob] = []  # waiting for the scan under way
        self._scan_started = self._scan_ended = time.monotonic()  # the last scan's (the starved pace)
        self._scan_seconds = 0.0

    def scan_started(self) -> None:
        self._scan_started = time.monotonic()

    def refused(self, job: WriteJob, results: list[IoResult], *, closed: bool) -> None:
        """The usage ledger refused ``job``: give way and retry it; with nothing to evict, park it
        for a (starved) rescan; else complete it ``DROPPED`` into ``results``."""
        state = self._state
        retry = job.attempt < NO_ROOM_RETRIES and not closed
        wait_for = state.retry_after_no_room(job.key) if retry else None
        if wait_for is None and retry and job.key not in state.cancelled:
            self.rescan_if_starved()
            if state.scan_running:
                job.attempt += 1
                self._parked.append(job)
                return
        if wait_for is not None:
            job.attempt += 1
            self._resubmit(job, wait_for)
            return
        result = IoResult(job.job_id, IoKind.WRITE, job.key, False, error=IoError.DROPPED)
        state.finish_write(result, WriteOutcome.NO_ROOM)
        results.append(result)
        self.rescan_if_starved()  # the root stayed full: learn what fills it (paced; not once closed)

    def after_scan(self, scan: ScanResult, evicted: Future | None, results: list[IoResult], *,
                   closed: bool) -> None:
        """A scan was merged (``evicted``: the unlink of the blocks the merge evicted): settle the
        writes parked for it (see the module docstring)."""
        self._scan_ended = time.monotonic()
        self._scan_seconds = self._scan_ended - self._scan_started
        parked, self._parked = self._parked, []
        if not parked:
            return
        found = {hex_key for _, hex_key in scan.new}
        state = self._state
        for job in parked:
            key = job.key
            if closed or key in state.cancelled:
                self.refused(job, results, closed=closed)
            elif key.hex() in found and key not in state.unlinking and key not in state.unreadable:
                result = IoResult(job.job_id, IoKind.WRITE, key, True)
                state.finish_write(result, WriteOutcome.WRITTEN)  # indexes it: 0 bytes written
                results.append(result)
            elif evicted is not None:
                state.counts["no_room_retries"] += 1
                self._resubmit(job, distinct_futures((state.unlinking.get(key), state.clearing, evicted)))
            else:
                self.refused(job, results, closed=closed)

    def drop_parked(self, results: list[IoResult]) -> None:
        """The tier closed: complete what is still parked (its scan was cancelled) ``DROPPED``."""
        parked, self._parked = self._parked, []
        for job in parked:
            self.refused(job, results, closed=True)

    def rescan_if_starved(self) -> None:
        """The ledger refused a write and this process has nothing of its own left to evict (or
        its retries are spent): the root is full of blocks this process does not index (other
        engines wrote them since its last scan) or the ledger drifted. Rescan now rather than at the
        next refresh: the scan indexes those blocks, so writes can evict them, and reconciles the
        ledger. Paced to at most a tenth of the scan thread's time (a walk of a big root takes
        seconds), never within :data:`STARVED_RESCAN_S` of the last scan; counted when one starts."""
        state = self._state
        if state.scan_running or time.monotonic() - self._scan_ended < max(STARVED_RESCAN_S, 10 * self._scan_seconds):
            return
        self._rescan()
        if state.scan_running:
            state.counts["starved_rescans"] += 1
