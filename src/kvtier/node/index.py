"""The node pool's index: which block sits in which slots, who is charged for it, who holds it.

Driven by the service's one loop thread only (:mod:`kvtier.node.server`); not thread-safe.
Memory only, never blocks.

A block (one key) occupies ``width`` slots: one per tensor-parallel rank of the engines that
store it (all its engines share its namespace, so they agree on ``width``). Life cycle::

    (absent) --reserve(session)--> WRITING --commit(same session)--> READY --evict--> (absent)
                                       \\--abort, or the session's connection drops--> (absent)

Invariants (``tests/test_node_index.py`` checks them after every operation):

- every slot is either free or in exactly one entry: ``free + sum(width) == num_slots``;
- a WRITING entry belongs to exactly one session (its writer); no one else sees it as a hit;
- a READY entry with ``readers > 0`` (pinned by some session) or a WRITING entry is never evicted;
- a key is held at most once, whoever stores it: a second reserve of a present key answers
  :attr:`Reservation.PRESENT` (stored once, counted as a duplicate);
- each READY or WRITING entry is charged to its owner (the engine name that reserved it):
  ``charged[owner]`` is the number of slots it holds; an engine with a cap never holds more than
  its cap (it evicts its own oldest unpinned blocks first, in the order it stored them, else its
  reserve is CAPPED);
- tails (partial blocks) live in their own LRU order and are evicted before any full block, as
  in the embedded host tier (:mod:`kvtier.tiers.host`): a tail saves less than a block;
- a pin is a handle: one lookup pins its whole hit run under one id that :meth:`NodeIndex.unpin`
  releases (one request's load = one handle; no key crosses the socket twice);
- when a session ends (:meth:`NodeIndex.release_session`), every reservation it holds is aborted
  and every pin it holds is released: nothing stays pinned by a dead engine;
- the service's own pins (:meth:`NodeIndex.hold`: a block being written to one of its tiers, or
  promoted from one and parked for the session that asked, :mod:`kvtier.node.tiers`) are
  released by :meth:`NodeIndex.let_go`; through :class:`kvtier.node.tiers.PoolSlots` this index is
  the :class:`~kvtier.tiers.stack.SlotIndex` the service's tiers run over.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from itertools import chain, takewhile
from operator import attrgetter, is_not

from kvtier.core.keys import BlockKey
from kvtier.policy import EvictionPolicy, PolicyName, make_policy
from kvtier.policy.lru import LRUPolicy
from kvtier.node.protocol import Reservation


_is_entry = partial(is_not, None)
_slots_of = attrgetter("slots")


class EntryState(enum.Enum):
    WRITING = "writing"
    READY = "ready"


@dataclass(slots=True)
class NodeEntry:
    slots: tuple[int, ...]
    state: EntryState
    owner: str
    writer: int | None  # the session that reserved it, while WRITING
    readers: int = 0
    tail: bool = False  # a partial block (kvtier.core.keys.tail_key): evicted before any full block


@dataclass
class Session:
    """What one connection holds. Created by the server at hello, released when it drops."""

    id: int
    engine: str
    cap_slots: int | None = None
    reserved: set[BlockKey] = field(default_factory=set)
    pins: dict[int, list[NodeEntry]] = field(default_factory=dict)  # pin handle -> the entries it pins
    next_pin: int = 1
    namespace: bytes | None = None  # its engine's namespace digest (hello), naming the service's tiers for it


@dataclass
class EngineStats:
    lookups: int = 0
    lookup_blocks: int = 0
    hit_blocks: int = 0
    stored_blocks: int = 0
    duplicate_blocks: int = 0
    refused_blocks: int = 0


class NodeIndex:
    """Slots of the node pool. See the module docstring for the state machine and invariants."""

    def __init__(self, num_slots: int, policy: PolicyName = PolicyName.LRU) -> None:
        if num_slots <= 0:
            raise ValueError("the node pool needs at least one slot")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._entries: dict[BlockKey, NodeEntry] = {}
        self._policy: EvictionPolicy = make_policy(policy, num_slots)
        self._tails = LRUPolicy()  # READY tails, evicted before anything in _policy
        self._by_owner: dict[str, LRUPolicy] = {}  # READY keys of each owner, oldest stored first (never touched)
        self.charged: Counter = Counter()  # owner -> slots held (READY + WRITING)
        self.engines: dict[str, EngineStats] = {}
        self._ready: dict[int, dict[BlockKey, NodeEntry]] = {}  # width -> READY entries of that width
        self.evictions = 0

    # --- queries ------------------------------------------------------------------------
    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def pinned_entries(self) -> int:
        """Entries WRITING or with readers (never evictable). O(blocks): for stats, not hot paths."""
        writing = EntryState.WRITING
        return sum(1 for e in self._entries.values() if e.readers or e.state is writing)

    @property
    def blocks(self) -> int:
        return len(self._entries)

    def entry(self, key: BlockKey) -> NodeEntry | None:
        return self._entries.get(key)

    def stats_of(self, engine: str) -> EngineStats:
        stats = self.engines.get(engine)
        if stats is None:
            stats = self.engines[engine] = EngineStats()
        return stats

    # --- operations (one per protocol op) -----------------------------------------------
    def lookup(self, session: Session, keys: list[BlockKey], pin: bool, width: int = 1
               ) -> tuple[int, list[int], int]:
        """Leading run of ``keys`` READY with ``width`` slots each; touched (most recent last).

        With ``pin`` the run is pinned under a new handle (returned; 0 when nothing was pinned)
        and its slots are returned flat, ``width`` per key. Memory only: O(len(keys)), the probe
        and the slot list in C loops (``map`` over the READY dict of that width).
        """
        ready = self._ready.get(width)
        run = list(takewhile(_is_entry, map(ready.get, keys))) if ready else []
        hits = len(run)
        stats = self.stats_of(session.engine)
        stats.lookups += 1
        stats.lookup_blocks += len(keys)
        stats.hit_blocks += hits
        if not hits:
            return 0, [], 0
        if run[-1].tail:  # a tail ends a run (it is never a parent)
            self._policy.touch(keys[:hits - 1])
            self._tails.touch(keys[hits - 1:hits])
        else:
            self._policy.touch(keys[:hits])
        if not pin:
            return hits, [], 0
        for entry in run:
            entry.readers += 1
        handle = session.next_pin
        session.next_pin += 1
        session.pins[handle] = run
        return hits, list(chain.from_iterable(map(_slots_of, run))), handle

    def reserve(self, session: Session, keys: list[BlockKey], width: int, tails: frozenset[int] = frozenset()
                ) -> tuple[list[Reservation], list[tuple[int, ...] | None]]:
        """Reserve ``width`` slots per key for ``session`` to write (see :class:`Reservation`);
        ``tails``: the positions in ``keys`` of tails (partial blocks, evicted first)."""
        if not 1 <= width <= self.num_slots:
            raise ValueError(f"width must be 1..{self.num_slots} slots per block, got {width}")
        stats = self.stats_of(session.engine)
        status: list[Reservation] = []
        slots: list[tuple[int, ...] | None] = []
        for position, key in enumerate(keys):
            entry = self._entries.get(key)
            if entry is not None:
                (self._tails if entry.tail else self._policy).touch((key,))
                stats.duplicate_blocks += 1
                status.append(Reservation.PRESENT)
                slots.append(None)
                continue
            outcome = self._make_room(session, width)
            if outcome is not Reservation.RESERVED:
                stats.refused_blocks += 1
                status.append(outcome)
                slots.append(None)
                continue
            got = tuple(self._free.pop() for _ in range(width))
            self._entries[key] = NodeEntry(got, EntryState.WRITING, session.engine, session.id,
                                           tail=position in tails)
            self.charged[session.engine] += width
            session.reserved.add(key)
            status.append(Reservation.RESERVED)
            slots.append(got)
        return status, slots

    def commit(self, session: Session, keys: list[BlockKey]) -> int:
        """WRITING -> READY for keys this session reserved; returns how many were not its own."""
        unknown = 0
        stats = self.stats_of(session.engine)
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or entry.state is not EntryState.WRITING or entry.writer != session.id:
                unknown += 1
                continue
            entry.state = EntryState.READY
            entry.writer = None
            self._ready_of(len(entry.slots))[key] = entry
            session.reserved.discard(key)
            (self._tails if entry.tail else self._policy).insert(key)
            self._owner_policy(entry.owner).insert(key)
            stats.stored_blocks += 1
        return unknown

    def abort(self, session: Session, keys: list[BlockKey]) -> int:
        """Forget keys this session reserved and did not commit; returns how many were not its own."""
        unknown = 0
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or entry.state is not EntryState.WRITING or entry.writer != session.id:
                unknown += 1
                continue
            session.reserved.discard(key)
            self._drop(key, entry)
        return unknown

    def unpin(self, session: Session, handles: list[int]) -> int:
        """Release pin handles of ``session``; returns how many it did not hold."""
        unknown = 0
        for handle in handles:
            run = session.pins.pop(handle, None)
            if run is None:
                unknown += 1
                continue
            for entry in run:
                entry.readers -= 1
        return unknown

    def release_session(self, session: Session) -> tuple[int, int]:
        """The session's connection dropped: abort its reservations, release its pins.
        Returns ``(aborted, unpinned)``."""
        reserved = list(session.reserved)
        self.abort(session, reserved)
        handles = list(session.pins)
        self.unpin(session, handles)
        return len(reserved), len(handles)

    def hold(self, key: BlockKey) -> NodeEntry | None:
        """Pin READY ``key`` for the service itself (a tier write reading its slots); None if absent."""
        entry = self._entries.get(key)
        if entry is None or entry.state is not EntryState.READY:
            return None
        entry.readers += 1
        return entry

    def let_go(self, entries: list[NodeEntry]) -> None:
        """Release pins taken by :meth:`hold`."""
        for entry in entries:
            entry.readers -= 1

    # --- internals ----------------------------------------------------------------------
    def _owner_policy(self, owner: str) -> LRUPolicy:
        policy = self._by_owner.get(owner)
        if policy is None:
            policy = self._by_owner[owner] = LRUPolicy()
        return policy

    def _evictable(self, key: BlockKey) -> bool:
        entry = self._entries[key]
        return entry.state is EntryState.READY and entry.readers == 0

    def _ready_of(self, width: int) -> dict[BlockKey, NodeEntry]:
        ready = self._ready.get(width)
        if ready is None:
            ready = self._ready[width] = {}
        return ready

    def _drop(self, key: BlockKey, entry: NodeEntry) -> None:
        del self._entries[key]
        if entry.state is EntryState.READY:
            del self._ready[len(entry.slots)][key]
        owner = self._by_owner.get(entry.owner)
        if owner is not None:
            owner.remove(key)
        self.charged[entry.owner] -= len(entry.slots)
        if not self.charged[entry.owner]:
            del self.charged[entry.owner]
        self._free.extend(entry.slots)

    def _make_room(self, session: Session, width: int) -> Reservation:
        """Evict until ``width`` slots are free and the session's engine stays within its cap."""
        cap = session.cap_slots
        if cap is not None:
            if width > cap:
                return Reservation.CAPPED
            own = self._owner_policy(session.engine)
            while self.charged[session.engine] + width > cap:
                victim = own.evict(self._evictable)
                if victim is None:
                    return Reservation.CAPPED
                entry = self._entries[victim]
                (self._tails if entry.tail else self._policy).remove(victim)
                self._drop(victim, entry)
                self.evictions += 1
        while len(self._free) < width:
            victim = self._tails.evict(self._evictable)
            if victim is None:
                victim = self._policy.evict(self._evictable)
            if victim is None:
                return Reservation.FULL
            entry = self._entries[victim]
            self._drop(victim, entry)
            self.evictions += 1
        return Reservation.RESERVED
