"""The node pool's index: which block sits in which slots, who is charged for it, who holds it.

Driven by the service's one loop thread only (:mod:`kvtier.node.server`); not thread-safe.
Memory only, never blocks. The life cycle is the host tier's (:class:`kvtier.tiers.host.SlotTable`:
WRITING -> READY, pins, tails evicted first); this index adds who writes, pins and pays.

A block (one key) occupies ``width`` slots: one per tensor-parallel rank of the engines that
store it (all its engines share its namespace, so they agree on ``width``). Life cycle::

    (absent) --reserve(session)--> WRITING --commit(same session)--> READY --evict--> (absent)
                                       \\--abort, or the session's connection drops--> (absent)

Invariants (``tests/test_node_index.py`` checks them after every operation), besides the shared ones:

- a WRITING entry belongs to exactly one session (its writer); no one else sees it as a hit;
- a key is held at most once, whoever stores it: a second reserve of a present key answers
  :attr:`Reservation.PRESENT` (stored once, counted as a duplicate);
- each READY or WRITING entry is charged to its owner (the engine name that reserved it):
  ``charged[owner]`` is the number of slots it holds; an engine with a cap never holds more than
  its cap (it evicts its own oldest unpinned blocks first, in the order it stored them, else its
  reserve is CAPPED);
- a pin is a handle: one lookup pins its whole hit run under one id that :meth:`NodeIndex.unpin`
  releases (one request's load = one handle; no key crosses the socket twice);
- a lookup's reply is bounded before it is built: its run holds at most ``num_slots // width``
  keys (a longer one can only repeat keys), so its slots are at most the pool's slot count;
- a session holds at most :data:`MAX_SESSION_PINS` pin handles pinning at most
  :data:`MAX_SESSION_PINNED` entries in all (a key pinned by two handles counts twice); a pinning
  lookup beyond either is refused (:class:`PinLimit`) before it touches or pins anything;
- a commit reports which keys it committed (each at most once: a key repeated in one request is
  READY by its second occurrence, so ``unknown``); only those are cascaded to the service's tiers;
- :attr:`NodeIndex.pinned_entries` (WRITING entries and those with readers) is a counter kept by
  every transition, O(1) to read;
- an owner charged nothing has no per-owner policy left (engines come and go with fresh names).
- when a session ends (:meth:`NodeIndex.release_session`), every reservation it holds is aborted
  and every pin it holds is released: nothing stays pinned by a dead engine;
- the service's own pins (:meth:`NodeIndex.hold`: a block being written to one of its tiers, or
  promoted from one and parked for the session that asked, :mod:`kvtier.node.tiers`) are
  released by :meth:`NodeIndex.let_go`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from itertools import chain, takewhile
from operator import attrgetter, is_not

from kvtier.core.keys import BlockKey
from kvtier.node.protocol import Reservation
from kvtier.policy import PolicyName
from kvtier.policy.lru import LRUPolicy
from kvtier.tiers.host import SlotEntry as NodeEntry
from kvtier.tiers.host import SlotState as EntryState
from kvtier.tiers.host import SlotTable

__all__ = ["EngineStats", "EntryState", "NodeEntry", "NodeIndex", "PinLimit", "Session"]

MAX_SESSION_PINS = 1 << 14
"""Pin handles one session may hold (an engine holds one per request whose load is planned; vLLM
schedules at most a few thousand at once)."""
MAX_SESSION_PINNED = 1 << 20
"""Entries one session's handles may pin in all (1M: sixteen 1M-token prompts at 16 tokens per
block, or 1,024 requests of 16K-token prefixes; each costs the service 8 bytes while held)."""


class PinLimit(Exception):
    """A pinning lookup that would take the session past :data:`MAX_SESSION_PINS` or
    :data:`MAX_SESSION_PINNED` (refused; nothing touched or pinned)."""

_is_entry = partial(is_not, None)
_slots_of = attrgetter("slots")


@dataclass
class Session:
    """What one connection holds. Created by the server at hello, released when it drops."""

    id: int
    engine: str
    cap_slots: int | None = None
    reserved: set[BlockKey] = field(default_factory=set)
    pins: dict[int, list[NodeEntry]] = field(default_factory=dict)  # pin handle -> the entries it pins
    pinned: int = 0  # entries its handles pin, in all (sum of the runs' lengths)
    next_pin: int = 1
    namespace: tuple[bytes, int] | None = None  # its engine's namespace digest and slot size (hello): its tiers


@dataclass
class EngineStats:
    lookups: int = 0
    lookup_blocks: int = 0
    hit_blocks: int = 0
    stored_blocks: int = 0
    duplicate_blocks: int = 0
    refused_blocks: int = 0


class NodeIndex(SlotTable):
    """Slots of the node pool. See the module docstring for the state machine and invariants."""

    def __init__(self, num_slots: int, policy: PolicyName = PolicyName.LRU) -> None:
        super().__init__(num_slots, policy, "the node pool")
        self._by_owner: dict[str, LRUPolicy] = {}  # READY keys of each owner, oldest stored first (never touched)
        self.charged: Counter = Counter()  # owner -> slots held (READY + WRITING)
        self.engines: dict[str, EngineStats] = {}
        self._ready: dict[int, dict[BlockKey, NodeEntry]] = {}  # width -> READY entries of that width
        self._pinned = 0  # entries WRITING or with readers (kept by every transition)

    # --- queries ------------------------------------------------------------------------
    @property
    def pinned_entries(self) -> int:
        """Entries WRITING or with readers (never evictable). O(1)."""
        return self._pinned

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
        and the slot list in C loops (``map`` over the READY dict of that width). The run stops
        at ``num_slots // width`` keys (only repeated keys make a longer one). Raises
        :class:`PinLimit` (nothing touched or pinned) when pinning it would take ``session``
        past its bounds.
        """
        ready = self._ready.get(width)
        most = self.num_slots // width
        run = list(takewhile(_is_entry, map(ready.get, keys[:most] if len(keys) > most else keys))) if ready else []
        hits = len(run)
        if pin and hits:
            if len(session.pins) >= MAX_SESSION_PINS:
                raise PinLimit(f"this session holds {len(session.pins)} pin handles, the most one may hold: "
                               "unpin finished loads first")
            if session.pinned + hits > MAX_SESSION_PINNED:
                raise PinLimit(f"pinning {hits} more blocks would take this session past {MAX_SESSION_PINNED} "
                               f"pinned blocks (it pins {session.pinned}): unpin finished loads first")
        stats = self.stats_of(session.engine)
        stats.lookups += 1
        stats.lookup_blocks += len(keys)
        stats.hit_blocks += hits
        if not hits:
            return 0, [], 0
        if run[-1].tail:  # a tail ends a run (it is never a parent)
            self._touched(keys[:hits - 1])
            self._touched(keys[hits - 1:hits], tails=True)
        else:
            self._touched(keys[:hits])
        if not pin:
            return hits, [], 0
        for entry in run:
            entry.readers += 1
            self._pinned += entry.readers == 1  # (a run is READY)
        handle = session.next_pin
        session.next_pin += 1
        session.pins[handle] = run
        session.pinned += hits
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
        # The first key refused for want of room (FULL: nothing evictable; CAPPED: nothing of its
        # own): every later absent key of the request is too, as nothing is unpinned or freed
        # meanwhile, so it is answered without another scan of the pool's pinned blocks.
        refused: Reservation | None = None
        for position, key in enumerate(keys):
            entry = self._entries.get(key)
            got = None
            if entry is not None:
                self._touched([key], tails=entry.tail)
                stats.duplicate_blocks += 1
                outcome = Reservation.PRESENT
            else:
                outcome = self._within_cap(session, width) if refused is None else refused
                if outcome is Reservation.RESERVED:
                    got = self._reserve(key, width, position in tails, session.engine, session.id)
                if got is None:
                    stats.refused_blocks += 1
                    outcome = refused = Reservation.FULL if outcome is Reservation.RESERVED else outcome
                else:
                    self.charged[session.engine] += width
                    self._pinned += 1
                    session.reserved.add(key)
            status.append(outcome)
            slots.append(got)
        return status, slots

    def commit(self, session: Session, keys: list[BlockKey], committed: list[int] | None = None) -> int:
        """WRITING -> READY for keys this session reserved; returns how many were not its own
        (a key repeated in ``keys`` is READY by its second occurrence: not its own then). The
        positions in ``keys`` of those committed are appended to ``committed`` (each key once)."""
        unknown = 0
        stats = self.stats_of(session.engine)
        for position, key in enumerate(keys):
            entry = self._entries.get(key)
            if entry is None or entry.state is not EntryState.WRITING or entry.writer != session.id:
                unknown += 1
                continue
            self._commit(key, entry)
            self._pinned -= 1  # no reader pins a WRITING entry
            if committed is not None:
                committed.append(position)
            self._ready_of(len(entry.slots))[key] = entry
            session.reserved.discard(key)
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
            self._drop(key)
        return unknown

    def unpin(self, session: Session, handles: list[int]) -> int:
        """Release pin handles of ``session``; returns how many it did not hold."""
        unknown = 0
        for handle in handles:
            run = session.pins.pop(handle, None)
            if run is None:
                unknown += 1
                continue
            session.pinned -= len(run)
            self.let_go(run)
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
        self._pinned += entry.readers == 1
        return entry

    def let_go(self, entries: list[NodeEntry]) -> None:
        """Release pins taken by :meth:`hold` (and a handle's, by :meth:`unpin`)."""
        for entry in entries:
            entry.readers -= 1
            self._pinned -= entry.readers == 0  # (pinned entries are READY)

    # --- internals ----------------------------------------------------------------------
    def _owner_policy(self, owner: str) -> LRUPolicy:
        policy = self._by_owner.get(owner)
        if policy is None:
            policy = self._by_owner[owner] = LRUPolicy()
        return policy

    def _ready_of(self, width: int) -> dict[BlockKey, NodeEntry]:
        ready = self._ready.get(width)
        if ready is None:
            ready = self._ready[width] = {}
        return ready

    def _drop(self, key: BlockKey) -> NodeEntry:
        entry = super()._drop(key)
        if entry.state is EntryState.READY:
            del self._ready[len(entry.slots)][key]
        if entry.state is EntryState.WRITING or entry.readers:  # (abort; a READY entry dropped is unpinned)
            self._pinned -= 1
        owner = self._by_owner.get(entry.owner)
        if owner is not None:
            owner.remove(key)
        self.charged[entry.owner] -= len(entry.slots)
        if not self.charged[entry.owner]:
            del self.charged[entry.owner]
            self._by_owner.pop(entry.owner, None)  # it holds no READY key: its policy is empty
        return entry

    def _within_cap(self, session: Session, width: int) -> Reservation:
        """Evict the session's engine's own oldest unpinned blocks until ``width`` more slots stay
        within its cap: RESERVED, or CAPPED if they cannot."""
        cap = session.cap_slots
        if cap is None:
            return Reservation.RESERVED
        if width > cap:
            return Reservation.CAPPED
        own = self._owner_policy(session.engine)
        while self.charged[session.engine] + width > cap:
            victim = own.evict(self._evictable)
            if victim is None:
                return Reservation.CAPPED
            (self._tails if self._entries[victim].tail else self._policy).remove(victim)
            self._evict(victim)
        return Reservation.RESERVED
