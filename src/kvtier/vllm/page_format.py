"""The byte order of a rank's pages, as its worker really has them, folded into the namespace.

The scheduler process cannot see the engine's KV tensors (it has no model), yet the namespace must
name the page layout "as the engine actually picked it": two engines whose pages hold the same
numbers in another order (another block size, attention backend, KV dtype or layout) must never
share blocks. So each worker describes its pages when vLLM registers its KV caches
(:func:`describe_pages`, worker process, main thread) and publishes the description in the header
of its host region (:meth:`kvtier.tiers.shm.SharedRegion.publish`); the scheduler reads every
rank's description when it attaches the regions and turns it into a
:class:`~kvtier.core.keys.PageFormat` (:func:`page_format`).

What a description holds, per offloaded layer in slot order: the layer name, the attention
backend the engine picked for it, the tensor dtype, which dimension indexes blocks (0: vLLM's
views; kernel blocks regrouped under it, :func:`kvtier.copy.pages.block_view`), and the page's
shape (so the KV space size does not matter). Plus the engine's resolved KV cache layout, and,
where some page's elements lie in memory in another order than its row-major one (LBNHC: tokens
outside heads), each layer's physical order of the page's dimensions: a dense page is stored in
that order (:mod:`kvtier.copy.pages`), so shape, dtype, order and backend fix the bytes' meaning;
and whether ROCm's AITER backends shuffle the bytes inside each page (``VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT``,
:mod:`kvtier.vllm.rocm_layout`), which changes neither shape nor size.
(vLLM-CPU's LBHNC pages are row-major: their description, and so their namespace, has no orders.)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import blake3
import torch
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

from kvtier.copy.pages import block_view, physical_order
from kvtier.core.keys import PageFormat
from kvtier.vllm.geometry import EngineGeometry

logger = logging.getLogger(__name__)


def attention_backends(vllm_config: VllmConfig, layer_names: Sequence[str]) -> dict[str, str]:
    """Layer name -> the name of the attention backend the engine picked for it (worker side,
    after the model is loaded). Layers vLLM does not list get "unknown"."""
    try:
        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, list(layer_names))
    except Exception:  # the model's layers are not registered in this process
        layers = {}
    names = {}
    for name in layer_names:
        layer = layers.get(name)
        try:
            names[name] = layer.get_attn_backend().get_name() if layer is not None else "unknown"
        except Exception:
            names[name] = "unknown"
    return names


def describe_pages(
    layer_tensors: Mapping[str, torch.Tensor], layer_names: Sequence[str], num_blocks: int,
    backends: Mapping[str, str], kv_cache_layout: str | None, *, rocm_shuffled: bool = False,
) -> dict[str, Any]:
    """The description a worker publishes (JSON-ready, deterministic for equal engines).
    ``rocm_shuffled``: vLLM keeps the pages in ROCm AITER's shuffled order
    (:func:`~kvtier.vllm.rocm_layout.rocm_shuffled_kv_cache`); said only when on, so every other
    description, and the namespaces on disk, stay as they were."""
    layers, orders = [], []
    for name in layer_names:
        tensor = layer_tensors[name]
        blocks = block_view(tensor, num_blocks)
        shape = list(blocks.shape[1:])
        layers.append([name, backends.get(name, "unknown"), str(tensor.dtype).removeprefix("torch."), 0, shape])
        order = physical_order(blocks[0]) if num_blocks else None
        row_major = tuple(d for d in range(len(shape)) if shape[d] != 1)
        orders.append(list(order) if order is not None and order != row_major else None)
    description: dict[str, Any] = {"layers": layers, "kv_cache_layout": kv_cache_layout or "default"}
    if any(order is not None for order in orders):
        description["physical_orders"] = orders
    if rocm_shuffled:  # same shapes and size, other bytes
        description["rocm_shuffled_kv_cache"] = True
    return description


def encode_description(description: Mapping[str, Any]) -> bytes:
    return json.dumps(description, sort_keys=True, separators=(",", ":")).encode()


def page_format(geometry: EngineGeometry, published: bytes) -> PageFormat:
    """A rank's :class:`PageFormat` from the description its worker published (scheduler side)."""
    description = json.loads(published)
    backends = tuple(sorted({layer[1] for layer in description["layers"]}))
    return PageFormat(
        engine_block_tokens=geometry.engine_block_tokens,
        kv_dtype=geometry.kv_dtype,
        layout=str(description["kv_cache_layout"]),
        attention=geometry.attention,
        backends=backends,
        num_layers=len(description["layers"]),
        num_kv_heads=geometry.num_kv_heads,
        head_size=geometry.head_size,
        page_bytes=geometry.layout.page_bytes,
        pages=blake3.blake3(encode_description(description)).hexdigest()[:32],
        kv_scales=geometry.kv_scales,
    )
