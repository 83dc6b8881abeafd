"""Unit and stateful (hypothesis) tests for the LRU and ARC eviction policies."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from itertools import takewhile

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtier.core.keys import KEY_BYTES, BlockKey
from kvtier.policy import EvictionPolicy, PolicyName, make_policy
from kvtier.policy.arc import ARCPolicy
from kvtier.policy.lru import LRUPolicy


def key(name: str) -> BlockKey:
    return hashlib.sha256(name.encode()).digest()


A, B, C, D, X, Y = (key(n) for n in "abcdxy")


def allow_all(_: BlockKey) -> bool:
    return True


def refuse(*keys: BlockKey) -> Callable[[BlockKey], bool]:
    return lambda k: k not in keys


def admit(policy: EvictionPolicy, k: BlockKey, capacity: int) -> None:
    """What a tier of ``capacity`` blocks does on an access: hit -> touch, miss -> make room, insert."""
    if k in policy:
        policy.touch([k])
        return
    while len(policy) >= capacity:
        assert policy.evict(allow_all) is not None
    policy.insert(k)


def drain(policy: EvictionPolicy) -> list[BlockKey]:
    out = []
    while (victim := policy.evict(allow_all)) is not None:
        out.append(victim)
    return out


# --------------------------------------------------------------------------------------- LRU


def test_keys_are_block_sized() -> None:
    assert len(A) == KEY_BYTES


def test_lru_evicts_in_insertion_order() -> None:
    lru = LRUPolicy()
    for k in (A, B, C, D):
        lru.insert(k)
    assert len(lru) == 4 and B in lru and X not in lru
    assert drain(lru) == [A, B, C, D]
    assert len(lru) == 0 and lru.evict(allow_all) is None


def test_lru_touch_changes_victim_in_order() -> None:
    lru = LRUPolicy()
    for k in (A, B, C):
        lru.insert(k)
    lru.touch([C, A, X])  # X is unknown: ignored
    assert drain(lru) == [B, C, A]


def test_lru_touch_orders_as_key_by_key_whatever_the_input() -> None:
    """The one-C-loop path (every key resident) and its fallback end in the same order."""
    for touched, expected in (([A, X, C], [B, A, C]), ([C, A, C], [B, A, C]), ((k for k in (B, A)), [C, B, A])):
        lru = LRUPolicy()
        for k in (A, B, C):
            lru.insert(k)
        lru.touch(touched)
        assert drain(lru) == expected


def test_lru_passes_pinned_keys_to_the_recent_end() -> None:
    lru = LRUPolicy()
    for k in (A, B, C):
        lru.insert(k)
    assert lru.evict(refuse(A)) == B  # A, in use, counts as used: now after C
    assert lru.evict(refuse(A, C)) is None  # a pass that finds none leaves the order as it was
    assert drain(lru) == [C, A]


@pytest.mark.parametrize("make", [LRUPolicy, lambda: ARCPolicy(4096)], ids=["lru", "arc"])
def test_evictions_past_many_pinned_keys_ask_about_each_once(make) -> None:
    """1,000 pinned keys at the cold end (a peer of the node service holding its pins), then 1,000
    evictions: the pinned keys are passed once, not once per eviction."""
    policy = make()
    keys = [key(f"k{i}") for i in range(2000)]
    for k in keys:
        policy.insert(k)
    pinned = set(keys[:1000])
    asked = []

    def can_evict(k):
        asked.append(k)
        return k not in pinned

    assert [policy.evict(can_evict) for _ in range(1000)] == keys[1000:]
    assert policy.evict(can_evict) is None
    assert len(asked) == 1000 + 1000 + 1000  # once each on the way, then one failed pass


def test_lru_remove_and_duplicate_insert() -> None:
    lru = LRUPolicy()
    lru.insert(A)
    lru.insert(B)
    with pytest.raises(ValueError):
        lru.insert(A)
    lru.remove(A)
    lru.remove(X)  # unknown: ignored
    assert A not in lru and len(lru) == 1
    assert drain(lru) == [B]


# --------------------------------------------------------------------------------------- ARC


def test_arc_rejects_bad_capacity_and_duplicates() -> None:
    with pytest.raises(ValueError):
        ARCPolicy(0)
    arc = ARCPolicy(2)
    arc.insert(A)
    with pytest.raises(ValueError):
        arc.insert(A)


def test_make_policy() -> None:
    assert isinstance(make_policy(PolicyName.LRU, 8), LRUPolicy)
    arc = make_policy(PolicyName.ARC, 8)
    assert isinstance(arc, ARCPolicy) and arc.capacity == 8


def test_arc_new_keys_go_to_t1_and_touch_promotes_to_t2() -> None:
    arc = ARCPolicy(4)
    arc.insert(A)
    arc.insert(B)
    assert arc.where(A) == "T1" and arc.where(B) == "T1"
    arc.touch([A, X])
    assert arc.where(A) == "T2" and arc.where(X) is None
    assert arc.sizes() == (1, 1, 0, 0) and len(arc) == 2 and A in arc and B in arc


def test_arc_touch_reorders_t2() -> None:
    arc = ARCPolicy(4)
    arc.insert(A)
    arc.insert(B)
    arc.touch([A, B, A])  # T2 = [B, A]
    assert drain(arc) == [B, A]


def test_arc_ghost_bounds_drop_least_recent_ghosts() -> None:
    arc = ARCPolicy(2)
    for k in (B, C):
        arc.insert(k)
    arc.touch([B, C])
    assert drain(arc) == [B, C] and arc.sizes() == (0, 0, 0, 2)
    arc.insert(A)
    arc.touch([A])
    arc.insert(X)
    assert arc.evict(allow_all) == X and arc.sizes() == (0, 1, 1, 2)
    arc.insert(Y)  # total would be 2c + 1: the least recent B2 ghost goes (paper, case IV.B)
    assert arc.where(B) is None and arc.where(C) == "B2" and arc.where(X) == "B1"
    arc.insert(D)  # |T1| + |B1| would be c + 1: the least recent B1 ghost goes (case IV.A)
    assert arc.where(X) is None and arc.sizes() == (2, 1, 0, 1)
    assert drain(arc) == [Y, D, A] and arc.where(Y) == "B1" and arc.where(D) == "B1"
    arc.insert(key("e"))
    assert arc.where(Y) is None and arc.where(D) == "B1"


def test_arc_overfilled_tier_keeps_ghosts_bounded() -> None:
    arc = ARCPolicy(1)
    arc.insert(A)
    arc.insert(B)  # the tier may hold more than c keys; the policy never refuses
    assert arc.evict(allow_all) == A
    assert arc.where(A) is None and arc.sizes() == (1, 0, 0, 0)  # |T1| + |B1| <= max(c, |T1|)


def test_arc_scan_does_not_flush_keys_used_twice() -> None:
    capacity = 4
    hot = [key("hot0"), key("hot1")]
    scan = [key(f"scan{i}") for i in range(50)]
    arc, lru = ARCPolicy(capacity), LRUPolicy()
    for policy in (arc, lru):
        for k in hot + hot + scan:  # hot keys seen twice, then a long one-time scan
            admit(policy, k, capacity)
    assert all(k in arc for k in hot)
    assert arc.p == 0 and arc.sizes().t2 == 2
    assert not any(k in lru for k in hot)  # the same trace flushes LRU


def test_arc_b1_hit_increases_p_and_b2_hit_decreases_it() -> None:
    arc = ARCPolicy(4)
    for k in (A, B, C, D):
        arc.insert(k)
    assert arc.evict(allow_all) == A and arc.where(A) == "B1"
    arc.insert(A)  # ghost hit in B1: T1 was too small
    assert arc.p == 1 and arc.where(A) == "T2"
    # T1 = [B, C, D] is larger than p, but all pinned: fall back to T2, ghost goes to B2
    assert arc.evict(refuse(B, C, D)) == A and arc.where(A) == "B2"
    arc.insert(A)  # ghost hit in B2: T2 was too small
    assert arc.p == 0 and arc.where(A) == "T2"


def test_arc_p_moves_by_ghost_ratio() -> None:
    arc = ARCPolicy(4)
    arc.insert(A)
    arc.insert(B)
    arc.touch([A, B])
    assert drain(arc) == [A, B] and arc.sizes() == (0, 0, 0, 2)
    arc.insert(X)
    assert arc.evict(allow_all) == X and arc.sizes() == (0, 0, 1, 2)
    arc.insert(X)  # B1 hit with |B2| / |B1| = 2
    assert arc.p == 2

    arc = ARCPolicy(8)
    arc.insert(A)
    arc.evict(allow_all)
    arc.insert(A)  # p = 1
    arc.insert(B)
    assert arc.evict(refuse(A)) == B  # T2 chosen (|T1| == p), A pinned: falls back to T1
    arc.insert(B)  # p = 2
    arc.insert(X)
    arc.insert(Y)
    assert arc.evict(refuse(A, B)) == X and arc.evict(refuse(A, B)) == Y
    assert arc.evict(allow_all) == A and arc.sizes() == (0, 1, 2, 1) and arc.p == 2
    arc.insert(A)  # B2 hit with |B1| / |B2| = 2
    assert arc.p == 0


def test_arc_tie_goes_to_t2_after_a_fresh_miss() -> None:
    arc = ARCPolicy(4)
    arc.insert(A)
    arc.evict(allow_all)
    arc.insert(A)  # p = 1, T2 = [A]
    arc.insert(B)  # T1 = [B]: |T1| == p, last miss was not in B2
    assert arc.evict(allow_all) == A


def test_arc_b1_hit_clears_the_b2_tie_break() -> None:
    arc = ARCPolicy(4)
    arc.insert(A)
    arc.evict(allow_all)
    arc.insert(A)  # p = 1, T2 = [A]
    arc.insert(X)
    arc.insert(Y)
    assert arc.evict(allow_all) == X and arc.evict(allow_all) == A  # B1 = [X], B2 = [A]
    arc.insert(A)  # B2 hit: p = 0
    arc.insert(X)  # B1 hit: p = 1 == |T1|, the last miss was not in B2
    assert arc.p == 1 and arc.sizes() == (1, 2, 0, 0)
    assert arc.evict(allow_all) == A


def test_arc_tie_goes_to_t1_after_a_b2_hit() -> None:
    arc = ARCPolicy(4)
    for k in (A, B):
        arc.insert(k)
        assert arc.evict(refuse(A) if k == B else allow_all) == k
        arc.insert(k)  # B1 hit
    assert arc.p == 2 and arc.sizes() == (0, 2, 0, 0)
    arc.insert(X)
    assert arc.evict(allow_all) == A  # |T1| = 1 < p
    arc.insert(A)  # B2 hit: p = 1 == |T1|
    assert arc.p == 1 and arc.sizes() == (1, 2, 0, 0)
    assert arc.evict(allow_all) == X


def test_arc_passes_pinned_keys_to_the_recent_end_of_their_list() -> None:
    arc = ARCPolicy(4)
    for k in (A, B, C):
        arc.insert(k)
    assert arc.evict(refuse(A)) == B
    assert arc.where(A) == "T1"  # still seen once: moved within T1, after C
    assert arc.evict(refuse(A, C)) is None and arc.sizes() == (2, 0, 1, 0)
    assert arc.evict(allow_all) == C


def test_arc_remove_resident_and_ghost_leaves_no_trace() -> None:
    arc = ARCPolicy(4)
    arc.insert(A)
    arc.insert(B)
    arc.touch([A])
    arc.remove(A)  # resident in T2
    assert A not in arc and arc.where(A) is None and arc.sizes() == (1, 0, 0, 0)
    assert arc.evict(allow_all) == B and arc.where(B) == "B1"
    arc.remove(B)  # ghost
    arc.remove(X)  # unknown: ignored
    assert arc.where(B) is None and arc.sizes() == (0, 0, 0, 0)
    arc.insert(A)
    arc.insert(B)
    assert arc.where(A) == "T1" and arc.where(B) == "T1" and arc.p == 0


# ------------------------------------------------------------------------- stateful models

POOL = [key(f"pool{i}") for i in range(12)]
pool_keys = st.sampled_from(POOL)
STATEFUL = settings(max_examples=80, stateful_step_count=30, deadline=None, database=None)


class PolicyMachine(RuleBasedStateMachine):
    """Checks a policy against a model resident set (kept in recency order for LRU)."""

    policy: EvictionPolicy

    def __init__(self) -> None:
        super().__init__()
        self.resident: list[BlockKey] = []

    def do_insert(self, k: BlockKey) -> None:
        if k in self.resident:
            with pytest.raises(ValueError):
                self.policy.insert(k)
        else:
            self.policy.insert(k)
            self.resident.append(k)

    def do_evict(self, pinned: set[BlockKey]) -> BlockKey | None:
        asked: list[BlockKey] = []

        def can_evict(k: BlockKey) -> bool:
            asked.append(k)
            return k not in pinned

        victim = self.policy.evict(can_evict)
        assert all(k in self.resident for k in asked), "predicate asked about a non-resident key"
        if victim is None:
            assert all(k in pinned for k in self.resident)
        else:
            assert victim in self.resident and victim not in pinned
            assert victim not in self.policy
            self.resident.remove(victim)
        return victim

    @rule(k=pool_keys)
    def remove(self, k: BlockKey) -> None:
        self.policy.remove(k)
        if k in self.resident:
            self.resident.remove(k)

    @invariant()
    def resident_set_matches(self) -> None:
        assert len(self.policy) == len(self.resident)
        assert {k for k in POOL if k in self.policy} == set(self.resident)


class LRUMachine(PolicyMachine):
    def __init__(self) -> None:
        super().__init__()
        self.policy = LRUPolicy()

    @rule(k=pool_keys)
    def insert(self, k: BlockKey) -> None:
        self.do_insert(k)

    @rule(keys=st.lists(pool_keys, max_size=5))
    def touch(self, keys: list[BlockKey]) -> None:
        self.policy.touch(keys)
        for k in keys:
            if k in self.resident:
                self.resident.remove(k)
                self.resident.append(k)

    @rule(pinned=st.sets(pool_keys))
    def evict(self, pinned: set[BlockKey]) -> None:
        expected = next((k for k in self.resident if k not in pinned), None)
        passed = list(takewhile(lambda k: k in pinned, self.resident))  # in use: they become the most recent
        assert self.do_evict(pinned) == expected
        if expected is not None:
            self.resident = [k for k in self.resident if k not in passed] + passed


class ARCMachine(PolicyMachine):
    """Model: T1 and T2 in recency order, the previous miss's ghost list, ARC's movement rules."""

    @initialize(capacity=st.integers(min_value=1, max_value=6))
    def make(self, capacity: int) -> None:
        self.arc = ARCPolicy(capacity)
        self.policy = self.arc
        self.c = capacity
        self.t1: list[BlockKey] = []
        self.t2: list[BlockKey] = []
        self.last_miss_in_b2 = False

    def do_insert(self, k: BlockKey) -> None:
        before, p, sizes = self.arc.where(k), self.arc.p, self.arc.sizes()
        super().do_insert(k)
        if before in ("T1", "T2"):
            return
        if before == "B1":
            assert self.arc.p == min(self.c, p + max(1, sizes.b2 / sizes.b1))
        elif before == "B2":
            assert self.arc.p == max(0, p - max(1, sizes.b1 / sizes.b2))
        else:
            assert self.arc.p == p
        (self.t1 if before is None else self.t2).append(k)
        self.last_miss_in_b2 = before == "B2"

    @rule(k=pool_keys)
    def insert(self, k: BlockKey) -> None:
        """The tier may overfill the policy; the ghost bounds must still hold (relaxed form)."""
        self.do_insert(k)

    @rule(k=pool_keys)
    def access(self, k: BlockKey) -> None:
        """What a tier of c blocks does: hit -> touch, miss -> evict until there is room, insert."""
        if k in self.resident:
            self.touch([k])
            return
        while len(self.resident) >= self.c:
            assert self.do_evict(set()) is not None
        self.do_insert(k)

    @rule(keys=st.lists(pool_keys, max_size=5))
    def touch(self, keys: list[BlockKey]) -> None:
        ghosts = {k: self.arc.where(k) for k in POOL if k not in self.resident}
        p = self.arc.p
        self.policy.touch(keys)
        assert self.arc.p == p
        assert all(self.arc.where(k) == w for k, w in ghosts.items())
        for k in keys:
            if k in self.t1:
                self.t1.remove(k)
            if k in self.t2:
                self.t2.remove(k)
            if k in self.resident:
                self.t2.append(k)

    @rule(pinned=st.sets(pool_keys))
    def evict(self, pinned: set[BlockKey]) -> None:
        self.do_evict(pinned)

    def do_evict(self, pinned: set[BlockKey]) -> BlockKey | None:
        p = self.arc.p
        t1_first = len(self.t1) > p or (self.last_miss_in_b2 and len(self.t1) == p)
        lists = [(self.t1, "B1"), (self.t2, "B2")]
        if not t1_first:
            lists.reverse()
        expected = next(((lst, k, ghost) for lst, ghost in lists for k in lst if k not in pinned), None)
        victim = super().do_evict(pinned)
        assert self.arc.p == p
        if expected is None:
            assert victim is None
            return None
        lst, k, ghost = expected
        for scanned, _ in lists:  # the lists scanned up to the victim's: their pinned keys passed to the end
            passed = list(takewhile(lambda key: key in pinned, scanned))
            scanned[:] = [key for key in scanned if key not in passed] + passed
            if scanned is lst:
                break
        assert victim == k
        lst.remove(k)
        assert self.arc.where(k) in (ghost, None)
        if len(self.resident) < self.c:  # ghosts are only dropped at once when the tier overfills
            assert self.arc.where(k) == ghost
        return victim

    @rule(k=pool_keys)
    def remove(self, k: BlockKey) -> None:
        p = self.arc.p
        super().remove(k)
        assert self.arc.where(k) is None and self.arc.p == p
        for lst in (self.t1, self.t2):
            if k in lst:
                lst.remove(k)

    @invariant()
    def arc_invariants(self) -> None:
        t1, t2, b1, b2 = sizes = self.arc.sizes()
        c = self.c
        assert (t1, t2) == (len(self.t1), len(self.t2)) and t1 + t2 == len(self.arc)
        assert 0 <= self.arc.p <= c
        assert t1 + b1 <= max(c, t1)
        assert t1 + t2 + b1 + b2 <= max(2 * c, t1 + t2)
        if t1 + t2 <= c:
            assert t1 + b1 <= c and t1 + t2 + b1 + b2 <= 2 * c
        # every key comes from POOL, so the lists are disjoint iff these counts add up
        where = {k: self.arc.where(k) for k in POOL}
        assert tuple(sum(w == name for w in where.values()) for name in ("T1", "T2", "B1", "B2")) == sizes
        assert all(where[k] == "T1" for k in self.t1) and all(where[k] == "T2" for k in self.t2)


TestLRUStateMachine = LRUMachine.TestCase
TestLRUStateMachine.settings = STATEFUL
TestARCStateMachine = ARCMachine.TestCase
TestARCStateMachine.settings = STATEFUL
