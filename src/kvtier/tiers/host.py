"""The host tier's index: which block sits in which slot, and which slots may be reused.

The bytes live in :mod:`kvtier.tiers.shm` regions (one per rank, same slot numbering); this
index lives only in the scheduler process and is driven by one thread (the orchestrator's). It is
the :class:`~kvtier.tiers.stack.SlotIndex` an embedded engine's tiers run over.

Slot life cycle::

    FREE --allocate--> WRITING --commit--> READY --evict/delete--> FREE
                          \\--abort--> FREE

Invariants (checked by ``tests/test_host_index.py``):

- a slot is handed out by :meth:`allocate` only when FREE: never twice;
- a WRITING slot, or a READY slot with ``readers > 0`` (pinned), is never evicted or freed;
- ``len(free) + len(slot_of) == num_slots``: usage never exceeds capacity;
- only READY keys are visible to :meth:`is_ready` and live in the eviction policy;
- tails (partial blocks, see :func:`kvtier.core.keys.tail_key`) live in their own LRU order and
  are evicted before any full block: a tail saves less than a block and is cheaper to lose;
- :attr:`HostIndex.residency` records a key STORED when it turns READY and REMOVED when it stops
  being visible (evicted, or deleted: a pinned block is invisible at once, freed on release).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

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
    slot: int
    state: SlotState
    readers: int = 0
    doomed: bool = False  # deleted while pinned: freed when the last reader unpins
    tail: bool = False  # a partial block: evicted before full blocks


@dataclass
class HostIndexStats:
    evictions: int = 0
    allocation_failures: int = 0


@dataclass
class HostIndex:
    """Slots of the host tier. See the module docstring for the state machine and invariants."""

    num_slots: int
    policy_name: PolicyName = PolicyName.LRU
    stats: HostIndexStats = field(default_factory=HostIndexStats)
    residency: ResidencyLog = field(default_factory=lambda: ResidencyLog(Medium.HOST), init=False)

    def __post_init__(self) -> None:
        if self.num_slots <= 0:
            raise ValueError("host tier needs at least one slot")
        self._free: list[int] = list(range(self.num_slots - 1, -1, -1))
        self._entries: dict[BlockKey, SlotEntry] = {}
        self._policy: EvictionPolicy = make_policy(self.policy_name, self.num_slots)
        self._tails = LRUPolicy()  # READY tails, evicted before anything in _policy
        self._pinned = 0  # entries WRITING or with readers (kept by every transition: O(1) to read)

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
        return self._entries[key].slot

    def slots(self, key: BlockKey) -> tuple[int, ...]:
        """``key``'s slot, the same number on every rank (:class:`~kvtier.tiers.stack.SlotIndex`)."""
        return (self._entries[key].slot,)

    def ready_run(self, keys: Iterable[BlockKey]) -> int:
        """Length of the leading run of ``keys`` that are READY."""
        count = 0
        for key in keys:
            if not self.is_ready(key):
                break
            count += 1
        return count

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    def pinned_slots(self) -> int:
        """Slots being written or read (never evictable): 0 whenever no job is in flight."""
        return self._pinned

    # --- mutations ------------------------------------------------------------------------
    def allocate(self, key: BlockKey, *, tail: bool = False) -> tuple[int | None, list[BlockKey]]:
        """Reserve a slot for writing ``key`` (a tail if ``tail``); evicts unpinned READY blocks
        if needed, tails first.

        Returns ``(slot, evicted_keys)``; ``slot`` is None when every slot is pinned (the
        caller drops the store). ``key`` must not be in the index.
        """
        assert key not in self._entries, "allocate() of a key already in the host tier"
        evicted: list[BlockKey] = []
        if not self._free:
            victim = self._tails.evict(self._evictable)
            if victim is None:
                victim = self._policy.evict(self._evictable)
            if victim is None:
                self.stats.allocation_failures += 1
                return None, evicted
            self._free.append(self._entries.pop(victim).slot)
            self.stats.evictions += 1
            self.residency.removed(victim)
            evicted.append(victim)
        slot = self._free.pop()
        self._entries[key] = SlotEntry(slot, SlotState.WRITING, tail=tail)
        self._pinned += 1
        return slot, evicted

    def take(self, key: BlockKey, tail: bool) -> tuple[int, ...] | None:
        """:meth:`allocate` for a promotion (:class:`~kvtier.tiers.stack.SlotIndex`; evictions are
        counted in :attr:`stats`)."""
        slot, _evicted = self.allocate(key, tail=tail)
        return None if slot is None else (slot,)

    def commit(self, key: BlockKey) -> None:
        """WRITING -> READY: the slot's bytes are complete on every rank."""
        entry = self._entries[key]
        assert entry.state is SlotState.WRITING
        entry.state = SlotState.READY
        self._pinned -= 1  # no reader can have pinned a WRITING slot
        if entry.doomed and entry.readers == 0:
            self._free_entry(key)
            return
        (self._tails if entry.tail else self._policy).insert(key)
        self.residency.stored(key)

    def abort(self, key: BlockKey) -> None:
        """WRITING -> FREE: the write failed or was cancelled."""
        entry = self._entries[key]
        assert entry.state is SlotState.WRITING and entry.readers == 0
        self._free.append(self._entries.pop(key).slot)
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
        keys = list(keys)
        self._policy.touch(keys)
        self._tails.touch(keys)

    def is_tail(self, key: BlockKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.tail

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
    def _evictable(self, key: BlockKey) -> bool:
        entry = self._entries[key]
        return entry.state is SlotState.READY and entry.readers == 0

    def _free_entry(self, key: BlockKey) -> None:
        entry = self._entries.pop(key)
        self._policy.remove(key)
        self._tails.remove(key)
        self._free.append(entry.slot)
