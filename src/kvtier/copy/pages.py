"""Byte-page views of the engine's KV tensors and of one rank's host slots, and the page copy.

Engine-agnostic: the engine's KV is one tensor per layer with a *block dimension* somewhere in its
shape (vLLM's CPU backend: dim 0, ``[blocks, kv_heads, block_size, 2*head]``; FlashAttention: dim
1, ``[2, blocks, block_size, kv_heads, head]``). A page is "everything of one block of one layer",
moved as an opaque byte tensor, never token by token.

Views only: nothing here allocates KV-sized memory or owns a buffer. :class:`PagedKV` views the
engine's tensors (owned by vLLM), :class:`HostSlots` views a host region (owned by the worker's
:class:`~kvtier.tiers.shm.SharedRegion`). Called by the copy engines on whichever thread runs a copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from kvtier.copy.base import Direction, PageCopy
from kvtier.core.slots import HostSlotLayout


def find_block_dim(shape: Sequence[int], num_blocks: int) -> int:
    """The dimension of a layer's KV tensor that indexes blocks (first dim equal to ``num_blocks``)."""
    for dim, size in enumerate(shape):
        if size == num_blocks:
            return dim
    raise ValueError(f"no dimension of size num_blocks={num_blocks} in KV tensor shape {tuple(shape)}")


class PagedKV:
    """The engine's per-layer KV tensors as byte pages ``page(layer, block_id)`` (views, no copies).

    When every layer's pages are contiguous (vLLM-CPU: block dim 0) pages are rows of a
    ``[num_blocks, page_bytes]`` view, which keeps the per-copy overhead to one index op.
    """

    def __init__(self, layers: Sequence[torch.Tensor], num_blocks: int):
        if not layers:
            raise ValueError("no KV layers to offload")
        pages: list[torch.Tensor] = []
        for tensor in layers:
            block_dim = find_block_dim(tensor.shape, num_blocks)
            as_bytes = tensor if tensor.dtype == torch.uint8 else tensor.view(torch.uint8)
            pages.append(as_bytes.movedim(block_dim, 0))
        page_shapes = {tuple(p.shape[1:]) for p in pages}
        if len(page_shapes) != 1:
            raise ValueError(f"KV layers have different page shapes {sorted(page_shapes)}; not supported")
        self.page_shape = page_shapes.pop()
        self.page_bytes = pages[0][0].numel()
        self.num_layers = len(pages)
        self.device = pages[0].device
        self.flat = all(p.is_contiguous() for p in pages)
        self._pages = [p.reshape(num_blocks, self.page_bytes) for p in pages] if self.flat else pages

    def page(self, layer: int, block_id: int) -> torch.Tensor:
        """A page: a 1-D byte row if :attr:`flat`, else a view of shape :attr:`page_shape`."""
        return self._pages[layer][block_id]


class HostSlots:
    """One rank's host region as ``[num_slots, layers, pages_per_block, page_bytes]`` uint8."""

    def __init__(self, buffer: torch.Tensor, layout: HostSlotLayout):
        expected = layout.region_bytes
        if buffer.dtype != torch.uint8 or buffer.numel() != expected:
            raise ValueError(f"host buffer must be {expected} uint8 bytes, got {buffer.numel()} {buffer.dtype}")
        self.layout = layout
        self.tensor = buffer.view(layout.num_slots, layout.num_layers, layout.pages_per_block, layout.page_bytes)
        self._rows = buffer.view(-1, layout.page_bytes)

    def page(self, slot: int, layer: int, sub: int) -> torch.Tensor:
        """A 1-D byte row: page ``sub`` of layer ``layer`` in slot ``slot``."""
        layout = self.layout
        return self._rows[(slot * layout.num_layers + layer) * layout.pages_per_block + sub]


class BlockCopier:
    """Copies pages between :class:`PagedKV` and :class:`HostSlots` (same layer count and page size)."""

    def __init__(self, kv: PagedKV, host: HostSlots):
        if kv.num_layers != host.layout.num_layers or kv.page_bytes != host.layout.page_bytes:
            raise ValueError(
                f"engine KV ({kv.num_layers} layers x {kv.page_bytes} B pages) does not match the host "
                f"layout ({host.layout.num_layers} layers x {host.layout.page_bytes} B pages)"
            )
        self.kv = kv
        self.host = host
        self._non_blocking = kv.device.type != "cpu"

    def copy(self, direction: Direction, pages: Iterable[PageCopy]) -> int:
        """Copy ``pages`` in ``direction``; returns bytes moved. Synchronous on CPU."""
        pages = list(pages)
        shape = None if self.kv.flat else self.kv.page_shape
        for layer in range(self.kv.num_layers):
            for p in pages:
                host_page = self.host.page(p.slot, layer, p.sub)
                if shape is not None:
                    host_page = host_page.view(shape)
                engine_page = self.kv.page(layer, p.block_id)
                if direction is Direction.STORE:
                    host_page.copy_(engine_page, non_blocking=self._non_blocking)
                else:
                    engine_page.copy_(host_page, non_blocking=self._non_blocking)
        return len(pages) * self.kv.num_layers * self.kv.page_bytes
