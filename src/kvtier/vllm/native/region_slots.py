"""vLLM's shared CPU offload region, seen by kvtier's page copier as host slots.

vLLM's CPU tier (``SharedOffloadRegion``) gives each worker, per canonical KV tensor, a strided
view ``[num_chunks, blocks_per_chunk * page_bytes]``: in every row, this rank's slot holds each
tensor's pages of the chunk one after another. kvtier's :class:`~kvtier.copy.pages.BlockCopier`
copies between engine pages and :class:`~kvtier.copy.pages.HostSlots`; :class:`RegionSlots` is a
``HostSlots`` whose "layers" are (KV cache group, tensor) pairs and whose pages are those views'
slices, so the copier runs unchanged.

Buffers: the views belong to vLLM's region (owned by the worker, released at shutdown); nothing is
allocated here. Any thread may read the views; the copy engine decides which copies where.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.copy.pages import HostSlots
from kvtier.core.slots import HostSlotLayout


class RegionSlots(HostSlots):
    """Host slots in vLLM's region: ``layer i`` is view ``tensor_of_layer[i]``; ``slot`` a chunk.

    Does not call :meth:`HostSlots.__init__`, which takes one contiguous kvtier region: this
    region's pages are strided rows shared with the other ranks' slots.
    """

    def __init__(self, views: Sequence[torch.Tensor], tensor_of_layer: Sequence[int], pages_per_block: int,
                 page_bytes: int):
        if page_bytes % 8:
            raise ValueError(f"pages of {page_bytes} bytes: kvtier copies pages of whole 8-byte words")
        rows = {view.shape[0] for view in views}
        if len(rows) != 1:
            raise ValueError(f"region views of different row counts {sorted(rows)}")
        for view in views:
            if view.shape[1] != pages_per_block * page_bytes or view.stride(1) != 1 or view.data_ptr() % 8:
                raise ValueError(f"region view {tuple(view.shape)} / {view.stride()} is not {pages_per_block} "
                                 f"word-aligned pages of {page_bytes} bytes per row")
        self._views = [view.view(torch.uint8) for view in views]
        self._tensor_of_layer = list(tensor_of_layer)
        self.layout = HostSlotLayout(num_layers=len(self._tensor_of_layer), pages_per_block=pages_per_block,
                                     page_bytes=page_bytes, world_size=1, num_slots=rows.pop())
        self.tensor = self._views[0]  # BlockCopier checks its alignment to pick word-sized copies

    def page(self, slot: int, layer: int, sub: int) -> torch.Tensor:
        size = self.layout.page_bytes
        return self._views[self._tensor_of_layer[layer]][slot, sub * size : (sub + 1) * size]

    def block_pages(self, slot: int, sub: int, word: torch.dtype, page_shape: Sequence[int]) -> tuple[torch.Tensor, ...]:
        layout = self.layout
        if not (0 <= slot < layout.num_slots and 0 <= sub < layout.pages_per_block):
            raise IndexError(f"region page (chunk {slot}, sub {sub}) out of range ({layout.num_slots} chunks x "
                             f"{layout.pages_per_block} pages per chunk)")
        return tuple(self.page(slot, layer, sub).view(word).view(*page_shape) for layer in range(layout.num_layers))
