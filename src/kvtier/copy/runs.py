"""A job's page copies as byte runs: what the CUDA engine hands to one batched copy call per job.

vLLM's own offloading issues one batched call per job over arrays of source and destination
addresses (``v1/kv_offload/cpu/gpu_worker.py:645-687``); a Python ``copy_`` per (layer, page)
costs milliseconds of host time per job on the thread that launches the forward, and through
``torch._foreach_copy_`` across devices it is one ``cudaMemcpyAsync`` per pair anyway. So for
dense pages (:attr:`~kvtier.copy.pages.PagedKV.flat`: every block-compact layout):

- :class:`RunPlanner` computes once, per layer, where block 0's page starts in its storage and how
  far apart blocks are (vLLM's ``KVCacheTensor`` placement: layer-outermost layouts put a layer's
  blocks one page apart, block-outermost ones a whole packed block apart), and once where the
  host region starts;
- :meth:`RunPlanner.plan` turns a job's pages into arrays of (source, destination, length), one
  entry per (layer, page), with numpy (no Python loop over layers), sorted in host order, and
  merges neighbours contiguous on both sides into one run: the pages of a kvtier block of several
  engine blocks (consecutive engine blocks of a layer, consecutive pages of a host slot), or,
  under block-outermost layouts, whole blocks and consecutive blocks. A run never crosses a host
  pinning chunk (:func:`kvtier.copy.pinning.register_chunk_bytes`).

A :class:`ByteRuns` holds its address arrays for as long as the job is in flight, and can also
be carried out with torch ops on the same memory (:meth:`ByteRuns.views`): how the tests check
the planning bit for bit on CPU tensors, and the fallback where no CUDA runtime library is found.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvtier.copy.base import Direction, PageCopy, Pages, SlotRun, page_table, run_first
from kvtier.copy.pages import HostSlots, PagedKV, storage_bytes
from kvtier.copy.pinning import register_chunk_bytes


@dataclass(frozen=True, eq=False)
class ByteRuns:
    """One job's copies: run ``i`` moves ``sizes[i]`` bytes from ``storages[src_storage[i]]`` at
    byte ``src_offset[i]`` to ``storages[dst_storage[i]]`` at ``dst_offset[i]``. ``src_addr`` and
    ``dst_addr`` are the same places as raw addresses (int64), the arrays a batched copy call
    reads. ``num_pages`` counts the (layer, page) copies before merging."""

    direction: Direction
    storages: tuple[torch.Tensor, ...]  # 1-D uint8 views of whole storages (engine ones, then the host region)
    src_storage: np.ndarray
    src_offset: np.ndarray
    dst_storage: np.ndarray
    dst_offset: np.ndarray
    sizes: np.ndarray
    src_addr: np.ndarray
    dst_addr: np.ndarray
    num_pages: int

    @property
    def num_runs(self) -> int:
        return len(self.sizes)

    @property
    def num_bytes(self) -> int:
        return int(self.sizes.sum())

    def views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each run's destination and source as 1-D uint8 views (for ``torch._foreach_copy_``)."""
        def side(storage: np.ndarray, offset: np.ndarray) -> list[torch.Tensor]:
            return [self.storages[s].narrow(0, o, n)
                    for s, o, n in zip(storage.tolist(), offset.tolist(), self.sizes.tolist())]

        return side(self.dst_storage, self.dst_offset), side(self.src_storage, self.src_offset)


@dataclass(frozen=True, eq=False)
class SlotJob:
    """A job of whole kvtier blocks of one engine block each, in slot order, no slot twice: kvtier
    block ``i`` is host ``slot[i]`` <-> engine block ``block[i]``, every layer (one KV cache
    group). Most jobs are (:meth:`RunPlanner.slot_job`); planned per block, not per (block,
    layer), which is what makes planning cheap on the thread that issues the forward."""

    slot: np.ndarray
    block: np.ndarray
    first_slot: int | None = None  # set when slot[i] == first_slot + i, all in one pinning chunk

    def __len__(self) -> int:
        return len(self.slot)


@dataclass(frozen=True, eq=False)
class PageEntries:
    """A job's (layer, page) copies in host order, one entry each: engine storage index and byte
    offset, host region byte offset, bytes."""

    e_storage: np.ndarray
    e_offset: np.ndarray
    h_offset: np.ndarray
    sizes: np.ndarray

    def __len__(self) -> int:
        return len(self.sizes)


class RunPlanner:
    """Plans :class:`ByteRuns` between dense engine pages and host slots (see the module docstring).
    Built once per copy engine; :meth:`plan` is called on the thread that starts a job."""

    def __init__(self, kv: PagedKV, host: HostSlots):
        if kv.rows is None:
            raise ValueError("byte runs need dense KV pages (a block-compact KV cache layout)")
        storages: list[torch.Tensor] = []
        index_of: dict[int, int] = {}
        layer_storage, layer_base, layer_stride = [], [], []
        for rows in kv.rows:
            key = rows.untyped_storage().data_ptr()
            if key not in index_of:
                index_of[key] = len(storages)
                storages.append(storage_bytes(rows))
            layer_storage.append(index_of[key])
            layer_base.append(rows.storage_offset())
            layer_stride.append(rows.stride(0))
        self.host_storage = len(storages)
        storages.append(host.buffer)
        self.storages = tuple(storages)
        self._pointers = np.array([s.data_ptr() for s in storages], dtype=np.int64)
        self._layer_storage = np.array(layer_storage, dtype=np.int64)
        self._layer_base = np.array(layer_base, dtype=np.int64)
        self._layer_stride = np.array(layer_stride, dtype=np.int64)
        self._layer_bytes = np.array(kv.layer_bytes, dtype=np.int64)
        self._storages_vary = len(set(layer_storage)) > 1  # else entries hold one value, broadcast
        self._sizes_vary = not kv.uniform
        self._strides_vary = len(set(layer_stride)) > 1
        self._groups = [np.array(g, dtype=np.int64) for g in kv.layer_groups]
        self._units: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # engine_rows in rows of a unit
        self._bounds = np.array((host.layout.num_slots, host.layout.pages_per_block, kv.num_blocks,
                                 len(self._groups)), dtype=np.uint64)  # of a page table's columns
        # whether a job can be a SlotJob: one KV cache group, one page per kvtier block, one page size
        self._slot_jobs = len(self._groups) == 1 and host.layout.pages_per_block == 1 and not self._sizes_vary
        self._tiled_bounds = np.tile(self._bounds, 1024)  # the bounds of a flat table's values (grown on demand)
        layout = host.layout
        page = kv.page_bytes
        # whether layer l + 1 of a block continues layer l in the engine's memory (block-outermost layouts)
        self._layer_joins = int(np.sum((self._layer_storage[1:] == self._layer_storage[:-1])
                                       & (self._layer_base[1:] == self._layer_base[:-1] + page)
                                       & (self._layer_stride[1:] == self._layer_stride[:-1])))
        self.page_bytes = kv.page_bytes
        self.num_blocks = kv.num_blocks
        self.num_layers = kv.num_layers
        self._layout = layout
        self.segment_bytes = register_chunk_bytes(layout.slot_bytes)
        self._block_step = self._block_join_step(page)

    def _block_join_step(self, page: int) -> int | object | None:
        """Under uniform positive block strides, the engine block step ``d`` such that block
        ``b + d``'s first layer continues block ``b``'s last in memory (:meth:`_block_joins`), or
        :data:`_NEVER` where no step does; None otherwise (joins are then computed per pair)."""
        stride, last = int(self._layer_stride[0]), len(self._layer_base) - 1
        if self._strides_vary or stride <= 0:
            return None
        gap = int(self._layer_base[last]) + page - int(self._layer_base[0])
        if self._layer_storage[0] != self._layer_storage[last] or gap % stride:
            return _NEVER
        return gap // stride

    def entries(self, pages: Pages) -> PageEntries:
        """The job's (layer, page) copies in host order, not merged. IndexError naming the first
        page out of range, before anything could be copied."""
        table = self.table(pages)
        if len(self._groups) == 1:
            e_storage, e_offset, h_offset, size = self._one_group(table)
        else:
            e_storage, e_offset, h_offset, size = self._every_group(table)
        if len(h_offset) > 1 and not np.all(h_offset[1:] > h_offset[:-1]):
            order = np.argsort(h_offset)
            e_storage, e_offset, h_offset, size = e_storage[order], e_offset[order], h_offset[order], size[order]
        return PageEntries(e_storage, e_offset, h_offset, size)

    def table(self, pages: Pages) -> np.ndarray:
        """The job's pages as an ``[n, 4]`` array, checked: IndexError naming the first page out of
        range, before anything could be copied."""
        table = page_table(pages)
        self._check(table)
        return table

    def slot_job(self, table: np.ndarray) -> SlotJob | None:
        """``table`` (checked) as a :class:`SlotJob` when it is one (one KV cache group, one page per
        kvtier block, one page size, no slot twice), else None."""
        if not self._slot_jobs or not len(table):
            return None
        slot, block = table[:, 0], table[:, 2]
        first = self._run_first(slot)
        if first is not None:  # consecutive slots in one pinning chunk (the usual store): one host run
            return SlotJob(slot, block, first)
        if len(slot) > 1 and not np.all(slot[1:] > slot[:-1]):
            order = np.argsort(slot, kind="stable")
            slot, block = slot[order], block[order]
            if np.any(slot[1:] == slot[:-1]):
                return None
        return SlotJob(slot, block)

    def one_run_first(self, table: np.ndarray) -> int | None:
        """For ``table`` (checked): the first slot of a job that :meth:`slot_job` makes one host
        run of (:attr:`SlotJob.first_slot`), without making the job; else None."""
        if not self._slot_jobs or not len(table):
            return None
        return self._run_first(table[:, 0])

    def slot_run_first(self, run: SlotRun) -> int | None:
        """``run.first_slot`` when ``run`` is a job :meth:`slot_job` makes one host run of (its
        slots in one pinning chunk; one KV cache group and one page per kvtier block here), checked
        from two integers and one comparison over its blocks; else None (the caller plans it from
        its table). IndexError naming the first page out of range, as :meth:`table` does."""
        blocks, first = run.blocks, run.first_slot
        count = len(blocks)
        if not self._slot_jobs or not count or type(blocks) is not np.ndarray or blocks.dtype != np.int64 \
                or blocks.ndim != 1:
            return None
        if first < 0 or first + count > self._layout.num_slots \
                or np.count_nonzero(blocks.view(np.uint64) < self.num_blocks) != count:
            self._check(page_table(run))  # raises, naming the page
        return first if self._in_one_chunk(first, first + count) else None

    def _run_first(self, slot: np.ndarray) -> int | None:
        """``slot[0]`` when the slots are consecutive and in one pinning chunk, else None."""
        first = run_first(slot)
        return first if first is not None and self._in_one_chunk(first, first + len(slot)) else None

    def _in_one_chunk(self, first: int, end: int) -> bool:
        """Whether slots ``[first, end)`` lie in one pinning chunk of the host region."""
        slot_bytes, segment = self._layout.slot_bytes, self.segment_bytes
        return first * slot_bytes // segment == (end * slot_bytes - 1) // segment

    def engine_rows(self, job: SlotJob, unit: int = 1) -> np.ndarray:
        """Offsets of the job's pages in their engine storage, host order ([block, layer]
        flattened), in bytes, or in rows of ``unit`` bytes (every page's offset and block stride
        a multiple of it: the staged planner's rows)."""
        stride, base = self._layer_stride, self._layer_base
        if unit != 1:
            stride, base = self._in_units(unit)
        if self._strides_vary:
            return (job.block[:, None] * stride + base).ravel()
        return (job.block[:, None] * int(stride[0]) + base).ravel()

    def block_rows(self, unit: int) -> tuple[int, np.ndarray] | None:
        """(rows from one engine block to the next, each layer's row of block 0), in rows of
        ``unit`` bytes, when every layer has the same block stride; None otherwise."""
        if self._strides_vary:
            return None
        stride, base = self._in_units(unit)
        return int(stride[0]), base

    def _in_units(self, unit: int) -> tuple[np.ndarray, np.ndarray]:
        """(block strides, layer bases) in ``unit``-byte rows, computed once per unit."""
        cached = self._units.get(unit)
        if cached is None:
            if np.any(self._layer_stride % unit) or np.any(self._layer_base % unit):
                raise ValueError(f"engine pages are not rows of {unit} B")
            cached = self._units[unit] = (self._layer_stride // unit, self._layer_base // unit)
        return cached

    def block_breaks(self, job: SlotJob) -> np.ndarray:
        """``breaks[i]`` (i >= 1): kvtier block ``i`` does not continue block ``i - 1`` in the host
        region (slots not consecutive, or a pinning chunk between them); ``breaks[0]`` is True."""
        slot = job.slot
        if job.first_slot is not None:
            breaks = np.zeros(len(slot), dtype=bool)
            breaks[0] = True
            return breaks
        breaks = np.ones(len(slot), dtype=bool)
        breaks[1:] = slot[1:] != slot[:-1] + 1
        if self.segment_bytes < self._layout.region_bytes:
            chunk = slot * self._layout.slot_bytes // self.segment_bytes
            breaks[1:] |= chunk[1:] != chunk[:-1]
        return breaks

    def _block_joins(self, job: SlotJob, breaks: np.ndarray | None = None) -> np.ndarray:
        """Whether block ``i + 1``'s first layer continues block ``i``'s last on both sides
        (``breaks``: :meth:`block_breaks` of ``job``, if computed already)."""
        last = len(self._layer_base) - 1
        engine = (job.block[1:] * self._layer_stride[0] + self._layer_base[0]
                  == job.block[:-1] * self._layer_stride[last] + self._layer_base[last] + self.page_bytes)
        same = self._layer_storage[0] == self._layer_storage[last]
        return ~(self.block_breaks(job) if breaks is None else breaks)[1:] & engine & same

    def fewest_slot_runs(self, job: SlotJob) -> int:
        """A lower bound of :meth:`count_slot_runs` computed without looking at the job's blocks
        (at most every block continues the one before it)."""
        return max(self.most_slot_runs(job) - (len(job) - 1), 1)

    def most_slot_runs(self, job: SlotJob) -> int:
        """An upper bound of :meth:`count_slot_runs` computed without looking at the job's blocks
        (no block continues the one before it; exact for scattered engine blocks)."""
        return len(job) * (len(self._layer_base) - self._layer_joins)

    def count_slot_runs(self, job: SlotJob, breaks: np.ndarray | None = None) -> int:
        """How many runs :meth:`merge` would make of the job's entries (computed per block;
        ``breaks``: :meth:`block_breaks` of ``job``, if computed already). A job of one host run
        under uniform block strides counts its joins as engine block steps, in a few array ops."""
        if job.first_slot is not None and self._block_step is not None:
            block = job.block
            joins = 0 if self._block_step is _NEVER or len(block) < 2 else \
                int(np.count_nonzero(block[1:] - block[:-1] == self._block_step))
            return self.most_slot_runs(job) - joins
        return self.most_slot_runs(job) - int(self._block_joins(job, breaks).sum())

    def merge_slots(self, direction: Direction, job: SlotJob) -> ByteRuns | None:
        """:meth:`merge` of the job's entries computed per block, where every block is one run in
        the engine (block-outermost layouts); None otherwise."""
        layers = len(self._layer_base)
        if self._layer_joins != layers - 1:
            return None
        starts = np.flatnonzero(np.concatenate(([True], ~self._block_joins(job))))
        sizes = np.diff(np.append(starts, len(job))) * (layers * self.page_bytes)
        e_offset = job.block[starts] * self._layer_stride[0] + self._layer_base[0]
        h_offset = job.slot[starts] * self._layout.slot_bytes
        e_storage = np.full(len(starts), self._layer_storage[0], dtype=np.int64)
        h_storage = np.full(len(starts), self.host_storage, dtype=np.int64)
        src, dst = ((e_storage, e_offset), (h_storage, h_offset)) if direction is Direction.STORE else \
            ((h_storage, h_offset), (e_storage, e_offset))
        return ByteRuns(direction, self.storages, src[0], src[1], dst[0], dst[1], sizes.astype(np.int64),
                        self._pointers[src[0]] + src[1], self._pointers[dst[0]] + dst[1], len(job) * layers)

    def plan(self, direction: Direction, pages: Pages) -> ByteRuns:
        """The merged runs of a job. IndexError naming the first page out of range, before anything
        could be copied."""
        return self.merge(direction, self.entries(pages))

    def merge(self, direction: Direction, entries: PageEntries) -> ByteRuns:
        """``entries`` as runs, neighbours contiguous on both sides merged."""
        e_storage, e_offset, h_offset, size = entries.e_storage, entries.e_offset, entries.h_offset, entries.sizes
        num_pages = len(h_offset)
        joins = self._joins(entries)
        starts = np.flatnonzero(np.concatenate(([True], ~joins))) if num_pages else np.zeros(0, dtype=np.int64)
        ends = np.append(np.cumsum(size), 0)  # ends[i]: bytes of entries 0..i; ends[-1] = 0
        sizes = ends[np.append(starts[1:], num_pages) - 1] - ends[starts - 1] if num_pages else starts
        e_storage, e_offset, h_offset = e_storage[starts], e_offset[starts], h_offset[starts]
        h_storage = np.full(len(starts), self.host_storage, dtype=np.int64)
        if direction is Direction.STORE:
            src, dst = (e_storage, e_offset), (h_storage, h_offset)
        else:
            src, dst = (h_storage, h_offset), (e_storage, e_offset)
        return ByteRuns(direction, self.storages, src[0], src[1], dst[0], dst[1], sizes.astype(np.int64),
                        self._pointers[src[0]] + src[1], self._pointers[dst[0]] + dst[1], num_pages)

    def count_runs(self, entries: PageEntries) -> int:
        """How many runs :meth:`merge` would make of ``entries``."""
        return len(entries) - int(self._joins(entries).sum()) if len(entries) else 0

    def _joins(self, entries: PageEntries) -> np.ndarray:
        """``joins[i]``: entry ``i + 1`` continues entry ``i`` on both sides, in one pinning chunk."""
        e_storage, e_offset, h_offset, size = entries.e_storage, entries.e_offset, entries.h_offset, entries.sizes
        joins = ((h_offset[1:] == h_offset[:-1] + size[:-1]) & (e_storage[1:] == e_storage[:-1])
                 & (e_offset[1:] == e_offset[:-1] + size[:-1]))
        if self.segment_bytes < self._layout.region_bytes:  # several registrations: never across one
            joins &= h_offset[1:] // self.segment_bytes == h_offset[:-1] // self.segment_bytes
        return joins

    def _grid(self, table: np.ndarray, layers: np.ndarray) -> tuple[np.ndarray, ...]:
        """Per (page, layer) of ``table``'s pages and ``layers``: engine storage, engine offset,
        host offset, bytes, each ``[pages, layers]``."""
        layout = self._layout
        slot, sub, block = table[:, 0:1], table[:, 1:2], table[:, 2:3]
        shape = (len(table), len(layers))
        engine_storage = np.broadcast_to(self._layer_storage[layers] if self._storages_vary else 0, shape)
        if self._strides_vary:
            engine_offset = self._layer_base[layers] + block * self._layer_stride[layers]
        else:  # one [pages, layers] operation instead of two
            engine_offset = block * int(self._layer_stride[0]) + self._layer_base[layers]
        # ((slot * num_layers + layer) * pages_per_block + sub) * page, with one [pages, layers] operation
        page_run = layout.pages_per_block * self.page_bytes
        host_offset = (slot * (layout.num_layers * page_run) + sub * self.page_bytes) + layers * page_run
        sizes = np.broadcast_to(self._layer_bytes[layers] if self._sizes_vary else self.page_bytes, shape)
        return engine_storage, engine_offset, host_offset, sizes

    def _one_group(self, table: np.ndarray) -> tuple[np.ndarray, ...]:
        """Pages sorted by (slot, sub), laid out in host order (slot, layer, sub) without sorting
        the (page, layer) entries when every slot of the job has its whole block (the usual job);
        else left for the caller's sort."""
        per_block = self._layout.pages_per_block
        if per_block > 1 or len(table) < 2 or not np.all(table[1:, 0] > table[:-1, 0]):
            table = table[np.lexsort((table[:, 1], table[:, 0]))]
        grids = self._grid(table, self._groups[0])
        if per_block > 1 and len(table) % per_block == 0:
            subs, slots = table[:, 1].reshape(-1, per_block), table[:, 0].reshape(-1, per_block)
            if (subs == np.arange(per_block)).all() and (slots == slots[:, :1]).all():
                grids = tuple(g.reshape(-1, per_block, g.shape[1]).transpose(0, 2, 1) for g in grids)
        return tuple(_flat(g) for g in grids)

    def _every_group(self, table: np.ndarray) -> tuple[np.ndarray, ...]:
        parts = [self._grid(table[table[:, 3] == group], layers) for group, layers in enumerate(self._groups)]
        return tuple(np.concatenate([part[i].ravel() for part in parts]) for i in range(4))

    def _check(self, table: np.ndarray) -> None:
        """IndexError naming the first page of ``table`` out of range. One contiguous comparison
        of the flat table against its columns' bounds tiled (a [n, 4] broadcast is 3x slower:
        this runs on the thread that issues the forward)."""
        layout = self._layout
        flat = table.reshape(-1).view(np.uint64)  # a negative value is >= 2**63 there
        if len(self._tiled_bounds) < len(flat):
            self._tiled_bounds = np.tile(self._bounds, 2 * len(table))
        if np.count_nonzero(flat < self._tiled_bounds[:len(flat)]) == len(flat):
            return
        in_range = table.view(np.uint64) < self._bounds
        page = PageCopy(*table[int(np.flatnonzero(~in_range.all(axis=1))[0])].tolist())
        raise IndexError(
            f"page {page} out of range ({layout.num_slots} slots x {layout.pages_per_block} pages per block, "
            f"engine blocks [0, {self.num_blocks}), {len(self._groups)} KV cache groups)"
        )


_NEVER = object()  # RunPlanner._block_step: no engine block continues another


def _flat(grid: np.ndarray) -> np.ndarray:
    """``grid`` flattened in C order; a grid of one value (a broadcast: one storage, one page
    size) as a 1-D broadcast of it, without copying."""
    if grid.size and grid.strides and not any(grid.strides):
        return np.broadcast_to(grid.flat[0], (grid.size,))
    return grid.ravel()
