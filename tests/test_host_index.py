"""Host slot allocator: no slot handed out twice, pinned slots never evicted, usage <= capacity."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.core.residency import ChangeKind
from kvtier.policy.base import PolicyName
from kvtier.tiers.base import Medium
from kvtier.tiers.host import HostIndex


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_allocate_commit_pin_evict_cycle():
    index = HostIndex(2)
    slot_a, _ = index.allocate(key(1))
    index.commit(key(1))
    slot_b, _ = index.allocate(key(2))
    index.commit(key(2))
    assert {slot_a, slot_b} == {0, 1}
    index.pin(key(1))
    slot_c, evicted = index.allocate(key(3))  # only key 2 is evictable
    assert evicted == [key(2)] and slot_c == slot_b
    index.pin(key(3)) if index.is_ready(key(3)) else None
    slot_d, evicted = index.allocate(key(4))  # key 1 pinned, key 3 writing
    assert slot_d is None and evicted == [] and index.stats.allocation_failures == 1
    index.unpin(key(1))
    slot_e, evicted = index.allocate(key(4))
    assert evicted == [key(1)] and slot_e == slot_a


def test_delete_of_pinned_block_frees_it_on_unpin():
    index = HostIndex(1)
    index.allocate(key(1))
    index.commit(key(1))
    index.pin(key(1))
    assert index.delete(key(1))
    assert not index.is_ready(key(1)) and index.used_slots == 1 and index.pinned_slots() == 1
    index.unpin(key(1))
    assert index.used_slots == 0 and key(1) not in index and index.pinned_slots() == 0


def test_lru_touch_changes_victim():
    index = HostIndex(2)
    for i in (1, 2):
        index.allocate(key(i))
        index.commit(key(i))
    index.touch([key(1)])
    _, evicted = index.allocate(key(3))
    assert evicted == [key(2)]


def test_residency_log_reports_visibility_not_slots():
    index = HostIndex(1)
    index.allocate(key(1))
    index.commit(key(1))  # before enable(): not recorded
    index.residency.enable()
    index.pin(key(1))
    index.delete(key(1))  # pinned: invisible now, slot freed on unpin
    index.unpin(key(1))
    index.allocate(key(2))
    index.delete(key(2))  # deleted while WRITING: never visible
    index.commit(key(2))
    index.allocate(key(3))
    index.commit(key(3))
    _, evicted = index.allocate(key(4))
    assert evicted == [key(3)]
    assert [(c.kind, c.key) for c in index.residency.take()] == [
        (ChangeKind.REMOVED, key(1)),
        (ChangeKind.STORED, key(3)),
        (ChangeKind.REMOVED, key(3)),
    ]
    assert index.residency.take() == []


@pytest.mark.parametrize("policy", list(PolicyName))
def test_ready_run(policy):
    index = HostIndex(4, policy)
    for i in (1, 2, 4):
        index.allocate(key(i))
        index.commit(key(i))
    assert index.ready_run([key(1), key(2), key(3), key(4)]) == 2


def filled(slots: int = 8, **options) -> HostIndex:
    """An index whose slot ``i`` holds READY ``key(i)``, committed in slot order."""
    index = HostIndex(slots, **options)
    for i in range(slots):
        assert index.allocate(key(i))[0] == i
        index.commit(key(i))
    return index


def aged(**options) -> HostIndex:
    """LRU order key 4, key 6, key 5, then the rest: key 5 is old but not the oldest after 4."""
    index = filled(**options)
    index.touch([key(5)])
    index.touch([key(i) for i in (0, 1, 2, 3, 7)])
    return index


def store_job(index: HostIndex, first: int, count: int) -> tuple[list[int | None], list[bytes]]:
    slots, evicted = [], []
    for i in range(first, first + count):
        slot, gone = index.allocate(key(i))
        slots.append(slot)
        evicted += gone
    return slots, evicted


def test_a_job_continues_its_run_through_a_cold_block_that_is_not_the_oldest():
    index = aged()
    slots, evicted = store_job(index, 100, 2)
    assert slots == [4, 5] and evicted == [key(4), key(5)]  # strict LRU would take key 6's slot
    assert index.evictions == 2 and index.run_evictions == 1
    assert not index.is_ready(key(5)) and index.is_ready(key(6))


@pytest.mark.parametrize("coldness", [None, 0.0])
def test_strict_order_without_run_coldness_and_with_a_cold_line_at_the_victim(coldness):
    index = aged(run_coldness=coldness)
    slots, evicted = store_job(index, 100, 2)
    assert slots == [4, 6] and evicted == [key(4), key(6)] and index.run_evictions == 0


def test_a_run_never_evicts_a_recent_pinned_or_writing_neighbour():
    index = filled()
    index.touch([key(i) for i in (2, 1, 0)])  # LRU order: 3..7, then 2, 1, 0
    slots, _ = store_job(index, 100, 1)
    assert slots == [3]
    index.touch([key(4)])  # key 4 is now the most recent: the run jumps to the oldest, key 5
    slots, _ = store_job(index, 101, 2)
    assert slots == [5, 6]
    index.pin(key(7))  # LRU order now: 7, 2, 1, 0, 4
    assert store_job(index, 103, 1)[0] == [2]  # key 7 pinned: the policy's victim instead
    assert store_job(index, 104, 1)[0] == [1]  # slot 3 holds key 100, WRITING: the victim again
    assert index.is_ready(key(7)) and index.is_writing(key(100)) and index.run_evictions == 1


def test_a_tail_neighbour_goes_whatever_its_age_and_free_slots_come_first():
    index = filled(4)
    index.delete(key(0))
    index.allocate(key(10), tail=True)
    index.commit(key(10))  # in slot 0, a tail, the most recent of all
    index.touch([key(1), key(2), key(3)])
    index.delete(key(3))
    assert store_job(index, 100, 2)[0] == [3, 0]  # the free slot; then slot 0 (past the end: the tail, first out)
    assert index.run_evictions == 0
    index.commit(key(100))
    index.commit(key(101))
    index.touch([key(100), key(101)])  # key 1 is the oldest; key 10's tail is gone, key 2 next after 1
    assert store_job(index, 200, 2)[0] == [1, 2]


def test_a_tail_evicted_first_does_not_make_recent_blocks_cold():
    index = HostIndex(4)
    for i in range(4):
        index.allocate(key(i), tail=i == 0)
        index.commit(key(i))
    for i in (3, 1, 0):
        index.touch([key(i)])  # blocks by age: 2, 3, 1; the tail (slot 0) the most recent of all
    assert store_job(index, 100, 2) == ([0, 2], [key(0), key(2)])  # the tail, then the oldest block, not key 1


def test_runs_stay_long_under_churn_at_the_same_hit_rate():
    """benchmarks/bench_slot_runs.py's workload, smaller: jobs of 16-48 blocks over 40 sessions."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from bench_slot_runs import churn

    strict = churn(2048, 40, 32, None, turns=900, seed=3, warmup=300, max_blocks=600)
    runs = churn(2048, 40, 32, 0.5, turns=900, seed=3, warmup=300, max_blocks=600)
    assert strict["runs_per_job"] > 10 and runs["runs_per_job"] < strict["runs_per_job"] / 4
    assert runs["one_run_share"] > strict["one_run_share"] + 0.2
    assert abs(runs["hit_rate"] - strict["hit_rate"]) < 0.02


class HostIndexMachine(RuleBasedStateMachine):
    policy = PolicyName.ARC

    def __init__(self):
        super().__init__()
        self.index = HostIndex(4, self.policy)
        self.index.residency.enable()
        self.visible: set[bytes] = set()  # replayed from the residency log
        self.writing: dict[bytes, int] = {}
        self.ready: dict[bytes, int] = {}
        self.pins: dict[bytes, int] = {}
        self.next_key = 0

    @rule(policy_arc=st.booleans())
    def allocate(self, policy_arc):
        self.next_key += 1
        k = key(self.next_key)
        slot, evicted = self.index.allocate(k)
        for victim in evicted:
            assert victim in self.ready, "evicted a block that was not READY"
            assert self.pins.get(victim, 0) == 0, "evicted a pinned block"
            del self.ready[victim]
        if slot is None:
            assert all(self.pins.get(r, 0) > 0 for r in self.ready), "refused although a block was evictable"
            return
        held = set(self.writing.values()) | set(self.ready.values())
        assert slot not in held, "slot handed out twice"
        self.writing[k] = slot

    @precondition(lambda self: self.writing)
    @rule(data=st.data(), ok=st.booleans())
    def finish_write(self, data, ok):
        k = data.draw(st.sampled_from(sorted(self.writing)))
        slot = self.writing.pop(k)
        if ok:
            self.index.commit(k)
            self.ready[k] = slot
        else:
            self.index.abort(k)

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def pin(self, data):
        k = data.draw(st.sampled_from(sorted(self.ready)))
        self.index.pin(k)
        self.pins[k] = self.pins.get(k, 0) + 1

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def unpin(self, data):
        k = data.draw(st.sampled_from(sorted(k for k, n in self.pins.items() if n)))
        self.index.unpin(k)
        self.pins[k] -= 1

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def touch(self, data):
        self.index.touch([data.draw(st.sampled_from(sorted(self.ready)))])

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def delete_unpinned(self, data):
        candidates = sorted(k for k in self.ready if not self.pins.get(k))
        if not candidates:
            return
        k = data.draw(st.sampled_from(candidates))
        assert self.index.delete(k)
        del self.ready[k]

    @invariant()
    def usage_matches_model_and_capacity(self):
        assert self.index.used_slots == len(self.writing) + len(self.ready) <= self.index.num_slots
        for k in self.ready:
            assert self.index.is_ready(k) and self.index.slot_of(k) == self.ready[k]
        for k in self.writing:
            assert self.index.is_writing(k)
        pinned = len(self.writing) + sum(1 for k in self.ready if self.pins.get(k))
        assert self.index.pinned_slots() == pinned

    @invariant()
    def slot_holders_and_stamps_match_the_entries(self):
        index = self.index
        for slot in range(index.num_slots):
            holder = index._holder[slot]
            assert (holder is None) == (slot in index._free)
            assert holder is None or slot in index.slots(holder)
        assert set(index._stamps) <= set(self.ready) | set(self.writing)

    @invariant()
    def residency_log_replays_to_the_ready_blocks(self):
        for change in self.index.residency.take():
            assert change.medium is Medium.HOST
            if change.kind is ChangeKind.STORED:
                assert change.key not in self.visible, "STORED twice without REMOVED"
                self.visible.add(change.key)
            else:
                assert change.key in self.visible, "REMOVED without STORED"
                self.visible.remove(change.key)
        assert self.visible == set(self.ready)


TestHostIndexMachine = HostIndexMachine.TestCase
TestHostIndexMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class LRUHostIndexMachine(HostIndexMachine):
    policy = PolicyName.LRU


TestLRUHostIndexMachine = LRUHostIndexMachine.TestCase
TestLRUHostIndexMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
