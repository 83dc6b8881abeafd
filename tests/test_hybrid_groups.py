"""Several KV cache groups (vLLM's hybrid allocator): full attention + sliding window, in the engine sim.

The sim's hybrid model (``SimEngine(sliding_window=W)``) has layer 0 in a full-attention group and
layer 1 in a sliding-window group with its own block table; vLLM frees a running request's
sliding blocks below the window and hands them to other requests. The fake model reads, checks
and samples from every full-attention position and the sliding layer's last W positions, so a
wrong page in either group changes the outputs or shows as a KV mismatch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.engine_sim import (
    SimEngine,
    by_prompt,
    counting,
    cpu_and_gpu_defaults,
    external,
    prompts_of,
    reference_outputs,
    renamed,
    tokens_of,
    write_model,
)

from support.late_stores import run_with_late_stores

from kvtier.copy import Direction, page_list
from kvtier.core.config import ConfigError

HOST = {"cpu_bytes_to_use": 2 * 2**20}
WINDOW = 32  # two 16-token engine blocks: most of a 100-token prompt's sliding blocks are freed


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "model", seed=7)


def worker_copies(sim: SimEngine):
    return sim.worker._worker.copies  # noqa: SLF001


def record_loads(sim: SimEngine) -> list:
    """Every page the worker loads from now on (PageCopy objects, in order)."""
    copies = worker_copies(sim)
    loaded: list = []
    real = copies.start_load

    def start_load(job_id, pages, **kwargs):
        assert kwargs == {"synchronous": False}  # asynchronous: no compute-stream wait on CUDA
        loaded.extend(page_list(pages))
        real(job_id, pages, **kwargs)

    copies.start_load = start_load
    return loaded


@cpu_and_gpu_defaults
def test_round_two_loads_every_full_page_and_only_the_window_of_sliding_pages(model, mode):
    prompts = prompts_of(1, 4, 100, shared_prefix=40)
    ref = reference_outputs(model, prompts, 4, sliding_window=WINDOW)
    assert ref != reference_outputs(model, prompts, 4), "the sliding layer must change the outputs"
    with SimEngine(model, kvtier=HOST, sliding_window=WINDOW, **mode) as sim:
        geometry = sim.kvtier_scheduler.geometry
        assert geometry.num_groups == 2
        assert geometry.attention == "full_attention+sliding_window"
        assert tokens_of(sim.generate(prompts, 4)) == ref
        assert sim.reset_prefix_cache()
        loaded = record_loads(sim)
        second = sim.generate(renamed(prompts, "-2"), 4)
        assert by_prompt(second, "-2") == ref
        assert external(second) == [96] * 4  # 6 full blocks of each 100-token prompt
        assert sim.model.kv_mismatches == []
        full = [p for p in loaded if p.group == 0]
        sliding = [p for p in loaded if p.group == 1]
        assert len(full) == 4 * 6
        # vLLM allocates the sliding group's blocks of the last W-1 tokens before token 96 only
        assert len(sliding) == 4 * 2
        assert all(p.block_id != 0 for p in loaded)


def test_negative_control_skipping_the_sliding_pages_is_caught(model):
    """A load that fills the full-attention group but not the sliding one changes the outputs."""
    prompts = prompts_of(2, 3, 100)
    ref = reference_outputs(model, prompts, 4, sliding_window=WINDOW)
    with SimEngine(model, kvtier=HOST, sliding_window=WINDOW) as sim:
        sim.generate(prompts, 4)
        assert sim.reset_prefix_cache()
        copies = worker_copies(sim)
        real = copies.start_load
        copies.start_load = lambda job_id, pages, **kwargs: real(job_id, [p for p in page_list(pages) if p.group == 0],
                                                                  **kwargs)
        second = sim.generate(renamed(prompts, "-2"), 4)
        assert by_prompt(second, "-2") != ref
        assert sim.model.kv_mismatches


@cpu_and_gpu_defaults
def test_a_block_freed_below_the_window_waits_for_its_store_before_reuse(model, mode):
    result = run_with_late_stores(model, fence=True, **mode)
    assert result.wrong == 0 and result.mismatches == []
    assert result.flushed  # sliding blocks were handed out again while their stores were in flight


@cpu_and_gpu_defaults
def test_negative_control_without_the_fence_reused_blocks_are_stored_wrong(model, mode):
    result = run_with_late_stores(model, fence=False, **mode)
    assert result.wrong and result.mismatches
    assert not result.flushed


@cpu_and_gpu_defaults
def test_a_failed_load_with_several_groups_is_recomputed_per_request(model, mode):
    """vLLM refuses per-block failure reports with several groups: kvtier reports the request
    (failed_recving of an asynchronous load) and vLLM computes it from scratch."""
    prompts = prompts_of(4, 3, 100)
    ref = reference_outputs(model, prompts, 4, sliding_window=WINDOW)
    with SimEngine(model, kvtier=HOST, sliding_window=WINDOW, **mode) as sim:
        sim.generate(prompts, 4)
        assert sim.reset_prefix_cache()
        copier = worker_copies(sim).copier
        real = type(copier).copy.__get__(copier)
        failed: list[int] = []

        def failing(direction, pages):
            if direction is Direction.LOAD:
                failed.append(len(pages))
                raise RuntimeError("injected load failure")
            return real(direction, pages)

        copier.copy = failing
        counted = counting(sim.kvtier_scheduler.orchestrator)
        second = sim.generate(renamed(prompts, "-2"), 4)
        assert by_prompt(second, "-2") == ref
        assert sim.model.kv_mismatches == []
        assert len(failed) == 3  # one load per request, not retried (its blocks are computed instead)
        assert counted.add(sim.kvtier_scheduler.orchestrator.stats).load_errors == 3


def test_a_fresh_hybrid_engine_is_served_from_disk(model, tmp_path):
    prompts = prompts_of(5, 3, 100)
    ref = reference_outputs(model, prompts, 4, sliding_window=WINDOW)
    tiers = {**HOST, "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "kv"), "capacity_bytes": 2**30}]}
    with SimEngine(model, kvtier=tiers, sliding_window=WINDOW) as sim:
        assert tokens_of(sim.generate(prompts, 4)) == ref
    with SimEngine(model, kvtier=tiers, sliding_window=WINDOW) as sim:
        results = sim.generate(renamed(prompts, "-r"), 4)
        assert by_prompt(results, "-r") == ref
        assert external(results) == [96] * 3
        assert sim.model.kv_mismatches == []


def test_hybrid_and_single_group_engines_never_share_blocks(model, tmp_path):
    """The same model with the hybrid allocator off lays a slot's layers out in one group: another
    namespace (a miss), never a block read under another layout."""
    prompts = prompts_of(6, 2, 100)
    tiers = {**HOST, "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "kv"), "capacity_bytes": 2**30}]}
    with SimEngine(model, kvtier=tiers, sliding_window=WINDOW) as sim:
        sim.generate(prompts, 4)
    with SimEngine(model, kvtier=tiers) as sim:
        assert external(sim.generate(renamed(prompts, "-1"), 4)) == [0, 0]


def test_a_block_size_the_window_cannot_hold_is_refused_at_start(model):
    """A 64-token kvtier block over 16-token engine blocks: its first page is computed 48 tokens
    before the block completes, so a window of 48 could free it before the store."""
    with pytest.raises(ConfigError, match="at most 63"):
        SimEngine(model, kvtier={**HOST, "block_size": 64}, sliding_window=48)
    prompts = prompts_of(7, 2, 150)
    ref = reference_outputs(model, prompts, 4, sliding_window=49)
    with SimEngine(model, kvtier={**HOST, "block_size": 64}, sliding_window=49) as sim:
        assert tokens_of(sim.generate(prompts, 4)) == ref
        assert sim.reset_prefix_cache()
        second = sim.generate(renamed(prompts, "-2"), 4)
        assert by_prompt(second, "-2") == ref and external(second) == [128, 128]
        assert sim.model.kv_mismatches == []


def test_which_groups_kvtier_offloads_and_which_make_it_inactive(model):
    """Attention groups (full, sliding window, chunked local, MLA) and Mamba state in vLLM's "align"
    mode, alone or together: offloaded. Mamba state in another mode or with speculative blocks:
    inactive. Groups vLLM does not cache for reuse or frees under rules of its own (R-SWA,
    circular buffers): inactive, named in the message."""
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        RSWASpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    from kvtier.vllm.inactive import InactiveReason, inactive_reason

    with SimEngine(model, kvtier=None) as sim:
        vllm_config = sim.vllm_config

    def config(*groups):
        specs = []
        for i, group in enumerate(groups):
            if isinstance(group, tuple):  # several layers of one type in one group
                group = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={f"l{i}.{j}": s for j, s in enumerate(group)})
            specs.append(KVCacheGroupSpec([f"l{i}"], group))
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=specs)

    shape = {"block_size": 16, "num_kv_heads": 1, "head_size": 4, "dtype": torch.float32}
    full, promoted = FullAttentionSpec(**shape), FullAttentionSpec(**shape, sliding_window=64)
    sliding = SlidingWindowSpec(**shape, sliding_window=64)
    local = ChunkedLocalAttentionSpec(**shape, attention_chunk_size=64)
    aligned = MambaSpec(block_size=16, shapes=((4, 4),), dtypes=(torch.float32,), mamba_cache_mode="align")
    for offloaded in [(full,), (sliding,), (full, sliding), (full, sliding, sliding), (local, full),
                      ((promoted, full),), (aligned, full)]:
        assert inactive_reason(vllm_config, config(*offloaded)) is None, offloaded
    for state in (MambaSpec(block_size=16, shapes=((4, 4),), dtypes=(torch.float32,)),  # mode "none"
                  MambaSpec(block_size=16, shapes=((4, 4),), dtypes=(torch.float32,), mamba_cache_mode="align",
                            num_speculative_blocks=1)):
        assert inactive_reason(vllm_config, config(full, state)) is InactiveReason.STATE_GROUP
    rswa = config(RSWASpec(**shape, rswa_window=64))
    assert inactive_reason(vllm_config, rswa) is InactiveReason.UNSUPPORTED_GROUP
    message = InactiveReason.UNSUPPORTED_GROUP.message("m", rswa)
    assert message.startswith("kvtier is INACTIVE for m:") and "(RSWASpec)" in message
    assert "Mamba" in InactiveReason.STATE_GROUP.message("m", config(full, state))
