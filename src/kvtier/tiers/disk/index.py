"""Caller-thread bookkeeping of the disk tier: the index, capacity and keys with jobs in flight.

:class:`DiskIndex` holds what :class:`~kvtier.tiers.disk.DiskTier` knows about its blocks (the
index in LRU order, the bytes indexed and reserved, the keys being read, written or unlinked,
the state of a :meth:`~kvtier.tiers.disk.DiskTier.clear` and of a rescan) and the rules that
apply a job's outcome to it. See "Index and capacity" in :mod:`kvtier.tiers.disk`.

Threading: every method runs on the caller's (orchestrator's) thread; workers never touch this
state, so it needs no lock. Nothing here does I/O: removing files goes through the ``remove_files`` callback,
which the tier implements by queuing a job on its write pool.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass

from kvtier.core.keys import BlockKey
from kvtier.core.residency import ResidencyLog
from kvtier.tiers.base import IoError, IoResult, Medium
from kvtier.tiers.disk.layout import ScanResult
from kvtier.tiers.disk.writer import WriteOutcome


@dataclass(frozen=True, slots=True)
class DiskTierStats:
    """Counters of one :class:`~kvtier.tiers.disk.DiskTier` (a snapshot; read ``DiskTier.stats`` again).

    ``read_misses`` counts ``NOT_FOUND`` reads, ``corrupt_quarantined`` files moved to quarantine
    (by reads or by scans), ``unauthenticated`` reads of files without a valid MAC under the tier's
    fleet keys (or sealed where the tier has none: quarantined too), ``io_errors`` failed reads, writes and unlinks. ``writes_dropped``
    counts writes refused because the queue was full (``submit_write`` returned False) or that
    completed ``DROPPED``: block larger than the capacity, no evictable space, a re-store of a
    block whose write :meth:`~kvtier.tiers.disk.DiskTier.clear` cancelled while it was in flight,
    and the two counted apart as well: ``writes_no_room`` (the namespace's usage ledger stayed
    full: the processes sharing the root hold ``capacity_bytes``) and ``writes_no_space`` (the
    filesystem refused: ``ENOSPC``, ``EDQUOT``, ``EFBIG``). ``no_room_retries``: writes the ledger
    refused that were tried again after this process evicted a block to make room (one of its own,
    or one a rescan found); ``starved_rescans``: rescans started early because the ledger refused a
    write and this process had nothing to evict (the write waits for the rescan).
    """

    reads_ok: int = 0
    read_misses: int = 0
    corrupt_quarantined: int = 0
    unauthenticated: int = 0
    io_errors: int = 0
    writes_ok: int = 0
    writes_dropped: int = 0
    writes_no_room: int = 0
    writes_no_space: int = 0
    no_room_retries: int = 0
    starved_rescans: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0


_STAT_FIELDS = tuple(f.name for f in dataclasses.fields(DiskTierStats))
_DROP_COUNTERS = {WriteOutcome.NO_ROOM: "writes_no_room", WriteOutcome.NO_SPACE: "writes_no_space"}


RemoveFiles = Callable[[list[BlockKey] | None, Iterable[Future | None]], Future | None]
"""``remove_files(keys, earlier)``: queue the removal of ``keys``' files (None: every file of the
namespace) after the ``earlier`` removals; returns the future resolved when the files are gone,
or None if they are gone already. Provided by the tier, which owns the I/O threads."""


class DiskIndex:
    """The caller-thread state of a disk tier and the rules that keep it consistent (no I/O).

    Owned by one :class:`~kvtier.tiers.disk.DiskTier` and used only on its caller's thread; the
    only I/O it causes goes through the ``remove_files`` callback the tier gives it.
    """

    def __init__(self, *, block_bytes: int, capacity_bytes: int, remove_files: RemoveFiles) -> None:
        self._remove_files = remove_files
        self.block_bytes = block_bytes
        self.capacity = capacity_bytes
        # key -> its generation (``gen`` when it was indexed), least recently used first. Every
        # block costs ``block_bytes``, so nothing else is kept per key (a million keys: ~100 MB).
        self.index: OrderedDict[BlockKey, int] = OrderedDict()
        # The indexed tails (partial blocks written by this process), least recently used first:
        # evicted before any block. Tails found by a scan (after a restart) are plain index entries.
        self.tails: OrderedDict[BlockKey, None] = OrderedDict()
        self.tail_writes: set[BlockKey] = set()  # writes in flight that are tails
        self.used = 0  # bytes of indexed blocks
        self.reserved = 0  # bytes of writes in flight
        self.writing: set[BlockKey] = set()  # keys with a write in flight
        # In-flight writes deleted meanwhile (files unlinked on completion) -> whether a new submit
        # of the key may revive them: yes after delete(), no after clear() (its sweep may race them).
        self.cancelled: dict[BlockKey, bool] = {}
        self.reading: dict[BlockKey, int] = {}  # keys with reads in flight (never evicted)
        self.removed_while_reading: set[BlockKey] = set()  # such keys deleted meanwhile: never adopt
        # Keys whose read failed with an I/O error (EIO, EACCES, ...): no longer offered, and not
        # adopted again by a scan (the file is still there) until this process writes them anew.
        self.unreadable: set[BlockKey] = set()
        self.unlinking: dict[BlockKey, Future] = {}  # keys whose files an unlink job will remove
        self.gen = 0  # bumped on every index insert
        self.scan_running = False
        self.scan_forgotten: set[BlockKey] = set()  # keys removed while a rescan runs
        self.clearing: Future | None = None  # the sweep of clear(), until it is done
        self.clear_epoch = 0  # bumped by clear(): a scan that saw the files before must not re-add them
        self.scan_epoch = 0  # _clear_epoch when the running scan started
        self.counts: dict[str, int | float] = dict.fromkeys(_STAT_FIELDS, 0)
        # Index inserts are STORED, index removals REMOVED (recorded once enabled by the owner).
        self.residency = ResidencyLog(Medium.DISK)

    def finish_removal(self, keys: list[BlockKey] | None, future: Future, errors: int) -> None:
        """An unlink of ``keys`` (None: a clear() sweep) resolved ``future`` with ``errors`` failures."""
        self.counts["io_errors"] += errors
        if keys is None:
            if self.clearing is future:
                self.clearing = None
        else:
            for key in keys:
                if self.unlinking.get(key) is future:
                    del self.unlinking[key]

    def touch_one(self, key: BlockKey) -> bool:
        """Mark ``key`` most recently used; False if it is not indexed."""
        if key not in self.index:
            return False
        self.index.move_to_end(key)
        if key in self.tails:
            self.tails.move_to_end(key)
        return True

    def insert(self, key: BlockKey, *, tail: bool = False) -> None:
        """Index ``key`` as the most recently used block (a tail if ``tail``)."""
        self.gen += 1
        self.index[key] = self.gen
        if tail:
            self.tails[key] = None
        self.used += self.block_bytes
        self.residency.stored(key)

    def load(self, keys: list[BlockKey]) -> None:
        """Start-up: index ``keys`` (least recently used first) in one go, as one generation.

        Only into an empty index (a snapshot, see :mod:`kvtier.tiers.disk.snapshot`); evicts what
        exceeds the capacity. Not recorded in the residency log (neither is the start-up scan)."""
        if self.index:
            raise RuntimeError("DiskIndex.load: the index is not empty")
        self.gen += 1
        self.index.update(zip(keys, itertools.repeat(self.gen)))
        self.used = len(self.index) * self.block_bytes
        self.evict()

    def forget(self, key: BlockKey) -> bool:
        if self.index.pop(key, None) is None:
            return False
        self.tails.pop(key, None)
        self.used -= self.block_bytes
        self.residency.removed(key)
        if self.scan_running:
            self.scan_forgotten.add(key)
        if key in self.reading:
            self.removed_while_reading.add(key)
        return True

    def evict(self, extra: int = 0) -> Future | None:
        """Evict LRU blocks (not being read) until ``extra`` more bytes fit in the capacity, or as
        many as can go. Returns the future of their unlink (None: nothing evicted, or removed at once)."""
        victims = self._victims(extra, all_or_nothing=False)
        return self._evict_keys(victims) if victims else None

    def writes_that_fit(self) -> int | None:
        """How many more writes could reserve their block now, evicting indexed blocks: the
        capacity less what writes in flight reserved. None when no write ever fits (a block larger
        than the capacity: refused at submit). Blocks being read are counted as evictable (reads
        are short)."""
        if self.block_bytes > self.capacity:
            return None
        return (self.capacity - self.reserved) // self.block_bytes

    def reserve_write(self, key: BlockKey) -> tuple[Future, ...] | None:
        """Reserve a block's space for a write of ``key``, evicting LRU blocks (not being read) to
        fit the capacity; None (nothing evicted) when impossible. Returns the removals the write must
        wait for: an earlier unlink of ``key`` and a pending clear() sweep (they must not remove the
        new files), and the unlink of the blocks evicted for it (so their bytes are given back to the
        usage ledger before the write charges its own). The files of a block that failed a read
        with an I/O error (``unreadable``) are removed first, so the write replaces them."""
        victims = self._victims(self.block_bytes, all_or_nothing=True)
        if victims is None:
            return None
        self._evict_keys(victims)
        self.reserved += self.block_bytes
        self.writing.add(key)
        if key in self.unreadable:  # its files failed a read: replace them (a write never replaces a file)
            self.schedule_unlink([key])
        earlier = [self.unlinking.get(key), self.clearing, *map(self.unlinking.get, victims)]
        return tuple({id(f): f for f in earlier if f is not None}.values())

    def give_way(self) -> Future | None:
        """The usage ledger had no room for a write: the processes sharing the root fill the
        namespace. Evict this process's least recently used block (not being read), so that every
        writer gives way under shared pressure and the namespace keeps turning over. Returns the
        future of its unlink (None: nothing to evict)."""
        for key in itertools.chain(self.tails, self.index):
            if key not in self.reading:
                self._evict_keys([key])
                return self.unlinking.get(key)
        return None

    def retry_after_no_room(self, key: BlockKey) -> tuple[Future, ...] | None:
        """A write of ``key`` found no room in the usage ledger: give way (one block) and return
        what its retry must wait for (that unlink, and as at submit an earlier unlink of ``key``
        and a pending clear() sweep); None when it is not retried (deleted or cleared meanwhile,
        or nothing to evict). The write stays in flight, its space reserved."""
        if key in self.cancelled:
            return None
        freed = self.give_way()
        if freed is None:
            return None
        self.counts["no_room_retries"] += 1
        earlier = (self.unlinking.get(key), self.clearing, freed)
        return tuple({id(f): f for f in earlier if f is not None}.values())

    def _victims(self, extra: int, *, all_or_nothing: bool) -> list[BlockKey] | None:
        """LRU keys (not being read) to evict so that ``extra`` more bytes fit; None when that is
        impossible and ``all_or_nothing`` (else as many as there are)."""
        if extra > self.capacity:
            return None
        over = self.used + self.reserved + extra - self.capacity
        victims: list[BlockKey] = []
        if over > 0:
            tails = self.tails
            for key in itertools.chain(tails, (k for k in self.index if k not in tails)):
                if key not in self.reading:
                    victims.append(key)
                    over -= self.block_bytes
                    if over <= 0:
                        break
            else:
                if all_or_nothing:
                    return None  # not enough evictable blocks: evict nothing
        return victims

    def _evict_keys(self, victims: list[BlockKey]) -> Future | None:
        for key in victims:
            self.forget(key)
        self.counts["evictions"] += len(victims)
        return self.schedule_unlink(victims)

    def schedule_unlink(self, keys: list[BlockKey]) -> Future | None:
        """Queue the unlink of ``keys``' files (after earlier unlinks of them); returns its future
        (None: nothing to do, or removed at once)."""
        if not keys:
            return None
        reading = self.reading
        self.removed_while_reading.update(key for key in keys if key in reading)
        # Earlier unlinks of these keys still pending: this one runs after them, so a write that
        # waits for the latest unlink of its key (see submit_write) waits for all of them.
        future = self._remove_files(keys, map(self.unlinking.get, keys))
        if future is not None:
            for key in keys:
                self.unlinking[key] = future
        return future

    def finish_read(self, result: IoResult, gen: int | None) -> None:
        key = result.key
        left = self.reading.get(key, 0) - 1
        removed_meanwhile = key in self.removed_while_reading
        if left > 0:
            self.reading[key] = left
        else:
            self.reading.pop(key, None)
            self.removed_while_reading.discard(key)
        counts = self.counts
        if result.ok:
            counts["reads_ok"] += 1
            counts["bytes_read"] += result.num_bytes
            counts["read_seconds"] += result.seconds
            if (
                not self.touch_one(key)
                and gen is None
                and not removed_meanwhile
                and key not in self.writing
                and key not in self.unlinking
                and self.clearing is None
            ):
                # Not indexed at submit, found on disk: written by another process. Adopt it.
                # (Indexed at submit and gone now, or deleted since: it was removed on purpose.)
                self.insert(key)
                self.evict()
            return
        if result.error is IoError.NOT_FOUND:
            counts["read_misses"] += 1
        elif result.error is IoError.CORRUPT:
            counts["corrupt_quarantined"] += 1
        elif result.error is IoError.UNAUTHENTICATED:
            counts["unauthenticated"] += 1
        else:
            counts["io_errors"] += 1
            # Maybe transient, but offered again it could fail again on every step (vLLM asks
            # again after a failed promotion): the block is a miss from now on, its file left alone
            # until this process writes the block again (reserve_write removes the files first).
            self.unreadable.add(key)
        if gen is not None and self.index.get(key) == gen:  # not rewritten since the read was submitted
            self.forget(key)
            if result.error in (IoError.CORRUPT, IoError.UNAUTHENTICATED):
                self.schedule_unlink([key])  # the other ranks' files are useless now

    def finish_write(self, result: IoResult, outcome: WriteOutcome) -> None:
        """A write job ended with ``outcome`` (``result`` reports it to the caller)."""
        key = result.key
        self.writing.discard(key)
        is_tail = key in self.tail_writes
        self.tail_writes.discard(key)
        self.reserved -= self.block_bytes
        counts = self.counts
        if outcome is not WriteOutcome.WRITTEN:
            self.cancelled.pop(key, None)
            if outcome is WriteOutcome.FAILED:
                counts["io_errors"] += 1
                return
            counts["writes_dropped"] += 1
            counts[_DROP_COUNTERS[outcome]] += 1
            if outcome is WriteOutcome.NO_ROOM:
                self.give_way()
            return
        counts["writes_ok"] += 1
        self.unreadable.discard(key)  # its files are this write's now
        counts["bytes_written"] += result.num_bytes
        counts["write_seconds"] += result.seconds
        if key in self.cancelled:
            del self.cancelled[key]
            self.schedule_unlink([key])
            return
        if key not in self.index:
            self.insert(key, tail=is_tail)
        self.evict()

    def merge_scan(self, result: ScanResult, scan_gen: int | None) -> Future | None:
        """Apply a scan. ``scan_gen`` None: the start-up scan (the index is empty). Returns the
        unlink of the least recently used blocks evicted so that the index and the writes in flight
        fit the capacity (None: none)."""
        self.counts["corrupt_quarantined"] += result.quarantined
        self.counts["io_errors"] += result.io_errors
        forgotten = self.scan_forgotten
        self.scan_running = False
        self.scan_forgotten = set()
        index = self.index
        if scan_gen is not None and (self.scan_epoch != self.clear_epoch or self.clearing is not None):
            return None  # clear() ran since the scan started: what it saw is being swept
        if scan_gen is not None:
            # Indexed before the scan started, no longer complete on disk: another process removed it.
            for hex_key in result.vanished:
                key = bytes.fromhex(hex_key)
                key_gen = index.get(key)
                if key_gen is not None and key_gen <= scan_gen and key not in self.reading:
                    self.forget(key)
        # New blocks go to the MRU end in mtime order (at start-up: the whole index, oldest first).
        result.new.sort()
        fromhex = bytes.fromhex
        for mtime_ns, hex_key in result.new:
            try:
                key = fromhex(hex_key)
            except ValueError:  # not a name kvtier writes: leave the file alone
                continue
            if key in self.unreadable or scan_gen is not None and (
                key in index or key in self.writing or key in self.unlinking or key in forgotten
            ):
                continue
            self.insert(key)
        return self.evict()
