"""KV cache views laid out as vLLM 0.32/0.33 lays them out on a GPU, without vLLM (the GPU machine has
none): the arithmetic of ``compute_layout_strides`` and ``create_kv_cache_views``
(vLLM 0.32 ``v1/kv_cache_interface.py:336-441``) and of ``get_kv_cache_config_from_groups``'s
tensor placement (``v1/core/kv_cache_utils.py:1588-1686``), redone in plain torch for any device.

``tests/test_vllm_layouts.py`` checks on CPU that every case here gives exactly the views vLLM's own
code gives (shapes, strides, offsets into one allocation), so the GPU kit copies the pages a real
vLLM worker would hand kvtier.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ORDERS = {  # KVCacheLayout: logical [L, B, H, N, C] axes in physical (memory) order
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}


@dataclass(frozen=True)
class Case:
    """One KV cache: ``layers`` attention (or MLA: ``heads=1``) layers of ``heads`` x ``tokens`` x
    ``content`` elements of ``dtype`` per block; ``kernel_tokens``: the attention kernel's smaller
    block; ``state_layers`` Mamba layers of ``state_bytes`` padded up to the attention page, in
    their own group, overlaying the attention layers' memory as vLLM's hybrid allocator does."""

    layout: str
    layers: int = 3
    heads: int = 2
    tokens: int = 16
    content: int = 32
    dtype: torch.dtype = torch.float16
    kernel_tokens: int | None = None
    state_layers: int = 0
    state_bytes: int = 448
    padded_to: int | None = None  # attention pages padded to this size (vLLM unifying page sizes)

    @property
    def page_bytes(self) -> int:
        """The page size in vLLM's spec: padded, or the content."""
        return self.padded_to or self.heads * self.tokens * self.content * self.dtype.itemsize


@dataclass
class GpuKV:
    raw: torch.Tensor  # the one int8 allocation
    views: list[torch.Tensor]  # slot order: attention layers, then state layers
    layer_groups: list[list[int]]
    state_layers: set[int] = field(default_factory=set)
    page_bytes: list[int] = field(default_factory=list)  # per view: vLLM's page size, padding included


def _strides(order, shape, fixed=(None,) * 5, padded_to=None):
    strides, current = [0] * 5, 1
    for position, dim in reversed(tuple(enumerate(order))):
        if padded_to and position == 1:  # compute_layout_strides: pages padded below the L/B grid
            current = max(current, padded_to)
        strides[dim] = fixed[dim] or current
        current = strides[dim] * shape[dim]
    return strides


def build(case: Case, num_blocks: int, device: torch.device | str) -> GpuKV:
    order = ORDERS[case.layout]
    item = case.dtype.itemsize
    shape = (case.layers, num_blocks, case.heads, case.tokens, case.content * item)
    if case.padded_to:
        assert set(order[:2]) == {0, 1} and not case.kernel_tokens, f"{case.layout} cannot pad pages"
    layer_stride, block_stride = _strides(order, shape, padded_to=case.padded_to)[:2]
    size = layer_stride * case.layers if order[0] == 0 else block_stride * num_blocks
    raw = torch.zeros(size, dtype=torch.int8, device=device)
    ratio = case.tokens // case.kernel_tokens if case.kernel_tokens else 1
    if ratio > 1:  # create_kv_cache_views: kernel blocks a constant stride apart inside a dense page
        assert block_stride == case.page_bytes, f"{case.layout} cannot split blocks"
        shape = (case.layers, num_blocks * ratio, case.heads, case.kernel_tokens, case.content * item)
        block_stride //= ratio
    strides = _strides(order, shape, (layer_stride, block_stride, None, None, None))
    views = [torch.as_strided(raw, shape[1:], strides[1:], layer * strides[0]).view(case.dtype)
             for layer in range(case.layers)]
    groups = [list(range(case.layers))]
    states = set()
    if case.state_layers:
        assert order[0] == 0, "padded state pages overlay layer-outermost layouts here"
        state = case.state_bytes
        for layer in range(case.state_layers):
            views.append(torch.as_strided(raw, (num_blocks, 1, 1, state), (case.page_bytes, state, state, 1),
                                          layer * layer_stride))
            states.add(len(views) - 1)
        groups.append(sorted(states))
    return GpuKV(raw, views, groups, states, [case.page_bytes] * len(views))


CASES = {
    **{f"{layout}-attention": Case(layout) for layout in ORDERS},
    "LBNHC-mla": Case("LBNHC", heads=1, content=40, dtype=torch.bfloat16),
    "LBNHC-kernel-blocks": Case("LBNHC", kernel_tokens=8),
    "LBHNC-kernel-blocks": Case("LBHNC", kernel_tokens=8),
    "LBNHC-mamba-hybrid": Case("LBNHC", layers=2, state_layers=2),
    "LBNHC-padded-attention": Case("LBNHC", padded_to=2560),
    "LBHNC-padded-attention": Case("LBHNC", padded_to=2560),
}
"""Every layout vLLM 0.32 can resolve, kernel blocks, MLA, a Mamba hybrid under LBNHC, and attention
pages padded (2,048 -> 2,560 B) under vLLM-CPU's layout and FlashAttention's."""
