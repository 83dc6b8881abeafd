"""The orchestrator: lookup across tiers, admission, promotion, cascade. Knows no engine.

It lives in one process (vLLM's scheduler process) and is driven by ONE thread; it never blocks
on I/O. Tier I/O runs on the tiers' own threads and is collected by :meth:`Orchestrator.poll`.

Block flow::

    store:   begin_store (host slot WRITING) -> [engine copies bytes in] -> finish_store
             -> READY in host -> cascade: disk write (slot pinned while it runs)
    load:    acquire (host READY blocks pinned for the owner; disk-only blocks are promoted
             into host slots first and the caller is told to ask again) -> [engine copies bytes
             out] -> release (unpin)

Ownership of host slots: a slot is written only by its WRITING owner (the engine's store job or
a promotion); a READY slot may be read by any number of pinned readers; unpinned READY slots
may be evicted and reused by :meth:`begin_store` or promotions.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.core.keys import BlockKey
from kvtier.core.residency import ResidencyChange
from kvtier.core.stats import KVTierStats
from kvtier.policy.admission import StoreAdmission
from kvtier.tiers.base import IoError, IoKind, IoResult, Medium, SecondaryTier
from kvtier.tiers.host import HostIndex

logger = logging.getLogger(__name__)


class HostBytes:
    """The scheduler's mapping of the host tier: slot ``s`` of rank ``r`` as a memoryview."""

    def __init__(self, rank_views: Sequence[memoryview], slot_bytes: int):
        self.rank_views = list(rank_views)
        self.slot_bytes = slot_bytes

    def slot(self, slot: int) -> list[memoryview]:
        start = slot * self.slot_bytes
        return [view[start : start + self.slot_bytes] for view in self.rank_views]


class AcquireStatus(enum.Enum):
    READY = "ready"  # the returned run is pinned in host slots for the owner
    RETRY = "retry"  # promotions are running; ask again later (never wait)


@dataclass(frozen=True)
class Acquired:
    status: AcquireStatus
    num_blocks: int = 0
    from_disk: int = 0  # of num_blocks, how many were promoted from disk for this owner


@dataclass
class _Hold:
    """Host blocks pinned for one owner (a request) while it loads them."""

    keys: list[BlockKey] = field(default_factory=list)
    promoted: set[BlockKey] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What the disk format needs besides the bytes: the chain parent and the token count."""

    parent: BlockKey
    num_tokens: int


REFRESH_INTERVAL_S = 30.0
"""How often secondary tiers look for blocks other engines stored (shared disk roots)."""


class Orchestrator:
    def __init__(
        self,
        host: HostIndex,
        host_bytes: HostBytes | None,
        disk: SecondaryTier | None,
        admission: StoreAdmission,
    ):
        if disk is not None and host_bytes is None:
            raise ValueError("a disk tier needs the scheduler to map the host tier's bytes")
        self.host = host
        self.host_bytes = host_bytes
        self.disk = disk
        self.admission = admission
        self.stats = KVTierStats()
        self._job_ids = itertools.count(1)
        self._holds: dict[str, _Hold] = {}
        self._promoting: dict[BlockKey, str] = {}  # key -> owner that asked
        self._cascading: dict[int, BlockKey] = {}  # disk write job -> key (slot pinned)
        self._promotion_jobs: dict[int, BlockKey] = {}
        self._info: dict[BlockKey, BlockInfo] = {}  # for blocks stored but not yet cascaded
        self._next_refresh = time.monotonic() + REFRESH_INTERVAL_S
        self._disk_evictions_reported = 0

    # --- lookups (memory only) -------------------------------------------------------------
    def locate(self, key: BlockKey) -> Medium | None:
        if self.host.is_ready(key):
            return Medium.HOST
        if self.disk is not None and self.disk.contains(key):
            return Medium.DISK
        return None

    def leading_run(self, keys: Sequence[BlockKey]) -> int:
        """Blocks at the start of ``keys`` present in some tier (memory only)."""
        for index, key in enumerate(keys):
            if self.locate(key) is None:
                return index
        return len(keys)

    def media_of(self, key: BlockKey) -> list[Medium]:
        """Every tier ``key`` is readable from (memory only)."""
        media = [Medium.HOST] if self.host.is_ready(key) else []
        if self.disk is not None and self.disk.contains(key):
            media.append(self.disk.medium)
        return media

    def is_stored(self, key: BlockKey) -> bool:
        """Present or being written anywhere: a store of ``key`` would be redundant."""
        return key in self.host or (self.disk is not None and self.disk.contains(key))

    # --- loads ------------------------------------------------------------------------------
    def acquire(self, owner: str, keys: Sequence[BlockKey]) -> Acquired:
        """Pin the longest available run of ``keys`` in host slots for ``owner``.

        Replaces any earlier hold of ``owner``. Disk-only blocks of the run are promoted into
        host slots (asynchronously): then the answer is RETRY and nothing is pinned yet except
        finished promotions, which stay held for ``owner`` so they cannot be evicted before it
        asks again. A run is cut at the first block that is missing, being stored, or cannot get
        a host slot.
        """
        self.poll()
        previous = self._holds.pop(owner, None)
        hold = _Hold(promoted=previous.promoted if previous else set())
        pending = False
        for key in keys:
            if self.host.is_ready(key):
                self.host.pin(key)
                hold.keys.append(key)
                continue
            if key in self._promoting:
                pending = True
                break
            if self.disk is None or key in self.host or not self.disk.contains(key):
                break
            slot, evicted = self.host.allocate(key)
            self._count_evictions(evicted)
            if slot is None:
                break
            job_id = next(self._job_ids)
            self._promoting[key] = owner
            self._promotion_jobs[job_id] = key
            assert self.host_bytes is not None
            self.disk.submit_read(job_id, key, self.host_bytes.slot(slot))
            pending = True
            # keep walking: start the whole run's reads at once
        if previous is not None:
            for key in previous.keys:
                self.host.unpin(key)
        hold.promoted &= set(hold.keys)
        self._holds[owner] = hold
        if pending:
            return Acquired(AcquireStatus.RETRY, len(hold.keys))
        self.host.touch(hold.keys)
        return Acquired(AcquireStatus.READY, len(hold.keys), from_disk=len(hold.promoted))

    def held(self, owner: str) -> list[BlockKey]:
        hold = self._holds.get(owner)
        return list(hold.keys) if hold else []

    def trim_hold(self, owner: str, num_blocks: int) -> None:
        """Keep only the first ``num_blocks`` of ``owner``'s hold (the engine loads fewer)."""
        hold = self._holds.get(owner)
        if hold is None:
            return
        for key in hold.keys[num_blocks:]:
            self.host.unpin(key)
            hold.promoted.discard(key)
        del hold.keys[num_blocks:]

    def release(self, owner: str) -> None:
        """Unpin everything held for ``owner``. Idempotent."""
        hold = self._holds.pop(owner, None)
        if hold is None:
            return
        for key in hold.keys:
            self.host.unpin(key)

    def slots_of(self, keys: Sequence[BlockKey]) -> list[int]:
        return [self.host.slot_of(key) for key in keys]

    # --- stores -----------------------------------------------------------------------------
    def begin_store(self, key: BlockKey, info: BlockInfo) -> int | None:
        """Reserve a host slot to receive ``key`` from the engine, or None (skipped/dropped).

        None when the block is already stored anywhere (it is touched instead), when admission
        refuses it (``store_threshold``), or when every host slot is pinned (counted as dropped).
        """
        if key in self.host:
            self.host.touch((key,))
            return None
        if self.disk is not None and self.disk.contains(key):
            self.disk.touch((key,))
            return None
        if not self.admission.offer(key):
            self.stats.stores_skipped_threshold += 1
            return None
        slot, evicted = self.host.allocate(key)
        self._count_evictions(evicted)
        if slot is None:
            self.stats.stores_dropped += 1
            return None
        self.stats.stores_submitted += 1
        self._info[key] = info
        return slot

    def finish_store(self, keys: Sequence[BlockKey], ok: bool) -> None:
        """The engine finished (or failed) copying ``keys`` into their slots on every rank."""
        for key in keys:
            if not ok:
                self.host.abort(key)
                self._info.pop(key, None)
                continue
            self.host.commit(key)
            self._cascade(key)

    def _cascade(self, key: BlockKey) -> None:
        info = self._info.pop(key, None)
        if self.disk is None or info is None or not self.host.is_ready(key) or self.disk.contains(key):
            return
        assert self.host_bytes is not None
        self.host.pin(key)
        job_id = next(self._job_ids)
        if self.disk.submit_write(job_id, key, info.parent, info.num_tokens, self.host_bytes.slot(self.host.slot_of(key))):
            self._cascading[job_id] = key
        else:
            self.host.unpin(key)
            self.stats.disk_writes_dropped += 1

    # --- completions ------------------------------------------------------------------------
    def poll(self) -> None:
        """Collect tier completions. Cheap when idle; call it every step."""
        if self.disk is None:
            return
        now = time.monotonic()
        if now >= self._next_refresh:
            self._next_refresh = now + REFRESH_INTERVAL_S
            self.disk.refresh()
        for result in self.disk.poll():
            if result.kind is IoKind.WRITE:
                self._on_write_done(result)
            else:
                self._on_read_done(result)

    def _on_write_done(self, result: IoResult) -> None:
        key = self._cascading.pop(result.job_id, None)
        if key is None:
            return
        self.host.unpin(key)
        if result.ok:
            self.stats.host_to_disk.record(result.num_bytes, result.seconds)
        elif result.error is IoError.DROPPED:
            self.stats.disk_writes_dropped += 1

    def _on_read_done(self, result: IoResult) -> None:
        key = self._promotion_jobs.pop(result.job_id, None)
        if key is None:
            return
        owner = self._promoting.pop(key, None)
        if not result.ok:
            self.host.abort(key)
            self.stats.promotion_failures += 1
            if result.error is IoError.CORRUPT:
                self.stats.checksum_failures += 1
            logger.warning("kvtier: disk block %s unreadable (%s): it is a miss", key.hex()[:16], result.error)
            return
        self.host.commit(key)
        self.stats.promotions += 1
        self.stats.disk_to_host.record(result.num_bytes, result.seconds)
        if not self.host.is_ready(key):
            return  # deleted while the read ran (clear(), reset_prefix_cache): commit freed the slot
        hold = self._holds.get(owner) if owner is not None else None
        if hold is not None:
            # Held for the owner until it asks again, so the promotion cannot be evicted first.
            self.host.pin(key)
            hold.keys.append(key)
            hold.promoted.add(key)

    def has_pending_io(self) -> bool:
        return bool(self._promotion_jobs or self._cascading)

    def _count_evictions(self, evicted: list[BlockKey]) -> None:
        self.stats.host_evictions += len(evicted)

    # --- residency (KV events) -------------------------------------------------------------
    def track_residency(self) -> None:
        """Start recording which blocks become visible in / vanish from each tier (off by
        default). Blocks already present (e.g. found on disk at start-up) are not reported."""
        self.host.residency.enable()
        if self.disk is not None:
            self.disk.residency.enable()

    def take_residency_changes(self) -> list[ResidencyChange]:
        """Changes since the last call: per tier in the order they happened (see
        :mod:`kvtier.core.residency`). They reflect the completions :meth:`poll` has applied, as
        :meth:`media_of` does."""
        changes = self.host.residency.take()
        if self.disk is not None:
            changes += self.disk.residency.take()
        return changes

    # --- management -------------------------------------------------------------------------
    def clear(self) -> None:
        """Drop every block from every tier (blocks in flight are freed when they complete)."""
        self.host.clear()
        if self.disk is not None:
            self.disk.clear()

    def take_stats(self) -> KVTierStats:
        """The counters since the last call, with a fresh sample of every tier's usage."""
        stats, self.stats = self.stats, KVTierStats()
        host = self.host
        stats.host_blocks = host.used_slots
        if self.host_bytes is not None:
            block_bytes = self.host_bytes.slot_bytes * len(self.host_bytes.rank_views)
            stats.host_used_bytes = host.used_slots * block_bytes
            stats.host_capacity_bytes = host.num_slots * block_bytes
        if self.disk is not None:
            usage = self.disk.usage()
            stats.disk_used_bytes = usage.used_bytes
            stats.disk_capacity_bytes = usage.capacity_bytes
            stats.disk_blocks = usage.num_blocks
            evictions = self.disk.evictions
            stats.disk_evictions = evictions - self._disk_evictions_reported
            self._disk_evictions_reported = evictions
        return stats

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
