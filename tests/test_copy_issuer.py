"""Jobs issued off the forward's thread (kvtier.copy.issuer, CudaCopyEngine(background=True)): the
start calls return before the job is issued, jobs are issued in the order they were started whoever
issues them, a job is reported only once issued and done, a synchronous load is issued and ordered
before its call returns, failures are reported, and nothing queued is lost by wait or close. On CPU
tensors with the simulated device shared by two threads (tests/sim_device.py: SharedSimDevice)."""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest
import torch
from sim_device import SharedSimDevice
from test_cuda_engine import block_bytes, fill_slot, slot_bytes, write_block
from test_staged_copies import STAGED_CASES, expected_host, job, rig as staged_rig, run_in_random_order
from test_transfer import NUM_BLOCKS, cpu_layers

from kvtier.copy import BlockCopier, HostSlots, PageCopy, PagedKV
from kvtier.copy.cuda import CudaCopyEngine
from kvtier.copy.issuer import Issuer
from kvtier.core.slots import HostSlotLayout


def background_rig(num_slots: int = 6):
    device = SharedSimDevice()
    layers = cpu_layers()
    kv = PagedKV(layers, NUM_BLOCKS)
    layout = HostSlotLayout(len(layers), 1, kv.page_bytes, 1, num_slots)
    host = HostSlots(torch.zeros(layout.region_bytes, dtype=torch.uint8), layout)
    return CudaCopyEngine(BlockCopier(kv, host), device, background=True), device, layers, host


def wait_until(condition, what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def test_the_issuer_issues_in_hand_over_order_whoever_issues():
    issued: list[int] = []

    def slow(item: int) -> None:
        time.sleep(random.random() * 0.002)
        issued.append(item)

    issuer = Issuer(slow, "test-issuer")
    rng = random.Random(7)
    for item in range(200):  # queued, or issued now on this thread after the backlog
        (issuer.issue_now if rng.random() < 0.1 else issuer.submit)(item)
    issuer.flush()
    assert issued == list(range(200))
    issuer.close()
    assert not any(t.name == "test-issuer" for t in threading.enumerate()), "close left the thread running"


def test_an_item_that_raises_is_logged_and_the_next_is_issued_and_close_issues_the_backlog(caplog):
    issued: list[int] = []
    gate = threading.Event()

    def issue(item: int) -> None:
        gate.wait(10)
        if item == 1:
            raise RuntimeError("boom")
        issued.append(item)

    issuer = Issuer(issue, "test-issuer-2")
    with caplog.at_level(logging.ERROR):
        for item in range(5):
            issuer.submit(item)
        assert issuer.backlog >= 4  # the thread holds item 0 at most
        gate.set()
        issuer.close()
    assert issued == [0, 2, 3, 4] and "could not issue" in caplog.text
    with pytest.raises(RuntimeError, match="closed"):
        issuer.submit(9)


def test_a_store_returns_before_it_is_issued_and_is_reported_only_once_issued_and_done():
    engine, device, layers, host = background_rig()
    written = write_block(device, layers, 3, 7.0)
    device.hold_copies.clear()  # the issuing thread stands still at the job's copy
    began = time.perf_counter()
    engine.start_store(1, [PageCopy(0, 0, 3)])
    assert time.perf_counter() - began < 1.0
    wait_until(lambda: engine.queued == 0, "the issuing thread never took the job")
    assert engine.poll() == [], "a job not yet issued was reported (or its unrecorded end queried)"
    device.run_all()
    assert engine.poll() == [] and torch.count_nonzero(slot_bytes(host, 0)) == 0
    device.hold_copies.set()
    engine.wait()
    [done] = engine.poll()
    assert (done.job_id, done.ok, done.num_bytes) == (1, True, host.layout.slot_bytes) and done.issue_seconds > 0
    assert torch.equal(slot_bytes(host, 0), written)
    assert device.copy_threads == ["kvtier-copy-issuer"], "the store was not issued by the engine's thread"
    engine.close()


def test_a_synchronous_load_is_issued_after_the_jobs_queued_before_it_and_holds_back_the_forward():
    """Jobs of 1, 2, 3 and 4 pages (told apart by their size on the device) started while the
    issuing thread stands still: the synchronous load (the last) is issued after the others, on
    the calling thread, and the compute stream waits for it."""
    engine, device, layers, host = background_rig(num_slots=10)
    slot_bytes_ = host.layout.slot_bytes
    loads = {slot: fill_slot(host, slot, seed=slot) for slot in (1, 2, 6, 7, 8, 9)}
    device.hold_copies.clear()
    engine.start_store(1, [PageCopy(0, 0, 3)])
    engine.start_load(2, [PageCopy(1, 0, 5), PageCopy(2, 0, 6)], synchronous=False)
    engine.start_store(3, [PageCopy(3, 0, 1), PageCopy(4, 0, 2), PageCopy(5, 0, 3)])
    threading.Timer(0.2, device.hold_copies.set).start()  # until then the synchronous load waits its turn
    engine.start_load(4, [PageCopy(6, 0, 0), PageCopy(7, 0, 4), PageCopy(8, 0, 7), PageCopy(9, 0, 8)])
    assert [plan.num_bytes // slot_bytes_ for plan in device.plans] == [1, 2, 3, 4], "issued out of order"
    assert device.copy_threads[-1] == threading.current_thread().name, "a synchronous load was issued elsewhere"
    seen = []
    device.enqueue(device.compute, lambda: seen.append(block_bytes(layers, 8)), "forward reads block 8")
    device.advance(device.compute)
    assert seen == [], "the forward ran before the synchronous load arrived"
    device.run_all()
    assert torch.equal(seen[0], loads[9]) and torch.equal(block_bytes(layers, 6), loads[2])
    engine.wait()
    assert sorted(d.job_id for d in engine.poll()) == [1, 2, 3, 4]
    engine.close()


def test_a_bad_job_issued_in_the_background_is_reported_failed_and_the_next_one_runs(caplog):
    engine, device, layers, host = background_rig()
    with caplog.at_level(logging.ERROR):
        engine.start_store(1, [PageCopy(0, 0, NUM_BLOCKS + 5)])  # no such engine block
        engine.start_store(2, [PageCopy(1, 0, 4)])
        engine.wait()
        device.run_all()
        done = {d.job_id: d for d in engine.poll()}
    assert not done[1].ok and done[2].ok and "job 1 failed" in caplog.text
    assert torch.equal(slot_bytes(host, 1), block_bytes(layers, 4))
    engine.close()


def test_close_issues_and_completes_every_queued_job():
    engine, device, layers, host = background_rig()
    device.hold_copies.clear()
    for slot in range(4):
        engine.start_store(slot, [PageCopy(slot, 0, slot + 1)])
    threading.Timer(0.1, device.hold_copies.set).start()
    engine.close()
    for slot in range(4):
        assert torch.equal(slot_bytes(host, slot), block_bytes(layers, slot + 1)), f"job {slot} was lost"
    assert not any(t.name == "kvtier-copy-issuer" and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("case_name", STAGED_CASES[:4])
def test_staged_jobs_issued_in_the_background_are_bit_exact_in_any_device_order(case_name):
    """Many jobs started back to back (the issuing thread behind), the device run in a random order."""
    engine, device, paged, host, kv = staged_rig(case_name, num_slots=8, device_class=SharedSimDevice,
                                                 background=True)
    rng = random.Random(case_name)
    blocks = rng.sample(range(1, 14), 8)
    stores = [job(kv, [slot], [block]) for slot, block in enumerate(blocks)]
    for job_id, pages in enumerate(stores):
        engine.start_store(job_id, pages)
    engine.wait()
    run_in_random_order(device, seed=3)
    assert torch.equal(host.buffer, expected_host(paged, host, [p for pages in stores for p in pages]))
    assert sorted(d.job_id for d in engine.poll()) == list(range(8))
    engine.close()
