"""KV caches exactly as vLLM lays them out on a GPU, built by vLLM's own code on CPU tensors.

vLLM-CPU always runs LBHNC pages without kernel blocks; on CUDA, vLLM 0.32 picks LBNHC for
FlashAttention (``v1/attention/backends/utils.py:194-201, 259-348``), splits manager blocks into
kernel blocks for some backends (``v1/kv_cache_interface.py:319-333, 398-416``), pads Mamba state
pages, and overlays cache groups in one allocation. :func:`vllm_kv_caches` runs the same functions
the GPU worker runs (``get_kv_cache_config_from_groups``, then ``allocate_kv_cache``, as
``v1/worker/gpu/attn_utils.py:396-443`` does) with ``device="cpu"``, so a connector's tests see the
very views (shapes, strides, offsets, aliasing) a GPU worker hands ``register_kv_caches``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.config import CacheConfig, VllmConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

BLOCK = 16


@dataclass
class VllmKV:
    config: KVCacheConfig
    views: dict[str, torch.Tensor]  # what the GPU worker hands the connector (manager-block views)
    layer_names: list[str]  # slot order: group by group
    layer_groups: list[list[int]]
    state_layers: set[int]  # indices (slot order) of padded Mamba state layers

    @property
    def num_blocks(self) -> int:
        return self.config.num_blocks

    @property
    def page_bytes(self) -> int:
        """The host page: the largest layer's page (vLLM's page size, padding included)."""
        return max(self.layer_page_bytes)

    @property
    def layer_page_bytes(self) -> list[int]:
        """Each layer's page size in vLLM's spec (slot order)."""
        out = []
        for group in self.config.kv_cache_groups:
            spec = group.kv_cache_spec
            for name in group.layer_names:
                layer = spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec
                out.append(layer.page_size_bytes)
        return out


def attention_spec(dtype: torch.dtype = torch.float16, kv_heads: int = 2, head_size: int = 16,
                   padded_to: int | None = None) -> KVCacheSpec:
    """Full attention; ``padded_to``: its page padded as vLLM pads it to unify page sizes (a draft
    model's layers, vLLM 0.32 ``v1/core/kv_cache_utils.py:1336-1345``)."""
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=kv_heads, head_size=head_size, dtype=dtype,
                             page_size_padded=padded_to)


def skip_quantized_window_spec(padded_to: int, kv_heads: int = 2) -> KVCacheSpec:
    """A sliding-window layer left unquantized beside quantized ones: vLLM pads its page to the
    shared page (``model_executor/layers/attention/attention.py:626-667``)."""
    return SlidingWindowSpec(block_size=BLOCK, num_kv_heads=kv_heads, head_size=16, dtype=torch.float16,
                             sliding_window=4 * BLOCK, page_size_padded=padded_to)


def mixed_type_group(names: list[str], heads: list[int]) -> KVCacheSpec:
    """One group of full-attention layers with per-layer head counts (``UniformTypeKVCacheSpecs``:
    every layer keeps its own page size, vLLM 0.32 ``v1/kv_cache_interface.py:1225-1254``)."""
    return UniformTypeKVCacheSpecs(block_size=BLOCK, kv_cache_specs={
        name: attention_spec(kv_heads=h) for name, h in zip(names, heads)})


def mla_spec() -> KVCacheSpec:
    return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=40, dtype=torch.bfloat16)


def mamba_spec(page_bytes: int) -> KVCacheSpec:
    """A Mamba2-like state (conv + ssm) padded up to the attention page, in align mode."""
    return MambaSpec(block_size=BLOCK, shapes=((3, 24), (4, 10)), dtypes=(torch.float32, torch.float32),
                     page_size_padded=page_bytes, mamba_cache_mode="align")


def vllm_kv_caches(layout: KVCacheLayout, groups: list[tuple[list[str], KVCacheSpec]], num_blocks: int = 8,
                   kernel_block_size: int | None = None, seed: int = 0) -> VllmKV:
    """vLLM's KV cache views for ``groups`` under ``layout``, filled with random bytes (every byte
    of the allocation, padding included)."""
    vllm_config = VllmConfig(cache_config=CacheConfig(block_size=BLOCK))
    vllm_config.cache_config.kv_cache_layout = layout.name
    vllm_config.cache_config.num_gpu_blocks_override = num_blocks
    group_specs = [KVCacheGroupSpec(list(names), spec) for names, spec in groups]
    config = get_kv_cache_config_from_groups(vllm_config, group_specs, 2**40)
    kernel = None
    if kernel_block_size is not None:
        kernel = [kernel_block_size if not isinstance(spec, MambaSpec) else spec.block_size for _, spec in groups]
    views = allocate_kv_cache(config, torch.device("cpu"), layout, kernel)
    raw = views[groups[0][0][0]].untyped_storage()
    generator = torch.Generator().manual_seed(seed)
    torch.empty(0, dtype=torch.uint8).set_(raw).copy_(torch.randint(0, 256, (raw.nbytes(),), dtype=torch.uint8,
                                                                    generator=generator))
    names, layer_groups, state_layers = [], [], set()
    for group_names, spec in groups:
        layer_groups.append(list(range(len(names), len(names) + len(group_names))))
        if isinstance(spec, MambaSpec):
            state_layers.update(layer_groups[-1])
        names.extend(group_names)
    return VllmKV(config, views, names, layer_groups, state_layers)


def layer_views(kv: VllmKV) -> list[torch.Tensor]:
    """The views in slot order, state layers as their padded pages (as the worker passes them)."""
    from kvtier.copy.pages import padded_pages

    return [padded_pages(kv.views[name], kv.num_blocks, size) if i in kv.state_layers else kv.views[name]
            for i, (name, size) in enumerate(zip(kv.layer_names, kv.layer_page_bytes))]


LAYER_COMPACT = [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC]
"""vLLM-CPU's layout, and FlashAttention's default on CUDA."""
