"""Small pages moved through device staging buffers, pipelined: gathers (or scatters) at the device
memory's speed on one queue, large DMA copies on another, overlapped chunk by chunk.

Why: under FlashAttention's default layout (LBNHC) a page is one layer of one block, and a kvtier
block's pages are consecutive in the engine's memory only when its engine block ids are, so a job
is one descriptor per (layer, page) (:mod:`kvtier.copy.runs`). With tensor parallelism a page is
small (one KV head x 16 tokens x 256 values x bf16 = 8 KiB); copy engines move small descriptors
far below the link's bandwidth (0.06-0.33 of one ``cudaMemcpyAsync`` at 8-16 KiB, measured on an
H100), and issuing 16,384 descriptors costs the calling thread 10-15 ms. Copy kernels that read or
write host memory directly reach the link but take a third to half of the GPU's SMs from the
forward pass for the whole copy (docs/benchmarks.md). So, with device-memory kernels and DMA only:

- store, per chunk: a gather kernel copies the chunk's pages, in host order, from the engine's
  storage viewed as ``[rows, page]`` words into staging buffer ``k`` (on the KERNEL lane, at
  ~1 TB/s; kvtier's own kernel where it loads, :mod:`kvtier.copy.kernels`, else torch's
  ``index_select``); the TRANSFER lane waits for it and copies buffer ``k`` to the host slots in runs as
  long as the host slots are contiguous (a whole slot at least), then marks ``k`` free; the
  gather of chunk ``c + buffers`` waits for that mark. While chunk ``c`` crosses the link, chunk
  ``c + 1`` is gathered: the link never waits for a gather but the first.
- load, per chunk: the TRANSFER lane copies the host runs into buffer ``k``; the KERNEL lane waits
  and a scatter kernel (or torch's ``index_copy_``) writes the rows into the engine's pages, then marks ``k`` free for the
  transfer of chunk ``c + buffers``.

Ordering: a job begins on both lanes after everything issued before it on its side stream (the
TRANSFER lane; the copy engine made it wait for the compute stream), and ends with the TRANSFER
lane waiting for the KERNEL lane, so the copy engine's ``end`` event (:mod:`kvtier.copy.cuda`)
covers the whole job and every ordering rule of :mod:`kvtier.copy.base` holds as for one stream.
Consecutive jobs of a direction reuse its buffers safely: the next job's KERNEL lane starts after
the TRANSFER lane reached it, i.e. after every copy out of (or into) the buffers before it.

:class:`StagingLanes` is what a job asks of the device; :class:`~kvtier.copy.streams.TorchCudaStreams`
implements it with two CUDA streams and events, the tests' simulated device with two simulated
streams (``tests/sim_device.py``), so the same schedule (:meth:`StagedRuns.issue`) is checked for
bit-exactness and ordering on CPU tensors. On a GPU with kvtier's kernels, a job shape's
repeated jobs go as one CUDA graph of this same schedule (:mod:`kvtier.copy.jobgraph`,
:mod:`kvtier.copy.cudagraph`).

Memory: :data:`STAGING_BUFFERS` buffers of :data:`STAGING_CHUNK_BYTES` per direction (128 MiB, so
256 MiB of device memory for stores and loads), allocated when the copy engine is built (vLLM
registering its KV caches) and kept; a job larger than that goes in chunks. :class:`CopyMethod` and
:mod:`kvtier.copy.choice` pick staged or runs per job. Planning is called on the thread that
starts a job; :meth:`StagedRuns.issue` by the device's ``copy`` on that same thread.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvtier.copy.base import Direction
from kvtier.copy.pages import PagedKV, storage_bytes
from kvtier.copy.runs import PageEntries, RunPlanner, SlotJob

# One staging buffer; a chunk of a job fills at most one. A job shape's CUDA graph costs the
# issuing thread ~4 us per chunk (an update and two nodes launched, H100 host): 64 MiB chunks make
# a 512-block x 32-layer job 2-16 chunks at 8-64 KiB pages; 32 and 64 MiB moved alike (0.98-0.99
# of one cudaMemcpyAsync, docs/benchmarks.md).
STAGING_CHUNK_BYTES = 64 * 2**20
STAGING_BUFFERS = 2  # per direction: a chunk crosses the link while the next is gathered
STAGE_BELOW_BYTES = 32 * 2**10  # runs averaging fewer bytes are always staged (vLLM: ~28 KiB)


class CopyMethod(enum.Enum):
    """How the CUDA engine moves a job of dense pages."""

    RUNS = "runs"  # one DMA descriptor per merged run (cudaMemcpyBatchAsync)
    STAGED = "staged"  # gather/scatter kernels through device staging buffers, pipelined with large DMAs
    AUTO = "auto"  # per job: staged below STAGE_BELOW_BYTES per run, else the faster one as measured
    PAGES = "pages"  # not a choice: how strided pages (and the CPU engine's) move, one copy per page pair


class Lane(enum.Enum):
    KERNEL = "kernel"  # gathers and scatters (device memory only)
    TRANSFER = "transfer"  # host copies; the job's side stream

    __hash__ = object.__hash__  # members are singletons compared by identity; Enum's hash is a Python call


class StagingLanes(Protocol):
    """The two queues one staged job is issued on, and marks between them (each mark a reusable
    event named by a small integer; a wait binds to the mark's latest record, issued before it).
    Every call issues work and returns at once; nothing here blocks."""

    def upload(self, plan: StagedRuns) -> torch.Tensor:
        """Issue the upload of what the job's gathers or scatters read (its row index,
        :meth:`StagedRuns.row_index`, or, for kernels that read them, its
        :meth:`StagedRuns.kernel_numbers`) to the device on the KERNEL lane, after :meth:`begin`
        (the lanes may land every job's upload in one device buffer: begun, the KERNEL lane is past
        every earlier job's gathers and scatters, whichever lane or graph issued them); the device
        tensor it lands in (valid for work issued on that lane from now on, until the next upload),
        handed back to :meth:`gather` / :meth:`scatter`. Never blocks (from page-locked memory on a
        GPU)."""

    def begin(self) -> None:
        """Both lanes start after everything issued so far on the TRANSFER lane."""

    def gather(self, plan: StagedRuns, uploaded: torch.Tensor, first: int, pages: int, buffer: int) -> None:
        """Issue on the KERNEL lane: the rows of ``plan.rows`` of the job's pages ``[first, first +
        pages)`` into the first ``pages`` rows of staging buffer ``buffer`` (``uploaded``: what
        :meth:`upload` returned)."""

    def scatter(self, plan: StagedRuns, uploaded: torch.Tensor, first: int, pages: int, buffer: int) -> None:
        """Issue on the KERNEL lane: the first ``pages`` rows of staging buffer ``buffer`` into the
        rows of ``plan.rows`` of the job's pages ``[first, first + pages)``."""

    def transfer(self, plan: StagedRuns, chunk: int) -> None:
        """Issue chunk ``chunk``'s host copies (:meth:`StagedRuns.chunk_runs`) on the TRANSFER lane."""

    def mark(self, lane: Lane, mark: int) -> None:
        """Record ``mark`` at the point ``lane`` has reached."""

    def wait(self, lane: Lane, mark: int) -> None:
        """Work issued on ``lane`` from now on waits for ``mark`` (as last recorded)."""

    def finish(self) -> None:
        """The TRANSFER lane waits for everything issued on the KERNEL lane."""


def filled(buffer: int) -> int:
    """The mark of staging buffer ``buffer`` holding its chunk (gathered, or arrived from the host)."""
    return 2 * buffer


def freed(buffer: int) -> int:
    """The mark of staging buffer ``buffer`` free again (its chunk copied out, or scattered)."""
    return 2 * buffer + 1


@dataclass(frozen=True, eq=False)
class HostRuns:
    """One chunk's copies between a staging buffer and the host region: run ``i`` is
    ``sizes[i]`` bytes at ``staging_offset[i]`` of ``staging`` and ``host_offset[i]`` of ``host``;
    to the host for a store, from it for a load (for torch's copies; a batched copy call reads
    :meth:`StagedRuns.chunk_addresses`)."""

    direction: Direction
    staging: torch.Tensor  # 1-D uint8 view of one staging buffer, on the device
    host: torch.Tensor  # 1-D uint8, the whole host region
    staging_offset: np.ndarray
    host_offset: np.ndarray
    sizes: np.ndarray

    def views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(destinations, sources) as 1-D uint8 views, for torch copies."""
        runs = list(zip(self.staging_offset.tolist(), self.host_offset.tolist(), self.sizes.tolist()))
        staging = [self.staging.narrow(0, s, n) for s, _, n in runs]
        host = [self.host.narrow(0, h, n) for _, h, n in runs]
        return (host, staging) if self.direction is Direction.STORE else (staging, host)


_COUNT_WORDS: dict[int, np.ndarray] = {}  # page count -> a read-only int64 array of it (jobs repeat sizes)


def _count_word(pages: int) -> np.ndarray:
    """``np.array([pages], int64)``, read-only, made once per count (at most 4,096 kept)."""
    word = _COUNT_WORDS.get(pages)
    if word is None:
        if len(_COUNT_WORDS) >= 4096:
            _COUNT_WORDS.clear()
        word = _COUNT_WORDS[pages] = np.array([pages], dtype=np.int64)
        word.flags.writeable = False
    return word


class StagingBuffers:
    """One direction's staging buffers: ``count`` device buffers of ``chunk_pages`` pages each, as
    ``[chunk_pages, words]`` views (``words`` of the planner's word type) and as flat bytes.
    Allocated once, on the calling thread (the memory is never freed while the engine lives, so no
    stream of the allocator's bookkeeping matters); used in the order of the direction's lanes."""

    def __init__(self, device: torch.device, count: int, chunk_pages: int, page_words: int, word: torch.dtype):
        whole = torch.empty(count * chunk_pages, page_words, dtype=word, device=device)
        self.rows = list(whole.view(count, chunk_pages, page_words).unbind(0))
        self.flat = [rows.view(-1).view(torch.uint8) for rows in self.rows]
        self.addresses = np.array([flat.data_ptr() for flat in self.flat], dtype=np.int64)
        self.address_list = self.addresses.tolist()  # the same as ints (what a launch takes)
        self.bytes = whole.numel() * whole.element_size()


@dataclass(eq=False, slots=True)
class StagedRuns:
    """One job through the staging buffers (see the module docstring). The engine row of each
    page, host order: ``index``, or, for a job of whole blocks, ``blocks[p // layers] *
    block_rows + layer_rows[p % layers]`` for page ``p`` (``index`` None: :meth:`row_index`
    computes it when asked); chunk ``c`` is pages ``[c * chunk_pages, (c + 1) * chunk_pages)``
    and runs ``[run_bounds[c], run_bounds[c + 1])`` of the run arrays (``staging_offset`` within
    the chunk's buffer, ``host_offset`` in the host region, ``sizes``, ``staging_addr`` /
    ``host_addr``: the same in raw addresses, buffer ``c % len(buffers.rows)``). Read-only once
    made (not frozen: a frozen dataclass's construction costs the issuing thread ~1.5 us more)."""

    direction: Direction
    rows: torch.Tensor  # [rows, words] view of the engine's storage
    host: torch.Tensor
    index: np.ndarray | None
    chunk_pages: int
    run_bounds: np.ndarray
    staging_offset: np.ndarray
    host_offset: np.ndarray
    sizes: np.ndarray
    staging_addr: np.ndarray
    host_addr: np.ndarray
    buffers: StagingBuffers
    rows_address: int = 0  # ``rows.data_ptr()``, for launches that take raw addresses
    blocks: np.ndarray | None = None  # a job of whole blocks: its engine blocks, host order
    layer_rows: np.ndarray | None = None  # with ``blocks``: each layer's row of engine block 0
    block_rows: int = 0  # with ``blocks``: rows from one engine block to the next

    @property
    def num_bytes(self) -> int:
        return self.num_pages * self.rows.shape[1] * self.rows.element_size()

    @property
    def num_pages(self) -> int:
        if self.index is not None:
            return len(self.index)
        assert self.blocks is not None and self.layer_rows is not None
        return len(self.blocks) * len(self.layer_rows)

    def row_index(self) -> np.ndarray:
        """The engine row of each page, host order (int64)."""
        if self.index is not None:
            return self.index
        assert self.blocks is not None and self.layer_rows is not None
        return (self.blocks[:, None] * self.block_rows + self.layer_rows).ravel()

    def kernel_numbers(self) -> tuple[np.ndarray, ...]:
        """What kvtier's row kernels read (:meth:`kvtier.copy.kernels.RowKernels.launch`), as the
        parts to upload one after the other (int64): the job's page count, then, for a job of
        whole blocks, ``layer_rows`` and ``blocks``, else its :meth:`row_index`."""
        count = _count_word(self.num_pages)
        if self.blocks is not None and self.layer_rows is not None:
            return count, self.layer_rows, self.blocks
        return count, self.row_index()

    def kernel_blocks(self) -> tuple[int, int] | None:
        """The ``blocks`` argument of a row kernel (:meth:`kvtier.copy.kernels.RowKernels.launch`):
        ``(layers, block_rows)`` for a job of whole blocks, else None."""
        if self.blocks is not None and self.layer_rows is not None:
            return len(self.layer_rows), self.block_rows
        return None

    @property
    def last_chunk_pages(self) -> int:
        """Pages of the job's last chunk (0: no chunk)."""
        return self.num_pages - (self.num_chunks - 1) * self.chunk_pages if self.num_chunks else 0

    @property
    def num_chunks(self) -> int:
        return len(self.run_bounds) - 1

    @property
    def num_runs(self) -> int:
        """Host copies (DMA descriptors) of the job."""
        return len(self.sizes)

    @property
    def one_run_per_chunk(self) -> bool:
        """Whether each chunk's host copies are one run (the usual job: consecutive slots)."""
        return self.num_runs == self.num_chunks

    def chunk_runs(self, chunk: int) -> HostRuns:
        """Chunk ``chunk``'s host copies, through its staging buffer."""
        lo, hi = int(self.run_bounds[chunk]), int(self.run_bounds[chunk + 1])
        buffer = chunk % len(self.buffers.flat)
        return HostRuns(self.direction, self.buffers.flat[buffer], self.host, self.staging_offset[lo:hi],
                        self.host_offset[lo:hi], self.sizes[lo:hi])

    def copy_addresses(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The job's host copies as (destinations, sources, sizes) raw addresses, run order."""
        if self.direction is Direction.STORE:
            return self.host_addr, self.staging_addr, self.sizes
        return self.staging_addr, self.host_addr, self.sizes

    def chunk_addresses(self, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Chunk ``chunk``'s host copies as (destinations, sources, sizes) raw addresses, the
        arrays a batched copy call reads (views of the plan's arrays)."""
        lo, hi = int(self.run_bounds[chunk]), int(self.run_bounds[chunk + 1])
        dsts, srcs, sizes = self.copy_addresses()
        return dsts[lo:hi], srcs[lo:hi], sizes[lo:hi]

    def issue(self, lanes: StagingLanes) -> None:
        """Issue the whole job on ``lanes`` (see the module docstring); returns at once."""
        count = len(self.buffers.rows)
        store = self.direction is Direction.STORE
        chunks, chunk_pages, total = self.num_chunks, self.chunk_pages, self.num_pages
        lanes.begin()
        index = lanes.upload(self)  # after begin: every earlier job's gathers or scatters read the last upload
        for c in range(chunks):
            buffer = c % count
            first = c * chunk_pages
            pages = min(chunk_pages, total - first)
            reused = c >= count  # an earlier chunk of this job went through this buffer
            last_use = c + count >= chunks  # no later chunk waits for this buffer
            if store:
                if reused:
                    lanes.wait(Lane.KERNEL, freed(buffer))
                lanes.gather(self, index, first, pages, buffer)
                lanes.mark(Lane.KERNEL, filled(buffer))
                lanes.wait(Lane.TRANSFER, filled(buffer))
                lanes.transfer(self, c)
                if not last_use:
                    lanes.mark(Lane.TRANSFER, freed(buffer))
            else:
                if reused:
                    lanes.wait(Lane.TRANSFER, freed(buffer))
                lanes.transfer(self, c)
                lanes.mark(Lane.TRANSFER, filled(buffer))
                lanes.wait(Lane.KERNEL, filled(buffer))
                lanes.scatter(self, index, first, pages, buffer)
                if not last_use:
                    lanes.mark(Lane.KERNEL, freed(buffer))
        lanes.finish()

    def torch_gather(self, index: torch.Tensor, first: int, pages: int, buffer: int) -> None:
        """:meth:`StagingLanes.gather` as a torch op on the current stream (``index``: the
        :meth:`row_index` on the device)."""
        torch.index_select(self.rows, 0, index[first:first + pages], out=self.buffers.rows[buffer][:pages])

    def torch_scatter(self, index: torch.Tensor, first: int, pages: int, buffer: int) -> None:
        """:meth:`StagingLanes.scatter` as a torch op on the current stream."""
        self.rows.index_copy_(0, index[first:first + pages], self.buffers.rows[buffer][:pages])


class StagingUnavailable(RuntimeError):
    """The staging buffers could not be allocated (device memory): jobs go as runs instead."""


class StagedPlanner:
    """Plans :class:`StagedRuns` from a :class:`~kvtier.copy.runs.RunPlanner`'s entries. Only for
    KV whose every page is a row of one storage seen as ``[rows, page_bytes]`` (:meth:`fits`):
    one allocation (vLLM 0.32 allocates one), one page size, every page starting at a multiple of
    it (LBNHC, LBHNC, BLNHC, BLHNC, padded or not; kernel-split blocks regrouped; MLA; Mamba state
    pages padded to the attention page). Pages move as the widest word (int64 where the page size
    allows): torch's ``index_copy_`` moves uint8 rows at a third of the speed.

    Owns the staging buffers, one :class:`StagingBuffers` per direction (each direction's jobs
    run in its lanes' order)."""

    def __init__(self, kv: PagedKV, runs: RunPlanner, host: torch.Tensor,
                 chunk_bytes: int = STAGING_CHUNK_BYTES, buffers: int = STAGING_BUFFERS):
        if not self.fits(kv):
            raise ValueError("staged copies need every page as a row of one storage ([rows, page_bytes])")
        assert kv.rows is not None
        page = kv.page_bytes
        storage = storage_bytes(kv.rows[0])
        word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8) if page % w.itemsize == 0)
        self.rows = storage[: storage.numel() // page * page].view(-1, page).view(word)
        self._rows_address = self.rows.data_ptr()
        self.word = word
        self.page_bytes = page
        self.runs = runs
        self.host = host
        self.segment_bytes = runs.segment_bytes
        self.chunk_pages = max(chunk_bytes // page, 1)
        self.buffer_count = max(buffers, 1)
        self._buffers: dict[Direction, StagingBuffers] = {}
        self._host_address = host.data_ptr()
        self.slot_stride = runs.num_layers * page  # host bytes from a slot to the next, for jobs of whole blocks
        self._chunked: dict[tuple[Direction, int], tuple[np.ndarray, ...]] = {}  # see _one_run_chunks
        self._chunk_tables: dict[Direction, tuple[np.ndarray, ...]] = {}
        self._block_rows = runs.block_rows(page)  # (rows a block, each layer's row of block 0), or None

    @staticmethod
    def fits(kv: PagedKV) -> bool:
        if kv.rows is None or not kv.uniform:
            return False
        page = kv.page_bytes
        storages = {rows.untyped_storage().data_ptr() for rows in kv.rows}
        return len(storages) == 1 and all(
            rows.storage_offset() % page == 0 and (rows.shape[0] < 2 or rows.stride(0) % page == 0)
            for rows in kv.rows)

    @property
    def staging_bytes(self) -> int:
        """Device memory the staging buffers take once both directions staged a job."""
        return 2 * self.buffer_count * self.chunk_pages * self.page_bytes

    def plan(self, direction: Direction, entries: PageEntries) -> StagedRuns:
        """The job's chunks and host runs from its entries (vectorized). Raises
        :class:`StagingUnavailable` if the direction's buffers cannot be allocated."""
        page, count = self.page_bytes, len(entries)
        h = entries.h_offset
        if count:
            joins = h[1:] == h[:-1] + page
            if self.segment_bytes < self.host.numel():  # several pinning registrations: never across one
                joins &= h[1:] // self.segment_bytes == h[:-1] // self.segment_bytes
            breaks = np.flatnonzero(np.concatenate(([True], ~joins)))
        else:
            breaks = np.zeros(0, dtype=np.int64)
        return self._plan(direction, entries.e_offset // page, count, breaks, lambda starts: h[starts])

    def plan_slots(self, direction: Direction, job: SlotJob, breaks: np.ndarray | None = None) -> StagedRuns:
        """:meth:`plan` of a :class:`~kvtier.copy.runs.SlotJob`, computed per block: the host runs
        break only where blocks do (a block's layers are one run of its slot). ``breaks``: the
        planner's :meth:`~kvtier.copy.runs.RunPlanner.block_breaks` of ``job``, if computed."""
        layers, page = self.runs.num_layers, self.page_bytes
        rows_of = self._block_rows
        count = len(job) * layers
        if rows_of is None:  # per-layer block strides: an index of every page
            index, blocks = self.runs.engine_rows(job, page), {}
        else:
            index, blocks = None, {"blocks": job.block, "block_rows": rows_of[0], "layer_rows": rows_of[1]}
        if job.first_slot is not None:  # one host run: page position p is at (first_slot * layers + p) pages
            buffers = self.buffers(direction)
            starts, run_bounds, staging_offset, sizes, staging_addr = self._one_run_chunks(direction, count)
            hosts = starts + job.first_slot * self.slot_stride
            return StagedRuns(direction, self.rows, self.host, index, self.chunk_pages, run_bounds, staging_offset,
                              hosts, sizes, staging_addr, self._host_address + hosts, buffers, self._rows_address,
                              **blocks)
        if breaks is None:
            breaks = self.runs.block_breaks(job)

        def host_offset(starts: np.ndarray) -> np.ndarray:
            return (job.slot[starts // layers] * layers + starts % layers) * page

        return self._plan(direction, index, count, np.flatnonzero(breaks) * layers, host_offset, **blocks)

    def _plan(self, direction: Direction, index: np.ndarray | None, count: int, breaks: np.ndarray,
              host_offset: Callable[[np.ndarray], np.ndarray], **blocks) -> StagedRuns:
        """The plan of ``count`` pages (engine rows ``index``, host order, or ``blocks``: the
        :class:`StagedRuns` fields of a job of whole blocks) whose host copies break at the page
        positions ``breaks`` and at every chunk's start; ``host_offset(starts)``: where in the
        host region the pages at positions ``starts`` go."""
        buffers = self.buffers(direction)
        if len(breaks) <= 1:  # one host run (or none): it breaks at chunk starts only
            starts, run_bounds, staging_offset, sizes, staging_addr = self._one_run_chunks(direction, count)
            starts = starts // self.page_bytes
        else:
            page, chunk = self.page_bytes, self.chunk_pages
            chunk_starts = np.arange(0, count, chunk)
            starts = np.union1d(breaks, chunk_starts)
            sizes = (np.diff(np.append(starts, count)) * page).astype(np.int64, copy=False)
            chunk_of = starts // chunk
            run_bounds = np.searchsorted(chunk_of, np.arange(len(chunk_starts) + 1), side="left")
            staging_offset = (starts - chunk_of * chunk) * page
            staging_addr = buffers.addresses[chunk_of % self.buffer_count] + staging_offset
        hosts = host_offset(starts)
        return StagedRuns(direction, self.rows, self.host, index, self.chunk_pages, run_bounds, staging_offset, hosts,
                          sizes, staging_addr, self._host_address + hosts, buffers, self._rows_address, **blocks)

    _CHUNKED_SHAPES = 1024  # job sizes whose chunking is kept (jobs are as long as their prompts' hits)

    def _one_run_chunks(self, direction: Direction, count: int) -> tuple[np.ndarray, ...]:
        """(run starts in bytes from the run's start, run bounds, staging offsets, sizes, staging
        addresses) of a job of ``count`` pages whose host copies are one run, cut at chunk starts
        (most jobs: consecutive slots), shared read-only by the plans of that size. Kept for the
        last :data:`_CHUNKED_SHAPES` sizes; a size not kept is sliced from one table per direction
        (grown as larger jobs come), so it costs a few slices, not a computation."""
        key = (direction, count)
        found = self._chunked.get(key)
        if found is not None:
            return found
        chunks = -(-count // self.chunk_pages)
        table = self._chunk_tables.get(direction)
        if table is None or len(table[0]) < chunks:
            table = self._chunk_table(direction, max(chunks, 2 * len(table[0]) if table else 64))
            self._chunk_tables[direction] = table
        starts, bounds, zeros, sizes, staging_addr = table
        sizes = sizes[:chunks].copy()
        if chunks:
            sizes[-1] = (count - (chunks - 1) * self.chunk_pages) * self.page_bytes
        sizes.flags.writeable = False
        found = (starts[:chunks], bounds[:chunks + 1], zeros[:chunks], sizes, staging_addr[:chunks])
        if len(self._chunked) >= self._CHUNKED_SHAPES:
            self._chunked.pop(next(iter(self._chunked)))
        self._chunked[key] = found
        return found

    def _chunk_table(self, direction: Direction, chunks: int) -> tuple[np.ndarray, ...]:
        """:meth:`_one_run_chunks`' arrays for ``chunks`` whole chunks, read-only."""
        chunk_bytes = self.chunk_pages * self.page_bytes
        addresses = self.buffers(direction).addresses
        table = (np.arange(chunks, dtype=np.int64) * chunk_bytes, np.arange(chunks + 1, dtype=np.int64),
                 np.zeros(chunks, dtype=np.int64), np.full(chunks, chunk_bytes, dtype=np.int64),
                 addresses[np.arange(chunks) % self.buffer_count])
        for array in table:
            array.flags.writeable = False
        return table

    def host_address(self, slot: int) -> int:
        """The address of host slot ``slot`` of a job of whole blocks."""
        return self._host_address + slot * self.slot_stride

    def buffers(self, direction: Direction) -> StagingBuffers:
        """The direction's staging buffers (allocated at the first call). Raises
        :class:`StagingUnavailable` if they cannot be allocated."""
        buffers = self._buffers.get(direction)
        if buffers is None:
            try:
                buffers = StagingBuffers(self.rows.device, self.buffer_count, self.chunk_pages, self.rows.shape[1],
                                         self.word)
            except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
                raise StagingUnavailable(
                    f"cannot allocate {self.buffer_count} x {self.chunk_pages * self.page_bytes} B of staging "
                    f"buffers on {self.rows.device}: {exc}") from exc
            self._buffers[direction] = buffers
        return buffers
