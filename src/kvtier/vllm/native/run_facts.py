"""What a native tier reads of its run from vLLM: ``offloading_spec.config`` and the platform.

:func:`engine_run` restates vLLM's ``OffloadingConfig`` (0.32 and 0.33: 0.33 adds each group's
sliding window in chunks and the model's ``max_model_len``) as a vLLM-free
:class:`~kvtier.runtime.chunks.run.EngineRun`. Runs in the scheduler process, in the tier's
constructor; reads the model's ``config.json`` (KV heads and head size, for operators' displays).
The attention backend is not among the facts: vLLM picks it in its workers and tells a tier nothing
of it (see :mod:`kvtier.runtime.chunks.run`); ROCm's shuffled page layout is
(:mod:`kvtier.vllm.rocm_layout`).
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import OffloadingSpec

from kvtier.runtime.chunks.run import EngineRun, GroupFacts
from kvtier.vllm.rocm_layout import rocm_shuffled_kv_cache


def _heads(model: str, tp_size: int) -> tuple[int, int]:
    """KV heads per rank and head size from the model folder's config.json; (0, 0) if unknown."""
    try:
        config = json.loads((Path(model).expanduser() / "config.json").read_text())
        config = config.get("text_config", config)
        heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
        head_size = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return 0, 0
    return max(1, heads // max(1, tp_size)), head_size


def engine_run(spec: OffloadingSpec) -> EngineRun:
    """The run's chunk bytes as ``spec`` (vLLM's offloading spec) states them."""
    config = spec.config
    parallel = config.parallel
    heads, head_size = _heads(config.model.name, parallel.tp_size)
    return EngineRun(
        model_name=config.model.name,
        kv_dtype=config.model.dtype,
        groups=tuple(
            GroupFacts(group.group_id, group.tokens_per_block, tuple(group.layer_names),
                       getattr(group, "sliding_window_size_in_chunks", None))
            for group in config.groups
        ),
        tokens_per_hash=config.cache.tokens_per_hash,
        blocks_per_chunk=config.cache.blocks_per_chunk,
        worker_kv_bytes_per_block=config.worker_kv_bytes_per_block,
        world_size=parallel.world_size,
        tp_size=parallel.tp_size,
        pp_size=parallel.pp_size,
        pcp_size=parallel.pcp_size,
        dcp_size=parallel.dcp_size,
        # the CPU spec decides whether replicated KV is stored once (it needs the shared region)
        replicated=bool(getattr(spec, "replicated_layout", config.replicated_layout)),
        canonical_layout=config.canonical_layout,
        kv_cache_layout=config.kv_cache_layout,
        device=str(current_platform.device_type),
        rocm_shuffled_kv=rocm_shuffled_kv_cache(),
        num_kv_heads=heads,
        head_size=head_size,
    )
