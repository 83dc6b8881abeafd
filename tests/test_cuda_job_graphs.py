"""The CUDA engine's staged path as it runs on a GPU with kvtier's kernels (``TorchCudaStreams`` and
its lanes, ``kvtier.copy.cudagraph``), on CPU tensors through a stand-in device that runs every
call at once on host memory (``tests/host_device.py``): every address, size and kernel argument
the GPU path computes is checked by the bytes it lands; the ordering between lanes is
``tests/test_job_graphs.py``'s.

- a job shape's first job goes op by op, its second is built into a graph and launched, later
  ones cost one copy update per chunk and one launch, and every job is bit-exact, store and load;
- jobs whose chunks are several host runs never become graphs;
- a graph that fails to build or launch turns graphs off (logged) and the job still lands;
- graphs built on an index buffer that was grown are retired and rebuilt; closing destroys
  every graph;
- jobs as the scheduler sends them (page tables, or a SlotRun for a job of one host run) of a
  size that went as a graph go as repeats of it, unplanned, and fall back to a planned job where
  the graph is gone; a SlotRun out of range fails its job before anything is copied.
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from host_device import HostDevice, host_streams

from kvtier.copy import BlockCopier, Direction, HostSlots, PageCopy, PagedKV, SlotRun, page_table, slot_run_of
from kvtier.copy.choice import TRIALS, TrialKey
from kvtier.copy.cuda import CudaCopyEngine
from kvtier.copy.lanes import CudaLanes
from kvtier.copy.staging import STAGE_BELOW_BYTES, CopyMethod
from kvtier.core.slots import HostSlotLayout

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from gpu_layouts import CASES, Case, build  # noqa: E402
from test_staged_copies import STAGED_CASES  # noqa: E402

LAYERS, BLOCKS, SLOTS = 4, 24, 24
CHUNK_PAGES = 3  # a block is 4 pages: chunks split blocks


def rig(device: HostDevice, chunk_pages: int = CHUNK_PAGES):
    """The calls-per-job rig: LBNHC, 4 layers of 1 KiB pages, 24 blocks and slots, 2 buffers."""
    case = Case("LBNHC", layers=LAYERS, heads=1, tokens=16, content=32, dtype=torch.float16)
    engine, streams, _, paged, host = layout_rig(device, case, chunk_pages, 2, BLOCKS, SLOTS)
    return engine, streams, paged, host


def layout_rig(device: HostDevice, case: Case | str, chunk_pages: int, buffers: int, num_blocks: int = 12,
               num_slots: int = 12, method: CopyMethod = CopyMethod.STAGED):
    """``case`` (or ``CASES[case]``) on CPU with random bytes, a host region, and a CUDA engine
    that moves jobs by ``method`` (always staged by default), on ``device``."""
    case = CASES[case] if isinstance(case, str) else case
    kv = build(case, num_blocks, "cpu")
    kv.raw.copy_(torch.randint(-128, 128, kv.raw.shape, dtype=torch.int8))
    paged = PagedKV(kv.views, num_blocks, kv.layer_groups, kv.page_bytes)
    layout = HostSlotLayout(paged.num_layers, 1, paged.page_bytes, 1, num_slots)
    host = HostSlots(torch.zeros(layout.region_bytes, dtype=torch.uint8), layout)
    streams = host_streams(device)
    engine = CudaCopyEngine(BlockCopier(paged, host), streams, method,
                            chunk_bytes=chunk_pages * paged.page_bytes, buffers=buffers)
    return engine, streams, kv, paged, host


@pytest.mark.parametrize("case_name", STAGED_CASES)
@pytest.mark.parametrize("chunk_pages, buffers", [(2, 2), (5, 3)])
def test_every_staged_layout_repeats_as_graphs_bit_exact(case_name, chunk_pages, buffers):
    """What the GPU kit runs on a device (tests/gpu/test_gpu_copies.py, the same name): three
    stores then three loads of one shape (4 whole blocks, 4 consecutive slots), for every layout
    and page shape staged jobs take; the second and third of each direction are graph launches."""
    device = HostDevice()
    engine, streams, kv, paged, host = layout_rig(device, case_name, chunk_pages, buffers)
    groups = len(kv.layer_groups)
    sources = [[3, 11, 1, 8], [9, 2, 10, 5], [0, 4, 6, 7]]
    expected = torch.zeros_like(host.buffer)
    cpu_copier = BlockCopier(paged, HostSlots(expected, host.layout))
    for job_id, blocks in enumerate(sources):
        store = [PageCopy(4 * job_id + s, 0, b, g) for s, b in enumerate(blocks) for g in range(groups)]
        engine.start_store(job_id, store)
        cpu_copier.copy(Direction.STORE, store)
    assert all(d.ok for d in engine.poll())
    assert torch.equal(host.buffer, expected)
    originals = kv.raw.clone()
    kv.raw.zero_()
    targets = [[(b + 5) % 12 for b in blocks] for blocks in sources]
    for j, blocks in enumerate(targets):
        engine.start_load(10 + j, [PageCopy(4 * j + s, 0, b, g) for s, b in enumerate(blocks) for g in range(groups)],
                          synchronous=False)
    assert all(d.ok for d in engine.poll())
    loaded = kv.raw.clone()
    for layers in kv.layer_groups:
        for source_blocks, target_blocks in zip(sources, targets):
            for source, target in zip(source_blocks, target_blocks):
                for layer in layers:
                    kv.raw.copy_(originals)
                    want = paged.page(layer, source).clone()
                    kv.raw.copy_(loaded)
                    assert torch.equal(paged.page(layer, target), want), (case_name, layer, source, target)
    assert sorted(lanes.graph_launches for lanes in streams._lanes.values()) == [2, 2]  # noqa: SLF001
    engine.close()


def pages_of(slots, blocks):
    return [PageCopy(slot, 0, block) for slot, block in zip(slots, blocks)]


def store_exactly(engine, paged, host, job_id, pages) -> bool:
    engine.start_store(job_id, pages)
    [done] = engine.poll()
    expected = torch.zeros_like(host.buffer)
    BlockCopier(paged, HostSlots(expected, host.layout)).copy(Direction.STORE, pages)
    theirs = HostSlots(expected, host.layout)
    return done.ok and all(torch.equal(host.page(p.slot, layer, 0), theirs.page(p.slot, layer, 0))
                           for p in pages for layer in range(LAYERS))


def load_exactly(engine, paged, host, job_id, pages) -> bool:
    for p in pages:
        for layer in range(LAYERS):
            paged.page(layer, p.block_id).zero_()
    engine.start_load(job_id, pages, synchronous=False)
    [done] = engine.poll()
    return done.ok and all(torch.equal(paged.page(layer, p.block_id).reshape(-1).view(torch.uint8),
                                       host.page(p.slot, layer, 0).reshape(-1).view(torch.uint8))
                           for p in pages for layer in range(LAYERS))




def test_a_shapes_second_job_is_a_graph_and_every_job_lands_exactly():
    device = HostDevice()
    engine, streams, paged, host = rig(device)
    jobs = [pages_of(range(first, first + 6), blocks) for first, blocks in
            ((0, [3, 11, 1, 8, 9, 2]), (6, [13, 5, 0, 7, 4, 12]), (12, [22, 20, 21, 6, 10, 14]), (18, [15, 16, 17, 18, 19, 23]))]
    for job_id, pages in enumerate(jobs):
        before = Counter(device.calls)
        assert store_exactly(engine, paged, host, job_id, pages), job_id
        spent = device.calls - before
        chunks = -(-6 * LAYERS // CHUNK_PAGES)
        if job_id == 0:
            assert spent["graph_create"] == 0 and spent["launch"] == chunks  # op by op
        elif job_id == 1:
            # a copy node per chunk and the upload's
            assert spent["graph_create"] == 1 and spent["add_node"] == chunks and spent["graph_add_memcpy"] == chunks + 1
        if job_id >= 1:  # one update per chunk and the upload's, and a launch: no kernel launch, no copy of its own
            assert (spent["memcpy"], spent["launch"], spent["graph_set_memcpy"], spent["graph_launch"]) == \
                (0, 0, chunks + 1, 1)
    for job_id, pages in enumerate(jobs, start=10):  # loads into other engine blocks
        moved = pages_of([p.slot for p in pages], [(p.block_id + 5) % BLOCKS for p in pages])
        assert load_exactly(engine, paged, host, job_id, moved), job_id
    lanes = [lanes for lanes in streams._lanes.values()]  # noqa: SLF001
    assert sorted(lanes.graph_launches for lanes in lanes) == [3, 3]
    engine.close()
    assert len(device.destroyed) == 2  # one graph per direction, destroyed at close


def test_jobs_of_other_sizes_with_as_many_chunks_share_a_graph_and_touch_nothing_past_their_pages():
    """Chunks of 24 pages (6 blocks): jobs of 3 and 4 blocks are one chunk of 12 or 16 pages, one
    graph shape (sized for 16); 5 and 6 blocks another (24); 7 to 9 blocks, two chunks, a third
    (its last chunk's launch sized for a whole chunk). A graph built by a job of one size
    moves another size's pages exactly: its copies' sizes and its upload are the job's, and the
    kernels stop at the job's page count; nothing outside the job's slots or blocks changes."""
    device = HostDevice()
    engine, streams, paged, host = rig(device, chunk_pages=24)
    sizes = [4, 3, 4, 3, 6, 5, 5, 6, 7, 9, 8]
    stores, loads, first = [], [], 0
    for n in sizes:
        blocks = [(7 * (first + i) + 3) % BLOCKS for i in range(n)]
        stores.append(pages_of(range(first, first + n), blocks))
        loads.append(pages_of(range(first, first + n), [(b + 5) % BLOCKS for b in blocks]))
        first = (first + n) % (SLOTS - 9)
    for job_id, pages in enumerate(stores):
        outside = [s for s in range(SLOTS) if s not in {p.slot for p in pages}]
        before = {(s, layer): host.page(s, layer, 0).clone() for s in outside for layer in range(LAYERS)}
        assert store_exactly(engine, paged, host, job_id, pages), job_id
        assert all(torch.equal(host.page(s, layer, 0), page) for (s, layer), page in before.items()), job_id
    for job_id, pages in enumerate(loads, start=100):
        targets = {p.block_id for p in pages}
        kept = {(layer, b): paged.page(layer, b).clone() for layer in range(LAYERS) for b in range(BLOCKS)
                if b not in targets}
        assert load_exactly(engine, paged, host, job_id, pages), job_id
        assert all(torch.equal(paged.page(layer, b), page) for (layer, b), page in kept.items()), job_id
    launches = sorted(lanes.graph_launches for lanes in streams._lanes.values())  # noqa: SLF001
    # per direction: [4, 3, 4, 3] is one shape (its 2nd job builds it: 3 launches), [6, 5, 5, 6] another (3),
    # [7, 9, 8] a third (2)
    assert launches == [8, 8]
    engine.close()


def test_jobs_of_several_host_runs_per_chunk_go_op_by_op():
    device = HostDevice()
    engine, streams, paged, host = rig(device)
    scattered = pages_of([0, 2, 4, 6, 8, 10], [3, 11, 1, 8, 9, 2])
    for job_id in range(3):
        assert store_exactly(engine, paged, host, job_id, scattered)
    assert device.calls["graph_create"] == 0 and device.calls["memcpy_batch"] > 0


def test_jobs_whose_numbers_exceed_the_upload_ring_go_op_by_op_and_graphs_stay_on(monkeypatch):
    """A graph uploads its job's numbers from the ring: a job with more numbers than the ring holds
    (its layers' rows and one number per block: 4 + 6 here, the ring 8 words) never builds one,
    and a smaller job's shape still does."""
    monkeypatch.setattr(CudaLanes, "UPLOAD_RING_BYTES", 8 * 8)
    device = HostDevice()
    engine, streams, paged, host = rig(device)
    for job_id, first in enumerate((0, 6, 12)):
        assert store_exactly(engine, paged, host, job_id, pages_of(range(first, first + 6), [3, 11, 1, 8, 9, 2]))
    assert device.calls["graph_create"] == 0
    for job_id, first in enumerate((18, 21), start=3):
        assert store_exactly(engine, paged, host, job_id, pages_of(range(first, first + 3), [13, 5, 0]))
    assert device.calls["graph_create"] == 1 and device.calls["graph_launch"] == 1


@pytest.mark.parametrize("failing", ["graph_instantiate", "add_node", "graph_set_memcpy", "graph_launch"])
def test_a_graph_that_fails_turns_graphs_off_and_the_job_still_lands(failing, caplog):
    caplog.set_level(logging.WARNING, "kvtier.copy.streams")
    device = HostDevice(fail={failing})
    engine, streams, paged, host = rig(device)
    for job_id, first in enumerate((0, 6, 12, 18)):
        assert store_exactly(engine, paged, host, job_id, pages_of(range(first, first + 6), [3, 11, 1, 8, 9, 2]))
    assert "not as CUDA graphs" in caplog.text
    assert device.calls["graph_create"] == 1  # not tried again
    assert device.calls["graph_launch"] <= 1
    engine.close()
    assert len(device.destroyed) == 1  # what was built is freed


def test_graphs_read_a_grown_index_buffer_only_after_being_built_again():
    device = HostDevice()
    engine, streams, paged, host = rig(device)
    blocks = [3, 11, 1, 8, 9, 2]
    for job_id, first in enumerate((0, 6)):
        assert store_exactly(engine, paged, host, job_id, pages_of(range(first, first + 6), blocks))
    [store_lanes] = [lanes for lanes in streams._lanes.values() if lanes.graph_launches]  # noqa: SLF001
    store_lanes._reserve(len(store_lanes._index) + 1)  # noqa: SLF001 - a job whose numbers did not fit
    assert store_exactly(engine, paged, host, 2, pages_of(range(12, 18), [13, 5, 0, 7, 4, 12]))
    assert device.calls["graph_create"] == 2 and device.calls["graph_launch"] == 2  # built again at once
    assert store_exactly(engine, paged, host, 3, pages_of(range(18, 24), blocks))
    assert len(device.destroyed) == 1  # the old graph, once the launches before its retirement ran
    engine.close()
    assert len(device.destroyed) == 2


# ---- jobs as the scheduler sends them: page tables, repeated unplanned ---------------------------

def _lands(paged, host, table, direction) -> bool:
    """Whether every page of ``table`` holds the same bytes on both sides."""
    return all(torch.equal(paged.page(layer, int(block)).reshape(-1).view(torch.uint8),
                           host.page(int(slot), layer, 0).reshape(-1).view(torch.uint8))
               for slot, _, block, _ in table.tolist() for layer in range(LAYERS))


FORMS = ["table", "scheduler"]
"""How a test sends its jobs: page tables, or as kvtier's scheduler sends them (a job of one
host run as a :class:`SlotRun`, :func:`slot_run_of`)."""


def _sent(table, form: str):
    return (slot_run_of(table) or table) if form == "scheduler" else table


def _run(engine, paged, host, job_id, direction, table, form: str = "table") -> bool:
    done = _done(engine, paged, job_id, direction, table, form)
    return done.ok and _lands(paged, host, table, direction)


def _done(engine, paged, job_id, direction, table, form: str = "table"):
    """Issue the job (a load into zeroed pages), sent as ``form`` says, and return its CopyDone."""
    if direction is Direction.LOAD:
        for block in table[:, 2].tolist():
            for layer in range(LAYERS):
                paged.page(layer, block).zero_()
        engine.start_load(job_id, _sent(table, form), synchronous=False)
    else:
        engine.start_store(job_id, _sent(table, form))
    [done] = engine.poll()
    return done


@pytest.mark.parametrize("form", FORMS)
def test_page_tables_of_a_size_seen_as_a_graph_repeat_it_unplanned_and_land_exactly(form):
    """A job of consecutive slots (a page table, or the scheduler's SlotRun) whose size went as a
    graph launch twice before is issued as a repeat of that graph (CudaLanes.repeat): no plan, one
    update per chunk and the upload's, one launch; other slots and blocks each time, every byte
    where it belongs, store and load."""
    device = HostDevice()
    engine, streams, paged, host = rig(device)
    jobs = [page_table(pages_of(range(first, first + 6), blocks)) for first, blocks in
            ((0, [3, 11, 1, 8, 9, 2]), (6, [13, 5, 0, 7, 4, 12]), (12, [22, 20, 21, 6, 10, 14]),
             (18, [15, 16, 17, 18, 19, 23]), (3, [1, 2, 3, 4, 5, 6]))]
    chunks = -(-6 * LAYERS // CHUNK_PAGES)
    for direction in (Direction.STORE, Direction.LOAD):
        for job_id, table in enumerate(jobs):
            if direction is Direction.LOAD:  # into other engine blocks
                table = table.copy()
                table[:, 2] = (table[:, 2] + 5) % BLOCKS
            before, repeated = Counter(device.calls), engine.repeated
            assert _run(engine, paged, host, job_id + 10 * (direction is Direction.LOAD), direction, table, form), job_id
            spent = device.calls - before
            # the 2nd builds the graph, the 3rd launches it (its size kept), later ones repeat it
            assert engine.repeated - repeated == (job_id >= 3)
            if job_id >= 1:
                assert (spent["memcpy"], spent["launch"], spent["graph_set_memcpy"], spent["graph_launch"]) == \
                    (0, 0, chunks + 1, 1)
    assert engine.repeated == 4
    assert sorted(lanes.graph_launches for lanes in streams._lanes.values()) == [4, 4]  # noqa: SLF001
    engine.close()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("seed", range(3))
def test_repeats_of_mixed_sizes_land_exactly_and_fall_back_when_their_graph_is_gone(seed, form):
    """Page tables of 1-8 blocks at random slots and blocks, stores and loads interleaved, with
    room for two graphs per side stream (shapes retire and are built again, a repeat of a
    retired shape goes planned), a few jobs of scattered slots (never repeats) between: every
    job lands exactly; many went as repeats."""
    rng = np.random.default_rng(seed)
    device = HostDevice()
    engine, streams, paged, host = rig(device, chunk_pages=8)
    for lanes in streams._lanes.values():  # noqa: SLF001
        lanes._graphs.capacity = 2  # noqa: SLF001
    for job_id in range(160):
        n = int(rng.integers(1, 9))
        first = int(rng.integers(0, SLOTS - n + 1))
        slots = np.arange(first, first + n) if rng.random() < 0.9 else np.sort(rng.choice(SLOTS, n, replace=False))
        table = page_table(pages_of(slots.tolist(), rng.choice(BLOCKS, n, replace=False).tolist()))
        direction = Direction.STORE if rng.random() < 0.5 else Direction.LOAD
        assert _run(engine, paged, host, job_id, direction, table, form), (job_id, direction, table.tolist())
    assert engine.repeated > 20 and device.calls["graph_create"] > 2 * 4, (engine.repeated, device.calls)
    engine.close()


@pytest.mark.parametrize("form", FORMS)
def test_block_outermost_jobs_repeat_only_where_their_own_run_count_is_staged(form):
    """AUTO on a block-outermost layout: a run is as many blocks as the engine holds in a row, so
    the method of a job (by its class: mean bytes per run) depends on its blocks, not its size
    alone. Jobs of scattered blocks, a class chosen STAGED, repeat their graph; a job of the same
    size whose blocks pair up (a class chosen RUNS) goes as runs, one of blocks in a row (a class
    not chosen yet: RUNS) too; every job lands exactly."""
    device = HostDevice()
    case = Case("BLNHC", layers=LAYERS, heads=1, tokens=16, content=256, dtype=torch.float16)
    engine, streams, _, paged, host = layout_rig(device, case, 8, 2, BLOCKS, SLOTS, CopyMethod.AUTO)
    run, n = LAYERS * paged.page_bytes, 6  # a block is one run of its every layer's page
    assert run == STAGE_BELOW_BYTES
    chooser = engine.chooser
    for direction in Direction:  # trials as the engine's would report them: ms on the device
        for runs, device_ms in ((n, {CopyMethod.STAGED: 1.0, CopyMethod.RUNS: 1.1}),  # scattered: staged
                                (n // 2, {CopyMethod.STAGED: 1.2, CopyMethod.RUNS: 1.0})):  # pairs: runs
            chooser.pick(direction, n * run, runs)
            key = TrialKey(direction, (n * run // runs).bit_length() - 1)
            for method, ms in device_ms.items():
                for _ in range(TRIALS):
                    chooser.observe(key, method, n * run, ms / 1e3, True, 1e-4)
    assert sorted(chooser.choices().values()) == ["runs", "runs", "staged", "staged"]
    scattered = [[3, 11, 1, 8, 14, 20], [13, 5, 0, 7, 22, 17], [22, 20, 2, 6, 10, 14], [15, 23, 17, 19, 1, 9]]
    jobs = [(first, blocks, "staged") for first, blocks in zip((0, 6, 12, 18), scattered)]
    jobs += [(3, [4, 5, 12, 13, 20, 21], "runs"), (9, [6, 7, 8, 9, 10, 11], "runs"), (0, scattered[1], "staged")]
    for direction in Direction:
        repeated = engine.repeated
        for job_id, (first, blocks, method) in enumerate(jobs):
            table = page_table(pages_of(range(first, first + n), blocks))
            if direction is Direction.LOAD:  # into other engine blocks, as many in a row
                table[:, 2] = (table[:, 2] + 1) % BLOCKS
            before = engine.repeated
            done = _done(engine, paged, 100 * (direction is Direction.LOAD) + job_id, direction, table, form)
            assert done.ok and done.method == method and _lands(paged, host, table, direction), (job_id, done)
            # the 2nd builds the graph, the 3rd launches it (its size kept), later staged ones repeat it
            assert engine.repeated - before == (job_id == 3 or job_id == 6), job_id
        assert engine.repeated - repeated == 2
    engine.close()


@pytest.mark.parametrize("kept", [False, True], ids=["no-graph-yet", "size-repeating"])
def test_a_slot_run_out_of_range_fails_its_job_and_copies_nothing(kept):
    """A SlotRun naming an engine block past the KV cache, a negative one, or slots past the host
    region fails its job (reported, never raised) before any byte moves, whether its size repeats
    a graph already (the check on its blocks column) or it is planned (the table's check); the
    engine goes on: a good job after it lands."""
    device = HostDevice()
    engine, _, paged, host = rig(device)
    good = page_table(pages_of(range(0, 6), [3, 11, 1, 8, 9, 2]))
    if kept:
        for job_id in range(3):
            assert _run(engine, paged, host, job_id, Direction.STORE, good, "scheduler")
    bad = [SlotRun(6, np.array([3, 11, BLOCKS, 8, 9, 2], dtype=np.int64)),
           SlotRun(6, np.array([3, 11, -1, 8, 9, 2], dtype=np.int64)),
           SlotRun(SLOTS - 5, np.array([3, 11, 1, 8, 9, 2], dtype=np.int64))]
    for job_id, job in enumerate(bad, start=10):
        before = Counter(device.calls)
        host_before = host.buffer.clone()
        engine.start_store(job_id, job)
        [done] = engine.poll()
        spent = device.calls - before
        assert not done.ok and done.num_bytes == 0, job_id
        assert not (spent["memcpy"] or spent["launch"] or spent["graph_launch"]), (job_id, spent)
        assert torch.equal(host.buffer, host_before), job_id
    repeated = engine.repeated
    assert _run(engine, paged, host, 20, Direction.STORE, page_table(pages_of(range(12, 18), [13, 5, 0, 7, 4, 12])),
                "scheduler")
    assert engine.repeated == repeated + kept
    engine.close()


def test_a_slot_run_across_a_pinning_chunk_goes_planned_and_lands_exactly():
    """A SlotRun whose slots straddle two pinning chunks (two host runs) is no repeat: it goes
    planned, from its table, and lands exactly; one inside a chunk repeats."""
    device = HostDevice()
    engine, _, paged, host = rig(device)
    engine.runs.segment_bytes = engine.staged.segment_bytes = 8 * host.layout.slot_bytes  # chunks of 8 slots
    blocks = [[3, 11, 1, 8], [13, 5, 0, 7], [22, 20, 21, 6], [15, 16, 17, 18], [2, 4, 9, 10]]
    for job_id, (first, chosen) in enumerate(zip((0, 8, 16, 0, 6), blocks)):  # the last straddles slots 7 | 8
        repeated = engine.repeated
        assert _run(engine, paged, host, job_id, Direction.STORE, page_table(pages_of(range(first, first + 4), chosen)),
                    "scheduler"), job_id
        # the 2nd builds the graph, the 3rd launches it (its size kept), the 4th repeats it
        assert engine.repeated - repeated == (job_id == 3), job_id
    engine.close()


def test_a_repeat_never_launches_a_graph_built_on_an_index_buffer_since_grown():
    """The graph's upload node and kernels hold the index buffer's address: once it was grown
    (and the old one retired), a job of the repeated size goes planned and builds the graph again."""
    device = HostDevice()
    engine, streams, paged, host = rig(device)
    blocks = [3, 11, 1, 8, 9, 2]
    for job_id, first in enumerate((0, 6, 12, 18)):
        assert _run(engine, paged, host, job_id, Direction.STORE, page_table(pages_of(range(first, first + 6), blocks)))
    assert engine.repeated == 1 and device.calls["graph_create"] == 1
    [store_lanes] = [lanes for lanes in streams._lanes.values() if lanes.graph_launches]  # noqa: SLF001
    store_lanes._reserve(len(store_lanes._index) + 1)  # noqa: SLF001 - a job whose numbers did not fit
    assert _run(engine, paged, host, 4, Direction.STORE, page_table(pages_of(range(18, 24), [13, 5, 0, 7, 4, 12])))
    assert engine.repeated == 1 and device.calls["graph_create"] == 2  # planned, the graph built again
    assert _run(engine, paged, host, 5, Direction.STORE, page_table(pages_of(range(6, 12), blocks)))
    assert engine.repeated == 2  # a repeat of the new graph
    engine.close()
