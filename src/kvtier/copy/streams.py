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
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

from kvtier.copy.cudart import CudaRuntime, LoadedCudart, SourceOrder
from kvtier.copy.base import Direction
from kvtier.copy.pages import CopyPlan
from kvtier.copy.runs import ByteRuns
from kvtier.copy.kernels import RowKernels
from kvtier.copy.staging import Lane, StagedRuns

logger = logging.getLogger(__name__)


class DeviceStreams(Protocol):
    """Streams, events and copies of one device. ``Any`` handles are the implementation's own."""

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

    def copy(self, stream: Any, plan: ByteRuns | StagedRuns | CopyPlan) -> None:
        """Issue a job's copies on ``stream``, asynchronously to the calling thread."""

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

    Staged jobs (:class:`~kvtier.copy.staging.StagedRuns`) run on two lanes: the side stream
    (TRANSFER: host copies) and a KERNEL stream of kvtier's own paired with it (gathers, scatters,
    the index upload), ordered by events of the runtime made once per pair
    (:class:`_CudaLanes`); the KERNEL stream is current while a job is issued, so the torch ops
    run there.

    Copies: a job's :class:`~kvtier.copy.runs.ByteRuns` go out in one ``cudaMemcpyBatchAsync``
    (CUDA runtime 12.8 and later; one ``cudaMemcpyAsync`` per run before, or where the driver
    refused a batch) on the side stream, sources read in stream order for stores (engine memory)
    and in any order for loads (host memory, :class:`~kvtier.copy.cudart.SourceOrder`). Strided pages (:class:`~kvtier.copy.pages.CopyPlan`: layouts that are not
    block-compact), and every job where no CUDA runtime library is found, go through
    ``torch._foreach_copy_(..., non_blocking=True)`` under ``torch.cuda.stream(side stream)``:
    one copy per page pair, a strided one through a device temporary. Asynchronous only with
    page-locked host memory (:func:`kvtier.copy.pinning.pin_host_memory`); pageable memory is
    still copied correctly.

    ``cuda``, ``runtime`` and ``foreach_copy`` are injectable for the recording stand-in of the
    tests; production uses ``torch.cuda``, :meth:`LoadedCudart.find` and ``torch._foreach_copy_``.
    """

    def __init__(self, device: torch.device, cuda: Any = torch.cuda, runtime: CudaRuntime | None = None,
                 foreach_copy: Callable[..., Any] = torch._foreach_copy_, find_runtime: bool = True,
                 own_kernels: bool = True, raw_current_stream: Callable[[int], int] | None = None):
        self.device = device
        self.own_kernels = own_kernels  # staged jobs gather and scatter with kvtier's kernels where they load
        self._cuda = cuda
        self.runtime = runtime if runtime is not None or not find_runtime else LoadedCudart.find(torch.version.cuda)
        if self.runtime is None:
            logger.warning("kvtier: no CUDA runtime library found: copies go one page at a time through torch")
        self._foreach_copy = foreach_copy
        self._own_streams: list[int] = []
        self._lanes: dict[Any, _CudaLanes] = {}  # per side stream (a staged job's TRANSFER lane)
        self._index = device.index if device.index is not None else 0
        self._raw_current = raw_current_stream or _raw_current_stream(cuda)
        self._events = _EventPool(self, timing=True)  # the engine's (new_event / release)

    def current_stream(self) -> Any:
        if self.runtime is not None:
            return self._raw_current(self._index)
        return self._cuda.current_stream(self.device)

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
        """Make ``stream``'s staged-job lanes now (see :class:`_CudaLanes`), for pages moved as
        rows like ``rows`` (a staging buffer: its dtype and row length)."""
        if stream not in self._lanes:
            with self._cuda.device(self.device):
                self._lanes[stream] = _CudaLanes(self, stream, self._kernel_stream(stream), rows)

    def copy(self, stream: Any, plan: ByteRuns | StagedRuns | CopyPlan) -> None:
        if isinstance(plan, StagedRuns):  # kernels on the pair's KERNEL stream, host copies on ``stream``
            self.prepare_staging(stream, plan.buffers.rows[0])
            lanes = self._lanes[stream]
            if lanes.raw and self._cuda.current_device() == self.device.index:
                plan.issue(lanes)  # every call names its stream: no current stream to set
                return
            with self._cuda.device(self.device), self._cuda.stream(lanes.kernel_stream):
                plan.issue(lanes)
            return
        if isinstance(plan, ByteRuns) and self.runtime is not None:
            order = SourceOrder.STREAM if plan.direction is Direction.STORE else SourceOrder.ANY
            with self._cuda.device(self.device):
                self.runtime.memcpy_batch(plan.dst_addr, plan.src_addr, plan.sizes, stream.cuda_stream, order)
            return
        dsts, srcs = plan.views()
        with self._cuda.stream(stream):
            self._foreach_copy(dsts, srcs, non_blocking=True)

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


def _handle(stream: Any) -> int:
    """The raw ``cudaStream_t`` of ``stream``: the compute stream already is one (an int), a
    side stream is torch's ``ExternalStream`` of it."""
    return stream if type(stream) is int else stream.cuda_stream


class _EventPool:
    """Events of one kind (``timing``: able to time the work between two records, else for
    ordering only) for a :class:`TorchCudaStreams` and its lanes: with a runtime, the runtime's,
    made on the KV cache's device when none is free and handed out again once given back, every
    one made destroyed by :meth:`close` (once nothing in flight names them); without one, a new
    torch event each time, left to torch. Calling thread only."""

    def __init__(self, streams: TorchCudaStreams, timing: bool):
        self._streams, self._timing = streams, timing
        self._made: list[int] = []
        self._free: list[int] = []

    def take(self) -> Any:
        if self._free:
            return self._free.pop()
        streams = self._streams
        if streams.runtime is None:
            return streams._cuda.Event(enable_timing=self._timing)
        with streams._cuda.device(streams.device):
            event = streams.runtime.event_create(timing=self._timing)
        self._made.append(event)
        return event

    def give(self, event: Any) -> None:
        if self._streams.runtime is not None:
            self._free.append(event)

    def close(self) -> None:
        made, self._made, self._free = self._made, [], []
        for event in made:
            self._streams.runtime.event_destroy(event)


def _raw_current_stream(cuda: Any) -> Callable[[int], int]:
    """The raw ``cudaStream_t`` of a device's current stream: torch's own accessor (0.2 us of
    host time, against ~6 us for ``torch.cuda.current_stream`` and its Python object), else the
    public one's handle (older torch builds, and the tests' stand-in for ``torch.cuda``)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if cuda is torch.cuda and raw is not None:
        return raw
    return lambda index: cuda.current_stream(index).cuda_stream


class _CudaLanes:
    """:class:`~kvtier.copy.staging.StagingLanes` on a pair of CUDA streams: ``transfer`` (the
    side stream of a direction) and ``kernel_stream``, with the events of its marks made once
    (ordering only, no timing) and reused by every job of the pair: a wait binds to a mark's
    latest record, and each job records a mark before it waits for it. Events come from the
    runtime where one was found (a third of torch's host time per call), else from torch (an
    :class:`_EventPool` of ordering events, which also serves the uploads).

    Made when the copy engine is built (the device idle), so that nothing a first job does
    waits for the device: the gather and scatter kernels are loaded (kvtier's own,
    :class:`~kvtier.copy.kernels.RowKernels`, where NVRTC is found; else torch's, of the rows'
    dtype: CUDA loads modules lazily, and a load may wait for the work in flight), and index
    uploads go from a page-locked ring of :data:`UPLOAD_RING_BYTES` made here (a job whose
    index does not fit, or whose part of the ring the device has not read yet, takes torch's
    page-locked allocator instead) into one device index tensor, grown when a job needs more.

    ``raw``: with a runtime and kvtier's kernels every call names its stream (uploads, launches,
    copies, marks), so :meth:`TorchCudaStreams.copy` sets no current stream while the calling
    thread's current device is the KV cache's (the kernels were loaded in its context; a worker
    never changes it, and if it did the job would be issued under ``torch.cuda.device``); else
    torch's ops run on ``kernel_stream``, made current around the whole job. Called on the thread
    that issues the forward only."""

    UPLOAD_RING_BYTES = 4 * 2**20  # 512 Ki pages of index per job and in flight

    def __init__(self, streams: TorchCudaStreams, transfer: Any, kernel_stream: Any, rows: torch.Tensor):
        self.streams = streams
        self.transfer_stream = transfer
        self.kernel_stream = kernel_stream
        self.runtime = streams.runtime
        if self.runtime is not None:
            self._handles = {Lane.TRANSFER: transfer.cuda_stream, Lane.KERNEL: kernel_stream.cuda_stream}
        else:
            self._handles = {Lane.TRANSFER: transfer, Lane.KERNEL: kernel_stream}
        self._ordering = _EventPool(streams, timing=False)  # the marks' and the uploads' events
        self._events: dict[int, Any] = {}  # mark -> event, taken at its first record
        cuda = streams._cuda
        self._ring = torch.empty(self.UPLOAD_RING_BYTES, dtype=torch.uint8, pin_memory=True)
        self._ring_words = self._ring.view(torch.int64)
        self._ring_numpy = self._ring_words.numpy()
        self._ring_address = self._ring.data_ptr()
        self._ring_head = 0
        self._ring_pending: deque[tuple[int, int, Any]] = deque()  # (first, end) words, event after its upload
        with cuda.stream(kernel_stream):
            self._index = torch.empty(64 * 1024, dtype=torch.int64, device=rows.device)
            pick = self._index[:1].zero_()
            source = torch.zeros(2, rows.shape[1], dtype=rows.dtype, device=rows.device)
            target = torch.empty(1, rows.shape[1], dtype=rows.dtype, device=rows.device)
            torch.index_select(source, 0, pick, out=target)  # load the kernels now
            source.index_copy_(0, pick, target)
        self.kernels = None
        self.page_bytes = rows.shape[1] * rows.element_size()
        if self.runtime is not None and streams.own_kernels:
            self.kernels = self._load_kernels(rows.device, source, target, pick)
        kernel_stream.synchronize()
        self.raw = self.kernels is not None

    def _load_kernels(self, device: torch.device, source: torch.Tensor, target: torch.Tensor,
                      pick: torch.Tensor) -> RowKernels | None:
        """kvtier's row kernels, loaded and run once on the KERNEL stream; None if unavailable."""
        kernels = RowKernels.load(torch.cuda.get_device_capability(device), int(str(torch.version.cuda).split(".")[0]),
                                  self.page_bytes)
        if kernels is None:
            return None
        handle = self.kernel_stream.cuda_stream
        try:
            for kind in ("gather", "scatter"):
                kernels.launch(kind, handle, source.data_ptr(), target.data_ptr(), pick.data_ptr(), 1, self.page_bytes)
        except Exception as exc:  # noqa: BLE001 - any failure: torch's ops instead
            logger.warning("kvtier: kvtier's copy kernels failed a first launch (%s): torch's ops instead", exc)
            self.runtime.get_last_error()
            return None
        return kernels

    def upload(self, plan: StagedRuns) -> torch.Tensor:
        """The job's row index, or with kvtier's kernels and a job of whole blocks its block
        table (:meth:`~kvtier.copy.staging.StagedRuns.block_table`: one number per block)."""
        table = plan.block_table() if self.kernels is not None else None
        index = table if table is not None else plan.row_index()
        count = len(index)
        if count > len(self._index):  # grown on the KERNEL stream: freed memory is reused in its order
            with self.streams._cuda.device(self._index.device), self.streams._cuda.stream(self.kernel_stream):
                self._index = torch.empty(max(count, 2 * len(self._index)), dtype=torch.int64,
                                          device=self._index.device)
        first = self._take(count)
        device = self._index[:count]
        if first is None:
            host = torch.empty(count, dtype=torch.int64, pin_memory=True)
            host.numpy()[:] = index
            with self.streams._cuda.device(self._index.device), self.streams._cuda.stream(self.kernel_stream):
                device.copy_(host, non_blocking=True)
            return device
        self._ring_numpy[first:first + count] = index
        if self.runtime is not None:
            self.runtime.memcpy(device.data_ptr(), self._ring_address + 8 * first, 8 * count,
                                self._handles[Lane.KERNEL])
            done = self._ordering.take()
            self.runtime.event_record(done, self._handles[Lane.KERNEL])
        else:
            with self.streams._cuda.stream(self.kernel_stream):
                device.copy_(self._ring_words[first:first + count], non_blocking=True)
                done = self._ordering.take()
                done.record(self.kernel_stream)
        self._ring_pending.append((first, first + count, done))
        return device

    def _uploaded(self, event: Any) -> bool:
        if self.runtime is not None:
            return self.runtime.event_query(event)
        return event.query()

    def _take(self, count: int) -> int | None:
        """Where ``count`` words of the ring can be written now, or None (too large, or those
        words' last upload not run yet: never waited for)."""
        size = len(self._ring_words)
        if count > size:
            return None
        while self._ring_pending and self._uploaded(self._ring_pending[0][2]):
            self._ordering.give(self._ring_pending.popleft()[2])
        first = self._ring_head if self._ring_head + count <= size else 0
        end = first + count
        if any(a < end and first < b for a, b, _ in self._ring_pending):
            return None
        self._ring_head = end
        return first

    BEGIN, KERNEL_END = -1, -2  # the lanes' own marks (a job's marks are >= 0)

    def begin(self) -> None:
        self.mark(Lane.TRANSFER, self.BEGIN)
        self.wait(Lane.KERNEL, self.BEGIN)

    def gather(self, plan: StagedRuns, uploaded: torch.Tensor, first: int, pages: int, buffer: int) -> None:
        if self.kernels is None:
            plan.torch_gather(uploaded, first, pages, buffer)
        else:
            self._launch("gather", plan, uploaded, first, pages, buffer)

    def scatter(self, plan: StagedRuns, uploaded: torch.Tensor, first: int, pages: int, buffer: int) -> None:
        if self.kernels is None:
            plan.torch_scatter(uploaded, first, pages, buffer)
        else:
            self._launch("scatter", plan, uploaded, first, pages, buffer)

    def _launch(self, kind: str, plan: StagedRuns, uploaded: torch.Tensor, first: int, pages: int, buffer: int) -> None:
        """kvtier's kernel ``kind`` on the KERNEL lane; ``uploaded`` is the block table of a job of
        whole blocks, else its row index (see :meth:`upload`)."""
        assert self.kernels is not None
        staged = int(plan.buffers.addresses[buffer])
        if plan.blocks is not None:
            self.kernels.launch(kind, self._handles[Lane.KERNEL], plan.rows_address, staged, uploaded.data_ptr(),
                                pages, self.page_bytes, blocks=(len(plan.layer_rows), plan.block_rows, first))
        else:
            self.kernels.launch(kind, self._handles[Lane.KERNEL], plan.rows_address, staged,
                                uploaded.data_ptr() + 8 * first, pages, self.page_bytes)

    def transfer(self, plan: StagedRuns, chunk: int) -> None:
        self.streams._host_copies(self.transfer_stream, plan, chunk)

    def mark(self, lane: Lane, mark: int) -> None:
        event = self._events.get(mark)
        if event is None:
            event = self._events[mark] = self._ordering.take()
        if self.runtime is not None:
            self.runtime.event_record(event, self._handles[lane])
        else:
            event.record(self._handles[lane])

    def wait(self, lane: Lane, mark: int) -> None:
        if self.runtime is not None:
            self.runtime.stream_wait_event(self._handles[lane], self._events[mark])
        else:
            self._handles[lane].wait_event(self._events[mark])

    def finish(self) -> None:
        self.mark(Lane.KERNEL, self.KERNEL_END)
        self.wait(Lane.TRANSFER, self.KERNEL_END)

    def close(self) -> None:
        """Release the upload ring and index, then destroy the events and unload the kernels,
        while the pair's streams still exist (every job completed: the engine waited). The ring
        must go first: torch's page-locked allocator records an event on each stream that used a
        block when the block is freed, and a destroyed stream makes that fail in a destructor,
        which aborts the process."""
        self.kernel_stream.synchronize()
        self._ring_pending = deque()
        self._ring = self._ring_words = self._ring_numpy = self._index = None
        self._events = {}
        self._ordering.close()
        if self.kernels is not None:
            self.kernels.close()
            self.kernels = None
