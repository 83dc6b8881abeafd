"""What the disk tier's worker threads do: one job each (a block's read, its write, the removal of
blocks' files, the directory scan), posting what happened on the tier's outbox as the tuples of
:mod:`kvtier.tiers.disk.messages`.

Jobs never touch the tier's index (its caller thread owns it): file I/O through the layout and
the usage ledger only. Threads: reads on the read pool, writes and removals on the write pool,
scans on the scan thread; the tier's constructor and ``rescan(wait=True)`` call
:meth:`DiskJobs.scan_files`, and a removal once the tier is closed runs, on the caller's thread,
where blocking is allowed. Buffers: a read's ``dests`` and a write's sources belong to the caller
until the job's result is polled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from kvtier.core.keys import BlockKey
from kvtier.tiers.base import IoKind, IoResult
from kvtier.tiers.blockfile import HEADER_LEN
from kvtier.tiers.disk import files as disk_io
from kvtier.tiers.disk.layout import DiskLayout, ScanResult
from kvtier.tiers.disk.ledger import Ledger
from kvtier.tiers.disk.messages import Msg, WriteJob
from kvtier.tiers.disk.writer import NoSpaceLog, WriteOutcome, write_block
from kvtier.tiers.outbox import Outbox
from kvtier.tiers.sealing import Sealer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DiskJobs:
    """One tier's jobs: its files (``layout``), ``ledger``, ranks (``rank_digests``, one file each),
    record ``sealer`` and block size; they post on ``done``."""

    layout: DiskLayout
    ledger: Ledger
    no_space: NoSpaceLog
    rank_digests: tuple[bytes, ...]
    sealer: Sealer
    payload_bytes: int
    done: Outbox

    @property
    def file_bytes(self) -> int:
        return HEADER_LEN + self.payload_bytes

    @property
    def block_bytes(self) -> int:
        return len(self.rank_digests) * self.file_bytes

    def read(self, job_id: int, key: BlockKey, gen: int | None, dests: list[memoryview]) -> None:
        """Read every rank's file of ``key`` into ``dests`` and post the result (``gen``: see Msg.IO)."""
        start = time.perf_counter()
        error = disk_io.read_block(self.layout, self.ledger, self.rank_digests, key, dests, self.sealer)
        seconds = time.perf_counter() - start
        nbytes = 0 if error is not None else self.payload_bytes * len(self.rank_digests)
        self.done.put((Msg.IO, IoResult(job_id, IoKind.READ, key, error is None, nbytes, seconds, error), gen))

    def write(self, job: WriteJob, wait_for: Sequence[Future]) -> None:
        """Write ``job``'s files once the removals in ``wait_for`` are done; post the outcome."""
        for future in wait_for:  # queued before this job, so already running or done: no deadlock
            future.result()
        start = time.perf_counter()
        outcome = write_block(
            self.layout, self.ledger, self.no_space, self.rank_digests,
            job.key, job.parent, job.num_tokens, job.sources, self.sealer,
        )
        if outcome is WriteOutcome.NO_ROOM:
            self.done.put((Msg.NO_ROOM, job))
            return
        seconds = time.perf_counter() - start
        error = outcome.error
        nbytes = self.block_bytes if error is None else 0
        result = IoResult(job.job_id, IoKind.WRITE, job.key, error is None, nbytes, seconds, error)
        self.done.put((Msg.IO, result, outcome))

    def remove(self, keys: list[BlockKey] | None, future: Future | None, earlier: Sequence[Future]) -> int:
        """Unlink ``keys``' files, or sweep the namespace (None), after the ``earlier`` removals;
        returns the files that could not be removed. With a ``future`` (a job on the write pool) it
        is resolved and the outcome posted, whatever happens."""
        errors = 0
        try:
            for previous in earlier:  # queued before this job: started already, maybe not done
                previous.result()
            if keys is None:
                errors = disk_io.sweep_blocks(self.layout, self.ledger)
            else:
                errors = disk_io.unlink_blocks(self.layout, self.ledger, keys)
        finally:
            if future is not None:
                future.set_result(None)
                self.done.put((Msg.REMOVED, keys, future, errors))
        return errors

    def scan(self, known: list[BlockKey], gen: int) -> None:
        """:meth:`scan_files` on the scan thread; posts its result (an empty one if it failed)."""
        try:
            result = self.scan_files(known)
        except Exception:  # never lose the "scan finished" message
            logger.exception("kvtier disk: rescan failed")
            self.done.put((Msg.SCAN, ScanResult(new=[], vanished=[], io_errors=1), None))
            return
        self.done.put((Msg.SCAN, result, gen))

    def scan_files(self, known: list[BlockKey] | None) -> ScanResult:
        """Walk the files (``known``: keys indexed when the scan started, not ``stat``-ed; None:
        start-up), then settle what the walk found with the usage ledger."""
        try:
            since = self.ledger.version()
        except OSError as exc:  # not reconciled this time; removals still happen (see settle_scan)
            logger.warning("kvtier disk: usage ledger %s: %s", self.ledger.path, exc)
            since = None
        result = self.layout.scan(known, self.file_bytes)
        disk_io.settle_scan(self.layout, self.ledger, result, since)
        return result
