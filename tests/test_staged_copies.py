"""Staged copies (kvtier.copy.staging) on CPU tensors through the simulated device: the pipelined
schedule (gathers/scatters on a KERNEL lane, host copies on the side stream, marks between them)
lands the same bytes as the CPU engine for every layout and page shape the GPU kit covers
(tests/gpu/gpu_layouts.py: vLLM's own view arithmetic), with chunks that split a block and jobs
many times larger than the staging buffers, whatever order the device runs its streams in; and it
does not without the marks (a device whose lanes ignore each other). The method chooser
(kvtier.copy.choice) and the engine's fallback when staging memory cannot be had."""

from __future__ import annotations

import logging
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from sim_device import LanesIgnoreEachOther, SimDevice

from kvtier.copy import BlockCopier, Direction, HostSlots, PageCopy, PagedKV, page_table
from kvtier.copy.choice import TIMED_BYTES, TRIALS, MethodChooser
from kvtier.copy.cuda import CudaCopyEngine
from kvtier.copy.runs import RunPlanner
from kvtier.copy.staging import STAGE_BELOW_BYTES, CopyMethod, StagedPlanner, StagingBuffers
from kvtier.core.slots import HostSlotLayout

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from gpu_layouts import CASES, Case, build  # noqa: E402

NUM_BLOCKS = 14
STAGED_CASES = [name for name in CASES if not name.startswith(("LHBNC", "BHLNC"))]  # strided pages: never staged


def rig(case_name: str, num_slots: int = 8, chunk_pages: int = 3, buffers: int = 2, device_class=SimDevice):
    """The case's KV on CPU (random bytes), a host region, and a CUDA engine on a simulated device
    that always stages, with ``buffers`` staging buffers of ``chunk_pages`` pages."""
    case = CASES[case_name]
    kv = build(case, NUM_BLOCKS, "cpu")
    kv.raw.copy_(torch.randint(-128, 128, kv.raw.shape, dtype=torch.int8))
    paged = PagedKV(kv.views, NUM_BLOCKS, kv.layer_groups, kv.page_bytes)
    layout = HostSlotLayout(paged.num_layers, 1, paged.page_bytes, 1, num_slots)
    host = HostSlots(torch.zeros(layout.region_bytes, dtype=torch.uint8), layout)
    device = device_class()
    engine = CudaCopyEngine(BlockCopier(paged, host), device, CopyMethod.STAGED,
                            chunk_bytes=chunk_pages * paged.page_bytes, buffers=buffers)
    return engine, device, paged, host, kv


def job(kv, slots, blocks):
    """Pages of every group of ``kv`` for kvtier blocks in ``slots`` from engine ``blocks``."""
    return [PageCopy(slot, 0, block, group) for slot, block in zip(slots, blocks)
            for group in range(len(kv.layer_groups))]


def run_in_random_order(device: SimDevice, seed: int) -> None:
    """Run every stream to the end, one operation of a random runnable stream at a time."""
    rng = random.Random(seed)
    while any(s.ops for s in device.streams):
        runnable = [s for s in device.streams if s.ops and (s.ops[0][0] != "wait" or s.ops[0][1].done)]
        assert runnable, f"the device is stuck: {device.streams}"
        device.step(rng.choice(runnable))


def run_transfers_first(device: SimDevice) -> None:
    """The adversary of a pipeline: every side stream as far as it goes before any kernel runs."""
    kernels = {lanes.streams[lane] for lanes in device.lanes.values() for lane in lanes.streams
               if lane.value == "kernel"}
    while any(s.ops for s in device.streams):
        ran = sum(device.advance(s) for s in device.streams if s not in kernels)
        if not ran:
            ran = sum(device.step(s) for s in kernels)
        assert ran, f"the device is stuck: {device.streams}"


def expected_host(paged, host, pages):
    expected = torch.zeros_like(host.buffer)
    BlockCopier(paged, HostSlots(expected, host.layout)).copy(Direction.STORE, pages)
    return expected


@pytest.mark.parametrize("case_name", STAGED_CASES)
@pytest.mark.parametrize("chunk_pages, buffers", [(3, 2), (5, 3), (1, 1), (1000, 2)])
def test_a_staged_round_trip_is_bit_exact_for_every_layout_and_chunking(case_name, chunk_pages, buffers):
    """Chunks of 3 or 5 pages split blocks (2-5 layers each); 8 blocks in buffers of 3 pages make
    jobs of several times the staging memory; the streams run in a random order."""
    engine, device, paged, host, kv = rig(case_name, chunk_pages=chunk_pages, buffers=buffers)
    slots, blocks = [6, 0, 1, 2, 4, 5, 3, 7], [3, 11, 1, 8, 9, 2, 13, 5]
    store = job(kv, slots, blocks)
    engine.start_store(1, store)
    assert type(device.plans[-1]).__name__ == "StagedRuns"
    run_in_random_order(device, seed=chunk_pages)
    assert torch.equal(host.buffer, expected_host(paged, host, store))
    saved = kv.raw.clone()
    kv.raw.zero_()
    load_blocks = [12, 0, 4, 6, 7, 10, 3, 2]
    engine.start_load(2, job(kv, slots, load_blocks), synchronous=False)
    run_in_random_order(device, seed=chunk_pages + 1)
    for group, layers in enumerate(kv.layer_groups):
        for layer in layers:
            for src, dst in zip(blocks, load_blocks):
                assert torch.equal(paged.page(layer, dst), _page(saved, kv, paged, layer, src)), (layer, src, dst)
    assert sorted((d.job_id, d.ok, d.method) for d in engine.poll()) == [(1, True, "staged"), (2, True, "staged")]


@pytest.mark.parametrize("case_name", ["LBNHC-attention", "LBNHC-mamba-hybrid", "BLNHC-attention"])
def test_a_job_handed_as_a_page_table_moves_what_its_tuples_move(case_name):
    """What kvtier's scheduler sends the workers is a page table (``CopyJob.pages``); the CUDA
    engine plans it as it plans the tuples, store and load, one KV cache group or two."""
    engine, device, paged, host, kv = rig(case_name, chunk_pages=5)
    slots, blocks, load_blocks = [6, 0, 1, 2, 4, 5, 3, 7], [3, 11, 1, 8, 9, 2, 13, 5], [12, 0, 4, 6, 7, 10, 3, 2]
    store = job(kv, slots, blocks)
    engine.start_store(1, page_table(store))
    run_in_random_order(device, seed=1)
    assert torch.equal(host.buffer, expected_host(paged, host, store))
    saved = kv.raw.clone()
    kv.raw.zero_()
    engine.start_load(2, page_table(job(kv, slots, load_blocks)), synchronous=False)
    run_in_random_order(device, seed=2)
    for layers in kv.layer_groups:
        for layer in layers:
            for src, dst in zip(blocks, load_blocks):
                assert torch.equal(paged.page(layer, dst), _page(saved, kv, paged, layer, src)), (layer, src, dst)
    assert sorted((d.job_id, d.ok) for d in engine.poll()) == [(1, True), (2, True)]


def _page(raw, kv, paged, layer, block):
    """What ``paged.page(layer, block)`` held when the KV's bytes were ``raw``."""
    current = kv.raw.clone()
    kv.raw.copy_(raw)
    page = paged.page(layer, block).clone()
    kv.raw.copy_(current)
    return page


@pytest.mark.parametrize("direction", list(Direction))
def test_without_the_marks_between_the_lanes_the_pipeline_copies_wrong_bytes(direction):
    """The same jobs on a device whose two lanes ignore each other's marks, run transfers first: a
    store copies staging buffers not yet gathered, a load scatters chunks not yet arrived."""
    for device_class, exact in ((SimDevice, True), (LanesIgnoreEachOther, False)):
        engine, device, paged, host, kv = rig("LBNHC-attention", device_class=device_class)
        pages = job(kv, range(6), [3, 11, 1, 8, 9, 2])
        if direction is Direction.STORE:
            engine.start_store(1, pages)
            run_transfers_first(device)
            assert torch.equal(host.buffer, expected_host(paged, host, pages)) is exact
        else:
            host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, dtype=torch.uint8))
            engine.start_load(1, pages, synchronous=False)
            run_transfers_first(device)
            landed = all(torch.equal(paged.page(layer, p.block_id), host.page(p.slot, layer, 0))
                         for p in pages for layer in range(paged.num_layers))
            assert landed is exact


def test_consecutive_jobs_reuse_the_buffers_only_after_the_previous_job_copied_out_of_them():
    """Two stores back to back through one buffer of 3 pages, the second job's gathers free to
    run first: the side stream's order (the second job begins after the first's host copies)
    keeps the first job's bytes."""
    engine, device, paged, host, kv = rig("LBNHC-attention", chunk_pages=3, buffers=1)
    first, second = job(kv, [0, 1], [3, 4]), job(kv, [2, 3], [5, 6])
    engine.start_store(1, first)
    engine.start_store(2, second)
    [lanes] = device.lanes.values()
    kernels = [stream for lane, stream in lanes.streams.items() if lane.value == "kernel"]
    while any(s.ops for s in device.streams):  # kernels first, whenever they can
        if not sum(device.advance(s) for s in kernels):
            assert sum(device.step(s) for s in device.streams), "stuck"
    assert torch.equal(host.buffer, expected_host(paged, host, first + second))


def test_host_copies_are_whole_slot_runs_cut_at_chunk_ends_and_pinning_chunks():
    engine, device, paged, host, kv = rig("LBNHC-attention", chunk_pages=4)
    staged = engine.staged
    assert staged is not None
    pages = job(kv, [0, 1, 2, 4, 5], [3, 11, 1, 8, 9])  # slots 0-2 and 4-5: contiguous host segments
    plan = staged.plan(Direction.STORE, engine.runs.entries(pages))
    layers = paged.num_layers
    segments = [(0, 3 * layers), (3 * layers, 5 * layers)]  # page positions of the two host segments
    expected = {(seg, position // 4) for seg, (lo, hi) in enumerate(segments) for position in range(lo, hi)}
    assert plan.num_runs == len(expected) and plan.num_chunks == -(-5 * layers // 4)
    staged.segment_bytes = host.layout.slot_bytes  # each slot registered on its own
    plan = staged.plan(Direction.STORE, engine.runs.entries(pages))
    first, last = plan.host_offset, plan.host_offset + plan.sizes - 1
    assert np.array_equal(first // host.layout.slot_bytes, last // host.layout.slot_bytes)
    assert plan.num_runs > len(expected)  # cut at every slot now


@pytest.mark.parametrize("direction", list(Direction))
def test_one_run_chunking_matches_its_arithmetic_at_every_size(direction):
    """A one-run job's chunking (slices of a table grown as larger jobs come: 300 pages of 3-page
    chunks outgrow its first 64 chunks) equals the chunk arithmetic, in any order of sizes, and
    what a size is given is read-only (plans of that size share it)."""
    engine, *_ = rig("LBNHC-attention", chunk_pages=3)
    staged = engine.staged
    page, chunk = staged.page_bytes, 3
    addresses = staged.buffers(direction).addresses
    for count in (5, 300, 0, 1, 3, 192, 193, 7, 1000, 2):
        starts, bounds, offsets, sizes, staging = staged._one_run_chunks(direction, count)  # noqa: SLF001
        first = np.arange(0, count, chunk)
        assert np.array_equal(starts, first * page) and np.array_equal(bounds, np.arange(len(first) + 1))
        assert np.array_equal(offsets, np.zeros(len(first))) and np.array_equal(staging, addresses[np.arange(len(first)) % 2])
        assert np.array_equal(sizes, np.diff(np.append(first, count)) * page) and sizes.sum() == count * page
        assert not any(array.flags.writeable for array in (starts, bounds, offsets, sizes, staging))
        staged._chunked.clear()  # noqa: SLF001 (each size sliced from the table again)


def test_staged_jobs_move_the_widest_word_the_page_allows():
    engine, *_ = rig("LBNHC-attention")
    assert engine.staged.word is torch.int64  # noqa: SIM300 - 2 heads x 16 tokens x 32 fp16 values
    engine, *_ = rig("LBNHC-mla")
    assert engine.staged.rows.element_size() == 8  # 16 x 40 x 2 bytes = 1280 = 8 x 160


def test_the_engine_falls_back_to_runs_when_staging_memory_cannot_be_had(caplog, monkeypatch):
    """Staging buffers are allocated when the engine is built (vLLM registering its KV caches):
    a device out of memory then turns staging off, logged, and every job goes as runs."""
    def out_of_memory(self, *args):
        raise RuntimeError("CUDA out of memory. Tried to allocate 64.00 MiB")

    monkeypatch.setattr(StagingBuffers, "__init__", out_of_memory)
    with caplog.at_level(logging.WARNING):
        engine, device, paged, host, kv = rig("LBNHC-attention")
    assert engine.staged is None and "staged copies are off" in caplog.text
    assert "CUDA out of memory" in caplog.text
    pages = job(kv, range(4), [3, 11, 1, 8])
    engine.start_store(1, pages)
    assert type(device.plans[-1]).__name__ == "ByteRuns"
    device.run_all()
    assert torch.equal(host.buffer, expected_host(paged, host, pages))
    assert [(d.ok, d.method) for d in engine.poll()] == [(True, "runs")]


# ---- the method chooser -------------------------------------------------------------------------

BIG = TIMED_BYTES * 4


def test_small_runs_are_always_staged_and_fixed_methods_are_kept():
    chooser = MethodChooser()
    assert chooser.pick(Direction.STORE, BIG, BIG // (STAGE_BELOW_BYTES // 2)) == (CopyMethod.STAGED, None)
    assert MethodChooser(CopyMethod.RUNS).pick(Direction.STORE, BIG, BIG) == (CopyMethod.RUNS, None)
    assert MethodChooser(CopyMethod.STAGED).pick(Direction.LOAD, BIG, 1) == (CopyMethod.STAGED, None)
    assert MethodChooser(staged=False).pick(Direction.LOAD, BIG, BIG) == (CopyMethod.RUNS, None)


def test_bounds_on_a_jobs_run_count_decide_its_class_only_when_every_count_between_gives_one():
    """The copy engine skips the exact run count when ``decided_by`` says the bounds decide: then
    every count between them must put the job in the class of the bounds (or staging)."""
    def class_of(num_bytes: int, runs: int):
        chooser = MethodChooser()
        method, _ = chooser.pick(Direction.STORE, num_bytes, runs)
        return method, tuple(chooser._classes)  # noqa: SLF001 - () when staged below the threshold

    rng = np.random.default_rng(7)
    decided = undecided = 0
    for _ in range(3000):
        num_bytes = int(rng.integers(1, 2**31))
        most = int(rng.integers(1, 2**15))
        fewest = int(rng.integers(1, most + 1))
        if MethodChooser().decided_by(num_bytes, fewest, most):
            decided += 1
            for runs in {most, int(rng.integers(fewest, most + 1))}:
                assert class_of(num_bytes, runs) == class_of(num_bytes, fewest), (num_bytes, fewest, most, runs)
        else:
            undecided += 1
    assert decided > 100 and undecided > 100
    job = 512 * 32  # the kit's jobs: 512 blocks x 32 layers
    assert MethodChooser().decided_by(job * 16384, job - 511, job)  # LBNHC 16 KiB pages: staged either way
    assert MethodChooser().decided_by(job * 65536, job - 511, job)  # LBNHC 64 KiB: one class (~64 KiB runs)
    assert not MethodChooser().decided_by(job * 16384, 1, 512)  # BLNHC: 512 KiB to 256 MiB runs


@pytest.mark.parametrize("faster", [CopyMethod.RUNS, CopyMethod.STAGED])
def test_large_runs_alternate_as_timed_trials_then_the_faster_is_kept(faster, caplog):
    chooser = MethodChooser()
    runs = BIG // (256 * 1024)  # 256 KiB runs
    assert chooser.pick(Direction.STORE, TIMED_BYTES // 2, runs // 8)[1] is None  # too small to time
    picked = []
    with caplog.at_level(logging.INFO):
        for _ in range(2 * TRIALS):
            method, key = chooser.pick(Direction.STORE, BIG, runs)
            assert key is not None
            picked.append(method)
            chooser.observe(key, method, BIG, 0.001 if method is faster else 0.002, ok=True)
    assert picked.count(CopyMethod.RUNS) == picked.count(CopyMethod.STAGED) == TRIALS
    assert chooser.pick(Direction.STORE, BIG, runs) == (faster, None)
    assert chooser.pick(Direction.STORE, TIMED_BYTES // 2, runs // 8) == (faster, None)  # same class of runs
    assert chooser.choices() == {"engine_to_host ~256 KiB runs": faster.value}
    assert f"{faster.value} chosen" in caplog.text
    assert chooser.pick(Direction.LOAD, BIG, runs)[1] is not None  # the other direction is measured apart


def test_host_time_to_issue_counts_in_a_trial():
    """Queued behind compute, one descriptor per page moves at the link's speed but costs the
    forward's thread its issue: equal device times, the cheaper issue wins."""
    chooser = MethodChooser()
    runs = BIG // (64 * 1024)
    for _ in range(2 * TRIALS):
        method, key = chooser.pick(Direction.LOAD, BIG, runs)
        chooser.observe(key, method, BIG, 0.002, True, issue_seconds=0.013 if method is CopyMethod.RUNS else 0.001)
    assert chooser.pick(Direction.LOAD, BIG, runs) == (CopyMethod.STAGED, None)


@pytest.mark.parametrize("staged_slower_by, chosen", [(0.02, CopyMethod.STAGED), (0.04, CopyMethod.STAGED),
                                                      (0.08, CopyMethod.RUNS)])
def test_between_near_equal_device_bandwidths_the_least_host_time_wins(staged_slower_by, chosen):
    """Block-outermost pages: both methods reach the link, RUNS costs the forward's thread a
    descriptor per block. Staged within DEVICE_TIE (5%, the kit's bandwidth goal) of RUNS'
    bandwidth and cheaper to issue: staged (at 4% slower, what an H200's staged trials showed);
    clearly slower on the device: RUNS, however cheap staged is to issue."""
    chooser = MethodChooser()
    runs = BIG // (512 * 1024)
    for _ in range(2 * TRIALS):
        method, key = chooser.pick(Direction.STORE, BIG, runs)
        device = 0.005 * (1 + staged_slower_by) if method is CopyMethod.STAGED else 0.005
        chooser.observe(key, method, BIG, device, True, issue_seconds=0.0001 if method is CopyMethod.STAGED else 0.0004)
    assert chooser.pick(Direction.STORE, BIG, runs) == (chosen, None)


def test_a_staged_shape_is_costed_by_its_steady_issue_not_its_first_jobs():
    """A staged shape's first job goes op by op and its second builds the CUDA graph: slower to
    issue than the runs' batched call, although every later job only launches the graph."""
    chooser = MethodChooser()
    runs = BIG // (512 * 1024)
    staged_issues = iter([0.001, 0.004, 0.0001])  # op by op, graph built, graph launched
    for _ in range(2 * TRIALS):
        method, key = chooser.pick(Direction.LOAD, BIG, runs)
        issue = next(staged_issues) if method is CopyMethod.STAGED else 0.0004
        chooser.observe(key, method, BIG, 0.005, True, issue_seconds=issue)
    assert chooser.pick(Direction.LOAD, BIG, runs) == (CopyMethod.STAGED, None)


def test_a_failed_or_lost_trial_is_made_up_by_the_next_job():
    chooser = MethodChooser()
    method, key = chooser.pick(Direction.LOAD, BIG, BIG // 2**20)
    chooser.observe(key, method, BIG, 0.0, ok=False)
    assert chooser.pick(Direction.LOAD, BIG, BIG // 2**20)[0] is method
    chooser.pick(Direction.LOAD, BIG, BIG // 2**20)  # planned, never run (its job was never started)
    for _ in range(2 * TRIALS):
        method, key = chooser.pick(Direction.LOAD, BIG, BIG // 2**20)
        chooser.observe(key, method, BIG, 0.001, ok=True)
    assert chooser.choices()  # chosen after TRIALS timings of each, however many were lost


def test_the_engine_times_its_trials_on_the_device_and_reports_the_method(monkeypatch):
    """AUTO on a block-outermost layout (whole-block runs): jobs alternate as trials timed by their
    own events, and each CopyDone says how it moved."""
    monkeypatch.setattr("kvtier.copy.choice.TIMED_BYTES", 0)  # tiny jobs here: time them all
    case = Case("BLNHC", layers=4, heads=4, tokens=16, content=64)  # blocks of 4 x 8 KiB: 32 KiB runs
    kv = build(case, 64, "cpu")
    paged = PagedKV(kv.views, 64)
    layout = HostSlotLayout(paged.num_layers, 1, paged.page_bytes, 1, 64)
    host = HostSlots(torch.zeros(layout.region_bytes, dtype=torch.uint8), layout)
    device = SimDevice()
    engine = CudaCopyEngine(BlockCopier(paged, host), device)
    seen = []
    for job_id in range(1, 2 * TRIALS + 1):
        engine.start_store(job_id, [PageCopy(s, 0, (s * 7) % 64) for s in range(64)])
        device.run_all()
        seen += [d.method for d in engine.poll()]
    assert sorted(seen) == ["runs"] * TRIALS + ["staged"] * TRIALS
    assert len(engine.chooser.choices()) == 1


def test_runs_planner_and_staged_planner_share_the_entries():
    """A StagedPlanner is built over the engine's RunPlanner (one place computes page addresses)."""
    engine, *_ = rig("BLNHC-attention")
    assert isinstance(engine.runs, RunPlanner) and engine.staged.runs is engine.runs
    assert StagedPlanner.fits(engine.copier.kv)


# ---- planning per block (SlotJob) equals planning per (block, layer) ---------------------------

def _own_storage(view: torch.Tensor) -> torch.Tensor:
    """A tensor of ``view``'s shape and strides in a storage of its own (whole pages: a padded
    last page's padding too)."""
    extent = max(1 + sum((n - 1) * stride for n, stride in zip(view.shape, view.stride())),
                 view.shape[0] * view.stride(0))
    return torch.empty(extent, dtype=view.dtype).as_strided(view.shape, view.stride())


@pytest.mark.parametrize("case_name", [n for n in STAGED_CASES if "mamba" not in n])
@pytest.mark.parametrize("storages", ["one", "per layer"])
def test_the_run_count_of_a_one_run_job_equals_the_general_count(case_name, storages):
    """Jobs of consecutive slots (one host run) count their runs from engine block steps: equal to
    the count of the general per-(block, layer) merge, for blocks consecutive, in steps, repeated
    and scattered, with the layers in one storage (as the kit builds them) or one each (as vLLM
    allocates them on GPUs: no block then continues another)."""
    case = CASES[case_name]
    kv = build(case, NUM_BLOCKS, "cpu")
    views = kv.views if storages == "one" else [_own_storage(view) for view in kv.views]
    paged = PagedKV(views, NUM_BLOCKS, kv.layer_groups, kv.page_bytes)
    layout = HostSlotLayout(paged.num_layers, 1, paged.page_bytes, 1, 16)
    runs = RunPlanner(paged, HostSlots(torch.zeros(layout.region_bytes, dtype=torch.uint8), layout))
    rng = np.random.default_rng(3)
    for blocks in (np.arange(8) + 2, np.arange(0, NUM_BLOCKS, 2), np.arange(8)[::-1] + 4, np.array([5, 5, 6, 7, 9, 10, 3, 4]),
                   rng.permutation(NUM_BLOCKS)[:8], np.arange(1) + 3):
        table = runs.table([PageCopy(4 + i, 0, int(b)) for i, b in enumerate(blocks)])
        job = runs.slot_job(table)
        assert job is not None and job.first_slot == 4
        assert runs.count_slot_runs(job) == runs.count_runs(runs.entries(table)), blocks


@pytest.mark.parametrize("case_name", [n for n in STAGED_CASES if "mamba" not in n])
@pytest.mark.parametrize("seed", range(4))
def test_planning_whole_blocks_per_block_gives_the_plans_of_planning_per_page(case_name, seed):
    """Random jobs (slots in any order, runs of consecutive slots and engine blocks, pinning
    chunks of one and two slots): the per-block plans (what most jobs take) equal the general
    per-(block, layer) ones, for staged jobs, runs, and the run count the chooser reads."""
    rng = np.random.default_rng(seed)
    engine, device, paged, host, kv = rig(case_name, num_slots=12, chunk_pages=int(rng.integers(1, 9)))
    runs, staged = engine.runs, engine.staged
    for segment in (None, host.layout.slot_bytes, 2 * host.layout.slot_bytes):
        if segment is not None:
            runs.segment_bytes = staged.segment_bytes = segment
        count = int(rng.integers(1, 12))
        slots = rng.permutation(12)[:count] if seed % 2 else np.sort(rng.permutation(12)[:count])
        if seed % 3 == 0:  # consecutive slots, the usual store: one host run unless a pinning chunk splits it
            first = int(rng.integers(0, 12 - count + 1))
            slots = np.arange(first, first + count)
        blocks = np.arange(count) + int(rng.integers(0, NUM_BLOCKS - count)) if seed < 2 else \
            rng.permutation(NUM_BLOCKS)[:count]
        pages = [PageCopy(int(s), 0, int(b)) for s, b in zip(slots, blocks)]
        table = runs.table(pages)
        job = runs.slot_job(table)
        assert job is not None
        entries = runs.entries(table)
        assert runs.fewest_slot_runs(job) <= runs.count_slot_runs(job) == runs.count_runs(entries) \
            <= runs.most_slot_runs(job)
        fast, general = staged.plan_slots(Direction.STORE, job), staged.plan(Direction.STORE, entries)
        assert np.array_equal(fast.row_index(), general.index)
        assert fast.num_pages == general.num_pages and fast.num_bytes == general.num_bytes
        for name in ("run_bounds", "staging_offset", "host_offset", "sizes", "staging_addr", "host_addr"):
            assert np.array_equal(getattr(fast, name), getattr(general, name)), name
        numbers = np.concatenate(fast.kernel_numbers())  # what the kernels read: the page count, then
        assert numbers[0] == general.num_pages
        if fast.kernel_blocks() is not None:  # each layer's first row and the blocks
            layers = paged.num_layers
            rows = numbers[1 + layers:][:, None] * fast.block_rows + numbers[1:1 + layers]
            assert np.array_equal(rows.ravel(), general.index)
        else:  # each page's row
            assert np.array_equal(numbers[1:], general.index)
        assert np.array_equal(np.concatenate(general.kernel_numbers())[1:], general.index)
        merged = runs.merge_slots(Direction.LOAD, job)
        if merged is not None:
            reference = runs.merge(Direction.LOAD, entries)
            for name in ("src_addr", "dst_addr", "sizes"):
                assert np.array_equal(getattr(merged, name), getattr(reference, name)), name
        assert (merged is not None) == case_name.startswith("BL")


def test_jobs_that_are_not_whole_one_page_blocks_take_the_general_plan():
    engine, device, paged, host, kv = rig("LBNHC-mamba-hybrid")  # two KV cache groups
    assert engine.runs.slot_job(engine.runs.table(job(kv, [0, 1], [3, 4]))) is None
    engine, device, paged, host, kv = rig("LBNHC-attention")
    twice = engine.runs.table([PageCopy(1, 0, 3), PageCopy(1, 0, 4)])
    assert engine.runs.slot_job(twice) is None
