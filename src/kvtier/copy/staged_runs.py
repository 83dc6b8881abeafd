"""One staged job on the device: the staging buffers it goes through, its chunks and host runs
(:class:`StagedRuns`, planned by :class:`~kvtier.copy.staging.StagedPlanner`), and the pipelined
schedule that issues it on two lanes (:meth:`StagedRuns.issue`, through :class:`StagingLanes`).

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

Invariants:

- a :class:`StagedRuns` is read-only once made, and its arrays may be shared with other plans of
  its size (the planner's chunk tables): nothing here writes them;
- chunk ``c`` is at most ``chunk_pages`` pages (one staging buffer), goes through buffer
  ``c % len(buffers.rows)`` and its host copies are runs ``[run_bounds[c], run_bounds[c + 1])``;
- a buffer takes a chunk only after the mark that its previous chunk left it (:func:`freed`), in
  a job and, by the lanes' order, across jobs;
- :class:`StagingBuffers` are allocated once, on the calling thread, and never freed while the
  engine lives;
- every call issues work and returns at once, nothing here blocks; :meth:`StagedRuns.issue` runs
  on the thread that starts the job (the device's ``copy``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvtier.copy.base import Direction


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
