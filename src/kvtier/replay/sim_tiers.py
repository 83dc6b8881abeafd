"""In-memory disk and remote tiers for a replay: kvtier's tier contract
(:class:`~kvtier.tiers.base.SecondaryTier`) without bytes, whose jobs complete at the next
:meth:`poll` (a replay runs one request's events after another: every read and write is done
before the next request arrives, as on a machine whose tiers keep up).

- :class:`SimDiskTier` keeps its index in kvtier's own :class:`~kvtier.tiers.disk.index.DiskIndex`,
  so capacity, eviction order (tails first, then least recently used; a read or a re-store touches)
  and deduplication are the disk tier's code; only the files are missing.
- :class:`SimRemoteTier` stands for a Redis / Valkey server with ``maxmemory`` and an LRU eviction
  policy: kvtier gives Redis no capacity of its own, the server evicts. Modelled as an exact LRU of
  ``capacity_blocks`` records (Redis samples keys to approximate LRU); reads, writes and kvtier's
  touches make a record recent; no TTL. Presence is known at once (the real tier probes the server
  first: one engine step later, the same outcome).

One thread (the replay's); not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvtier.core.keys import BlockKey
from kvtier.core.residency import Medium, ResidencyLog
from kvtier.tiers.base import IoError, IoKind, IoResult, SecondaryTier, TierUsage
from kvtier.tiers.disk.index import DiskIndex
from kvtier.tiers.disk.writer import WriteOutcome
from kvtier.tiers.outbox import Outbox


class _SimTier(SecondaryTier):
    """What both simulated tiers share: every job is done when submitted, its result handed out by
    the next :meth:`poll`; writes never wait for room; nothing to close."""

    medium: Medium

    def __init__(self) -> None:
        self.residency = ResidencyLog(self.medium)
        self.outbox = Outbox()
        self._done: list[IoResult] = []

    def write_room(self) -> int | None:
        return 1 << 30

    def poll(self) -> list[IoResult]:
        done, self._done = self._done, []
        return done

    def close(self) -> None:
        pass


class SimDiskTier(_SimTier):
    """A disk tier of ``capacity_bytes`` holding blocks of ``block_bytes`` (all ranks, headers included)."""

    medium = Medium.DISK

    def __init__(self, capacity_bytes: int, block_bytes: int):
        super().__init__()
        self.index = DiskIndex(block_bytes=block_bytes, capacity_bytes=capacity_bytes, remove_files=lambda keys, earlier: None)

    def contains(self, key: BlockKey) -> bool:
        return key in self.index.index

    def submit_read(self, job_id: int, key: BlockKey, dests: Sequence[memoryview]) -> None:
        index = self.index
        index.reading[key] = index.reading.get(key, 0) + 1
        ok = key in index.index
        result = IoResult(job_id, IoKind.READ, key, ok, error=None if ok else IoError.NOT_FOUND)
        index.finish_read(result, index.index.get(key))
        self._done.append(result)

    def submit_write(self, job_id: int, key: BlockKey, parent: BlockKey, num_tokens: int,
                     sources: Sequence[memoryview], *, tail: bool = False) -> bool:
        index = self.index
        if key in index.index:  # dedup: the tier touches the block it has
            index.touch_one(key)
            self._done.append(IoResult(job_id, IoKind.WRITE, key, True))
            return True
        if index.reserve_write(key) is None:
            index.counts["writes_dropped"] += 1
            return False
        if tail:
            index.tail_writes.add(key)
        result = IoResult(job_id, IoKind.WRITE, key, True, num_bytes=index.block_bytes)
        index.finish_write(result, WriteOutcome.WRITTEN)
        self._done.append(result)
        return True

    def touch(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            self.index.touch_one(key)

    def delete(self, keys: Sequence[BlockKey]) -> int:
        return sum(self.index.forget(key) for key in keys)

    def clear(self) -> int:
        count = len(self.index.index)
        for key in list(self.index.index):
            self.index.forget(key)
        return count

    def usage(self) -> TierUsage:
        return TierUsage(Medium.DISK, self.index.used, self.index.capacity, len(self.index.index))

    @property
    def evictions(self) -> int:
        return int(self.index.counts["evictions"])


class SimRemoteTier(_SimTier):
    """A Redis / Valkey server holding at most ``capacity_blocks`` records, evicting the least
    recently used one (``maxmemory-policy allkeys-lru``) when a write needs room."""

    medium = Medium.REMOTE

    def __init__(self, capacity_blocks: int, block_bytes: int):
        super().__init__()
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.records: OrderedDict[BlockKey, None] = OrderedDict()
        self._evictions = 0

    def contains(self, key: BlockKey) -> bool:
        return key in self.records

    def submit_read(self, job_id: int, key: BlockKey, dests: Sequence[memoryview]) -> None:
        ok = key in self.records
        if ok:
            self.records.move_to_end(key)
        self._done.append(IoResult(job_id, IoKind.READ, key, ok, error=None if ok else IoError.NOT_FOUND))

    def submit_write(self, job_id: int, key: BlockKey, parent: BlockKey, num_tokens: int,
                     sources: Sequence[memoryview], *, tail: bool = False) -> bool:
        records = self.records
        if key in records:
            records.move_to_end(key)
        elif self.capacity_blocks < 1:
            return False
        else:
            while len(records) >= self.capacity_blocks:
                records.popitem(last=False)
                self._evictions += 1
            records[key] = None
        self._done.append(IoResult(job_id, IoKind.WRITE, key, True, num_bytes=self.block_bytes))
        return True

    def touch(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            if key in self.records:
                self.records.move_to_end(key)

    def delete(self, keys: Sequence[BlockKey]) -> int:
        return sum(self.records.pop(key, 1) is None for key in keys)

    def clear(self) -> int:
        count = len(self.records)
        self.records.clear()
        return count

    def usage(self) -> TierUsage:
        return TierUsage(Medium.REMOTE, len(self.records) * self.block_bytes,
                         self.capacity_blocks * self.block_bytes, len(self.records))

    @property
    def evictions(self) -> int:
        return self._evictions
