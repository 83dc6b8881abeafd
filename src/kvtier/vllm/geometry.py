"""Derive kvtier's slot layout from vLLM's config, identically in every process.

The scheduler and each worker build :class:`EngineGeometry` from the same ``vllm_config`` and
``kv_cache_config``, so they agree on slot sizes without talking to each other. The namespace
(what blocks may be shared with) is the scheduler's alone: it adds the model identity
(:mod:`kvtier.vllm.identity`) and what every worker reports of its pages
(:mod:`kvtier.vllm.page_format`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from vllm.config import ParallelConfig, VllmConfig
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    MLAAttentionSpec,
    UniformTypeKVCacheSpecs,
    get_kv_cache_spec_kind,
)

from kvtier.core.config import ConfigError, KVTierConfig
from kvtier.core.slots import HostSlotLayout


def model_name(vllm_config: VllmConfig) -> str:
    """The display name of the served model (the last part of a path or repo id)."""
    model = vllm_config.model_config.served_model_name or vllm_config.model_config.model
    if isinstance(model, list | tuple):
        model = model[0]
    return os.path.basename(str(model).rstrip("/")) or "model"


@dataclass(frozen=True)
class EngineGeometry:
    model_name: str
    layer_names: tuple[str, ...]
    engine_block_tokens: int
    block_tokens: int  # kvtier block = pages_per_block engine blocks
    layout: HostSlotLayout
    tp_size: int
    pp_size: int
    engine_id: str
    attention: str  # vLLM's name of the attention kind ("full_attention", "mla", ...)
    kv_dtype: str  # as stored in the pages ("float32", "fp8_e4m3", ...)
    num_kv_heads: int  # per rank
    head_size: int
    kv_scales: str = ""  # "" or "checkpoint" (quantized KV: scales from the weights)
    replicated: bool = False  # every rank holds the same KV bytes: one copy stored (rank 0's)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def stored_ranks(self) -> int:
        """How many ranks' pages a block stores: every rank's, or rank 0's alone when the KV is
        replicated. The host tier has one region per stored rank; a block is that many records."""
        return 1 if self.replicated else self.world_size

    @property
    def pages_per_block(self) -> int:
        return self.block_tokens // self.engine_block_tokens

    @property
    def kv_cache_spec_kind(self) -> str:
        return self.attention

    @classmethod
    def from_vllm(
        cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: KVTierConfig
    ) -> "EngineGeometry":
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ConfigError(
                f"kvtier supports models with one KV cache group; this model has {len(groups)} "
                "(hybrid attention). Run it without kvtier for now."
            )
        group = groups[0]
        spec = group.kv_cache_spec
        spec_kind = get_kv_cache_spec_kind(spec).value
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = next(iter(spec.kv_cache_specs.values()))
        if not isinstance(spec, AttentionSpec):
            raise ConfigError(f"kvtier cannot offload KV cache spec {type(spec).__name__}")
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ConfigError("kvtier does not support pipeline parallelism yet (pipeline_parallel_size must be 1)")
        engine_block_tokens = spec.block_size
        block_tokens = config.offload_block_tokens(engine_block_tokens)
        pages_per_block = block_tokens // engine_block_tokens
        replicated = replicated_kv(spec, parallel)
        cache_dtype = vllm_config.cache_config.cache_dtype
        kv_dtype = str(spec.dtype).removeprefix("torch.") if cache_dtype == "auto" else str(cache_dtype)
        try:
            layout = HostSlotLayout.for_budget(
                config.cpu_bytes_to_use,
                num_layers=len(group.layer_names),
                pages_per_block=pages_per_block,
                page_bytes=spec.page_size_bytes,
                world_size=1 if replicated else parallel.world_size,  # = stored_ranks
            )
        except ValueError as exc:
            raise ConfigError(f"kv_connector_extra_config: {exc}") from None
        engine_id = vllm_config.kv_transfer_config.engine_id if vllm_config.kv_transfer_config else None
        return cls(
            model_name=model_name(vllm_config),
            layer_names=tuple(group.layer_names),
            engine_block_tokens=engine_block_tokens,
            block_tokens=block_tokens,
            layout=layout,
            tp_size=parallel.tensor_parallel_size,
            pp_size=parallel.pipeline_parallel_size,
            engine_id=str(engine_id or "default"),
            attention=spec_kind,
            kv_dtype=kv_dtype,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            kv_scales="checkpoint" if kv_dtype.startswith("fp8") else "",
            replicated=replicated,
        )


def replicated_kv(spec: AttentionSpec, parallel: ParallelConfig) -> bool:
    """Whether every rank holds the same KV bytes: MLA under tensor parallelism. vLLM gives each
    rank the whole latent (one per token, no heads to split) computed from the same all-reduced
    hidden states. Not with decode or prefill context parallelism, which split the tokens over
    ranks, and not at world size 1 (nothing to share)."""
    splits_tokens = parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1
    return isinstance(spec, MLAAttentionSpec) and parallel.world_size > 1 and not splits_tokens
