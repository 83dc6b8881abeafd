"""The CUDA copy engine's ordering contract (kvtier.copy.base), run on CPU tensors with a simulated
asynchronous device (tests/sim_device.py): streams are FIFO queues that run only when the test
advances them or something blocks, so "before" and "after" are explicit.

Each ordering check is also run against a device that drops the ordering in question, to show
the check fails there: the checks can catch an engine that forgot a wait. What these tests do not
cover: the torch.cuda calls themselves (kvtier.copy.streams.TorchCudaStreams), pinned memory and
real asynchronous copies; there is no GPU here.
"""

from __future__ import annotations

import pytest
import torch
from sim_device import (
    ComputeIgnoresSideStreams,
    CopyFailsHalfway,
    PoolStreams,
    QueryAlwaysTrue,
    SideStreamsIgnoreCompute,
    SimDevice,
    SynchronizeReturnsAtOnce,
)
from test_transfer import LAYOUTS, NUM_BLOCKS, cpu_layers, page_bytes_of

from kvtier.copy import BlockCopier, Direction, HostSlots, PageCopy, PagedKV
from kvtier.copy.cuda import CudaCopyEngine
from kvtier.core.slots import HostSlotLayout


def rig(device, layers=None, num_slots=4):
    layers = cpu_layers() if layers is None else layers
    kv = PagedKV(layers, NUM_BLOCKS)
    layout = HostSlotLayout(len(layers), 1, kv.page_bytes, 1, num_slots)
    host = HostSlots(torch.zeros(layout.region_bytes, dtype=torch.uint8), layout)
    return CudaCopyEngine(BlockCopier(kv, host), device), layers, host


def block_bytes(layers, block_id):
    """Engine block ``block_id`` as the host stores it: every layer's page, layer order."""
    return torch.cat([page_bytes_of(layer, block_id) for layer in layers])


def slot_bytes(host, slot):
    return host.tensor[slot].reshape(-1).clone()


def fill_slot(host, slot, seed):
    payload = torch.randint(0, 256, (host.layout.slot_bytes,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(seed))
    host.tensor[slot].view(-1).copy_(payload)
    return payload


def write_block(device, layers, block_id, value):
    """Enqueue (not run) a 'forward' kernel on the compute stream that writes engine block ``block_id``."""
    device.enqueue(device.compute, lambda: [layer[block_id].fill_(value) for layer in layers],
                   f"forward writes block {block_id}")
    return torch.cat([torch.full_like(layer[block_id], value).view(torch.uint8).reshape(-1) for layer in layers])


# ---- the ordering checks, each a function of the device so it can also run on a broken one ----


def check_store_waits_for_the_forward(device):
    engine, layers, host = rig(device)
    written = write_block(device, layers, 3, 7.0)
    engine.start_store(1, [PageCopy(0, 0, 3)])
    device.advance_side_streams()  # the store stream runs as far as it can; the forward has not run
    assert torch.count_nonzero(slot_bytes(host, 0)) == 0, "the store copied the page before the forward wrote it"
    assert engine.poll() == [], "a store was reported before its copy ran"
    device.advance(device.compute)
    device.advance_side_streams()
    assert torch.equal(slot_bytes(host, 0), written)
    done = engine.poll()
    assert [(d.job_id, d.direction, d.ok, d.num_bytes) for d in done] == [(1, Direction.STORE, True, host.layout.slot_bytes)]


def check_load_is_seen_by_later_kernels(device):
    engine, layers, host = rig(device)
    payload = fill_slot(host, 0, seed=1)
    engine.start_load(1, [PageCopy(0, 0, 5)])
    seen = []
    device.enqueue(device.compute, lambda: seen.append(block_bytes(layers, 5)), "forward reads block 5")
    device.advance(device.compute)  # the compute stream runs as far as it can; the load has not run
    assert seen == [], "the forward read the block before the load arrived"
    device.run_all()
    assert torch.equal(seen[0], payload)


def check_load_waits_for_earlier_kernels(device):
    engine, layers, host = rig(device)
    before = block_bytes(layers, 5)
    seen = []
    device.enqueue(device.compute, lambda: seen.append(block_bytes(layers, 5)), "earlier kernel reads block 5")
    payload = fill_slot(host, 0, seed=2)
    engine.start_load(1, [PageCopy(0, 0, 5)])
    device.advance_side_streams()
    assert torch.equal(block_bytes(layers, 5), before), "the load overwrote a block an earlier kernel still reads"
    device.run_all()
    assert torch.equal(seen[0], before) and torch.equal(block_bytes(layers, 5), payload)


def check_poll_reports_only_completed_jobs_fifo(device):
    engine, layers, host = rig(device)
    loaded = fill_slot(host, 2, seed=3)
    engine.start_store(1, [PageCopy(0, 0, 3)])
    engine.start_store(2, [PageCopy(1, 0, 4)])
    engine.start_load(3, [PageCopy(2, 0, 6)])
    expected = {1: (lambda: slot_bytes(host, 0), block_bytes(layers, 3)),
                2: (lambda: slot_bytes(host, 1), block_bytes(layers, 4)),
                3: (lambda: block_bytes(layers, 6), loaded)}
    reported = []
    while True:  # one device operation at a time, polling in between
        for done in engine.poll():
            current, want = expected[done.job_id]
            assert torch.equal(current(), want), f"job {done.job_id} was reported before its copy ran"
            reported.append(done.job_id)
        if not any(device.step(stream) for stream in device.streams):
            break
    assert sorted(reported) == [1, 2, 3] and [j for j in reported if j != 3] == [1, 2]


def check_wait_blocks_until_done(device):
    engine, layers, host = rig(device)
    written = write_block(device, layers, 3, 5.0)
    engine.start_store(1, [PageCopy(0, 0, 3)])
    engine.start_store(2, [PageCopy(1, 0, 4)])
    engine.wait([1])  # must run the forward, then the copy
    assert torch.equal(slot_bytes(host, 0), written), "wait returned before the job's copy ran"
    assert 1 in [d.job_id for d in engine.poll()]
    engine.wait()
    assert torch.equal(slot_bytes(host, 1), block_bytes(layers, 4)), "wait() returned before every job ran"
    assert [d.job_id for d in engine.poll()] in ([2], [])  # 2 reported now unless it already was with 1


CHECKS = {
    "store waits for the forward": (check_store_waits_for_the_forward, SideStreamsIgnoreCompute,
                                    "before the forward wrote it"),
    "later kernels see a load": (check_load_is_seen_by_later_kernels, ComputeIgnoresSideStreams,
                                 "before the load arrived"),
    "a load waits for earlier kernels": (check_load_waits_for_earlier_kernels, SideStreamsIgnoreCompute,
                                         "an earlier kernel still reads"),
    "poll only completed jobs": (check_poll_reports_only_completed_jobs_fifo, QueryAlwaysTrue,
                                 "reported before its copy ran"),
    "wait blocks": (check_wait_blocks_until_done, SynchronizeReturnsAtOnce, "wait returned before"),
}


@pytest.mark.parametrize("name", CHECKS)
def test_ordering_contract_holds(name):
    check, _, _ = CHECKS[name]
    check(SimDevice())


@pytest.mark.parametrize("name", CHECKS)
def test_ordering_check_fails_on_a_device_without_that_ordering(name):
    check, broken_device, message = CHECKS[name]
    with pytest.raises(AssertionError, match=message):
        check(broken_device())


# ---- what start_* issue, failures, timing, close ----------------------------------------------


def test_start_issues_one_batched_copy_and_blocks_on_nothing():
    device = SimDevice()
    engine, layers, host = rig(device)
    engine.start_store(1, [PageCopy(0, 0, 3), PageCopy(1, 0, 4)])
    engine.start_load(2, [PageCopy(2, 0, 5)])
    assert device.executed == []  # nothing ran: no synchronization inside start_*
    store_stream, load_stream = (stream for stream, _ in device.copy_calls)
    assert device.copy_calls == [(store_stream, 2 * len(layers)), (load_stream, len(layers))]
    assert store_stream is not load_stream and device.compute not in (store_stream, load_stream)
    device.run_all()
    assert {d.job_id for d in engine.poll()} == {1, 2}


def test_a_bad_page_is_a_failed_job_not_an_exception():
    device = SimDevice()
    engine, layers, host = rig(device)
    engine.start_store(1, [PageCopy(99, 0, 3)])  # no such slot
    engine.start_store(2, [PageCopy(0, 0, 3)])
    assert len(device.copy_calls) == 1  # nothing issued for the bad job
    device.run_all()
    done = {d.job_id: d for d in engine.poll()}
    assert not done[1].ok and done[1].num_bytes == 0
    assert done[2].ok and torch.equal(slot_bytes(host, 0), block_bytes(layers, 3))


def test_a_load_failing_midway_is_reported_at_once_and_still_holds_back_the_forward():
    """Half the pages were issued when the device call failed. vLLM discards the token sampled on
    unloaded blocks only if the error arrives in the same step's output, so the failure is reported
    by the very next poll, before the device ran anything; the forward (which recomputes the
    blocks) still waits for the partial copies, so they land first."""
    device = CopyFailsHalfway()
    engine, layers, host = rig(device)
    fill_slot(host, 0, seed=4)
    fill_slot(host, 1, seed=5)
    engine.start_load(1, [PageCopy(0, 0, 5), PageCopy(1, 0, 6)])
    [done] = engine.poll()  # the same step's get_transfer_results
    assert (done.job_id, done.direction, done.ok, done.num_bytes) == (1, Direction.LOAD, False, 0)
    assert device.executed == []
    recomputed = write_block(device, layers, 5, 3.0)
    device.advance(device.compute)
    assert not torch.equal(block_bytes(layers, 5), recomputed)  # the recompute waits for the partial load
    device.run_all()
    assert torch.equal(block_bytes(layers, 5), recomputed)  # ... so it lands last
    assert engine.poll() == []  # reported once


@pytest.mark.parametrize("kind", ["store", "asynchronous load"])
def test_a_failed_job_with_copies_in_flight_is_reported_only_after_them(kind):
    """A store's host slots and an asynchronous load's engine blocks are reused once the job is
    reported: a partial copy still in flight must not outlive the report."""
    device = CopyFailsHalfway()
    engine, layers, host = rig(device)
    pages = [PageCopy(0, 0, 5), PageCopy(1, 0, 6)]
    if kind == "store":
        engine.start_store(1, pages)
    else:
        engine.start_load(1, pages, synchronous=False)
    assert engine.poll() == []
    device.run_all()
    [done] = engine.poll()
    assert (done.job_id, done.ok) == (1, False)


def test_a_job_failing_before_any_copy_is_reported_at_once():
    device = SimDevice()
    engine, _, _ = rig(device)
    engine.start_store(1, [PageCopy(99, 0, 3)])  # no such slot: nothing was issued
    engine.start_load(2, [PageCopy(0, 0, 99)], synchronous=False)
    assert sorted((d.job_id, d.ok) for d in engine.poll()) == [(1, False), (2, False)]
    device.run_all()
    assert engine.poll() == []


def test_an_asynchronous_load_does_not_hold_back_the_compute_stream():
    """Its request is in no batch until the load is polled done: other requests' kernels run on."""
    device = SimDevice()
    engine, layers, host = rig(device)
    payload = fill_slot(host, 0, seed=6)
    engine.start_load(1, [PageCopy(0, 0, 5)], synchronous=False)
    ran = []
    device.enqueue(device.compute, lambda: ran.append("other requests' forward"), "forward")
    device.advance(device.compute)
    assert ran == ["other requests' forward"]  # not behind the load
    assert engine.poll() == [] and not torch.equal(block_bytes(layers, 5), payload)
    device.advance_side_streams()
    [done] = engine.poll()
    assert done.ok and torch.equal(block_bytes(layers, 5), payload)  # reported only once the bytes landed


def test_a_synchronous_load_holds_back_the_compute_stream():
    device = SimDevice()
    engine, _, host = rig(device)
    fill_slot(host, 0, seed=7)
    engine.start_load(1, [PageCopy(0, 0, 5)])
    ran = []
    device.enqueue(device.compute, lambda: ran.append("forward"), "forward")
    device.advance(device.compute)
    assert ran == []


def test_side_streams_are_never_the_compute_stream():
    """torch hands out pool streams round robin and vLLM's compute stream is one of them."""
    device = PoolStreams(size=3)  # the first stream handed out is the compute stream
    engine, layers, host = rig(device)
    streams = set(engine._streams.values())  # noqa: SLF001
    assert device.compute not in streams and len(streams) == 2
    device.compute = engine._streams[Direction.STORE]  # noqa: SLF001 - vLLM switched to a stream we hold
    written = write_block(device, layers, 3, 4.0)
    engine.start_store(1, [PageCopy(0, 0, 3)])
    [(stream, _)] = device.copy_calls
    assert stream is not device.compute and stream is not engine._streams[Direction.LOAD]  # noqa: SLF001
    device.run_all()
    assert torch.equal(slot_bytes(host, 0), written)


def test_a_device_that_cannot_record_fails_the_job_at_once():
    class RecordFails(SimDevice):
        def record(self, event, stream):
            raise RuntimeError("simulated: CUDA error")

    engine, _, _ = rig(RecordFails())
    engine.start_store(1, [PageCopy(0, 0, 3)])
    [done] = engine.poll()
    assert (done.job_id, done.ok) == (1, False)


def test_seconds_come_from_the_job_events():
    device = SimDevice()
    engine, _, _ = rig(device)
    engine.start_store(1, [PageCopy(0, 0, 3)])
    device.run_all()
    [done] = engine.poll()
    assert done.seconds == pytest.approx(2e-6)  # start marker, copy, end marker: two ticks


def test_close_finishes_every_job_and_is_idempotent():
    device = SimDevice()
    engine, layers, host = rig(device)
    written = write_block(device, layers, 2, 9.0)
    engine.start_store(1, [PageCopy(3, 0, 2)])
    engine.close()
    assert torch.equal(slot_bytes(host, 3), written)
    engine.close()
    assert [d.job_id for d in engine.poll()] == [1]
    with pytest.raises(RuntimeError, match="closed"):
        engine.start_load(2, [PageCopy(3, 0, 1)])


@pytest.mark.parametrize("make_layers", LAYOUTS)
def test_round_trip_through_the_cuda_engine_is_bit_exact(make_layers):
    device = SimDevice()
    layers = make_layers()
    engine, _, host = rig(device, layers)
    originals = {b: block_bytes(layers, b) for b in (1, 4, 8)}
    engine.start_store(1, [PageCopy(0, 0, 1), PageCopy(1, 0, 4)])
    engine.start_store(2, [PageCopy(2, 0, 8)])
    engine.wait()
    device.enqueue(device.compute, lambda: [layer.zero_() for layer in layers], "forward wipes the engine")
    engine.start_load(3, [PageCopy(0, 0, 8), PageCopy(1, 0, 1), PageCopy(2, 0, 4)])
    device.run_all()
    assert torch.equal(block_bytes(layers, 8), originals[1])
    assert torch.equal(block_bytes(layers, 1), originals[4])
    assert torch.equal(block_bytes(layers, 4), originals[8])
    assert sorted(d.job_id for d in engine.poll()) == [1, 2, 3]


# ---- the simulated device itself -------------------------------------------------------------


def test_sim_device_runs_nothing_until_advanced_and_orders_by_events():
    device = SimDevice()
    side = device.new_stream()
    log = []
    device.enqueue(device.compute, lambda: log.append("compute"), "k1")
    ready = device.new_event()
    device.record(ready, device.compute)
    device.wait(side, ready)
    device.enqueue(side, lambda: log.append("side"), "k2")
    assert device.advance(side) == 0 and log == [] and not device.query(ready)
    device.advance(device.compute)
    assert device.query(ready) and log == ["compute"]
    device.advance(side)
    assert log == ["compute", "side"]


def test_sim_device_is_strict_and_waits_bind_to_a_record():
    device = SimDevice()
    with pytest.raises(AssertionError, match="before it was ever recorded"):
        device.query(device.new_event())
    side = device.new_stream()
    event = device.new_event()
    device.record(event, side)
    device.wait(device.compute, event)  # bound to this record ...
    device.enqueue(side, lambda: None, "later work")
    device.record(event, side)  # ... not to this later one (as in CUDA)
    device.step(side)
    assert device.advance(device.compute) == 1 and not device.query(event)
    device.run_all()
    assert device.query(event)
