"""kvtier's copies on the KV caches vLLM builds for GPUs, made by vLLM's own view code on CPU tensors
(tests/support/vllm_views.py): every layout vLLM 0.32 can resolve, kernel-split blocks, MLA, and a
Mamba hybrid (padded state pages overlaying the attention pages), copied to host slots and back,
bit-exact, through each of kvtier's copy paths:

- the CPU engine's page pairs (``BlockCopier.copy``);
- the CUDA engine's planning: byte runs (``RunPlanner``), carried out with torch on the same memory,
  whose address arrays (what ``cudaMemcpyBatchAsync`` reads on a GPU) point exactly where the
  views do;
- the CUDA engine itself on the simulated device, as runs and staging small pages through a device
  buffer (gather/scatter, where every page is a row of one allocation).

All three must leave the same bytes in the host slots: engines of one layout share blocks. And the
worker connector starts on them (start-up crashes of kvtier on GPUs: a Mamba hybrid under
LBNHC, "KV layers have different page shapes", and kernel blocks, "no dimension of size
num_blocks"; issue 32: attention pages vLLM pads, 2,048 -> 2,560 B, "engine KV page is 2048 B but
the KV cache spec says 2560 B", skip-quantized sliding-window pages padded to the shared page, a
3-head group beside a 2-head group padded to its size, and a mixed-type group whose layers keep
their own page sizes, "KV layers have different page shapes [(2048,), (3072,)]").
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from sim_device import SimDevice
from vllm.v1.kv_cache_layout import KVCacheLayout
from support.vllm_views import (
    LAYER_COMPACT,
    attention_spec,
    layer_views,
    mamba_spec,
    mixed_type_group,
    mla_spec,
    skip_quantized_window_spec,
    vllm_kv_caches,
)

from kvtier.copy import BlockCopier, Direction, HostSlots, PageCopy, PagedKV
from kvtier.copy.cuda import CudaCopyEngine
from kvtier.copy.pages import block_view
from kvtier.copy.runs import RunPlanner
from kvtier.copy.staging import CopyMethod
from kvtier.core.slots import HostSlotLayout

ATTENTION = ["model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn"]
MAMBA = ["model.layers.3.mixer", "model.layers.4.mixer"]
WINDOW = ["model.layers.5.attn", "model.layers.6.attn"]


def cases():
    out = {f"{layout.name}-attention": (layout, [(ATTENTION, attention_spec())], None) for layout in KVCacheLayout}
    for layout in LAYER_COMPACT:
        out[f"{layout.name}-mla"] = (layout, [(ATTENTION, mla_spec())], None)
        out[f"{layout.name}-kernel-blocks"] = (layout, [(ATTENTION, attention_spec())], 8)
        spec = attention_spec(head_size=32)
        out[f"{layout.name}-mamba-hybrid"] = (layout, [(ATTENTION[:2], spec), (MAMBA, mamba_spec(spec.page_size_bytes))],
                                              None)
        # Pages vLLM pads or sizes per layer (issue 32: each crashed the worker at start-up)
        out[f"{layout.name}-padded-attention"] = (layout, [(ATTENTION, attention_spec(padded_to=2560))], None)
        three_heads = attention_spec(kv_heads=3)
        out[f"{layout.name}-skip-quantized-window"] = (
            layout, [(ATTENTION, three_heads), (WINDOW, skip_quantized_window_spec(three_heads.page_size_bytes))], None)
        out[f"{layout.name}-padded-beside-larger"] = (
            layout, [(ATTENTION, three_heads), (WINDOW, attention_spec(padded_to=three_heads.page_size_bytes))], None)
        out[f"{layout.name}-mixed-type-group"] = (layout, [(ATTENTION, mixed_type_group(ATTENTION, [2, 3, 2]))], None)
    return out


PADDED_OR_MIXED = [name for name in cases() if name.split("-", 1)[1] in
                   ("padded-attention", "skip-quantized-window", "padded-beside-larger", "mixed-type-group")]


CASES = cases()


def build(name):
    layout, groups, kernel = CASES[name]
    return vllm_kv_caches(layout, groups, num_blocks=8, kernel_block_size=kernel)


def engine_pages(kv, paged):
    """Every (layer, block) page's bytes as vLLM's view shows them (padded state pages whole)."""
    views = layer_views(kv)
    out = {}
    for layer, view in enumerate(views):
        blocks = block_view(view, kv.num_blocks)
        for block in range(kv.num_blocks):
            out[layer, block] = blocks[block].contiguous().view(torch.uint8).reshape(-1).clone()
    return out


def jobs(kv):
    """Store: kvtier block s holds, per group, engine block ``sources[g][s]``; load them back into
    ``targets[g][s]``. Blocks 1..7 (0 is vLLM's null block), each owned by one group."""
    groups = len(kv.layer_groups)
    free = list(range(1, kv.num_blocks))
    per_group = len(free) // groups
    sources = [free[g * per_group:(g + 1) * per_group][:3] for g in range(groups)]
    targets = [list(reversed(ids)) for ids in sources]
    store = [PageCopy(s, 0, sources[g][s], g) for s in range(3) for g in range(groups)]
    load = [PageCopy(s, 0, targets[g][s], g) for s in range(3) for g in range(groups)]
    return store, load, sources, targets


def wipe(kv):
    for view in kv.views.values():
        torch.empty(0, dtype=torch.uint8).set_(view.untyped_storage()).zero_()


def run_pairs(paged, host, direction, pages):
    BlockCopier(paged, host).copy(direction, pages)


def run_byte_runs(paged, host, direction, pages):
    if not paged.flat:  # heads outside blocks: the CUDA engine copies page pairs there too
        return run_pairs(paged, host, direction, pages)
    plan = RunPlanner(paged, host).plan(direction, pages)
    dsts, srcs = plan.views()
    assert [d.data_ptr() for d in dsts] == plan.dst_addr.tolist()  # the arrays a batched copy call reads
    assert [s.data_ptr() for s in srcs] == plan.src_addr.tolist()
    torch._foreach_copy_(dsts, srcs)


def run_cuda_engine(paged, host, direction, pages, method=CopyMethod.RUNS):
    device = SimDevice()
    engine = CudaCopyEngine(BlockCopier(paged, host), device, method)
    (engine.start_store if direction is Direction.STORE else engine.start_load)(1, pages)
    device.run_all()
    [done] = engine.poll()
    assert done.ok and done.num_bytes == sum(paged.layer_bytes[i] for p in pages for i in paged.layer_groups[p.group])


def worker_paged(kv):
    """The engine pages as the worker reads them: vLLM's views with vLLM's per-layer page sizes."""
    return PagedKV([kv.views[name] for name in kv.layer_names], kv.num_blocks, kv.layer_groups, kv.layer_page_bytes)


PATHS = {"page pairs (CPU engine)": run_pairs, "byte runs (CUDA planning)": run_byte_runs,
         "CUDA engine, simulated device": run_cuda_engine,
         "CUDA engine staging small pages, simulated device": partial(run_cuda_engine, method=CopyMethod.STAGED)}


@pytest.mark.parametrize("case", CASES)
def test_pages_round_trip_bit_exact_on_every_copy_path(case):
    host_bytes = {}
    for path, run in PATHS.items():
        kv = build(case)
        paged = worker_paged(kv)
        assert paged.page_bytes == kv.page_bytes
        layout = HostSlotLayout(paged.num_layers, 1, paged.page_bytes, 1, 4)
        host = HostSlots(torch.zeros(layout.region_bytes, dtype=torch.uint8), layout)
        before = engine_pages(kv, paged)
        store, load, sources, targets = jobs(kv)
        run(paged, host, Direction.STORE, store)
        host_bytes[path] = host.buffer.clone()
        wipe(kv)
        run(paged, host, Direction.LOAD, load)
        after = engine_pages(kv, paged)
        for g, layers in enumerate(kv.layer_groups):
            for source, target in zip(sources[g], targets[g]):
                for layer in layers:
                    assert torch.equal(after[layer, target], before[layer, source]), (path, layer, source)
    first = next(iter(host_bytes.values()))
    assert all(torch.equal(first, other) for other in host_bytes.values()), "copy paths disagree on slot bytes"


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC])
def test_gpu_pages_are_dense_rows(layout):
    """Under the block-compact layouts a page is one run of memory: no page-by-page strided copy."""
    kv = vllm_kv_caches(layout, [(ATTENTION, attention_spec())])
    paged = PagedKV(layer_views(kv), kv.num_blocks)
    assert paged.flat and paged.rows is not None


def test_layouts_with_heads_outside_blocks_are_copied_as_strided_pages():
    kv = vllm_kv_caches(KVCacheLayout.LHBNC, [(ATTENTION, attention_spec())])
    assert not PagedKV(layer_views(kv), kv.num_blocks).flat


def worker_config(model_dir, kv):
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig

    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=4096, dtype="float16", seed=0)
    transfer = KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier.vllm",
                                kv_role="kv_both", engine_id=f"layouts-{id(kv)}",
                                kv_connector_extra_config={"cpu_bytes_to_use": 64 * kv.page_bytes * len(kv.views)})
    config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=16), kv_transfer_config=transfer,
                        device_config=DeviceConfig("cpu"), parallel_config=ParallelConfig())
    config.kv_transfer_config.kv_load_failure_policy = "recompute"
    return config


@pytest.mark.parametrize("case", ["LBNHC-mamba-hybrid", "LBNHC-kernel-blocks", *PADDED_OR_MIXED])
def test_the_worker_connector_starts_on_gpu_kv_caches_and_moves_pages(case, tmp_path):
    """The worker half as vLLM's GPU runner builds it (``register_kv_caches`` with the manager-block
    views, vLLM 0.32 ``v1/worker/gpu/model_runner.py:796-798``): it starts, and its copy engine
    moves a page of every layer to the host region and back."""
    from support.engine_sim import write_model
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.vllm.connector import KVTierConnector

    kv = build(case)
    connector = KVTierConnector(worker_config(write_model(tmp_path / "model", seed=1), kv), KVConnectorRole.WORKER,
                                kv.config)
    try:
        connector.register_kv_caches(kv.views)
        worker = connector._worker  # noqa: SLF001
        assert worker is not None and worker.copies is not None
        paged = worker_paged(kv)
        before = engine_pages(kv, paged)
        store, load, sources, targets = jobs(kv)
        worker.copies.start_store(1, store)
        worker.copies.wait()
        wipe(kv)
        worker.copies.start_load(2, load)
        assert {d.job_id for d in worker.copies.poll()} == {1, 2}
        after = engine_pages(kv, paged)
        for g, layers in enumerate(kv.layer_groups):
            for layer in layers:
                assert all(torch.equal(after[layer, t], before[layer, s]) for s, t in zip(sources[g], targets[g]))
    finally:
        connector.shutdown()


def vllm_case(case):
    """vLLM's own views for one of the GPU kit's cases (tests/gpu/gpu_layouts.py)."""
    layout = KVCacheLayout[case.layout]
    if case.state_layers:
        spec = attention_spec(head_size=case.content // 2)
        return vllm_kv_caches(layout, [(ATTENTION[:case.layers], spec),
                                       (MAMBA[:case.state_layers], mamba_spec(spec.page_size_bytes))])
    if case.padded_to:
        return vllm_kv_caches(layout, [(ATTENTION[:case.layers], attention_spec(padded_to=case.padded_to))])
    if case.heads == 1:
        return vllm_kv_caches(layout, [(ATTENTION[:case.layers], mla_spec())])
    spec = attention_spec(dtype=case.dtype, kv_heads=case.heads, head_size=case.content // 2)
    return vllm_kv_caches(layout, [(ATTENTION[:case.layers], spec)], kernel_block_size=case.kernel_tokens)


@pytest.mark.parametrize("name", list(__import__("gpu.gpu_layouts").gpu_layouts.CASES))
def test_the_gpu_kit_builds_the_views_vllm_builds(name):
    """The GPU machine has no vLLM: its kit lays KV out itself. Same views as vLLM's, or the kit
    would test pages no vLLM worker hands kvtier."""
    from gpu.gpu_layouts import CASES as KIT_CASES
    from gpu.gpu_layouts import build as kit_build

    case = KIT_CASES[name]
    kv = vllm_case(case)
    kit = kit_build(case, kv.num_blocks, "cpu")
    ours = [(tuple(v.shape), v.stride(), v.storage_offset(), v.dtype) for v in kit.views]
    theirs = [(tuple(v.shape), v.stride(), v.storage_offset(), v.dtype) for v in (kv.views[n] for n in kv.layer_names)]
    assert ours == theirs
    assert kit.raw.untyped_storage().nbytes() == kv.config.kv_cache_tensors[0].size
    assert kit.layer_groups == kv.layer_groups
    assert kit.page_bytes == kv.layer_page_bytes


def test_the_page_description_names_the_memory_order_only_where_it_is_not_row_major():
    """Slots hold dense pages in memory order: an LBNHC engine's bytes must never be read by an LBHNC
    one, so its description (folded into the namespace) says so; vLLM-CPU's LBHNC description, and
    with it every namespace already on disk, stays as it was."""
    from kvtier.vllm.page_format import describe_pages

    def describe(layout):
        kv = vllm_kv_caches(layout, [(ATTENTION, attention_spec())])
        return describe_pages(kv.views, ATTENTION, kv.num_blocks, {}, layout.name)

    lbhnc, lbnhc = describe(KVCacheLayout.LBHNC), describe(KVCacheLayout.LBNHC)
    assert "physical_orders" not in lbhnc
    assert lbnhc["physical_orders"] == [[1, 0, 2]] * len(ATTENTION)  # tokens, heads, content
    assert lbhnc["layers"] == lbnhc["layers"]  # same shapes: only the order tells them apart
