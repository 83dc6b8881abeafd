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
from collections.abc import Callable
from typing import Any, Protocol

import torch

from kvtier.copy.cudart import CudaRuntime, LoadedCudart
from kvtier.copy.pages import CopyPlan
from kvtier.copy.runs import ByteRuns

logger = logging.getLogger(__name__)


class DeviceStreams(Protocol):
    """Streams, events and copies of one device. ``Any`` handles are the implementation's own."""

    def current_stream(self) -> Any:
        """The stream the engine's compute work is being issued on, now."""

    def new_stream(self) -> Any:
        """A side stream (may, on CUDA, be a pool stream already in use: compare before use)."""

    def new_event(self) -> Any:
        """A new event (unrecorded), able to time the work between two recorded events."""

    def record(self, event: Any, stream: Any) -> None:
        """Mark the point of ``stream`` reached by the work issued so far; ``event`` completes there."""

    def wait(self, stream: Any, event: Any) -> None:
        """Work issued on ``stream`` after this call starts only once ``event`` (as recorded) completed."""

    def copy(self, stream: Any, plan: ByteRuns | CopyPlan) -> None:
        """Issue a job's copies on ``stream``, asynchronously to the calling thread."""

    def query(self, event: Any) -> bool:
        """Whether ``event`` completed. Never blocks."""

    def synchronize(self, event: Any) -> None:
        """Block the calling thread until ``event`` completed."""

    def elapsed_seconds(self, start: Any, end: Any) -> float:
        """Device time between two completed events recorded on one stream."""


class TorchCudaStreams:
    """:class:`DeviceStreams` on ``torch.cuda`` for the KV tensors' ``device``.

    Copies: a job's :class:`~kvtier.copy.runs.ByteRuns` go out in one ``cudaMemcpyBatchAsync``
    (CUDA runtime 12.8 and later; one ``cudaMemcpyAsync`` per run before, or after the driver
    refused a batch) on the side stream, sources read in stream order. Strided pages (:class:`~kvtier.copy.pages.CopyPlan`: layouts that are not
    block-compact), and every job where no CUDA runtime library is found, go through
    ``torch._foreach_copy_(..., non_blocking=True)`` under ``torch.cuda.stream(side stream)``:
    one copy per page pair, a strided one through a device temporary. Asynchronous only with
    page-locked host memory (:func:`kvtier.copy.pinning.pin_host_memory`); pageable memory is
    still copied correctly.

    ``cuda``, ``runtime`` and ``foreach_copy`` are injectable for the recording stand-in of the
    tests; production uses ``torch.cuda``, :meth:`LoadedCudart.find` and ``torch._foreach_copy_``.
    """

    def __init__(self, device: torch.device, cuda: Any = torch.cuda, runtime: CudaRuntime | None = None,
                 foreach_copy: Callable[..., Any] = torch._foreach_copy_, find_runtime: bool = True):
        self.device = device
        self._cuda = cuda
        self.runtime = runtime if runtime is not None or not find_runtime else LoadedCudart.find()
        if self.runtime is None:
            logger.warning("kvtier: no CUDA runtime library found: copies go one page at a time through torch")
        self._foreach_copy = foreach_copy

    def current_stream(self) -> Any:
        return self._cuda.current_stream(self.device)

    def new_stream(self) -> Any:
        return self._cuda.Stream(device=self.device)

    def new_event(self) -> Any:
        return self._cuda.Event(enable_timing=True)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def copy(self, stream: Any, plan: ByteRuns | CopyPlan) -> None:
        if isinstance(plan, ByteRuns) and self.runtime is not None:
            with self._cuda.device(self.device):
                self.runtime.memcpy_batch(plan.dst_addr, plan.src_addr, plan.sizes, stream.cuda_stream)
            return
        dsts, srcs = plan.views()
        with self._cuda.stream(stream):
            self._foreach_copy(dsts, srcs, non_blocking=True)

    def query(self, event: Any) -> bool:
        return event.query()

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def elapsed_seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0
