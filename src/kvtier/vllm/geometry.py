"""Derive kvtier's namespace and host layout from vLLM's config, identically in every process.

The scheduler and each worker build :class:`EngineGeometry` from the same ``vllm_config`` and
``kv_cache_config``, so they agree on slot sizes and keys without talking to each other.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import blake3
from vllm.config import VllmConfig
from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    MLAAttentionSpec,
    UniformTypeKVCacheSpecs,
    get_kv_cache_spec_kind,
)

from kvtier.core.config import ConfigError, KVTierConfig
from kvtier.core.keys import Namespace
from kvtier.core.slots import HostSlotLayout

# hf config fields that do not change KV bytes but differ between copies of one model
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation")


def model_digest(vllm_config: VllmConfig) -> str:
    """Digest of the model's config (minus volatile fields) and revision: the model identity."""
    model_config = vllm_config.model_config
    hf = model_config.hf_config.to_dict()
    for key in list(hf):
        if key.startswith(_VOLATILE_CONFIG_KEYS):
            del hf[key]
    payload = json.dumps({"config": hf, "revision": model_config.revision}, sort_keys=True, default=str)
    return blake3.blake3(payload.encode()).hexdigest()[:32]


def model_name(vllm_config: VllmConfig) -> str:
    model = vllm_config.model_config.served_model_name or vllm_config.model_config.model
    if isinstance(model, list | tuple):
        model = model[0]
    return os.path.basename(str(model).rstrip("/")) or "model"


@dataclass(frozen=True)
class EngineGeometry:
    namespace: Namespace  # rank-independent (rank fields 0); use namespace.for_rank(r) per rank
    layer_names: tuple[str, ...]
    engine_block_tokens: int
    block_tokens: int  # kvtier block = pages_per_block engine blocks
    layout: HostSlotLayout
    world_size: int
    engine_id: str
    kv_cache_spec_kind: str | None = None  # vLLM's name of the attention kind, for KV events

    @property
    def pages_per_block(self) -> int:
        return self.block_tokens // self.engine_block_tokens

    def rank_digests(self) -> list[bytes]:
        return [self.namespace.for_rank(rank).digest for rank in range(self.world_size)]

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
        world_size = parallel.world_size
        engine_block_tokens = spec.block_size
        block_tokens = config.offload_block_tokens(engine_block_tokens)
        pages_per_block = block_tokens // engine_block_tokens
        dtype = str(spec.dtype).removeprefix("torch.")
        attention_kind = "mla" if isinstance(spec, MLAAttentionSpec) else "mha"
        namespace = Namespace(
            model_name=model_name(vllm_config),
            model_digest=model_digest(vllm_config),
            kv_dtype=dtype if vllm_config.cache_config.cache_dtype == "auto" else vllm_config.cache_config.cache_dtype,
            num_layers=len(group.layer_names),
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            attention_kind=attention_kind,
            block_tokens=block_tokens,
            page_format=f"{current_platform.device_type}:{vllm_config.cache_config.kv_cache_layout or 'default'}",
            tp_size=parallel.tensor_parallel_size,
            pp_size=parallel.pipeline_parallel_size,
        )
        try:
            layout = HostSlotLayout.for_budget(
                config.cpu_bytes_to_use,
                num_layers=len(group.layer_names),
                pages_per_block=pages_per_block,
                page_bytes=spec.page_size_bytes,
                world_size=world_size,
            )
        except ValueError as exc:
            raise ConfigError(f"kv_connector_extra_config: {exc}") from None
        engine_id = vllm_config.kv_transfer_config.engine_id if vllm_config.kv_transfer_config else None
        return cls(
            namespace=namespace,
            layer_names=tuple(group.layer_names),
            engine_block_tokens=engine_block_tokens,
            block_tokens=block_tokens,
            layout=layout,
            world_size=world_size,
            engine_id=str(engine_id or "default"),
            kv_cache_spec_kind=spec_kind,
        )
