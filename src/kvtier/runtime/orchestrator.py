"""An embedded engine's host side: its host tier and its secondary tiers. Knows no engine.

Lives in vLLM's scheduler process, driven by ONE thread; never blocks on I/O (but for
:meth:`Orchestrator.wait_for_tiers`, bounded, when a step has nothing else to do). Lookup across
tiers, promotion and cascade are :class:`~kvtier.tiers.stack.TierStack`'s, run over the host tier's
index (:class:`~kvtier.tiers.host.HostIndex`) and its ranks' bytes (:class:`HostBytes`) as the node
service runs them over its pool. This class adds the engine's side of the host tier:

    store:   begin_store (host slot WRITING) -> [engine copies bytes in] -> finish_store
             -> READY in host -> cascaded to every secondary tier that lacks the block
    load:    acquire (the leading run READY in host pinned for the owner, a request; blocks of
             it only in a secondary tier promoted first, the owner told to ask again)
             -> [engine copies bytes out] -> release (unpin)

Host slots: a slot is written only by its WRITING owner (the engine's store job or a promotion);
a READY slot may be read by any number of pinned readers; unpinned READY slots may be evicted.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.core.keys import BlockKey
from kvtier.core.residency import ResidencyChange
from kvtier.core.stats import KVTierStats
from kvtier.policy.admission import StoreAdmission
from kvtier.runtime.host_side import Acquired, AcquireStatus
from kvtier.tiers.base import Medium, SecondaryTier
from kvtier.tiers.host import HostIndex
from kvtier.tiers.stack import DRAIN_TIMEOUT_S, BlockInfo, Chain, TierStack

logger = logging.getLogger(__name__)


class HostBytes:
    """The scheduler's mapping of the host tier: slot ``s`` of rank ``r`` as a memoryview."""

    def __init__(self, rank_views: Sequence[memoryview], slot_bytes: int):
        self.rank_views = list(rank_views)
        self.slot_bytes = slot_bytes

    def slot(self, slot: int) -> list[memoryview]:
        start = slot * self.slot_bytes
        return [view[start : start + self.slot_bytes] for view in self.rank_views]

    def views(self, slots: tuple[int, ...]) -> list[memoryview]:
        """A block's bytes, one view per rank (its slot number is the same on every rank)."""
        return self.slot(slots[0])


@dataclass
class _Hold:
    """Host blocks pinned for one owner (a request) while it loads them: ``keys``, the run its last
    answer counted, in order, one pin each; ``promoted``: those promoted for it, by source."""

    keys: list[BlockKey] = field(default_factory=list)
    promoted: dict[BlockKey, Medium] = field(default_factory=dict)


class Orchestrator:
    """The engine's own host tier and secondary tiers (a :class:`~kvtier.runtime.host_side.HostSide`)."""

    pool_id: str | None = None  # its slots are its own regions', never a node pool's

    def __init__(self, host: HostIndex, host_bytes: HostBytes | None, tiers: Sequence[SecondaryTier],
                 admission: StoreAdmission):
        """``tiers``: the secondary tiers, fastest first (lookups and promotions go in this order)."""
        if tiers and host_bytes is None:
            raise ValueError("secondary tiers need the scheduler to map the host tier's bytes")
        self.host = host
        self.host_bytes = host_bytes
        self.admission = admission
        self.stack = TierStack(host, host_bytes.views if host_bytes else None, tiers)
        self.stats = self.stack.stats  # this interval's counters: the stack's (swapped together by take_stats)
        self.tiers = self.stack.tiers
        self._holds: dict[str, _Hold] = {}
        self._info: dict[BlockKey, BlockInfo] = {}  # for blocks stored but not yet cascaded
        self._reported: dict[Medium | str | None, int] = {}  # running counts, as last taken

    @property
    def disk(self) -> SecondaryTier | None:
        return self.tier(Medium.DISK)

    def tier(self, medium: Medium) -> SecondaryTier | None:
        return next((t for t in self.tiers if t.medium is medium), None)

    # --- lookups (memory only) -------------------------------------------------------------
    def locate(self, key: BlockKey) -> Medium | None:
        return self.stack.locate(key)

    def leading_run(self, keys: Sequence[BlockKey]) -> int:
        return self.stack.leading_run(keys)

    def media_of(self, key: BlockKey) -> list[Medium]:
        return self.stack.media_of(key)

    # --- loads ------------------------------------------------------------------------------
    def acquire(self, owner: str, keys: Sequence[BlockKey], first_parent: BlockKey | None = None,
                block_tokens: int = 0, *, tail_tokens: int = 0) -> Acquired:
        """See :meth:`HostSide.acquire <kvtier.runtime.host_side.HostSide.acquire>`: the leading
        READY run pinned, the rest of the run promoted (:meth:`TierStack.promote
        <kvtier.tiers.stack.TierStack.promote>`; RETRY, what lands held for ``owner``)."""
        self.poll()
        host = self.host
        run = list(keys[: host.ready_run(keys)])
        for key in run:
            host.pin(key)
        pending = self.stack.promote(owner, keys, len(run), Chain(first_parent, block_tokens, tail_tokens))
        previous = self._holds.pop(owner, None)
        promoted: dict[BlockKey, Medium] = {}
        if previous is not None:
            for key in previous.keys:
                host.unpin(key)
            promoted = previous.promoted
        if not pending:
            promoted.update(self.stack.settle(owner))
        held = set(run)
        self._holds[owner] = _Hold(run, {key: medium for key, medium in promoted.items() if key in held})
        if pending:
            self.stats.lookups_retried += 1
            return Acquired(AcquireStatus.RETRY, len(run))
        host.touch(run)
        return Acquired(AcquireStatus.READY, len(run), dict(Counter(self._holds[owner].promoted.values())))

    def promoted_source(self, owner: str, key: BlockKey) -> Medium | None:
        """The tier ``owner``'s held ``key`` was promoted from for it (None: it was in the host tier)."""
        hold = self._holds.get(owner)
        return hold.promoted.get(key) if hold else None

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
            hold.promoted.pop(key, None)
        del hold.keys[num_blocks:]

    def release(self, owner: str) -> None:
        """Unpin everything held for ``owner``. Idempotent."""
        self.stack.forget(owner)
        hold = self._holds.pop(owner, None)
        if hold is not None:
            for key in hold.keys:
                self.host.unpin(key)

    def slots_of(self, keys: Sequence[BlockKey]) -> list[int]:
        return [self.host.slot_of(key) for key in keys]

    def held_slots(self, owner: str) -> list[tuple[int, ...]]:
        """The host slot of each of ``owner``'s held blocks, key order, as 1-tuples: the same slot
        number on every rank."""
        return [(slot,) for slot in self.slots_of(self.held(owner))]

    def held_pool(self, owner: str) -> str | None:
        return None

    def hold_lost(self, owner: str) -> bool:
        return False  # its pins live as long as this process

    # --- stores -----------------------------------------------------------------------------
    def begin_store(self, key: BlockKey, info: BlockInfo) -> int | None:
        """Reserve a host slot to receive ``key`` from the engine, or None (skipped/dropped).

        None when the block is already stored anywhere known (it is touched instead), when
        admission refuses it (``store_threshold``), or when every host slot is pinned (counted
        as dropped).
        """
        if key in self.host:
            self.host.touch((key,))
            return None
        for tier in self.tiers:
            if tier.contains(key):
                tier.touch((key,))
                return None
        if not self.admission.offer(key):
            self.stats.stores_skipped_threshold += 1
            return None
        slot, _evicted = self.host.allocate(key, tail=info.tail)
        if slot is None:
            self.stats.stores_dropped += 1
            return None
        self.stats.stores_submitted += 1
        self._info[key] = info
        return slot

    def begin_stores(self, blocks: Sequence[tuple[BlockKey, BlockInfo]]) -> list[tuple[int, ...] | None]:
        """:meth:`begin_store` of each block, in order, each slot as a 1-tuple (the same number on
        every rank)."""
        out: list[tuple[int, ...] | None] = []
        for key, info in blocks:
            slot = self.begin_store(key, info)
            out.append(None if slot is None else (slot,))
        return out

    def finish_store(self, keys: Sequence[BlockKey], ok: bool) -> None:
        """The engine finished (or failed) copying ``keys`` into their slots on every rank."""
        for key in keys:
            info = self._info.pop(key, None)
            if not ok:
                self.host.abort(key)
                continue
            self.host.commit(key)
            if info is not None:
                self.stack.cascade(key, info)

    # --- completions ------------------------------------------------------------------------
    def poll(self) -> None:
        """Collect tier completions. Cheap when idle; call it every step."""
        self.stack.poll()

    def wait_for_tiers(self, timeout_s: float) -> bool:
        """:meth:`TierStack.wait <kvtier.tiers.stack.TierStack.wait>` (an engine step that computes
        nothing while an owner was told to ask again)."""
        return self.stack.wait(timeout_s)

    def has_pending_io(self) -> bool:
        return self.stack.busy

    # --- residency (KV events) -------------------------------------------------------------
    def track_residency(self) -> None:
        """Start recording which blocks become visible in / vanish from each tier (off by
        default). Blocks already present (e.g. found on disk at start-up) are not reported."""
        self.host.residency.enable()
        for tier in self.tiers:
            tier.residency.enable()

    def take_residency_changes(self) -> list[ResidencyChange]:
        """Changes since the last call: per tier in the order they happened (see
        :mod:`kvtier.core.residency`). They reflect the completions :meth:`poll` has applied, as
        :meth:`media_of` does."""
        changes = self.host.residency.take()
        for tier in self.tiers:
            changes += tier.residency.take()
        return changes

    # --- management -------------------------------------------------------------------------
    def clear(self) -> None:
        """Drop every block from the host tier (blocks in flight are freed when they complete): the
        engine's own memory. The secondary tiers keep theirs (a disk root may be shared by other
        engines, Redis and S3 are): a reset of the connector's cache moves the engine to a new key
        epoch instead (:func:`~kvtier.core.keys.epoch_root`), or keeps offering them."""
        self.host.clear()

    def take_stats(self) -> KVTierStats:
        """The counters since the last call, with a fresh sample of every tier's usage."""
        stats = self.stats
        self.stats = self.stack.stats = KVTierStats()
        host = self.host
        stats.host_evictions = self._since_reported(None, host.evictions)
        stats.host_run_evictions = self._since_reported("host runs", host.run_evictions)
        stats.host_blocks = host.used_slots
        stats.host_pinned_blocks = host.pinned_slots()
        if self.host_bytes is not None:
            block_bytes = self.host_bytes.slot_bytes * len(self.host_bytes.rank_views)
            stats.set_usage(Medium.HOST, host.used_slots * block_bytes, host.num_slots * block_bytes, host.used_slots)
        for tier in self.tiers:
            usage = tier.usage()
            stats.set_usage(tier.medium, usage.used_bytes, usage.capacity_bytes, usage.num_blocks)
            evictions = self._since_reported(tier.medium, tier.evictions)
            unavailable = self._since_reported(f"{tier.medium.value} unavailable", tier.unavailable)
            if tier.medium is Medium.DISK:
                stats.disk_evictions = evictions
            elif tier.medium is Medium.S3:
                stats.s3_evictions, stats.s3_unavailable = evictions, unavailable
            elif tier.medium is Medium.REMOTE:
                stats.remote_unavailable = unavailable
        return stats

    def _since_reported(self, medium: Medium | str | None, total: int) -> int:
        """``total`` (a running count of ``medium``'s evictions, None: the host tier's, "host
        runs": its run evictions, "<medium> unavailable": its calls that found the server gone)
        less what was reported."""
        since = total - self._reported.get(medium, 0)
        self._reported[medium] = total
        return since

    def close(self, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Shut down (the engine is stopping; caller's thread): blocks in flight to a secondary
        tier get up to ``drain_timeout_s`` to land (:meth:`TierStack.close
        <kvtier.tiers.stack.TierStack.close>`), then every tier closes."""
        self.stack.close(drain_timeout_s)
        usages = [tier.usage() for tier in self.tiers]
        held = "".join(f", {u.medium.value} tier {u.num_blocks} blocks" for u in usages if u.num_blocks is not None)
        # pinned: blocks still being written or read. 0 once every request finished: more is a leak.
        logger.info("kvtier: stopped; host tier %d blocks (%d pinned)%s",
                    self.host.used_slots, self.host.pinned_slots(), held)
