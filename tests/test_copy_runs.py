"""The CUDA engine's copy planning (kvtier.copy.runs) on vLLM's own KV views (CPU tensors): a job is
one batched copy of byte runs, neighbours contiguous on both sides merged, in host order, never
across a host pinning chunk, address arrays pointing where the views do; bad pages refused before
anything is issued. Staged copies: tests/test_staged_copies.py."""

from __future__ import annotations

import pytest
import torch
from sim_device import SimDevice
from support.vllm_views import attention_spec, layer_views, vllm_kv_caches
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvtier.copy import BlockCopier, Direction, HostSlots, PageCopy, PagedKV, page_table
from kvtier.copy.cuda import CudaCopyEngine
from kvtier.copy.runs import RunPlanner
from kvtier.copy.staging import CopyMethod, StagedPlanner
from kvtier.core.slots import HostSlotLayout

LAYERS = [f"model.layers.{i}.attn" for i in range(4)]


def planner(layout, pages_per_block=1, num_slots=6, num_blocks=12):
    kv = vllm_kv_caches(layout, [(LAYERS, attention_spec())], num_blocks=num_blocks)
    paged = PagedKV(layer_views(kv), kv.num_blocks)
    slots = HostSlotLayout(len(LAYERS), pages_per_block, paged.page_bytes, 1, num_slots)
    host = HostSlots(torch.zeros(slots.region_bytes, dtype=torch.uint8), slots)
    return RunPlanner(paged, host), paged, host


def carry_out(plan):
    dsts, srcs = plan.views()
    torch._foreach_copy_(dsts, srcs)


def reference_store(paged, host, pages):
    expected = torch.zeros_like(host.buffer)
    BlockCopier(paged, HostSlots(expected, host.layout)).copy(Direction.STORE, pages)
    return expected


def test_layer_outermost_layouts_merge_the_engine_blocks_of_one_kvtier_block():
    """LBNHC, a kvtier block of 2 engine blocks: the two pages of a layer are neighbours in the
    engine (consecutive blocks) and in the slot (consecutive pages): one run per layer and block."""
    runs, paged, host = planner(KVCacheLayout.LBNHC, pages_per_block=2)
    pages = [PageCopy(slot, sub, 1 + 2 * slot + sub) for slot in (0, 1, 2) for sub in (0, 1)]
    plan = runs.plan(Direction.STORE, pages)
    assert plan.num_pages == 6 * 4 and plan.num_runs == 3 * 4
    assert set(plan.sizes.tolist()) == {2 * paged.page_bytes} and plan.num_bytes == 24 * paged.page_bytes
    carry_out(plan)
    assert torch.equal(host.buffer, reference_store(paged, host, pages))


def test_a_job_with_part_of_a_block_and_pages_out_of_order_lands_right():
    """A tail (only the first page of its slot) and pages listed in no particular order."""
    runs, paged, host = planner(KVCacheLayout.LBNHC, pages_per_block=2)
    pages = [PageCopy(2, 0, 9), PageCopy(0, 1, 2), PageCopy(1, 0, 5), PageCopy(0, 0, 1)]
    plan = runs.plan(Direction.STORE, pages)
    assert plan.num_pages == 16 and plan.num_runs == 3 * 4  # slot 0's two pages merge, per layer
    carry_out(plan)
    assert torch.equal(host.buffer, reference_store(paged, host, pages))


def test_block_outermost_layouts_merge_whole_blocks_and_consecutive_blocks():
    """BLHNC: a block is every layer's page in a row, as a host slot is: consecutive blocks into
    consecutive slots are one run; a block landing elsewhere starts another."""
    runs, paged, host = planner(KVCacheLayout.BLHNC)
    pages = [PageCopy(0, 0, 3), PageCopy(1, 0, 4), PageCopy(2, 0, 5), PageCopy(4, 0, 9)]
    plan = runs.plan(Direction.STORE, pages)
    assert plan.num_pages == 16 and plan.num_runs == 2
    assert plan.sizes.tolist() == [3 * 4 * paged.page_bytes, 4 * paged.page_bytes]
    carry_out(plan)
    assert torch.equal(host.buffer, reference_store(paged, host, pages))


def test_runs_follow_host_order_whatever_the_job_order():
    runs, paged, host = planner(KVCacheLayout.BLHNC)
    pages = [PageCopy(2, 0, 5), PageCopy(0, 0, 3), PageCopy(1, 0, 4)]
    plan = runs.plan(Direction.LOAD, pages)
    assert plan.num_runs == 1 and plan.dst_addr[0] == paged.rows[0][3].data_ptr()


def test_a_run_never_crosses_a_host_pinning_chunk():
    runs, paged, host = planner(KVCacheLayout.BLHNC)
    runs.segment_bytes = 2 * host.layout.slot_bytes  # chunks of two slots
    pages = [PageCopy(s, 0, 1 + s) for s in range(5)]
    plan = runs.plan(Direction.STORE, pages)
    assert plan.num_runs == 3 and all(n <= runs.segment_bytes for n in plan.sizes.tolist())
    assert all(offset % runs.segment_bytes == 0 for offset in plan.dst_offset.tolist())


@pytest.mark.parametrize("bad", [PageCopy(6, 0, 1), PageCopy(-1, 0, 1), PageCopy(0, 1, 1), PageCopy(0, 0, 12),
                                 PageCopy(0, 0, 1, group=1)])
def test_pages_out_of_range_are_refused(bad):
    runs, _, _ = planner(KVCacheLayout.LBNHC)
    for job in ([PageCopy(1, 0, 2), bad], page_table([PageCopy(1, 0, 2), bad])):  # tuples, or the scheduler's table
        with pytest.raises(IndexError, match="out of range") as refused:
            runs.plan(Direction.STORE, job)
        assert str(bad) in str(refused.value)  # the first page out of range is named
    # a table longer than the bounds were first tiled for (1,024 rows; 100k-token prompts are more)
    long = page_table([PageCopy(1, 0, 2)] * 3000 + [bad])
    with pytest.raises(IndexError, match="out of range"):
        runs.table(long)


def test_an_empty_job_plans_nothing():
    runs, _, _ = planner(KVCacheLayout.LBNHC)
    plan = runs.plan(Direction.LOAD, [])
    assert plan.num_runs == 0 and plan.num_bytes == 0


def test_the_cuda_engine_issues_one_batched_copy_per_job():
    """Not one copy per (layer, page): one call, the job's merged runs, on the job's side stream."""
    _, paged, host = planner(KVCacheLayout.BLHNC)
    device = SimDevice()
    engine = CudaCopyEngine(BlockCopier(paged, host), device, CopyMethod.RUNS)
    engine.start_store(1, [PageCopy(s, 0, 2 + s) for s in range(4)])
    engine.start_load(2, [PageCopy(s, 0, 7 + s) for s in range(4)])
    assert [runs for _, runs in device.copy_calls] == [1, 1]
    assert [plan.num_pages for plan in device.plans] == [16, 16]
    device.run_all()
    assert sorted(d.job_id for d in engine.poll()) == [1, 2]


def test_pages_that_are_not_rows_of_one_storage_are_never_staged():
    from test_transfer import cpu_layers

    layers = cpu_layers()  # one tensor (storage) per layer
    paged = PagedKV(layers, 9)
    layout = HostSlotLayout(len(layers), 1, paged.page_bytes, 1, 4)
    engine = CudaCopyEngine(BlockCopier(paged, HostSlots(torch.zeros(layout.region_bytes, dtype=torch.uint8), layout)),
                            SimDevice(), CopyMethod.STAGED)
    assert engine.staged is None and not StagedPlanner.fits(paged)
