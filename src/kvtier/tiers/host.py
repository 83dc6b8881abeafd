"""Slot indexes: which block sits in which slots, and which slots may be reused.

:class:`SlotTable` is the life cycle the host tier and the node pool share; :class:`HostIndex` is an
embedded engine's host tier (in vLLM's scheduler process; the bytes live in :mod:`kvtier.tiers.shm`
regions, one per rank, same slot numbering) and :class:`kvtier.node.index.NodeIndex` the node
pool's (a block takes ``width`` slots there, one per rank). Each is driven by one thread (the
orchestrator's; the service's loop); memory only, never blocks. The tiers below run over either
(:class:`~kvtier.tiers.stack.TierStack`).

Life cycle::

    FREE --reserve--> WRITING --commit--> READY --evict/delete--> FREE
                         \\--abort--> FREE

Invariants (checked by ``tests/test_host_index.py`` and ``tests/test_node_index.py``):

- every slot is free or in exactly one entry (``len(free) + sum(width) == num_slots``): a slot is
  never handed out twice and usage never exceeds capacity;
- a WRITING entry, or a READY one with ``readers > 0`` (pinned), is never evicted or freed;
- only READY keys live in the eviction policy; tails (partial blocks, see
  :func:`kvtier.core.keys.tail_key`) live in their own LRU order and the policies evict them
  before any full block (a tail saves less than a block and is cheaper to lose); a store that
  continues its run of slots may take a cold block's slot first (below);
- host tier: only READY keys are visible to :meth:`HostIndex.is_ready`; a block deleted while
  pinned is invisible at once and freed on release; :attr:`HostIndex.residency` records a key
  STORED when it turns READY and REMOVED when it stops being visible (evicted, or deleted).

Runs of slots (LRU only): a reservation of one slot continues the previous one's run when it
can: it takes the next slot if that is free, or, when no slot is free, evicts the block there if
it is evictable and cold (a tail, or a block last used, i.e. reserved or touched, no later than
``run_coldness`` of the way from the policy's last victim's last use to now), even while tails
remain elsewhere; otherwise it evicts by the policy as before (tails first). So a job's blocks
land in consecutive slots, which is what lets a CUDA engine move them as a few large copies and
replay a job's graph (:mod:`kvtier.copy.staging`, :mod:`kvtier.copy.jobgraph`). Under LRU the
policy's victims alone scatter a job over 40-100 runs once the cache is full; continued runs cut
that to 1.6-2.1 with hit rates within half a point of strict LRU, either way by seed
(``benchmarks/bench_slot_runs.py``). Stamps are taken when a key is reserved or touched, not when
its copy commits, so the replay through this code (:mod:`kvtier.replay.exact`, which commits at
once) still predicts a real engine's hits (``tests/test_plan_trace.py`` compares them).
``run_coldness=None`` keeps the policy's order exactly; ARC always does (its order is what
resists scans).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from kvtier.core.keys import BlockKey
from kvtier.core.residency import ResidencyLog
from kvtier.policy import EvictionPolicy, PolicyName, make_policy
from kvtier.policy.lru import LRUPolicy
from kvtier.tiers.base import Medium


class SlotState(enum.Enum):
    WRITING = "writing"
    READY = "ready"


@dataclass(slots=True)
class SlotEntry:
    slots: tuple[int, ...]  # one per rank in the node pool; one for all ranks in the host tier
    state: SlotState
    owner: str = ""  # the engine charged for it (node pool)
    writer: int | None = None  # the session that reserved it, while WRITING (node pool)
    readers: int = 0
    doomed: bool = False  # deleted while pinned (host tier): freed when the last reader unpins
    tail: bool = False  # a partial block: evicted before full blocks


RUN_COLDNESS = 0.5  # see "Runs of slots" in the module docstring


class SlotTable:
    """The shared life cycle (see the module docstring): reserving with eviction, committing,
    dropping, and continuing runs of slots.

    Recency for runs (with ``run_coldness`` set: none is kept otherwise): every key present has a
    stamp, a clock advanced by one per key reserved or touched (:meth:`_touched`); a subclass
    touches through :meth:`_touched` so that the stamps follow the policies."""

    def __init__(self, num_slots: int, policy: PolicyName, name: str,
                 run_coldness: float | None = RUN_COLDNESS) -> None:
        if num_slots <= 0:
            raise ValueError(f"{name} needs at least one slot")
        if run_coldness is not None and not 0.0 <= run_coldness <= 1.0:
            raise ValueError(f"run_coldness must be in [0, 1] or None, got {run_coldness}")
        self.num_slots = num_slots
        self.evictions = 0
        self.run_evictions = 0  # of :attr:`evictions`: cold blocks evicted to continue a run
        self._free: dict[int, None] = dict.fromkeys(range(num_slots - 1, -1, -1))  # a stack: slot 0 first, then the last freed
        self._entries: dict[BlockKey, SlotEntry] = {}
        self._policy: EvictionPolicy = make_policy(policy, num_slots)
        self._tails = LRUPolicy()  # READY tails, evicted before anything in _policy
        self._holder: list[BlockKey | None] = [None] * num_slots  # the key in each slot
        self._coldness = run_coldness if policy is PolicyName.LRU else None  # ARC: its own order (scans)
        self._next = num_slots  # the slot after the last one reserved
        self._clock = 0
        self._stamps: dict[BlockKey, int] = {}  # every key present -> the clock at its last use
        self._cold_line = 0  # the stamp of the block policy's last victim

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    def _reserve(self, key: BlockKey, width: int, tail: bool, owner: str = "", writer: int | None = None
                 ) -> tuple[int, ...] | None:
        """``width`` slots WRITING for absent ``key``: one slot continues the last reservation's
        run where it can (see the module docstring); else unpinned READY blocks are evicted by
        the policies (tails first). None when that many cannot be freed."""
        free = self._free
        got = self._continue_run() if width == 1 and self._coldness is not None else None
        if got is None:
            while len(free) < width:
                victim = self._tails.evict(self._evictable)
                if victim is None:
                    victim = self._policy.evict(self._evictable)
                    if victim is None:
                        return None
                    self._cold_line = self._stamps.get(victim, 0)  # (a tail's age says nothing of the blocks')
                self._evict(victim)
            got = (free.popitem()[0],) if width == 1 else tuple(free.popitem()[0] for _ in range(width))
        for slot in got:
            self._holder[slot] = key
        self._next = got[-1] + 1
        if self._coldness is not None:
            self._clock += 1
            self._stamps[key] = self._clock
        self._entries[key] = SlotEntry(got, SlotState.WRITING, owner, writer, tail=tail)
        return got

    def _continue_run(self) -> tuple[int] | None:
        """The slot after the last one reserved, taken out of the free slots: when it is free, or
        when no slot is and it holds an evictable one-slot block that is a tail or cold (evicted
        here). None otherwise. Only with ``run_coldness`` set."""
        slot, free = self._next, self._free
        if slot >= self.num_slots:
            return None
        if slot in free:
            del free[slot]
            return (slot,)
        holder = self._holder[slot]
        if free or holder is None:
            return None
        entry = self._entries[holder]
        if len(entry.slots) != 1 or not self._evictable(holder):
            return None
        if not entry.tail and self._stamps[holder] > self._cold_line + self._coldness * (self._clock - self._cold_line):
            return None
        (self._tails if entry.tail else self._policy).remove(holder)
        self._evict(holder)
        self.run_evictions += 1
        del free[slot]
        return (slot,)

    def _touched(self, keys: list[BlockKey], tails: bool | None = False) -> None:
        """Touch ``keys`` (each present: the callers touch hits) in the block policy (``tails``
        False), the tails' (True) or both (None), and stamp them as used now."""
        if tails is not True:
            self._policy.touch(keys)
        if tails is not False:
            self._tails.touch(keys)
        if self._coldness is not None:
            self._clock += len(keys)
            self._stamps.update(dict.fromkeys(keys, self._clock))

    def _commit(self, key: BlockKey, entry: SlotEntry) -> None:
        entry.state = SlotState.READY
        entry.writer = None
        (self._tails if entry.tail else self._policy).insert(key)

    def _evict(self, key: BlockKey) -> None:
        """READY, unpinned ``key``, already out of the eviction policies, leaves."""
        self._drop(key)
        self.evictions += 1

    def _drop(self, key: BlockKey) -> SlotEntry:
        entry = self._entries.pop(key)
        self._stamps.pop(key, None)
        holder, free = self._holder, self._free
        for slot in entry.slots:
            holder[slot] = None
            free[slot] = None
        return entry

    def _evictable(self, key: BlockKey) -> bool:
        entry = self._entries[key]
        return entry.state is SlotState.READY and entry.readers == 0


@dataclass
class HostIndexStats:
    allocation_failures: int = 0


class HostIndex(SlotTable):
    """Slots of the host tier, one block each (a :class:`~kvtier.tiers.stack.SlotIndex`). See the
    module docstring for the state machine and invariants."""

    def __init__(self, num_slots: int, policy_name: PolicyName = PolicyName.LRU,
                 run_coldness: float | None = RUN_COLDNESS) -> None:
        super().__init__(num_slots, policy_name, "host tier", run_coldness)
        self.stats = HostIndexStats()
        self.residency = ResidencyLog(Medium.HOST)
        self._pinned = 0  # entries WRITING or with readers (kept by every transition: O(1) to read)
        self._evicted: list[BlockKey] = []  # by the current allocate()

    # --- queries (memory only) -------------------------------------------------------------
    def is_ready(self, key: BlockKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.state is SlotState.READY and not entry.doomed

    def is_writing(self, key: BlockKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.state is SlotState.WRITING

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def slot_of(self, key: BlockKey) -> int:
        return self._entries[key].slots[0]

    def slots(self, key: BlockKey) -> tuple[int, ...]:
        """``key``'s slot, the same number on every rank."""
        return self._entries[key].slots

    def ready_run(self, keys: Iterable[BlockKey]) -> int:
        """Length of the leading run of ``keys`` that are READY."""
        count = 0
        for key in keys:
            if not self.is_ready(key):
                break
            count += 1
        return count

    def pinned_slots(self) -> int:
        """Slots being written or read (never evictable): 0 whenever no job is in flight."""
        return self._pinned

    # --- mutations ------------------------------------------------------------------------
    def allocate(self, key: BlockKey, *, tail: bool = False) -> tuple[int | None, list[BlockKey]]:
        """Reserve a slot for writing ``key`` (a tail if ``tail``); evicts unpinned READY blocks
        if needed, tails first. Returns ``(slot, evicted_keys)``; ``slot`` is None when every slot
        is pinned (the caller drops the store). ``key`` must not be in the index."""
        assert key not in self._entries, "allocate() of a key already in the host tier"
        self._evicted = []
        got = self._reserve(key, 1, tail)
        if got is None:
            self.stats.allocation_failures += 1
            return None, self._evicted
        self._pinned += 1
        return got[0], self._evicted

    def take(self, key: BlockKey, tail: bool) -> tuple[int, ...] | None:
        """:meth:`allocate` for a promotion (evictions are counted in :attr:`evictions`)."""
        slot, _evicted = self.allocate(key, tail=tail)
        return None if slot is None else (slot,)

    def commit(self, key: BlockKey) -> None:
        """WRITING -> READY: the slot's bytes are complete on every rank."""
        entry = self._entries[key]
        assert entry.state is SlotState.WRITING
        self._pinned -= 1  # no reader can have pinned a WRITING slot
        if entry.doomed and entry.readers == 0:
            self._free_entry(key)
            return
        self._commit(key, entry)
        self.residency.stored(key)

    def abort(self, key: BlockKey) -> None:
        """WRITING -> FREE: the write failed or was cancelled."""
        entry = self._entries[key]
        assert entry.state is SlotState.WRITING and entry.readers == 0
        self._drop(key)
        self._pinned -= 1

    def pin(self, key: BlockKey) -> None:
        """Add a reader to a READY block: it cannot be evicted until :meth:`unpin`."""
        entry = self._entries[key]
        assert entry.state is SlotState.READY
        entry.readers += 1
        self._pinned += entry.readers == 1

    def unpin(self, key: BlockKey) -> None:
        entry = self._entries[key]
        assert entry.readers > 0, "unpin() without pin()"
        entry.readers -= 1
        self._pinned -= entry.readers == 0
        if entry.doomed and entry.readers == 0:
            self._free_entry(key)

    def touch(self, keys: Iterable[BlockKey]) -> None:
        """Make ``keys`` (each in the index) the most recently used, in order."""
        self._touched(list(keys), tails=None)

    def delete(self, key: BlockKey) -> bool:
        """Remove ``key``; a pinned or in-flight block is freed once released. True if present."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        if entry.state is SlotState.READY and not entry.doomed:
            self.residency.removed(key)
        if entry.readers or entry.state is SlotState.WRITING:
            entry.doomed = True
            self._policy.remove(key)
            self._tails.remove(key)
        else:
            self._free_entry(key)
        return True

    def clear(self) -> list[BlockKey]:
        """Delete every block (pinned ones once released). Returns the keys that were READY."""
        removed = [key for key, entry in self._entries.items() if entry.state is SlotState.READY]
        for key in list(self._entries):
            self.delete(key)
        return removed

    # --- internals ------------------------------------------------------------------------
    def _evict(self, key: BlockKey) -> None:
        self._drop(key)  # (SlotTable._evict, inlined: a store's hot path)
        self.evictions += 1
        self.residency.removed(key)
        self._evicted.append(key)

    def _free_entry(self, key: BlockKey) -> None:
        self._drop(key)
        self._policy.remove(key)
        self._tails.remove(key)
