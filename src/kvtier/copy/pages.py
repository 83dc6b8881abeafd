"""Byte-page views of the engine's KV tensors and of one rank's host slots, and the batched page copy.

Engine-agnostic: the engine's KV is one tensor per layer with a *block dimension* somewhere in its
shape (vLLM's CPU backend: dim 0, ``[blocks, kv_heads, block_size, 2*head]``; FlashAttention: dim
1, ``[2, blocks, block_size, kv_heads, head]``; MLA: dim 0, ``[blocks, block_size, latent]``). A
page is "everything of one block of one layer", moved as opaque bytes (viewed as int64 words where
sizes and alignment allow), never token by token. In a host slot a page is stored contiguously, in
the logical (row-major) order of the engine page's dimensions, whatever the engine tensor's strides.

Views only: nothing here allocates KV-sized memory or owns a buffer. :class:`PagedKV` views the
engine's tensors (owned by vLLM), :class:`HostSlots` views a host region (owned by the worker's
:class:`~kvtier.tiers.shm.SharedRegion`). A :class:`CopyPlan` is a job's list of page pairs, built
once per job; :meth:`BlockCopier.copy` moves it with one ``torch._foreach_copy_`` call (the copies
are issued from C++, and it works across devices, strided page views included). Called by the
copy engines on whichever thread runs a job.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvtier.copy.base import Direction, PageCopy
from kvtier.core.slots import HostSlotLayout


def find_block_dim(shape: Sequence[int], num_blocks: int) -> int:
    """The dimension of a layer's KV tensor that indexes blocks (first dim equal to ``num_blocks``)."""
    for dim, size in enumerate(shape):
        if size == num_blocks:
            return dim
    raise ValueError(f"no dimension of size num_blocks={num_blocks} in KV tensor shape {tuple(shape)}")


def padded_pages(tensor: torch.Tensor, num_blocks: int, page_bytes: int) -> torch.Tensor:
    """A ``[num_blocks, page_bytes]`` byte view of a layer whose pages are padded: its tensor views
    only the first bytes of each ``page_bytes`` page (vLLM pads a Mamba state page up to the
    attention page and views the state alone), so the whole padded page is copied, padding
    included, as for any other layer. ValueError unless the blocks are dim 0, ``page_bytes`` apart."""
    as_bytes = tensor if tensor.dtype == torch.uint8 else tensor.view(torch.uint8)
    if find_block_dim(tensor.shape, num_blocks) != 0 or tensor.stride(0) * tensor.element_size() != page_bytes:
        raise ValueError(f"KV tensor of shape {tuple(tensor.shape)}, strides {tensor.stride()} is not "
                         f"{num_blocks} pages of {page_bytes} B")
    return torch.as_strided(as_bytes, (num_blocks, page_bytes), (page_bytes, 1))


class PagedKV:
    """The engine's per-layer KV tensors as byte pages ``page(layer, block_id)`` (views, no copies).

    When every layer's pages are contiguous (vLLM-CPU, MLA: block dim 0) pages are rows of a
    ``[num_blocks, page_bytes]`` view (:attr:`flat`); otherwise (FlashAttention's K and V halves,
    permuted strides) a page is a strided view of shape :attr:`page_shape`.

    ``layer_groups``: the layer indices of each KV cache group (default: one group of every
    layer). Under vLLM's hybrid allocator the groups share one block pool (and their layers may
    share tensors): a block id names a page of the layers of the group that owns it.
    """

    def __init__(self, layers: Sequence[torch.Tensor], num_blocks: int,
                 layer_groups: Sequence[Sequence[int]] | None = None):
        if not layers:
            raise ValueError("no KV layers to offload")
        groups = [list(g) for g in layer_groups] if layer_groups is not None else [list(range(len(layers)))]
        if sorted(i for g in groups for i in g) != list(range(len(layers))):
            raise ValueError(f"layer groups {groups} do not cover layers 0..{len(layers) - 1} once each")
        self.layer_groups = groups
        devices = {t.device for t in layers}
        if len(devices) != 1:
            raise ValueError(f"KV layers are on several devices {sorted(map(str, devices))}; not supported")
        pages: list[torch.Tensor] = []
        for tensor in layers:
            block_dim = find_block_dim(tensor.shape, num_blocks)
            as_bytes = tensor if tensor.dtype == torch.uint8 else tensor.view(torch.uint8)
            pages.append(as_bytes.movedim(block_dim, 0))
        self.flat = all(p.is_contiguous() for p in pages)
        # Contiguous pages are moved as byte rows: only their size must agree (a Mamba state page
        # beside attention pages: another shape, the same padded size). Strided ones by shape.
        page_shapes = {(p[0].numel(),) if self.flat else tuple(p.shape[1:]) for p in pages}
        if len(page_shapes) != 1:
            raise ValueError(f"KV layers have different page shapes {sorted(page_shapes)}; not supported")
        self.page_shape = page_shapes.pop()
        self.page_bytes = pages[0][0].numel()
        self.num_layers = len(pages)
        self.num_blocks = num_blocks
        self.device = pages[0].device
        self._pages = [p.reshape(num_blocks, self.page_bytes) for p in pages] if self.flat else pages

    def page(self, layer: int, block_id: int) -> torch.Tensor:
        """A page: a 1-D byte row if :attr:`flat`, else a view of shape :attr:`page_shape`."""
        return self._pages[layer][block_id]

    def word_views(self, word: torch.dtype) -> list[torch.Tensor] | None:
        """Every layer's pages as ``[num_blocks, *page]`` views of ``word`` elements (the same bytes
        in the same order), or None when a layer's size, strides or alignment do not allow it."""
        size = word.itemsize
        views = []
        for pages in self._pages:
            if not (
                pages.shape[-1] % size == 0 and pages.stride(-1) == 1
                and all(stride % size == 0 for stride in pages.stride()[:-1])
                and pages.storage_offset() % size == 0 and pages.data_ptr() % size == 0
            ):
                return None
            views.append(pages.view(word))
        return views


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

    def block_pages(self, slot: int, sub: int, word: torch.dtype, page_shape: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """Every layer's page ``sub`` in ``slot``, layer order, each viewed as ``page_shape`` ``word``
        elements. IndexError if ``slot`` or ``sub`` is out of range (never a wrapped-around index)."""
        layout = self.layout
        if not (0 <= slot < layout.num_slots and 0 <= sub < layout.pages_per_block):
            raise IndexError(
                f"host page (slot {slot}, sub {sub}) out of range ({layout.num_slots} slots x "
                f"{layout.pages_per_block} pages per block)"
            )
        return self.tensor[slot, :, sub].view(word).view(layout.num_layers, *page_shape).unbind(0)


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """One job's copies: ``dsts[i]`` receives ``srcs[i]`` (same shape, uint8). Views of the engine's
    and the host's buffers, valid while those live; ``num_bytes`` is the total moved."""

    direction: Direction
    dsts: list[torch.Tensor]
    srcs: list[torch.Tensor]
    num_bytes: int


class BlockCopier:
    """Copies pages between :class:`PagedKV` and :class:`HostSlots` (same layer count and page size).

    Pages are copied as int64 words when sizes, strides and alignment allow (always for vLLM's
    layouts), else as bytes: same bytes either way, but a page of up to 256 KiB is then under
    torch's parallel grain (32,768 elements), so each page copy is one plain loop on the calling
    thread rather than an OpenMP region, which stalls when the other cores are busy.
    """

    def __init__(self, kv: PagedKV, host: HostSlots):
        if kv.num_layers != host.layout.num_layers or kv.page_bytes != host.layout.page_bytes:
            raise ValueError(
                f"engine KV ({kv.num_layers} layers x {kv.page_bytes} B pages) does not match the host "
                f"layout ({host.layout.num_layers} layers x {host.layout.page_bytes} B pages)"
            )
        self.kv = kv
        self.host = host
        words = kv.word_views(torch.int64) if host.tensor.data_ptr() % 8 == 0 else None
        self.word = torch.uint8 if words is None else torch.int64
        self._engine = kv.word_views(torch.uint8) if words is None else words
        self._page_shape = tuple(self._engine[0].shape[1:])

    def plan(self, direction: Direction, pages: Iterable[PageCopy]) -> CopyPlan:
        """The page pairs of a job (layers x pages), views only, no bytes moved. Raises IndexError
        on a page out of range, before anything could be copied."""
        engine: list[torch.Tensor] = []
        host: list[torch.Tensor] = []
        num_blocks = self.kv.num_blocks
        groups = self.kv.layer_groups
        for p in pages:
            host_pages = self.host.block_pages(p.slot, p.sub, self.word, self._page_shape)
            if not 0 <= p.block_id < num_blocks:
                raise IndexError(f"engine block {p.block_id} out of range [0, {num_blocks})")
            if not 0 <= p.group < len(groups):
                raise IndexError(f"KV cache group {p.group} out of range [0, {len(groups)})")
            if len(groups) == 1:
                host.extend(host_pages)
                engine.extend([layer[p.block_id] for layer in self._engine])
            else:
                host.extend(host_pages[i] for i in groups[p.group])
                engine.extend(self._engine[i][p.block_id] for i in groups[p.group])
        num_bytes = len(engine) * self.kv.page_bytes
        if direction is Direction.STORE:
            return CopyPlan(direction, host, engine, num_bytes)
        return CopyPlan(direction, engine, host, num_bytes)

    def copy(self, direction: Direction, pages: Iterable[PageCopy]) -> int:
        """Copy ``pages`` in ``direction`` synchronously (the bytes are in place on return); returns
        bytes moved. For KV in host memory; the CUDA engine issues plans on its streams instead."""
        plan = self.plan(direction, pages)
        if plan.dsts:
            torch._foreach_copy_(plan.dsts, plan.srcs)
        return plan.num_bytes
