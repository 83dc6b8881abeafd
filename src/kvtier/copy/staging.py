"""Small pages moved through device staging buffers, pipelined: gathers (or scatters) at the device
memory's speed on one queue, large DMA copies on another, overlapped chunk by chunk. This module
plans such jobs (:class:`StagedPlanner`: which KV can be staged, a job's chunks and host runs, the
buffers they go through) and names the copy methods; a plan, its buffers and the schedule that
issues it are :mod:`kvtier.copy.staged_runs`'s.

Why: under FlashAttention's default layout (LBNHC) a page is one layer of one block, and a kvtier
block's pages are consecutive in the engine's memory only when its engine block ids are, so a job
is one descriptor per (layer, page) (:mod:`kvtier.copy.runs`). With tensor parallelism a page is
small (one KV head x 16 tokens x 256 values x bf16 = 8 KiB); copy engines move small descriptors
far below the link's bandwidth (0.06-0.33 of one ``cudaMemcpyAsync`` at 8-16 KiB, measured on an
H100), and issuing 16,384 descriptors costs the calling thread 10-15 ms. Copy kernels that read or
write host memory directly reach the link but take a third to half of the GPU's SMs from the
forward pass for the whole copy (docs/benchmarks.md). So, with device-memory kernels and DMA only:

- store: a gather kernel copies a chunk's pages, in host order, into a staging buffer (at ~1 TB/s),
  and the buffer goes to the host slots in runs as long as the slots are contiguous;
- load: the host runs are copied into a buffer, and a scatter kernel writes its rows into the
  engine's pages;

a chunk crossing the link while the next is gathered (:meth:`~kvtier.copy.staged_runs.StagedRuns.issue`).

Memory: :data:`STAGING_BUFFERS` buffers of :data:`STAGING_CHUNK_BYTES` per direction (128 MiB, so
256 MiB of device memory for stores and loads), allocated when the copy engine is built (vLLM
registering its KV caches) and kept; a job larger than that goes in chunks. :class:`CopyMethod` and
:mod:`kvtier.copy.choice` pick staged or runs per job.

Invariants of a plan (:meth:`StagedPlanner.plan`, :meth:`StagedPlanner.plan_slots`):

- a chunk is at most one staging buffer (``chunk_pages`` pages, at least one);
- its host runs break at every chunk's start and wherever the host region does not continue
  (pages not consecutive; a pinning registration's end: ``segment_bytes``,
  :meth:`~kvtier.copy.runs.RunPlanner.block_breaks`);
- plans of one page count share their one-run chunk arrays, read-only;
- a direction's buffers are allocated at its first plan, once (:class:`StagingUnavailable` when
  they cannot be), and kept.

Planning is called on the thread that starts a job.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import numpy as np
import torch

from kvtier.copy.base import Direction
from kvtier.copy.pages import PagedKV, storage_bytes
from kvtier.copy.runs import PageEntries, RunPlanner, SlotJob
from kvtier.copy.staged_runs import StagedRuns, StagingBuffers

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
