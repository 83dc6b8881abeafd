"""Byte-page views of the engine's KV tensors and of one rank's host slots, and the batched page copy.

Engine-agnostic, written against the views vLLM 0.32 and 0.33 hand a connector: one tensor per
layer, ``[blocks, heads, tokens, content]`` (``create_kv_cache_views``, vLLM 0.32
``v1/kv_cache_interface.py:378-441``), the manager's blocks in dim 0, whatever the physical layout
(LBHNC on vLLM-CPU, LBNHC by default with FlashAttention on CUDA, ...). When the attention kernel's
block is smaller than the manager's, dim 0 counts kernel blocks (``num_blocks x ratio``,
``:319-333, 398-416``); :func:`block_view` regroups them as vLLM's own ``group_kernel_blocks`` does.

A page is "everything of one block of one layer", moved as opaque bytes, never token by token.
Its byte order in a host slot:

- a *dense* page (its elements fill one contiguous run of memory: every block-compact layout,
  LBHNC, LBNHC, BLHNC, BLNHC, kernel-split or not, and padded Mamba state pages) is stored as that
  run, in physical order. With vLLM-CPU's LBHNC that is the logical row-major order; with LBNHC
  it is not, and the layout is part of the namespace (:mod:`kvtier.vllm.page_format`), so bytes
  of one layout are never read by an engine with another;
- a page spread over memory (LHBNC, BHLNC: heads outside blocks, ROCm backends only) is stored in
  the logical row-major order of its dimensions.

Views only: nothing here allocates KV-sized memory or owns a buffer. :class:`PagedKV` views the
engine's tensors (owned by vLLM), :class:`HostSlots` views a host region (owned by the worker's
:class:`~kvtier.tiers.shm.SharedRegion`). A :class:`CopyPlan` is a job's list of page pairs;
:meth:`BlockCopier.copy` moves it with one ``torch._foreach_copy_`` call (the CPU engine's path);
the CUDA engine plans byte runs instead (:mod:`kvtier.copy.runs`). Called by the copy engines on
whichever thread runs a job.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import prod

import numpy as np
import torch

from kvtier.copy.base import Direction, Pages, SlotRun, page_table
from kvtier.core.slots import HostSlotLayout


def block_view(tensor: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``tensor`` with exactly ``num_blocks`` manager blocks in dim 0 (a view). Kernel blocks
    (dim 0 = ``num_blocks x ratio``) are regrouped into ``[num_blocks, ratio, ...]``. ValueError
    naming the shape for anything else."""
    first = tensor.shape[0] if tensor.dim() else 0
    if first == num_blocks > 0:
        return tensor
    if num_blocks > 0 and first > num_blocks and first % num_blocks == 0:
        return tensor.unflatten(0, (num_blocks, first // num_blocks))
    raise ValueError(
        f"KV tensor of shape {tuple(tensor.shape)} has neither num_blocks={num_blocks} nor a multiple of it "
        "(kernel blocks) in dim 0; kvtier reads vLLM 0.32/0.33's [blocks, heads, tokens, content] KV views"
    )


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``tensor`` as a 1-D uint8 tensor (a view, same device)."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def physical_order(page: torch.Tensor) -> tuple[int, ...] | None:
    """The dimensions of ``page`` from outermost to innermost in memory if its elements fill one
    contiguous run (a dense page), else None. Size-1 dimensions are left out."""
    dims = sorted((d for d in range(page.dim()) if page.shape[d] != 1), key=lambda d: page.stride(d))
    expected = 1
    for d in dims:
        if page.stride(d) != expected:
            return None
        expected *= page.shape[d]
    return tuple(reversed(dims))


def page_rows(tensor: torch.Tensor, num_blocks: int, page_bytes: int | None = None) -> torch.Tensor | None:
    """A ``[num_blocks, page_bytes]`` uint8 view whose row ``b`` is block ``b``'s page as one run of
    memory, or None when the layer's pages are not dense. ``page_bytes`` (default: the page's own
    size) may be larger than the page's content: a padded Mamba state page, whose tensor views only
    the state at the start of the page, is copied whole, padding included. ValueError if the rows
    would overlap (``page_bytes`` larger than the distance between blocks)."""
    blocks = block_view(tensor, num_blocks)
    page = blocks[0]
    if physical_order(page) is None:
        return None
    item = tensor.element_size()
    content = page.numel() * item
    size = content if page_bytes is None else page_bytes
    stride = blocks.stride(0) * item
    if size < content or (num_blocks > 1 and stride < size):
        raise ValueError(f"KV tensor of shape {tuple(tensor.shape)}, strides {tensor.stride()} is not {num_blocks} "
                         f"pages of {size} B")
    return torch.as_strided(storage_bytes(tensor), (num_blocks, size), (stride, 1), blocks.storage_offset() * item)


def padded_pages(tensor: torch.Tensor, num_blocks: int, page_bytes: int) -> torch.Tensor:
    """:func:`page_rows` of a padded state layer (vLLM pads a Mamba state page up to the attention
    page and views the state alone); ValueError unless its state is one run at each page's start."""
    rows = page_rows(tensor, num_blocks, page_bytes)
    if rows is None:
        raise ValueError(f"KV tensor of shape {tuple(tensor.shape)}, strides {tensor.stride()} does not hold one "
                         f"state run per page")
    return rows


class PagedKV:
    """The engine's per-layer KV tensors as byte pages ``page(layer, block_id)`` (views, no copies).

    When every layer's pages are dense (:attr:`flat`: every block-compact layout) pages are rows
    of a ``[num_blocks, layer_bytes[i]]`` view of layer ``i``'s storage, and :attr:`rows` holds
    those views (the CUDA engine computes page addresses from them). ``page_bytes`` (per layer,
    default: each page's content) is vLLM's page size from the KV cache spec, padding included:
    a padded page is copied whole. :attr:`page_bytes` is the host page, the largest layer's. Otherwise (LHBNC, BHLNC) a page is a
    strided uint8 view of shape :attr:`page_shape`, in the logical order of its dimensions.

    ``layer_groups``: the layer indices of each KV cache group (default: one group of every
    layer). Under vLLM's hybrid allocator the groups share one block pool (and their layers may
    share tensors): a block id names a page of the layers of the group that owns it.
    """

    def __init__(self, layers: Sequence[torch.Tensor], num_blocks: int,
                 layer_groups: Sequence[Sequence[int]] | None = None,
                 page_bytes: Sequence[int | None] | None = None):
        if not layers:
            raise ValueError("no KV layers to offload")
        groups = [list(g) for g in layer_groups] if layer_groups is not None else [list(range(len(layers)))]
        if sorted(i for g in groups for i in g) != list(range(len(layers))):
            raise ValueError(f"layer groups {groups} do not cover layers 0..{len(layers) - 1} once each")
        sizes = list(page_bytes) if page_bytes is not None else [None] * len(layers)
        if len(sizes) != len(layers):
            raise ValueError(f"{len(sizes)} page sizes for {len(layers)} KV layers")
        self.layer_groups = groups
        devices = {t.device for t in layers}
        if len(devices) != 1:
            raise ValueError(f"KV layers are on several devices {sorted(map(str, devices))}; not supported")
        rows = [page_rows(tensor, num_blocks, size) for tensor, size in zip(layers, sizes)]
        self.flat = all(r is not None for r in rows)
        if self.flat:
            # Dense pages are moved as byte rows of each layer's own page size, padding included
            # (vLLM pads attention pages to unify page sizes, skip-quantized sliding-window pages,
            # and Mamba state pages; a mixed-type group's layers may differ). The host page is the
            # largest of them; a smaller layer fills the start of its host page.
            pages = rows
            self.layer_bytes: tuple[int, ...] = tuple(r.shape[1] for r in rows)
            self.page_shape: tuple[int, ...] = (max(self.layer_bytes),)
        else:
            pages = [_byte_pages(tensor, num_blocks) for tensor in layers]
            page_shapes = {tuple(p.shape[1:]) for p in pages}
            if len(page_shapes) != 1:
                raise ValueError(f"KV layers have different page shapes {sorted(page_shapes)} and their pages are "
                                 "not dense (heads outside blocks); not supported")
            self.page_shape = page_shapes.pop()
            content = prod(self.page_shape)
            if any(size is not None and size != content for size in sizes):
                raise ValueError(f"KV pages of {content} B padded to {sorted(set(sizes))} B are not dense "
                                 "(heads outside blocks); not supported")
            self.layer_bytes = (content,) * len(pages)
        self.page_bytes = prod(self.page_shape)
        self.num_layers = len(pages)
        self.num_blocks = num_blocks
        self.device = pages[0].device
        self.rows: list[torch.Tensor] | None = rows if self.flat else None  # type: ignore[assignment]
        self._pages = pages

    @property
    def uniform(self) -> bool:
        """Whether every layer's page is :attr:`page_bytes` long (else :attr:`layer_bytes` differ)."""
        return all(size == self.page_bytes for size in self.layer_bytes)

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


def _byte_pages(tensor: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``[num_blocks, *page]`` uint8 view of a layer whose pages are not dense (logical order)."""
    blocks = block_view(tensor, num_blocks)
    return blocks if blocks.dtype == torch.uint8 else blocks.view(torch.uint8)


class HostSlots:
    """One rank's host region as ``[num_slots, layers, pages_per_block, page_bytes]`` uint8."""

    def __init__(self, buffer: torch.Tensor, layout: HostSlotLayout):
        expected = layout.region_bytes
        if buffer.dtype != torch.uint8 or buffer.numel() != expected:
            raise ValueError(f"host buffer must be {expected} uint8 bytes, got {buffer.numel()} {buffer.dtype}")
        self.layout = layout
        self.buffer = buffer
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
    """One job's copies as page pairs: ``dsts[i]`` receives ``srcs[i]`` (same shape). Views of the
    engine's and the host's buffers, valid while those live; ``num_bytes`` is the total moved."""

    direction: Direction
    dsts: list[torch.Tensor]
    srcs: list[torch.Tensor]
    num_bytes: int

    def views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self.dsts, self.srcs


class BlockCopier:
    """Copies pages between :class:`PagedKV` and :class:`HostSlots` (same layer count and page size).

    Pages are copied as int64 words when sizes, strides and alignment allow (always for vLLM's
    layouts), else as bytes. A layer whose page is smaller than the host page (:attr:`PagedKV.uniform`
    false) fills the start of its host page: same bytes either way, but a page of up to 256 KiB is then under
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
        aligned = host.tensor.data_ptr() % 8 == 0 and (kv.uniform or kv.page_bytes % 8 == 0)
        words = kv.word_views(torch.int64) if aligned else None
        self.word = torch.uint8 if words is None else torch.int64
        self._engine = kv.word_views(torch.uint8) if words is None else words
        self._page_shape = tuple(self._engine[0].shape[1:])
        self._layer_words = [layer.shape[1] for layer in self._engine] if not kv.uniform else None

    def _host_pages(self, slot: int, sub: int) -> tuple[torch.Tensor, ...]:
        """Every layer's page ``sub`` of host ``slot`` as the engine's word views see it."""
        if self._layer_words is None:
            return self.host.block_pages(slot, sub, self.word, self._page_shape)
        first = self.host.block_pages(slot, sub, torch.uint8, (self.kv.page_bytes,))  # range check
        return tuple(first[layer].view(self.word)[:words] for layer, words in enumerate(self._layer_words))

    def plan(self, direction: Direction, pages: Pages) -> CopyPlan:
        """The page pairs of a job (layers x pages), views only, no bytes moved. Raises IndexError
        on a page out of range, before anything could be copied."""
        engine: list[torch.Tensor] = []
        host: list[torch.Tensor] = []
        num_blocks = self.kv.num_blocks
        groups = self.kv.layer_groups
        rows: Iterable[tuple[int, int, int, int]] = page_table(pages).tolist() if isinstance(pages, (np.ndarray, SlotRun)) else pages
        for slot, sub, block_id, group in rows:
            host_pages = self._host_pages(slot, sub)
            if not 0 <= block_id < num_blocks:
                raise IndexError(f"engine block {block_id} out of range [0, {num_blocks})")
            if not 0 <= group < len(groups):
                raise IndexError(f"KV cache group {group} out of range [0, {len(groups)})")
            if len(groups) == 1:
                host.extend(host_pages)
                engine.extend([layer[block_id] for layer in self._engine])
            else:
                host.extend(host_pages[i] for i in groups[group])
                engine.extend(self._engine[i][block_id] for i in groups[group])
        if self._layer_words is None:
            num_bytes = len(engine) * self.kv.page_bytes
        else:
            num_bytes = sum(page.numel() for page in engine) * self.word.itemsize
        if direction is Direction.STORE:
            return CopyPlan(direction, host, engine, num_bytes)
        return CopyPlan(direction, engine, host, num_bytes)

    def copy(self, direction: Direction, pages: Pages) -> int:
        """Copy ``pages`` in ``direction`` synchronously (the bytes are in place on return); returns
        bytes moved. For KV in host memory; the CUDA engine issues plans on its streams instead."""
        plan = self.plan(direction, pages)
        if plan.dsts:
            torch._foreach_copy_(plan.dsts, plan.srcs)
        return plan.num_bytes
