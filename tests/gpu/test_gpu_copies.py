"""kvtier's CUDA copy engine on a real device, real streams, pinned /dev/shm host regions
(run by scripts/gpu-check.sh; skipped without CUDA). What the CPU suite can only simulate:

- a store requested while a long kernel still writes the pages holds the final bytes;
- a load is reported only after its bytes landed, and a failed one at once;
- a synchronous load lands before the compute stream reads the page, read at once with the load
  stream held behind a long kernel (tests/gpu/kit_checks.py; tests/test_gpu_kit.py shows on CPU
  that the check fails without the compute-stream wait);
- every job went out as one batched copy, checked after the copies (a refused batch is counted);
- batched copies (as runs, and small pages staged through a device buffer) are bit-exact for every
  layout vLLM can pick (tests/gpu/gpu_layouts.py, checked
  against vLLM's own view code on CPU), from and to a pinned /dev/shm region, and leave the same
  slot bytes as the CPU engine does on the same pages;
- staged jobs many times larger than the staging buffers, chunks splitting blocks, bit-exact;
- repeated staged jobs of one shape issued as CUDA graphs (kvtier.copy.cudagraph), bit-exact, and
  ordered as op by op: a store launched while a long kernel writes the pages, a synchronous load
  read at once on the compute stream;
- the step orders of vLLM's model runners at the copy level (tests/test_runner_orders.py runs them
  through vLLM's scheduler, which cannot run here: no vLLM on the GPU machine): under V1's order a
  store flushed before the step rewrites its block holds the old bytes; under V2's, a store still
  in flight when the step zeroes its block copies the zeros (the hazard kvtier's scheduler voids);
- pinning, including a refused registration that does not poison the CUDA context.
"""

from __future__ import annotations

import time

import pytest
import torch
from gpu_layouts import CASES, Case, build
from kit_checks import CudaRig, check_a_synchronous_load_lands_before_compute_reads, check_batches_were_not_refused

from kvtier.copy import BlockCopier, Direction, HostSlots, PageCopy, PagedKV, page_table, slot_run_of
from kvtier.copy.cuda import CudaCopyEngine
from kvtier.copy.cudart import LoadedCudart
from kvtier.copy.jobgraph import graph_key
from kvtier.copy.pinning import pin_host_memory
from kvtier.copy.staging import CopyMethod
from kvtier.copy.streams import TorchCudaStreams
from kvtier.core.slots import HostSlotLayout

NUM_BLOCKS = 12
LONG_KERNEL_CYCLES = 200_000_000  # torch.cuda._sleep: ~0.1 s on an H100


def engine_for(kv, case: Case, host_buffer: torch.Tensor, num_slots: int, method: CopyMethod = CopyMethod.AUTO,
               kernel_blocks: int | None = None, **staging):
    paged = PagedKV(kv.views, NUM_BLOCKS, kv.layer_groups, kv.page_bytes)
    layout = HostSlotLayout(paged.num_layers, 1, paged.page_bytes, 1, num_slots)
    host = HostSlots(host_buffer[: layout.region_bytes], layout)
    streams = TorchCudaStreams(paged.device, kernel_blocks=kernel_blocks)
    return CudaCopyEngine(BlockCopier(paged, host), streams, method, **staging), paged, host


def attention_rig(device, shm_region, num_slots=2, method: CopyMethod = CopyMethod.AUTO):
    """vLLM's default GPU layout (LBNHC) on ``device``, a pinned /dev/shm host region, the engine."""
    case = CASES["LBNHC-attention"]
    kv = build(case, NUM_BLOCKS, device)
    slot_bytes = len(kv.views) * case.page_bytes
    buffer, _ = shm_region(num_slots * slot_bytes, slot_bytes)
    engine, paged, host = engine_for(kv, case, buffer, num_slots, method)
    return case, kv, engine, paged, host


def staged_rig(name: str, num_slots: int, chunk_pages: int, buffers: int, device, shm_region,
               kernel_blocks: int | None = None):
    """Case ``name``'s KV on ``device`` filled with random bytes, a pinned /dev/shm region of
    ``num_slots`` slots, a staged engine with staging buffers of ``chunk_pages`` pages (its
    kernels on at most ``kernel_blocks`` thread blocks a launch), and a CPU
    copier of the same KV that writes what the CPU engine moves into ``expected`` (host-sized).
    Returns (kv, groups, engine, paged, host, expected, cpu_copier)."""
    case = CASES[name]
    kv = build(case, NUM_BLOCKS, device)
    kv.raw.copy_(torch.randint(-128, 128, kv.raw.shape, dtype=torch.int8, device=device))
    slot_bytes = len(kv.views) * case.page_bytes
    buffer, _ = shm_region(num_slots * slot_bytes, slot_bytes)
    engine, paged, host = engine_for(kv, case, buffer, num_slots, CopyMethod.STAGED, kernel_blocks,
                                     chunk_bytes=chunk_pages * case.page_bytes, buffers=buffers)
    cpu = build(case, NUM_BLOCKS, "cpu")
    cpu.raw.copy_(kv.raw.cpu())
    expected = torch.zeros_like(host.buffer)
    cpu_copier = BlockCopier(PagedKV(cpu.views, NUM_BLOCKS, cpu.layer_groups, cpu.page_bytes),
                             HostSlots(expected, host.layout))
    return kv, len(kv.layer_groups), engine, paged, host, expected, cpu_copier


def wait_done(engine, job_ids, timeout=30.0):
    done, deadline = {}, time.monotonic() + timeout
    while set(done) != set(job_ids):
        assert time.monotonic() < deadline, f"jobs {job_ids} not reported in {timeout} s"
        done.update((d.job_id, d) for d in engine.poll())
    return done


def page_bytes(paged, layer, block):
    return paged.page(layer, block).contiguous().view(torch.uint8).reshape(-1).cpu().clone()  # a copy on any device


@pytest.mark.parametrize("method", [CopyMethod.RUNS, CopyMethod.STAGED], ids=lambda m: m.value)
@pytest.mark.parametrize("name", CASES)
def test_round_trip_is_bit_exact_and_matches_the_cpu_engine(name, method, device, shm_region):
    case = CASES[name]
    kv = build(case, NUM_BLOCKS, device)
    kv.raw.copy_(torch.randint(-128, 128, kv.raw.shape, dtype=torch.int8, device=device))
    groups = len(kv.layer_groups)
    slot_bytes = len(kv.views) * case.page_bytes
    buffer, pinning = shm_region(4 * slot_bytes, slot_bytes)
    assert pinning.pinned
    engine, paged, host = engine_for(kv, case, buffer, 4, method)
    sources = [[1 + g * 5 + s for s in range(3)] for g in range(groups)]
    targets = [list(reversed(ids)) for ids in sources]
    store = [PageCopy(s, 0, sources[g][s], g) for s in range(3) for g in range(groups)]
    load = [PageCopy(s, 0, targets[g][s], g) for s in range(3) for g in range(groups)]
    before = {(layer, b): page_bytes(paged, layer, b) for g, layers in enumerate(kv.layer_groups)
              for layer in layers for b in sources[g]}
    engine.start_store(1, store)
    done = wait_done(engine, [1])[1]
    expected = method.value if engine.runs is not None else "pages"  # strided pages go page by page
    assert done.ok and done.method == expected, f"{expected} expected, {done.method} done"
    slots = host.buffer.clone()

    cpu = build(case, NUM_BLOCKS, "cpu")  # the same pages on the CPU engine: the same slot bytes
    cpu.raw.copy_(kv.raw.cpu())
    cpu_engine_host = torch.zeros_like(slots)
    BlockCopier(PagedKV(cpu.views, NUM_BLOCKS, cpu.layer_groups, cpu.page_bytes),
                HostSlots(cpu_engine_host, host.layout)).copy(Direction.STORE, store)
    assert torch.equal(slots, cpu_engine_host)

    kv.raw.zero_()
    engine.start_load(2, load)
    assert wait_done(engine, [2])[2].ok
    torch.cuda.synchronize()
    check_batches_were_not_refused(engine.device.runtime)
    for g, layers in enumerate(kv.layer_groups):
        for source, target in zip(sources[g], targets[g]):
            for layer in layers:
                assert torch.equal(page_bytes(paged, layer, target), before[layer, source]), (name, layer)


def graph_launches(engine) -> int:
    return sum(lanes.graph_launches for lanes in engine.device._lanes.values())  # noqa: SLF001


METHODS_AND_GRAPHS = [(CopyMethod.RUNS, 0), (CopyMethod.STAGED, 0), (CopyMethod.STAGED, 2)]  # 2 jobs first: a graph


@pytest.mark.parametrize("method, warm", METHODS_AND_GRAPHS, ids=["runs", "staged", "staged-graph"])
def test_a_store_requested_while_a_long_kernel_writes_the_pages_holds_the_final_bytes(method, warm, device, shm_region):
    case, kv, engine, paged, host = attention_rig(device, shm_region, method=method)
    for job_id in range(100, 100 + warm):  # the same shape first: the store below is then a graph launch
        engine.start_store(job_id, [PageCopy(1, 0, 5)])
        assert wait_done(engine, [job_id])[job_id].ok
    compute = torch.cuda.current_stream(device)
    torch.cuda._sleep(LONG_KERNEL_CYCLES)  # the "forward" is still running ...
    for view in kv.views:
        view[4].fill_(3.0)  # ... and writes the pages last
    engine.start_store(1, [PageCopy(0, 0, 4)])
    assert not compute.query(), "the long kernel finished before the store was issued; the test proves nothing"
    assert wait_done(engine, [1])[1].ok
    final = torch.full((case.page_bytes // case.dtype.itemsize,), 3.0, dtype=case.dtype).view(torch.uint8)
    assert all(torch.equal(host.page(0, layer, 0), final) for layer in range(len(kv.views)))
    assert graph_launches(engine) == warm, "the store did not go as a graph (see the log)"


@pytest.mark.parametrize("synchronous", [True, False])
def test_a_load_is_reported_only_after_its_bytes_landed(synchronous, device, shm_region):
    case, kv, engine, paged, host = attention_rig(device, shm_region)
    payload = torch.randint(0, 256, (host.layout.slot_bytes,), dtype=torch.uint8)
    host.tensor[1].view(-1).copy_(payload)
    with torch.cuda.stream(engine._streams[Direction.LOAD]):  # noqa: SLF001 - hold the load stream back
        torch.cuda._sleep(LONG_KERNEL_CYCLES)
    engine.start_load(1, [PageCopy(1, 0, 7)], synchronous=synchronous)
    assert engine.poll() == [], "a load was reported while its stream had not even started it"
    assert wait_done(engine, [1])[1].ok
    reader = torch.cuda.Stream(device)  # depends on nothing: reads what is in device memory now
    with torch.cuda.stream(reader):
        landed = torch.cat([paged.page(i, 7).contiguous().view(torch.uint8).reshape(-1) for i in range(len(kv.views))])
        landed = landed.to("cpu", non_blocking=False)
    assert torch.equal(landed, payload)


@pytest.mark.parametrize("method, warm", METHODS_AND_GRAPHS, ids=["runs", "staged", "staged-graph"])
def test_a_synchronous_load_lands_before_the_compute_stream_reads_the_page(method, warm, device, shm_region):
    compute = torch.cuda.Stream(device)  # vLLM computes on a stream of its own, not the default one
    with torch.cuda.stream(compute):
        case, kv, engine, paged, host = attention_rig(device, shm_region, method=method)
        for job_id in range(100, 100 + warm):  # the same shape first: the checked load is then a graph launch
            engine.start_load(job_id, [PageCopy(0, 0, 8)], synchronous=True)
            assert wait_done(engine, [job_id])[job_id].ok
        check_a_synchronous_load_lands_before_compute_reads(CudaRig(engine, paged, host, compute))
        check_batches_were_not_refused(engine.device.runtime)
        assert graph_launches(engine) == warm, "the load did not go as a graph (see the log)"


def test_a_failed_load_is_reported_at_once(device, shm_region):
    _, _, engine, _, _ = attention_rig(device, shm_region)
    torch.cuda._sleep(LONG_KERNEL_CYCLES)
    engine.start_load(1, [PageCopy(0, 0, NUM_BLOCKS + 3)])
    [done] = engine.poll()
    assert (done.job_id, done.ok) == (1, False)


def test_pinning_and_a_refused_registration_that_does_not_poison_the_context(device, shm_region):
    buffer, pinning = shm_region(8 * 2**20, 2**20)
    assert pinning.pinned
    runtime = LoadedCudart.find(torch.version.cuda)
    assert runtime is not None
    again = pin_host_memory(buffer, 2**20)  # the driver refuses: already registered
    assert not again.pinned
    assert runtime.get_last_error() == 0, "the refused registration's error was left pending"
    x = torch.ones(1024, device=device)
    (x + 1).sum().item()  # a kernel launch after the refusal: torch would raise a pending error here
    torch.cuda.synchronize()
    pinning.release()
    assert runtime.get_last_error() == 0
    pinning = pin_host_memory(buffer, 2**20)  # and it can be registered again
    assert pinning.pinned
    pinning.release()


def test_the_cuda_runtime_library_is_torchs_and_batched_every_job_it_was_given(device, shm_region):
    runtime = LoadedCudart.find(torch.version.cuda)
    assert runtime is not None and runtime.version // 1000 == int(torch.version.cuda.split(".")[0])
    case, kv, engine, paged, host = attention_rig(device, shm_region)
    engine.start_store(1, [PageCopy(0, 0, 3), PageCopy(1, 0, 5)])
    engine.start_load(2, [PageCopy(0, 0, 8)], synchronous=False)
    assert all(d.ok for d in wait_done(engine, [1, 2]).values())
    if runtime.version >= 12080:
        assert engine.device.runtime.batch_state.name == "BATCHED", "CUDA runtime >= 12.8 exports cudaMemcpyBatchAsync"
    check_batches_were_not_refused(engine.device.runtime)


@pytest.mark.parametrize("name", ["LBNHC-attention", "BLNHC-attention", "LBNHC-mamba-hybrid", "LBNHC-kernel-blocks"])
@pytest.mark.parametrize("chunk_pages, buffers", [(2, 2), (5, 3), (1, 1)])
def test_staged_jobs_larger_than_the_staging_buffers_round_trip_bit_exact(name, chunk_pages, buffers, device,
                                                                           shm_region):
    kv, groups, engine, paged, host, expected, cpu_copier = staged_rig(name, 8, chunk_pages, buffers, device,
                                                                       shm_region)
    sources, targets = [3, 11, 1, 8, 9, 2, 10, 5], [0, 4, 6, 7, 10, 3, 2, 1]
    store = [PageCopy(s, 0, b, g) for s, b in enumerate(sources) for g in range(groups)]
    assert engine.staged is not None, "staging is off on this device (see the log)"
    engine.start_store(1, store)
    done = wait_done(engine, [1])[1]
    assert done.ok and done.method == "staged"
    cpu_copier.copy(Direction.STORE, store)
    assert torch.equal(host.buffer, expected)
    before = kv.raw.clone()
    kv.raw.zero_()
    engine.start_load(2, [PageCopy(s, 0, b, g) for s, b in enumerate(targets) for g in range(groups)], synchronous=False)
    assert wait_done(engine, [2])[2].ok
    after = kv.raw.clone()
    kv.raw.copy_(before)
    originals = {(layer, b): page_bytes(paged, layer, b) for layer in range(len(kv.views)) for b in sources}
    kv.raw.copy_(after)
    for layers in kv.layer_groups:
        for source, target in zip(sources, targets):
            for layer in layers:
                assert torch.equal(page_bytes(paged, layer, target), originals[layer, source]), (name, layer, target)


@pytest.mark.parametrize("name", ["LBNHC-attention", "BLNHC-attention", "LBNHC-mamba-hybrid", "LBNHC-kernel-blocks",
                                  "LBNHC-padded-attention"])
@pytest.mark.parametrize("chunk_pages, buffers", [(2, 2), (5, 3)])
@pytest.mark.parametrize("kernel_blocks", [None, 3], ids=["block-per-page", "3-blocks"])
def test_repeated_staged_jobs_go_as_cuda_graphs_bit_exact(name, chunk_pages, buffers, kernel_blocks, device,
                                                          shm_region):
    """Three stores, then three loads, of one shape (4 whole blocks to 4 consecutive slots): the
    second and third of each are one CUDA graph launched with their own host addresses
    (kvtier.copy.cudagraph); every byte as the CPU engine moves it, with the gather and scatter
    kernels on a block per page or on 3 blocks, each looping over every third page of a launch."""
    kv, groups, engine, paged, host, expected, cpu_copier = staged_rig(name, 12, chunk_pages, buffers, device,
                                                                       shm_region, kernel_blocks)
    sources = [[3, 11, 1, 8], [9, 2, 10, 5], [0, 4, 6, 7]]
    stores = [[PageCopy(4 * j + s, 0, b, g) for s, b in enumerate(blocks) for g in range(groups)]
              for j, blocks in enumerate(sources)]
    for job_id, store in enumerate(stores):
        engine.start_store(job_id, store)
        cpu_copier.copy(Direction.STORE, store)
    assert all(d.ok for d in wait_done(engine, [0, 1, 2]).values())
    assert torch.equal(host.buffer, expected)
    originals = {(layer, b): page_bytes(paged, layer, b) for layer in range(len(kv.views)) for b in range(NUM_BLOCKS)}
    kv.raw.zero_()
    targets = [[(b + 5) % NUM_BLOCKS for b in blocks] for blocks in sources]
    for job_id, blocks in enumerate(targets, start=10):
        j = job_id - 10
        engine.start_load(job_id, [PageCopy(4 * j + s, 0, b, g) for s, b in enumerate(blocks) for g in range(groups)],
                          synchronous=False)
    assert all(d.ok for d in wait_done(engine, [10, 11, 12]).values())
    for layers in kv.layer_groups:
        for source_blocks, target_blocks in zip(sources, targets):
            for source, target in zip(source_blocks, target_blocks):
                for layer in layers:
                    assert torch.equal(page_bytes(paged, layer, target), originals[layer, source]), (name, layer)
    launches = sorted(lanes.graph_launches for lanes in engine.device._lanes.values())  # noqa: SLF001
    assert launches == [2, 2], f"graph launches per direction: {launches} (see the log)"
    engine.close()


@pytest.mark.parametrize("method", [CopyMethod.RUNS, CopyMethod.STAGED], ids=lambda m: m.value)
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_store_in_flight_when_the_next_step_zeroes_its_block(runner, method, device, shm_region):
    """Step s stores block 4 (the store stream is slow: held behind a long kernel). Step s+1 zeroes
    block 4 for a new request on the compute stream, V1 after flushing the stores on reused
    blocks (kvtier's fence, handle_preemptions), V2 before it (vLLM 0.32
    v1/worker/gpu/model_runner.py:1259-1270 before v1/worker/gpu/kv_connector.py:81)."""
    case, kv, engine, paged, host = attention_rig(device, shm_region, method=method)
    for view in kv.views:
        view[4].fill_(3.0)
    original = [page_bytes(paged, layer, 4) for layer in range(len(kv.views))]
    with torch.cuda.stream(engine._streams[Direction.STORE]):  # noqa: SLF001 - a slow store stream
        torch.cuda._sleep(LONG_KERNEL_CYCLES)
    engine.start_store(1, [PageCopy(0, 0, 4)])
    if runner == "v1":
        engine.wait([1])  # handle_preemptions: the fence, before the step rewrites anything
    for view in kv.views:  # the step's zeroing kernel, on the compute stream
        view[4].zero_()
    assert wait_done(engine, [1])[1].ok
    stored = [host.page(0, layer, 0)[: case.page_bytes].clone() for layer in range(len(kv.views))]
    if runner == "v1":
        assert all(torch.equal(s, o) for s, o in zip(stored, original)), "the fenced store lost the step's bytes"
    else:
        assert all(int(s.count_nonzero()) == 0 for s in stored), (
            "the store in flight did not copy the zeroed block: the V2 hazard kvtier voids did not show here")


@pytest.mark.parametrize("name", ["LBNHC-attention", "BLNHC-attention", "LBNHC-mamba-hybrid", "LBNHC-kernel-blocks"])
@pytest.mark.parametrize("kernel_blocks", [None, 3], ids=["block-per-page", "3-blocks"])
def test_jobs_of_other_sizes_replay_one_graph_bit_exact(name, kernel_blocks, device, shm_region):
    """Stores then loads of 4, 3, 4 and 3 whole blocks, one chunk each (chunks of 64 pages): one
    graph shape (kvtier.copy.jobgraph.graph_key), built by the second job of each direction and
    launched by it and the two after with their own sizes; the kernels, sized for the shape's
    largest chunk, stop at each job's page count. Every byte as the CPU engine moves it; no block
    outside a load's targets is written."""
    kv, groups, engine, paged, host, expected, cpu_copier = staged_rig(name, 14, 64, 2, device, shm_region,
                                                                       kernel_blocks)
    sources = [[3, 11, 1, 8], [9, 2, 10], [0, 4, 6, 7], [5, 3, 11]]
    firsts = [0, 4, 7, 11]  # disjoint slots
    stores = [[PageCopy(first + s, 0, b, g) for s, b in enumerate(blocks) for g in range(groups)]
              for first, blocks in zip(firsts, sources)]
    keys = {graph_key(engine._plan(Direction.STORE, store)[0]) for store in stores}  # noqa: SLF001
    assert len(keys) == 1 and None not in keys, keys
    for job_id, store in enumerate(stores):
        engine.start_store(job_id, store)
        cpu_copier.copy(Direction.STORE, store)
    assert all(d.ok for d in wait_done(engine, [0, 1, 2, 3]).values())
    assert torch.equal(host.buffer, expected)
    originals = {(layer, b): page_bytes(paged, layer, b) for layer in range(len(kv.views)) for b in range(NUM_BLOCKS)}
    for job_id, (first, blocks) in enumerate(zip(firsts, sources), start=10):
        targets = [(b + 5) % NUM_BLOCKS for b in blocks]
        kv.raw.zero_()
        engine.start_load(job_id, [PageCopy(first + s, 0, b, g) for s, b in enumerate(targets) for g in range(groups)],
                          synchronous=False)
        assert wait_done(engine, [job_id])[job_id].ok
        for layers in kv.layer_groups:
            for source, target in zip(blocks, targets):
                for layer in layers:
                    assert torch.equal(page_bytes(paged, layer, target), originals[layer, source]), (name, layer)
        untouched = set(range(NUM_BLOCKS)) - set(targets)
        assert all(not page_bytes(paged, layer, b).any() for b in untouched for layer in range(len(kv.views))), job_id
    launches = sorted(lanes.graph_launches for lanes in engine.device._lanes.values())  # noqa: SLF001
    assert launches == [3, 3], f"graph launches per direction: {launches} (see the log)"
    engine.close()


def sent(table, form: str):
    """``table`` as a test sends it: as is, or as kvtier's scheduler sends it (a SlotRun where
    the job is one host run)."""
    return (slot_run_of(table) or table) if form == "scheduler" else table


@pytest.mark.parametrize("name", ["LBNHC-attention", "BLNHC-attention", "LBNHC-kernel-blocks", "LBNHC-padded-attention"])
@pytest.mark.parametrize("kernel_blocks", [None, 3], ids=["block-per-page", "3-blocks"])
@pytest.mark.parametrize("form", ["table", "scheduler"])
def test_page_tables_repeat_a_graph_unplanned_bit_exact(name, kernel_blocks, form, device, shm_region):
    """Five stores, then five loads, of 4 whole blocks to 4 consecutive slots, each a page table,
    or as kvtier's scheduler sends it (``form``: a SlotRun where the job is one, slot_run_of): from
    the fourth on each goes as a repeat of the graph (CudaLanes.repeat: not planned, its numbers
    and host addresses written by the repeat itself). Every byte as the CPU engine moves it; no
    block outside a load's targets is written."""
    kv, groups, engine, paged, host, expected, cpu_copier = staged_rig(name, 12, 5, 2, device, shm_region,
                                                                       kernel_blocks)
    sources = [[3, 11, 1, 8], [9, 2, 10, 5], [0, 4, 6, 7], [5, 3, 11, 2], [8, 10, 9, 1]]
    firsts = [0, 4, 8, 2, 6]
    for job_id, (first, blocks) in enumerate(zip(firsts, sources)):
        store = [PageCopy(first + s, 0, b, g) for s, b in enumerate(blocks) for g in range(groups)]
        engine.start_store(job_id, sent(page_table(store), form))
        cpu_copier.copy(Direction.STORE, store)
        assert wait_done(engine, [job_id])[job_id].ok
        assert torch.equal(host.buffer, expected), (name, job_id)
    stored_repeats = engine.repeated
    for job_id, (first, blocks) in enumerate(zip(firsts, sources), start=10):
        targets = [(b + 5) % NUM_BLOCKS for b in blocks]
        kv.raw.zero_()
        engine.start_load(job_id, sent(page_table([PageCopy(first + s, 0, b, g) for s, b in enumerate(targets)
                                                   for g in range(groups)]), form), synchronous=False)
        assert wait_done(engine, [job_id])[job_id].ok
        for layers in kv.layer_groups:
            for s, target in enumerate(targets):
                for layer in layers:
                    slot_page = host.page(first + s, layer, 0).contiguous().reshape(-1).view(torch.uint8)
                    assert torch.equal(page_bytes(paged, layer, target), slot_page), (name, job_id, layer)
        untouched = set(range(NUM_BLOCKS)) - set(targets)
        assert all(not page_bytes(paged, layer, b).any() for b in untouched for layer in range(len(kv.views))), job_id
    assert stored_repeats == 2 and engine.repeated == 4, f"repeats: {stored_repeats} stores, {engine.repeated} in all"
    engine.close()
