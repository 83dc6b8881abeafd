"""Derive kvtier's slot layout from vLLM's config, identically in every process.

The scheduler and each worker build :class:`EngineGeometry` from the same ``vllm_config`` and
``kv_cache_config``, so they agree on slot sizes without talking to each other.

KV cache groups (vLLM's hybrid allocator: full-attention layers in one group, each sliding-window
size in others, every group with its own block table over one shared block pool): a kvtier block
holds the pages of every offloaded layer of every group for the same tokens, in one slot; layer
``i`` of the slot is copied through its own group's block table (:attr:`EngineGeometry.layer_groups`).
Supported when every group has one block size (vLLM makes page sizes equal across groups, padding
Mamba's and, where needed, attention's; a mixed-type group's layers may still differ: a slot's page
is the largest layer's, a smaller page fills its start): attention over per-token KV, or Mamba / linear-attention state in
vLLM's "align" mode (:attr:`EngineGeometry.state_groups`: a kvtier block then holds the state after
its last token, and is one engine block). A sliding window must be wider than a kvtier block minus
one engine block (so a block is never partly freed by vLLM before the step that completes it stores
it, see :func:`check_windows`), a chunked-local chunk a multiple of the kvtier block.
:mod:`kvtier.vllm.inactive` keeps kvtier out of layouts outside this. The namespace
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
    ChunkedLocalAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
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


def group_spec(spec: KVCacheSpec) -> KVCacheSpec:
    """A group's spec as one layer's (a UniformTypeKVCacheSpecs group holds layers of one type)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return next(iter(spec.kv_cache_specs.values()))
    return spec


def layer_spec(spec: KVCacheSpec, layer_name: str) -> KVCacheSpec:
    """One layer's spec in its group's ``spec`` (a UniformTypeKVCacheSpecs group's layers may differ:
    other head counts, other page sizes, vLLM 0.32 ``v1/kv_cache_interface.py:1225-1254``)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.kv_cache_specs[layer_name]
    return spec


@dataclass(frozen=True)
class EngineGeometry:
    model_name: str
    layer_names: tuple[str, ...]  # every offloaded layer, slot order (group by group)
    engine_block_tokens: int
    block_tokens: int  # kvtier block = pages_per_block engine blocks
    layout: HostSlotLayout
    tp_size: int
    pp_size: int
    engine_id: str
    group_kinds: tuple[str, ...]  # vLLM's name of each KV cache group's kind ("full_attention", "mla", ...)
    kv_dtype: str  # as stored in the pages ("float32", "fp8_e4m3", ...)
    num_kv_heads: int  # per rank
    head_size: int
    kv_scales: str = ""  # "" or "checkpoint" (quantized KV: scales from the weights)
    replicated: bool = False  # every rank holds the same KV bytes: one copy stored (rank 0's)
    layer_groups: tuple[tuple[int, ...], ...] = ()  # per vLLM KV cache group: its layers' slot indices
    state_groups: tuple[int, ...] = ()  # the groups holding Mamba / linear-attention state (align mode)
    layer_page_bytes: tuple[int, ...] = ()  # per layer (slot order): vLLM's page size, padding included

    @property
    def num_groups(self) -> int:
        return len(self.layer_groups)

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
    def attention(self) -> str:
        """The kinds of the KV cache groups, in group order, joined by "+": one group's kind alone
        as before; another grouping lays the slot's layers out in another order, so it is another
        namespace."""
        return "+".join(self.group_kinds)

    @classmethod
    def from_vllm(
        cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: KVTierConfig
    ) -> "EngineGeometry":
        groups = kv_cache_config.kv_cache_groups
        specs = [group_spec(group.kv_cache_spec) for group in groups]
        for spec in specs:
            if not isinstance(spec, AttentionSpec | MambaSpec):
                raise ConfigError(f"kvtier cannot offload KV cache spec {type(spec).__name__}")
        state_groups = tuple(g for g, spec in enumerate(specs) if isinstance(spec, MambaSpec))
        attention_specs = [spec for spec in specs if isinstance(spec, AttentionSpec)]
        spec = attention_specs[0] if attention_specs else specs[0]
        if len({s.block_size for s in specs}) != 1:
            raise ConfigError(
                "kvtier needs one block size across the model's KV cache groups, got "
                + ", ".join(f"{s.block_size} tokens/{s.page_size_bytes} B" for s in specs)
                + "; start vLLM with --disable-hybrid-kv-cache-manager (one group) to offload this model"
            )
        layer_page_bytes = tuple(layer_spec(group.kv_cache_spec, name).page_size_bytes
                                 for group in groups for name in group.layer_names)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ConfigError("kvtier does not support pipeline parallelism yet (pipeline_parallel_size must be 1)")
        engine_block_tokens = spec.block_size
        block_tokens = config.offload_block_tokens(engine_block_tokens)
        check_windows(specs, block_tokens, engine_block_tokens)
        pages_per_block = block_tokens // engine_block_tokens
        if state_groups and pages_per_block != 1:
            raise ConfigError(
                f"kv_connector_extra_config block_size {block_tokens}: with Mamba / linear-attention layers a "
                f"kvtier block must be one engine block ({engine_block_tokens} tokens; vLLM keeps their state "
                "at engine block boundaries only): drop block_size or set it to that"
            )
        replicated = replicated_kv(spec, parallel)
        cache_dtype = vllm_config.cache_config.cache_dtype
        dtype = spec.dtype if isinstance(spec, AttentionSpec) else spec.dtypes[0]
        kv_dtype = str(dtype).removeprefix("torch.") if cache_dtype == "auto" else str(cache_dtype)
        layer_names = tuple(name for group in groups for name in group.layer_names)
        layer_groups, first = [], 0
        for group in groups:
            layer_groups.append(tuple(range(first, first + len(group.layer_names))))
            first += len(group.layer_names)
        try:
            layout = HostSlotLayout.for_budget(
                config.cpu_bytes_to_use,
                num_layers=len(layer_names),
                pages_per_block=pages_per_block,
                page_bytes=max(layer_page_bytes),  # a smaller (mixed-type group) page fills its start
                world_size=1 if replicated else parallel.world_size,  # = stored_ranks
            )
        except ValueError as exc:
            raise ConfigError(f"kv_connector_extra_config: {exc}") from None
        engine_id = vllm_config.kv_transfer_config.engine_id if vllm_config.kv_transfer_config else None
        kinds = [get_kv_cache_spec_kind(group.kv_cache_spec).value for group in groups]
        return cls(
            model_name=model_name(vllm_config),
            layer_names=layer_names,
            engine_block_tokens=engine_block_tokens,
            block_tokens=block_tokens,
            layout=layout,
            tp_size=parallel.tensor_parallel_size,
            pp_size=parallel.pipeline_parallel_size,
            engine_id=str(engine_id or "default"),
            group_kinds=tuple(kinds),
            kv_dtype=kv_dtype,
            num_kv_heads=spec.num_kv_heads if attention_specs else 0,
            head_size=spec.head_size if attention_specs else 0,
            kv_scales="checkpoint" if kv_dtype.startswith("fp8") else "",
            replicated=replicated,
            layer_groups=tuple(layer_groups),
            state_groups=state_groups,
            layer_page_bytes=layer_page_bytes,
        )


def check_windows(specs: list[KVCacheSpec], block_tokens: int, engine_block_tokens: int) -> None:
    """Refuse windowed groups whose freed blocks could cut into a kvtier block before it is stored.

    vLLM frees a request's sliding-window blocks below ``computed - window + 1`` (chunked-local:
    below the current chunk's start) when it allocates a step. kvtier stores a block in the step
    that completes it, reading every engine block of it: the first one was computed up to
    ``block_tokens - engine_block_tokens`` tokens earlier. So it is still allocated iff the window
    is wider than that (or the chunk boundaries fall on kvtier block boundaries)."""
    for spec in specs:
        if isinstance(spec, SlidingWindowSpec) and spec.sliding_window <= block_tokens - engine_block_tokens:
            raise ConfigError(
                f"kv_connector_extra_config block_size {block_tokens} is too large for the model's sliding "
                f"window of {spec.sliding_window} tokens (vLLM frees a block's first pages before the block is "
                f"complete); use a block_size of at most {spec.sliding_window + engine_block_tokens - 1} "
                f"(a multiple of the engine's {engine_block_tokens}-token blocks)"
            )
        if isinstance(spec, ChunkedLocalAttentionSpec) and spec.attention_chunk_size % block_tokens:
            raise ConfigError(
                f"kv_connector_extra_config block_size {block_tokens} does not divide the model's local attention "
                f"chunk of {spec.attention_chunk_size} tokens; use a block_size that divides it "
                f"(a multiple of the engine's {engine_block_tokens}-token blocks)"
            )


def replicated_kv(spec: KVCacheSpec, parallel: ParallelConfig) -> bool:
    """Whether every rank holds the same KV bytes: MLA under tensor parallelism. vLLM gives each
    rank the whole latent (one per token, no heads to split) computed from the same all-reduced
    hidden states. Not with decode or prefill context parallelism, which split the tokens over
    ranks, and not at world size 1 (nothing to share)."""
    splits_tokens = parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1
    return isinstance(spec, MLAAttentionSpec) and parallel.world_size > 1 and not splits_tokens
