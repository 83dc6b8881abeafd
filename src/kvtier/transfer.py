"""Worker-side copies between the engine's paged KV tensors and the host tier's slots.

Engine-agnostic: it sees the engine's KV as one tensor per layer with a *block dimension*
somewhere in its shape (vLLM's CPU backend: dim 0, ``[blocks, kv_heads, block_size, 2*head]``;
FlashAttention: dim 1, ``[2, blocks, block_size, kv_heads, head]``). A page is "everything of one
block of one layer", copied as an opaque byte tensor: never token by token.

Threading: :class:`TransferRunner` owns one background thread that runs copy jobs in FIFO order;
the engine thread submits jobs and polls completions, and blocks only in :meth:`TransferRunner.wait`
(used when vLLM is about to reuse blocks a pending store still reads). On CUDA the copies run on a
side stream with ``non_blocking=True`` from page-locked host memory; on CPU they are plain memcpy.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from kvtier.layout import HostSlotLayout
from kvtier.priority import become_background_thread

logger = logging.getLogger(__name__)


class Direction(enum.Enum):
    STORE = "engine_to_host"
    LOAD = "host_to_engine"


@dataclass(frozen=True, slots=True)
class PageCopy:
    """One page: ``sub``-th engine block of a kvtier block in host ``slot`` <-> engine ``block_id``."""

    slot: int
    sub: int
    block_id: int


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


@dataclass(frozen=True, slots=True)
class TransferDone:
    job_id: int
    direction: Direction
    ok: bool
    num_bytes: int
    seconds: float


class TransferRunner:
    """Runs copy jobs on one background thread, FIFO. Submit/poll/wait from the engine thread."""

    def __init__(self, copier: BlockCopier):
        self.copier = copier
        self._stream = torch.cuda.Stream(device=copier.kv.device) if copier.kv.device.type == "cuda" else None
        self._jobs: queue.SimpleQueue[tuple[int, Direction, list[PageCopy]] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[TransferDone] = queue.SimpleQueue()
        self._pending: set[int] = set()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvtier-transfer", daemon=True)
        self._thread.start()

    def submit(self, job_id: int, direction: Direction, pages: list[PageCopy]) -> None:
        with self._cond:
            self._pending.add(job_id)
        self._jobs.put((job_id, direction, pages))

    def poll(self) -> list[TransferDone]:
        done: list[TransferDone] = []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                return done

    def wait(self, job_ids: Iterable[int] | None = None) -> None:
        """Block until ``job_ids`` (default: every submitted job) have finished."""
        wanted = None if job_ids is None else set(job_ids)
        with self._cond:
            self._cond.wait_for(lambda: not (self._pending if wanted is None else self._pending & wanted))

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=30)

    def _run(self) -> None:
        become_background_thread()  # stores are background work: the forward pass goes first
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job_id, direction, pages = item
            start = time.perf_counter()
            ok, num_bytes = True, 0
            try:
                num_bytes = self._copy(direction, pages)
            except Exception:  # a failed copy is reported, never raised into the engine
                logger.exception("kvtier: %s copy of job %d failed", direction.value, job_id)
                ok = False
            self._done.put(TransferDone(job_id, direction, ok, num_bytes, time.perf_counter() - start))
            with self._cond:
                self._pending.discard(job_id)
                self._cond.notify_all()

    def _copy(self, direction: Direction, pages: list[PageCopy]) -> int:
        if self._stream is None:
            return self.copier.copy(direction, pages)
        with torch.cuda.stream(self._stream):
            num_bytes = self.copier.copy(direction, pages)
        self._stream.synchronize()
        return num_bytes


def pin_host_memory(buffer: torch.Tensor) -> Callable[[], None]:
    """Page-lock ``buffer`` for async device copies on CUDA; returns the undo. No-op elsewhere."""
    if not torch.cuda.is_available():
        return lambda: None
    cudart = torch.cuda.cudart()
    ptr, size = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    err = cudart.cudaHostRegister(ptr, size, 0)
    if err != 0:
        logger.warning("kvtier: cudaHostRegister of %d bytes failed (%s); copies stay pageable", size, err)
        return lambda: None
    return lambda: cudart.cudaHostUnregister(ptr)
