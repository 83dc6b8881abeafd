"""Small pages moved through a device staging buffer: one gather (or scatter) kernel and a few large
DMA copies per job, instead of one DMA descriptor per (layer, page).

Why: under FlashAttention's default layout (LBNHC) a page is one layer of one block, and a kvtier
block's pages are consecutive in the engine's memory only when its engine block ids are, so a job
is one descriptor per (layer, page) (:mod:`kvtier.copy.runs`). With tensor parallelism a page is
small (one KV head x 16 tokens x 256 values x bf16 = 8 KiB), and copy engines move small
descriptors far below the link's bandwidth; vLLM's own offloading switches to a Triton copy
kernel below ~28 KiB per descriptor (vLLM 0.32 ``v1/kv_offload/cpu/swap_blocks_triton.py:12-20``,
``v1/kv_offload/cpu/gpu_worker.py:38-61``). Here, with torch ops only (no Triton needed):

- store: ``index_select`` gathers the job's pages, in host order, from the engine's storage viewed
  as ``[rows, page_bytes]`` into a staging buffer on the device; then the staging buffer goes to the
  host slots in runs as long as the host slots are contiguous (a whole slot at least: every layer
  of a block), one batched call per chunk;
- load: the host runs into the staging buffer, then ``index_copy_`` scatters the rows into the
  engine's pages.

Everything runs on the copy engine's side stream, ordered by it (:mod:`kvtier.copy.cuda`): the
kernels, the copies, and the upload of the row indices (from page-locked memory, so the upload
never blocks the calling thread). The staging buffer is at most :data:`STAGING_BYTES` per side
stream, allocated once on that stream and reused: chunks of a job, and jobs, follow one another
in stream order. :class:`CopyMethod` picks the path per job; which one is faster at which page
size is for the GPU kit to measure (``scripts/gpu-check.sh``): the threshold
:data:`STAGE_BELOW_BYTES` follows vLLM's and has not been measured on a GPU with kvtier.

A :class:`StagedRuns` is carried out with torch ops on whatever device holds the KV (CPU tensors
in the tests, where the host transfers are torch copies too), so its indexing is tested on CPU.
Called on the thread that starts a job (planning) and by the device's ``copy`` (issuing).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.copy.base import Direction
from kvtier.copy.pages import PagedKV, storage_bytes
from kvtier.copy.runs import PageEntries, RunPlanner

STAGING_BYTES = 16 * 2**20  # per side stream; a job larger than this goes in chunks of it
STAGE_BELOW_BYTES = 32 * 2**10  # AUTO stages a job whose runs average fewer bytes (vLLM: ~28 KiB)


class CopyMethod(enum.Enum):
    """How the CUDA engine moves a job of dense pages."""

    RUNS = "runs"  # one DMA descriptor per merged run (cudaMemcpyBatchAsync)
    STAGED = "staged"  # gather/scatter kernel through a device staging buffer, large host runs
    AUTO = "auto"  # STAGED when the job's runs average below STAGE_BELOW_BYTES, else RUNS


@dataclass(frozen=True, eq=False)
class HostRuns:
    """One chunk's copies between the staging buffer and the host region: run ``i`` is
    ``sizes[i]`` bytes at ``staging_offset[i]`` of ``staging`` and ``host_offset[i]`` of ``host``;
    to the host for a store, from it for a load."""

    direction: Direction
    staging: torch.Tensor  # 1-D uint8, on the device
    host: torch.Tensor  # 1-D uint8, the whole host region
    staging_offset: np.ndarray
    host_offset: np.ndarray
    sizes: np.ndarray

    def addresses(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(destinations, sources, sizes) as raw addresses, what a batched copy call reads."""
        staging = self.staging.data_ptr() + self.staging_offset
        host = self.host.data_ptr() + self.host_offset
        if self.direction is Direction.STORE:
            return host, staging, self.sizes
        return staging, host, self.sizes

    def views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(destinations, sources) as 1-D uint8 views, for torch copies."""
        runs = list(zip(self.staging_offset.tolist(), self.host_offset.tolist(), self.sizes.tolist()))
        staging = [self.staging.narrow(0, s, n) for s, _, n in runs]
        host = [self.host.narrow(0, h, n) for _, h, n in runs]
        return (host, staging) if self.direction is Direction.STORE else (staging, host)


@dataclass(frozen=True, eq=False)
class StagedRuns:
    """One job through the staging buffer (see the module docstring). ``index``: the engine row of
    each page, host order; chunk ``c`` is pages ``[c * chunk_pages, (c + 1) * chunk_pages)``."""

    direction: Direction
    rows: torch.Tensor  # [rows, page_bytes] uint8 view of the engine's storage
    host: torch.Tensor
    index: np.ndarray
    chunk_pages: int
    chunks: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]  # per chunk: staging offset, host offset, size
    staging: Callable[[int], torch.Tensor]  # the side stream's staging buffer, at least n bytes

    @property
    def num_bytes(self) -> int:
        return len(self.index) * self.rows.shape[1]

    @property
    def num_pages(self) -> int:
        return len(self.index)

    @property
    def num_runs(self) -> int:
        """Host copies (DMA descriptors) of the job."""
        return sum(len(chunk[2]) for chunk in self.chunks)

    def carry_out(self, transfer: Callable[[HostRuns], None]) -> None:
        """Issue the job on the current stream of the engine's device: index upload, then per
        chunk the gather and its host copies (store) or the host copies and the scatter (load);
        ``transfer`` issues one chunk's host copies on that stream."""
        device = self.rows.device
        page = self.rows.shape[1]
        index = torch.from_numpy(self.index)
        if device.type == "cuda":  # from page-locked memory: the upload never blocks this thread
            index = torch.empty(len(self.index), dtype=torch.int64, pin_memory=True).copy_(index)
        index = index.to(device, non_blocking=True)
        buffer = self.staging(min(len(self.index), self.chunk_pages) * page)
        for c, (staging_offset, host_offset, sizes) in enumerate(self.chunks):
            rows = index[c * self.chunk_pages:(c + 1) * self.chunk_pages]
            staged = buffer[: len(rows) * page]
            runs = HostRuns(self.direction, staged, self.host, staging_offset, host_offset, sizes)
            if self.direction is Direction.STORE:
                torch.index_select(self.rows, 0, rows, out=staged.view(len(rows), page))
                transfer(runs)
            else:
                transfer(runs)
                self.rows.index_copy_(0, rows, staged.view(len(rows), page))


class StagedPlanner:
    """Plans :class:`StagedRuns` from a :class:`~kvtier.copy.runs.RunPlanner`'s entries. Only for
    KV whose every page is a row of one storage seen as ``[rows, page_bytes]`` (:meth:`fits`):
    one allocation (vLLM 0.32 allocates one), one page size, every page starting at a multiple of
    it (LBNHC, LBHNC, BLNHC, BLHNC, padded or not; kernel-split blocks regrouped)."""

    def __init__(self, kv: PagedKV, runs: RunPlanner, host: torch.Tensor, staging_bytes: int = STAGING_BYTES):
        if not self.fits(kv):
            raise ValueError("staged copies need every page as a row of one storage ([rows, page_bytes])")
        assert kv.rows is not None
        page = kv.page_bytes
        storage = storage_bytes(kv.rows[0])
        self.rows = storage[: storage.numel() // page * page].view(-1, page)
        self.page_bytes = page
        self.runs = runs
        self.host = host
        self.segment_bytes = runs.segment_bytes
        self.chunk_pages = max(staging_bytes // page, 1)
        self._buffers: dict[int, torch.Tensor] = {}  # per current stream (the side streams)

    @staticmethod
    def fits(kv: PagedKV) -> bool:
        if kv.rows is None or not kv.uniform:
            return False
        page = kv.page_bytes
        storages = {rows.untyped_storage().data_ptr() for rows in kv.rows}
        return len(storages) == 1 and all(
            rows.storage_offset() % page == 0 and (rows.shape[0] < 2 or rows.stride(0) % page == 0)
            for rows in kv.rows)

    def plan(self, direction: Direction, entries: PageEntries) -> StagedRuns:
        page, chunk = self.page_bytes, self.chunk_pages
        count = len(entries)
        h = entries.h_offset
        position = np.arange(count)
        joins = (h[1:] == h[:-1] + page) & (position[1:] % chunk != 0)
        if self.segment_bytes < self.host.numel():  # several pinning registrations: never across one
            joins &= h[1:] // self.segment_bytes == h[:-1] // self.segment_bytes
        starts = np.flatnonzero(np.concatenate(([True], ~joins))) if count else np.zeros(0, dtype=np.int64)
        sizes = np.diff(np.append(starts, count)) * page
        chunk_of = starts // chunk
        staging_offset = (starts % chunk) * page
        chunks = tuple((staging_offset[chunk_of == c], h[starts][chunk_of == c], sizes[chunk_of == c])
                       for c in range(-(-count // chunk)))
        return StagedRuns(direction, self.rows, self.host, entries.e_offset // page, chunk, chunks, self._staging)

    def _staging(self, size: int) -> torch.Tensor:
        """The current stream's staging buffer, ``chunk_pages`` pages (allocated on that stream at
        its first job, then reused in that stream's order)."""
        device = self.rows.device
        key = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = torch.empty(self.chunk_pages * self.page_bytes, dtype=torch.uint8,
                                                      device=device)
        assert buffer.numel() >= size
        return buffer


def choose(method: CopyMethod, runs_bytes: int, num_runs: int) -> CopyMethod:
    """The path of one job under ``method``: RUNS or STAGED."""
    if method is not CopyMethod.AUTO:
        return method
    return CopyMethod.STAGED if num_runs and runs_bytes / num_runs < STAGE_BELOW_BYTES else CopyMethod.RUNS
