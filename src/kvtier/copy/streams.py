"""The asynchronous-device calls the CUDA copy engine makes, behind one small interface.

:class:`DeviceStreams` is everything :class:`~kvtier.copy.cuda.CudaCopyEngine` asks of a device:
streams (FIFO queues of device work), events (markers recorded on a stream, complete once the
work before them on that stream ran), cross-stream waits and the batched copy. Streams and events
are opaque handles to the engine. :class:`TorchCudaStreams` implements it on ``torch.cuda``; the
tests drive the same engine with a simulated device (``tests/sim_device.py``), since this project
has no GPU: this module's torch.cuda calls are right by construction, never run here.

Every call is made from the thread that issues the engine's forward (the worker's main thread);
only :meth:`~DeviceStreams.synchronize` blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch


class DeviceStreams(Protocol):
    """Streams, events and copies of one device. ``Any`` handles are the implementation's own."""

    def current_stream(self) -> Any:
        """The stream the engine's compute work is being issued on, now."""

    def new_stream(self) -> Any:
        """A new side stream."""

    def new_event(self) -> Any:
        """A new event (unrecorded), able to time the work between two recorded events."""

    def record(self, event: Any, stream: Any) -> None:
        """Mark the point of ``stream`` reached by the work issued so far; ``event`` completes there."""

    def wait(self, stream: Any, event: Any) -> None:
        """Work issued on ``stream`` after this call starts only once ``event`` (as recorded) completed."""

    def copy(self, stream: Any, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        """Issue ``dsts[i] <- srcs[i]`` on ``stream``, asynchronously to the calling thread."""

    def query(self, event: Any) -> bool:
        """Whether ``event`` completed. Never blocks."""

    def synchronize(self, event: Any) -> None:
        """Block the calling thread until ``event`` completed."""

    def elapsed_seconds(self, start: Any, end: Any) -> float:
        """Device time between two completed events recorded on one stream."""


class TorchCudaStreams:
    """:class:`DeviceStreams` on ``torch.cuda`` for the KV tensors' ``device``.

    The copies are one ``torch._foreach_copy_(dsts, srcs, non_blocking=True)`` per job, issued under
    ``torch.cuda.stream(side stream)``: with host and device tensors mixed it takes the per-pair
    path in C++ (one ``cudaMemcpyAsync`` per contiguous page; a strided page first goes through a
    device temporary allocated on the side stream). Asynchronous only with page-locked host memory
    (:func:`kvtier.copy.pin_host_memory`); pageable host memory is still copied correctly.
    """

    def __init__(self, device: torch.device):
        self.device = device

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)

    def record(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def copy(self, stream: torch.cuda.Stream, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        with torch.cuda.stream(stream):
            torch._foreach_copy_(list(dsts), list(srcs), non_blocking=True)

    def query(self, event: torch.cuda.Event) -> bool:
        return event.query()

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def elapsed_seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1000.0
