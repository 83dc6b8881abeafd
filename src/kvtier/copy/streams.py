"""The device interface of the CUDA copy engine, and its implementation on ``torch.cuda``.

:class:`DeviceStreams` is everything :class:`~kvtier.copy.cuda.CudaCopyEngine` asks of a device:
streams (FIFO queues of device work), events (markers recorded on a stream, complete once the
work before them on that stream ran), cross-stream waits and a job's copies. Streams and events
are opaque handles to the engine, compared with ``==``. :class:`TorchCudaStreams` implements it
on ``torch.cuda`` and the CUDA runtime (:mod:`kvtier.copy.cudart`); the engine's ordering is
tested with a simulated device (``tests/sim_device.py``) and this class's calls against a
recording stand-in for ``torch.cuda`` (``tests/test_cuda_calls.py``); the real calls run in the GPU
kit (``scripts/gpu-check.sh``) only.

Every call is made from the thread that issues the engine's forward (the worker's main thread);
only :meth:`~DeviceStreams.synchronize` blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import numpy as np
import torch

from kvtier.copy.cudart import CudaRuntime, LoadedCudart, SourceOrder
from kvtier.copy.base import Direction
from kvtier.copy.lanes import CudaLanes, EventPool, GraphRepeat
from kvtier.copy.pages import CopyPlan
from kvtier.copy.runs import ByteRuns
from kvtier.copy.kernels import RowKernels
from kvtier.copy.staged_runs import StagedRuns

logger = logging.getLogger(__name__)

# the most thread blocks a gather or scatter launch of a staged job runs on (None: one per page);
# the GPU kit measures a GEMM's slowdown beside staged jobs at several (tests/gpu/bench_copies.py).
# Kept at one per page by measurement: three runs of the kit's sweep on an H200 (2026-11-28) put
# a staged load's GEMM slowdown at 1.007-1.021x for every cap from a block per page to 8 blocks,
# the cap with the least differing from run to run (page, 528, 132, 33) by less than each
# figure's own quartile spread, while 33 blocks lost bandwidth (0.96-0.97 of one
# cudaMemcpyAsync) and 8 lost more (0.92); docs/benchmarks.md.
KERNEL_BLOCKS: int | None = None


class DeviceStreams(Protocol):
    """Streams, events and copies of one device. ``Any`` handles are the implementation's own.
    A device whose :meth:`new_stream` always makes a stream of its own, which no compute stream
    can be, says so with ``owns_side_streams = True`` (the engine then never compares them)."""

    def current_stream(self) -> Any:
        """The stream the engine's compute work is being issued on, now."""

    def new_stream(self) -> Any:
        """A side stream (where the device cannot make one of kvtier's own, a shared pool stream
        that may be in use: the engine compares before use)."""

    def new_event(self) -> Any:
        """An event able to time the work between two records: a new one, or one handed back by
        :meth:`release` (its earlier records are of no concern: it is recorded before any use)."""

    def release(self, event: Any) -> None:
        """The engine is done with ``event`` (no later call names it): it may be handed out again
        by :meth:`new_event`. A wait already issued on it is unaffected (it binds to the record
        current when it was issued)."""

    def record(self, event: Any, stream: Any) -> None:
        """Mark the point of ``stream`` reached by the work issued so far; ``event`` completes there."""

    def wait(self, stream: Any, event: Any) -> None:
        """Work issued on ``stream`` after this call starts only once ``event`` (as recorded) completed."""

    def copy(self, stream: Any, plan: ByteRuns | StagedRuns | CopyPlan) -> Hashable | None:
        """Issue a job's copies on ``stream``, asynchronously to the calling thread. A device
        with a ``repeat`` method (:meth:`TorchCudaStreams.repeat`) returns the key of the graph
        a staged job went as, for later jobs of its shape; others return None."""

    def query(self, event: Any) -> bool:
        """Whether ``event`` completed. Never blocks."""

    def synchronize(self, event: Any) -> None:
        """Block the calling thread until ``event`` completed."""

    def elapsed_seconds(self, start: Any, end: Any) -> float:
        """Device time between two completed events recorded on one stream."""

    def close(self) -> None:
        """Release the streams made by :meth:`new_stream`; called once every job completed."""


class TorchCudaStreams:
    """:class:`DeviceStreams` on ``torch.cuda`` for the KV tensors' ``device``.

    Streams: kvtier's own (:meth:`new_stream`), destroyed by :meth:`close`.

    With a runtime library (every CUDA build of torch this was checked on) the engine's own
    calls go through it, not through torch's Python objects, which cost several times the host
    time on the forward's thread: :meth:`current_stream` is the raw ``cudaStream_t`` of the
    current stream (an int, never equal to a side stream: those are kvtier's own and cannot be
    current for the engine), events are the runtime's timing events from a pool (made on demand,
    handed back by :meth:`release`, destroyed by :meth:`close`), and records, waits, queries,
    synchronizations and elapsed times are the runtime's calls on raw handles. Without one,
    torch's streams and events.

    Staged jobs (:class:`~kvtier.copy.staged_runs.StagedRuns`) run on two lanes: the side stream
    (TRANSFER: host copies) and a KERNEL stream of kvtier's own paired with it (gathers, scatters,
    the index upload), ordered by events of the runtime made once per pair
    (:class:`~kvtier.copy.lanes.CudaLanes`); the KERNEL stream is current while a job is issued, so the torch ops
    run there. With kvtier's kernels, a job shape's second and later jobs go as one CUDA graph
    launched on the side stream (``job_graphs``; :mod:`kvtier.copy.cudagraph`).

    Copies: a job's :class:`~kvtier.copy.runs.ByteRuns` go out in one ``cudaMemcpyBatchAsync``
    (CUDA runtime 12.8 and later; one ``cudaMemcpyAsync`` per run before, or where the driver
    refused a batch) on the side stream, sources read in stream order for stores (engine memory)
    and in any order for loads (host memory, :class:`~kvtier.copy.cudart.SourceOrder`). Strided pages (:class:`~kvtier.copy.pages.CopyPlan`: layouts that are not
    block-compact), and every job where no CUDA runtime library is found, go through
    ``torch._foreach_copy_(..., non_blocking=True)`` under ``torch.cuda.stream(side stream)``:
    one copy per page pair, a strided one through a device temporary. Asynchronous only with
    page-locked host memory (:func:`kvtier.copy.pinning.pin_host_memory`); pageable memory is
    still copied correctly.

    ``kernel_blocks``: the most thread blocks one of kvtier's gather or scatter launches runs on
    (:class:`~kvtier.copy.kernels.RowKernels`; None: a block per page).

    ``cuda``, ``runtime``, ``foreach_copy``, ``pinned`` (page-locked host bytes) and
    ``load_kernels`` (kvtier's row kernels for a device and page size) are injectable for the
    tests' stand-ins; production uses ``torch.cuda``, :meth:`LoadedCudart.find`,
    ``torch._foreach_copy_``, torch's page-locked allocator and :meth:`RowKernels.load`.
    """

    def __init__(self, device: torch.device, cuda: Any = torch.cuda, runtime: CudaRuntime | None = None,
                 foreach_copy: Callable[..., Any] = torch._foreach_copy_, find_runtime: bool = True,
                 own_kernels: bool = True, raw_current_stream: Callable[[int], int] | None = None,
                 job_graphs: bool = True, pinned: Callable[[int], torch.Tensor] | None = None,
                 load_kernels: Callable[[torch.device, int], Any] | None = None,
                 kernel_blocks: int | None = KERNEL_BLOCKS):
        self.device = device
        self.own_kernels = own_kernels  # staged jobs gather and scatter with kvtier's kernels where they load
        self.job_graphs = job_graphs  # and repeated job shapes go as CUDA graphs (:mod:`kvtier.copy.cudagraph`)
        self.pinned = pinned or _pinned_bytes
        self.kernel_blocks = kernel_blocks
        self.load_kernels = load_kernels or (lambda where, page_bytes: _load_row_kernels(where, page_bytes,
                                                                                         kernel_blocks))
        self._cuda = cuda
        self.runtime = runtime if runtime is not None or not find_runtime else LoadedCudart.find(torch.version.cuda)
        if self.runtime is None:
            logger.warning("kvtier: no CUDA runtime library found: copies go one page at a time through torch")
        self._foreach_copy = foreach_copy
        self._own_streams: list[int] = []
        self._lanes: dict[int, CudaLanes] = {}  # per side stream's raw handle (a staged job's TRANSFER lane)
        self._index = device.index if device.index is not None else 0
        self._raw_current = raw_current_stream or _raw_current_stream(cuda)
        raw_device = getattr(torch._C, "_cuda_getDevice", None)  # torch.cuda.current_device without its lazy-init check
        self._current_device = raw_device if cuda is torch.cuda and raw_device is not None else \
            lambda: cuda.current_device()
        self._events = EventPool(self, timing=True)  # the engine's (new_event / release)

    def current_stream(self) -> Any:
        if self.runtime is not None:
            return self._raw_current(self._index)
        return self._cuda.current_stream(self.device)

    @property
    def owns_side_streams(self) -> bool:
        """Whether :meth:`new_stream` makes streams of kvtier's own (a runtime library was found)."""
        return self.runtime is not None

    def new_stream(self) -> Any:
        """A stream of kvtier's own (``cudaStreamCreateWithFlags``, wrapped as torch's
        ``ExternalStream``), never one of torch's pool streams, which vLLM's streams share; a pool
        stream only where no runtime library was found."""
        if self.runtime is None:
            return self._cuda.Stream(device=self.device)
        with self._cuda.device(self.device):
            handle = self.runtime.stream_create()
        self._own_streams.append(handle)
        return self._cuda.ExternalStream(handle, device=self.device)

    def close(self) -> None:
        lanes, self._lanes = list(self._lanes.values()), {}
        for pair in lanes:
            pair.close()
        self._events.close()
        streams, self._own_streams = self._own_streams, []
        for handle in streams:
            self.runtime.stream_destroy(handle)

    def new_event(self) -> Any:
        return self._events.take()

    def release(self, event: Any) -> None:
        self._events.give(event)

    def record(self, event: Any, stream: Any) -> None:
        if self.runtime is None:
            event.record(stream)
        else:
            self.runtime.event_record(event, _handle(stream))

    def wait(self, stream: Any, event: Any) -> None:
        if self.runtime is None:
            stream.wait_event(event)
        else:
            self.runtime.stream_wait_event(_handle(stream), event)

    def prepare_staging(self, stream: Any, rows: torch.Tensor) -> None:
        """Make ``stream``'s staged-job lanes now (see :class:`~kvtier.copy.lanes.CudaLanes`), for pages moved as
        rows like ``rows`` (a staging buffer: its dtype and row length)."""
        self._lanes_of(stream, rows)

    def _lanes_of(self, stream: Any, rows: torch.Tensor) -> CudaLanes:
        """``stream``'s lanes, made now if it has none (keyed by the raw handle: a torch stream
        object hashes and compares in Python, twice a job)."""
        lanes = self._lanes.get(stream.cuda_stream)
        if lanes is None:
            with self._cuda.device(self.device):
                lanes = self._lanes[stream.cuda_stream] = CudaLanes(self, stream, self._kernel_stream(stream), rows)
        return lanes

    def copy(self, stream: Any, plan: ByteRuns | StagedRuns | CopyPlan) -> Hashable | None:
        """(See :class:`DeviceStreams`.) A staged job that went as a launch of its shape's CUDA
        graph returns the graph's key (:meth:`repeat` can issue later jobs of the shape)."""
        if isinstance(plan, StagedRuns):  # kernels on the pair's KERNEL stream, host copies on ``stream``
            lanes = self._lanes_of(stream, plan.buffers.rows[0])
            if lanes.raw and self._current_device() == self._index:
                return lanes.issue(plan)  # every call names its stream: no current stream to set
            with self._cuda.device(self.device), self._cuda.stream(lanes.kernel_stream):
                plan.issue(lanes)
            return None
        if isinstance(plan, ByteRuns) and self.runtime is not None:
            order = SourceOrder.STREAM if plan.direction is Direction.STORE else SourceOrder.ANY
            with self._cuda.device(self.device):
                self.runtime.memcpy_batch(plan.dst_addr, plan.src_addr, plan.sizes, stream.cuda_stream, order)
            return
        dsts, srcs = plan.views()
        with self._cuda.stream(stream):
            self._foreach_copy(dsts, srcs, non_blocking=True)
        return None

    def repeat(self, stream: Any, job: GraphRepeat, first_slot: int, blocks: np.ndarray) -> bool:
        """Issue on ``stream`` a job of ``job``'s graph shape from host slot ``first_slot`` with
        engine ``blocks``, unplanned (:meth:`~kvtier.copy.lanes.CudaLanes.repeat`); False with
        nothing issued where it cannot go so."""
        lanes = self._lanes.get(stream.cuda_stream)
        if lanes is None or not lanes.raw or self._current_device() != self._index:
            return False
        return lanes.repeat(job, first_slot, blocks)

    def _kernel_stream(self, transfer: Any) -> Any:
        """A stream for ``transfer``'s KERNEL lane: neither it nor the compute stream (a pool
        stream only where no runtime library was found: then compared and taken again)."""
        compute = self.current_stream()
        for _ in range(64):
            stream = self.new_stream()
            if stream != compute and stream != transfer:
                return stream
        raise RuntimeError("kvtier: the device hands out no stream for staged copies but the compute stream")

    def _host_copies(self, stream: Any, plan: StagedRuns, chunk: int) -> None:
        """One staged chunk's host copies on ``stream``: batched where the runtime allows (one
        plain copy for a chunk of one run); the staging buffer, written on this stream, read in
        stream order. Without a runtime, torch's copies (``stream`` is then the current stream)."""
        if self.runtime is None:
            self._foreach_copy(*plan.chunk_runs(chunk).views(), non_blocking=True)
            return
        dsts, srcs, sizes = plan.chunk_addresses(chunk)
        if len(sizes) == 1:
            self.runtime.memcpy(int(dsts[0]), int(srcs[0]), int(sizes[0]), stream.cuda_stream)
            return
        order = SourceOrder.STREAM if plan.direction is Direction.STORE else SourceOrder.ANY
        self.runtime.memcpy_batch(dsts, srcs, sizes, stream.cuda_stream, order)

    def query(self, event: Any) -> bool:
        return event.query() if self.runtime is None else self.runtime.event_query(event)

    def synchronize(self, event: Any) -> None:
        if self.runtime is None:
            event.synchronize()
        else:
            self.runtime.event_synchronize(event)

    def elapsed_seconds(self, start: Any, end: Any) -> float:
        if self.runtime is None:
            return start.elapsed_time(end) / 1000.0
        return self.runtime.event_elapsed_ms(start, end) / 1000.0


def _pinned_bytes(size: int) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8, pin_memory=True)


def _load_row_kernels(device: torch.device, page_bytes: int, max_blocks: int | None) -> RowKernels | None:
    return RowKernels.load(torch.cuda.get_device_capability(device), int(str(torch.version.cuda).split(".")[0]),
                           page_bytes, max_blocks)


def _handle(stream: Any) -> int:
    """The raw ``cudaStream_t`` of ``stream``: the compute stream already is one (an int), a
    side stream is torch's ``ExternalStream`` of it."""
    return stream if type(stream) is int else stream.cuda_stream


def _raw_current_stream(cuda: Any) -> Callable[[int], int]:
    """The raw ``cudaStream_t`` of a device's current stream: torch's own accessor (0.2 us of
    host time, against ~6 us for ``torch.cuda.current_stream`` and its Python object), else the
    public one's handle (older torch builds, and the tests' stand-in for ``torch.cuda``)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if cuda is torch.cuda and raw is not None:
        return raw
    return lambda index: cuda.current_stream(index).cuda_stream
