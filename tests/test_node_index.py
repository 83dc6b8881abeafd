"""The node pool's index: slots never handed out twice, pins and reservations never evicted, a
block stored twice kept once, per-engine caps, and a dropped session releases everything."""

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.node.index import EntryState, NodeIndex, Session
from kvtier.node.protocol import Reservation
from kvtier.policy.base import PolicyName


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def store(index: NodeIndex, session: Session, *ids: int, width: int = 1) -> list[Reservation]:
    status, _ = index.reserve(session, [key(i) for i in ids], width)
    index.commit(session, [key(i) for i, s in zip(ids, status) if s is Reservation.RESERVED])
    return status


def test_a_block_stored_by_one_engine_is_a_hit_for_another_and_kept_once():
    index = NodeIndex(4)
    a, b = Session(1, "A"), Session(2, "B")
    assert store(index, a, 1, 2) == [Reservation.RESERVED] * 2
    assert index.lookup(b, [key(1), key(2), key(3)], pin=False) == (2, [], 0)
    assert store(index, b, 1, 2, 3) == [Reservation.PRESENT, Reservation.PRESENT, Reservation.RESERVED]
    assert index.blocks == 3 and index.used_slots == 3
    assert index.stats_of("B").duplicate_blocks == 2 and index.stats_of("B").hit_blocks == 2


def test_writing_blocks_are_no_hits_and_only_their_writer_commits():
    index = NodeIndex(2)
    a, b = Session(1, "A"), Session(2, "B")
    status, slots = index.reserve(a, [key(1)], 2)
    assert status == [Reservation.RESERVED] and len(slots[0]) == 2
    assert index.lookup(b, [key(1)], pin=True, width=2) == (0, [], 0)
    assert index.reserve(b, [key(1)], 2)[0] == [Reservation.PRESENT]  # being written: not twice
    assert index.commit(b, [key(1)]) == 1  # not B's reservation
    assert index.commit(a, [key(1)]) == 0
    assert index.lookup(b, [key(1)], pin=True, width=2) == (1, list(slots[0]), 1)
    assert index.lookup(b, [key(1)], pin=True, width=1)[0] == 0  # another parallel layout: a miss


def test_pinned_and_writing_blocks_are_never_evicted():
    index = NodeIndex(2)
    a = Session(1, "A")
    store(index, a, 1)
    _, _, handle = index.lookup(a, [key(1)], pin=True)
    index.reserve(a, [key(2)], 1)  # WRITING
    assert index.reserve(a, [key(3)], 1)[0] == [Reservation.FULL]
    assert index.unpin(a, [handle, 99]) == 1
    assert index.reserve(a, [key(3)], 1)[0] == [Reservation.RESERVED]
    assert index.entry(key(1)) is None and index.evictions == 1


def test_cap_evicts_the_engines_own_blocks_first():
    index = NodeIndex(8)
    a, b = Session(1, "A", cap_slots=2), Session(2, "B")
    store(index, b, 10, 11)  # older than A's blocks
    store(index, a, 1, 2)
    store(index, a, 3)  # A is at its cap: its own oldest block (1) goes, not B's
    assert index.entry(key(1)) is None and index.entry(key(10)) is not None
    assert index.charged["A"] == 2 and index.charged["B"] == 2
    index.lookup(a, [key(2), key(3)], pin=True)
    assert index.reserve(a, [key(4)], 1)[0] == [Reservation.CAPPED]  # its two blocks are pinned
    assert index.reserve(a, [key(5)], 3)[0] == [Reservation.CAPPED]  # wider than the cap


def test_tails_are_evicted_before_blocks_and_end_a_run():
    index = NodeIndex(3)
    a = Session(1, "A")
    store(index, a, 1)
    index.reserve(a, [key(2), key(3)], 1, frozenset({1}))  # key 3 is a tail
    index.commit(a, [key(2), key(3)])
    assert index.lookup(a, [key(1), key(3)], pin=False)[0] == 2
    index.lookup(a, [key(2)], pin=False)  # LRU order now: 1, 3, 2; key 1 is least recent, yet the tail goes first
    store(index, a, 4)
    assert index.entry(key(3)) is None and index.entry(key(1)) is not None and index.entry(key(2)) is not None


def test_release_session_aborts_reservations_and_drops_pins():
    index = NodeIndex(4)
    a, b = Session(1, "A"), Session(2, "B")
    store(index, a, 1)
    index.lookup(b, [key(1)], pin=True)
    index.lookup(b, [key(1)], pin=True)
    index.reserve(b, [key(2), key(3)], 1)
    assert index.entry(key(1)).readers == 2
    assert index.pinned_entries == 3
    assert index.release_session(b) == (2, 2)
    assert index.pinned_entries == 0 and index.blocks == 1 and index.used_slots == 1
    assert index.entry(key(1)).readers == 0


@pytest.mark.parametrize("policy", [PolicyName.LRU, PolicyName.ARC])
@pytest.mark.parametrize("cap", [None, 1024], ids=["full", "capped"])
def test_a_reserve_past_many_pinned_blocks_scans_them_once_not_per_key(policy, cap):
    """A peer pins 1,024 blocks (its cap, or the whole pool), then reserves 4,096 new keys in one
    request: every one is refused (FULL, CAPPED) and the pinned blocks are looked at about once,
    not once per key (which held the service's loop for seconds, minutes at larger pools)."""
    index = NodeIndex(1024 if cap is None else 4096, policy)
    a = Session(1, "A", cap_slots=cap)
    store(index, a, *range(1024))
    assert index.lookup(a, [key(i) for i in range(1024)], pin=True)[0] == 1024
    asked = Counter()
    evictable = index._evictable  # noqa: SLF001 - counted, not changed

    def counted(k):
        asked[k] += 1
        return evictable(k)

    index._evictable = counted  # noqa: SLF001
    status, _ = index.reserve(a, [key(10_000 + i) for i in range(4096)], 1)
    assert set(status) == {Reservation.FULL if cap is None else Reservation.CAPPED}
    assert sum(asked.values()) <= 2 * 1024, f"{sum(asked.values())} looks at pinned blocks for 4,096 keys"


@pytest.mark.parametrize("policy", [PolicyName.LRU, PolicyName.ARC])
def test_evictions_past_pinned_blocks_pass_each_once(policy):
    """Half the pool pinned at the cold end: storing 512 new blocks (2 slots each: no run of
    consecutive slots continued past the policy) evicts the 512 unpinned ones, and the pinned
    blocks are looked at about once in all, not once per eviction."""
    index = NodeIndex(2048, policy)
    a = Session(1, "A")
    store(index, a, *range(1024), width=2)
    index.lookup(a, [key(i) for i in range(512)], pin=True, width=2)  # pins (and touches) the 512 oldest
    index.lookup(a, [key(i) for i in range(512, 1024)], pin=False, width=2)  # the unpinned ones more recent still
    asked = Counter()
    evictable = index._evictable  # noqa: SLF001

    def counted(k):
        asked[k] += 1
        return evictable(k)

    index._evictable = counted  # noqa: SLF001
    assert store(index, a, *range(2000, 2512), width=2) == [Reservation.RESERVED] * 512
    assert all(index.entry(key(i)) is not None for i in range(512)) and index.evictions == 512
    assert sum(asked.values()) <= 2 * 1024, sum(asked.values())


class NodeIndexMachine(RuleBasedStateMachine):
    """Random operations from three sessions (one capped); the invariants hold after each."""

    def __init__(self) -> None:
        super().__init__()
        self.index = NodeIndex(6, PolicyName.ARC)
        self.sessions = [Session(1, "A", cap_slots=3), Session(2, "B"), Session(3, "A", cap_slots=3)]

    def _session(self, i: int) -> Session:
        return self.sessions[i % len(self.sessions)]

    @rule(s=st.integers(0, 2), ids=st.lists(st.integers(0, 9), min_size=1, max_size=4), width=st.integers(1, 2),
          tails=st.frozensets(st.integers(0, 3)))
    def reserve(self, s, ids, width, tails):
        self.index.reserve(self._session(s), [key(i) for i in ids], width, tails)

    @rule(s=st.integers(0, 2), ids=st.lists(st.integers(0, 9), max_size=4))
    def commit(self, s, ids):
        self.index.commit(self._session(s), [key(i) for i in ids])

    @rule(s=st.integers(0, 2), ids=st.lists(st.integers(0, 9), max_size=4))
    def abort(self, s, ids):
        self.index.abort(self._session(s), [key(i) for i in ids])

    @rule(s=st.integers(0, 2), ids=st.lists(st.integers(0, 9), max_size=4), pin=st.booleans(),
          width=st.integers(1, 2))
    def lookup(self, s, ids, pin, width):
        hits, slots, handle = self.index.lookup(self._session(s), [key(i) for i in ids], pin, width)
        assert hits <= len(ids) and (not pin or len(slots) == hits * width) and (handle > 0) == (pin and hits > 0)

    @rule(s=st.integers(0, 2), handles=st.lists(st.integers(0, 5), max_size=3))
    def unpin(self, s, handles):
        self.index.unpin(self._session(s), handles)

    @rule(s=st.integers(0, 2))
    def drop(self, s):
        old = self._session(s)
        self.index.release_session(old)
        self.sessions[s % 3] = Session(old.id + 10, old.engine, old.cap_slots)

    @invariant()
    def slots_partition_the_pool(self):
        index = self.index
        used = [slot for entry in index._entries.values() for slot in entry.slots]
        assert len(used) == len(set(used)) and not set(used) & set(index._free)
        assert len(used) + len(index._free) == index.num_slots

    @invariant()
    def holds_are_accounted(self):
        index = self.index
        readers: Counter = Counter()
        for session in self.sessions:
            for run in session.pins.values():
                for entry in run:
                    readers[id(entry)] += 1
            for k in session.reserved:
                entry = index._entries[k]
                assert entry.state is EntryState.WRITING and entry.writer == session.id
        for k, entry in index._entries.items():
            assert entry.readers == readers[id(entry)]
            assert entry.state is EntryState.READY or entry.writer in {s.id for s in self.sessions}
        pinned = sum(1 for e in index._entries.values() if e.state is EntryState.WRITING or e.readers)
        assert index.pinned_entries == pinned
        charged: Counter = Counter()
        for entry in index._entries.values():
            charged[entry.owner] += len(entry.slots)
        assert +charged == +index.charged
        assert charged["A"] <= 3  # A's cap holds whichever of its sessions stores

    @invariant()
    def only_ready_keys_are_in_the_policy(self):
        index = self.index
        ready = {k for k, e in index._entries.items() if e.state is EntryState.READY and not e.tail}
        tails = {k for k, e in index._entries.items() if e.state is EntryState.READY and e.tail}
        assert {k for k in ready if k in index._policy} == ready and len(index._policy) == len(ready)
        assert {k for k in tails if k in index._tails} == tails and len(index._tails) == len(tails)
        by_width = {(k, len(e.slots)) for k, e in self.index._entries.items() if e.state is EntryState.READY}
        assert {(k, w) for w, d in self.index._ready.items() for k in d} == by_width


TestNodeIndexMachine = NodeIndexMachine.TestCase
TestNodeIndexMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_width_outside_the_pool_is_refused():
    with pytest.raises(ValueError, match="width"):
        NodeIndex(2).reserve(Session(1, "A"), [key(1)], 3)


def test_a_run_of_repeated_keys_stops_at_the_pools_slots():
    """A lookup naming one block many times: its run (and its reply's slots) stops at
    num_slots // width keys, however many keys it names."""
    index = NodeIndex(8)
    a = Session(1, "A")
    store(index, a, 1, width=2)
    hits, slots, handle = index.lookup(a, [key(1)] * 65536, pin=True, width=2)
    assert hits == 4 and len(slots) == 8 and handle
    assert a.pinned == 4 and index.pinned_entries == 1
    assert index.unpin(a, [handle]) == 0 and a.pinned == 0 and index.pinned_entries == 0


def test_a_commit_reports_each_key_it_committed_once():
    index = NodeIndex(4)
    a, b = Session(1, "A"), Session(2, "B")
    index.reserve(a, [key(1), key(2)], 1)
    committed: list[int] = []
    assert index.commit(b, [key(1)], committed) == 1 and committed == []  # not b's
    assert index.commit(a, [key(1), key(1), key(3), key(2), key(2)], committed) == 3
    assert committed == [0, 3]


def test_pins_of_a_session_are_bounded_and_a_refusal_pins_nothing(monkeypatch):
    from kvtier.node import index as index_module

    monkeypatch.setattr(index_module, "MAX_SESSION_PINS", 2)
    monkeypatch.setattr(index_module, "MAX_SESSION_PINNED", 5)
    index = NodeIndex(8)
    a, b = Session(1, "A"), Session(2, "B")
    store(index, a, 1, 2, 3)
    keys = [key(1), key(2), key(3)]
    _, _, first = index.lookup(a, keys, pin=True)
    lookups = index.stats_of("A").lookups
    with pytest.raises(index_module.PinLimit, match="past 5 pinned"):
        index.lookup(a, keys, pin=True)
    assert a.pinned == 3 and index.pinned_entries == 3 and index.stats_of("A").lookups == lookups
    assert index.lookup(a, keys, pin=False)[0] == 3  # not pinning: not bounded
    index.lookup(a, keys[:1], pin=True)
    with pytest.raises(index_module.PinLimit, match="2 pin handles"):
        index.lookup(a, keys[:1], pin=True)
    assert index.lookup(b, keys, pin=True)[0] == 3  # another session's own bounds
    index.unpin(a, [first])
    assert a.pinned == 1
