"""A simulated asynchronous device, for testing the CUDA copy engine's ordering on CPU tensors.

Implements :class:`kvtier.copy.streams.DeviceStreams` (test code, not shipped): this project has
no GPU and torch's CPU build cannot record events. The model is CUDA's, made explicit:

- a stream is a FIFO queue of pending operations: copies the engine issues, kernels the test
  enqueues (:meth:`SimDevice.enqueue`), event markers and waits;
- nothing runs when issued: operations run only when the test advances a stream
  (:meth:`~SimDevice.advance`, :meth:`~SimDevice.step`, :meth:`~SimDevice.run_all`) or when the
  engine blocks on an event (:meth:`~SimDevice.synchronize` runs the device until it completes);
- recording an event appends a marker: the event completes when every operation issued before it
  on that stream ran (re-recording moves it to a new marker);
- ``wait(stream, event)`` appends a barrier: ``stream`` stops there until that marker completed.

Stricter than CUDA where CUDA would hide a bug: querying, waiting on or synchronizing an event
that was never recorded is an error (CUDA treats it as complete), and a device that cannot make
progress towards what is waited for raises instead of hanging. Released events are handed out
again first (as the runtime's pool does), and naming an event after its release, or releasing
it twice, is an error.

The subclasses at the end are deliberately broken devices: each drops one kind of ordering, so a
test can show that it would catch an engine that omitted it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable

import torch


class SimStream:
    def __init__(self, name: str):
        self.name = name
        self.ops: deque[tuple[str, object, str]] = deque()  # (kind, payload, label)

    def __repr__(self) -> str:
        return f"SimStream({self.name}, {len(self.ops)} pending)"


class _Marker:
    """One record of an event; ``done`` once the stream reached it. ``tick`` = device clock then."""

    def __init__(self, stream: SimStream):
        self.stream = stream
        self.done = False
        self.tick = -1


class SimEvent:
    _ids = itertools.count()

    def __init__(self):
        self.name = f"event{next(self._ids)}"
        self.marker: _Marker | None = None
        self.released = False

    @property
    def stream(self) -> SimStream | None:
        return None if self.marker is None else self.marker.stream

    def recorded(self) -> _Marker:
        self.held()
        if self.marker is None:
            raise AssertionError(f"{self.name} used before it was ever recorded")
        return self.marker

    def held(self) -> None:
        if self.released:
            raise AssertionError(f"{self.name} used after it was released")


class DeviceStuck(AssertionError):
    """Nothing can run, yet something waits for the device: a dependency cycle or a missing record."""


class SimDevice:
    """The simulated device. ``compute`` is the engine's compute stream (the current stream)."""

    def __init__(self):
        self.compute = SimStream("compute")
        self.streams: list[SimStream] = [self.compute]
        self.clock = 0
        self.copy_calls: list[tuple[SimStream, int]] = []  # (stream, number of copies: runs or page pairs) per call
        self.plans: list = []  # the plans handed to copy(), in order
        self.executed: list[str] = []  # labels of the operations run, in order
        self.lanes: dict[str, SimLanes] = {}  # staged jobs' lanes, per side stream
        self.free_events: list[SimEvent] = []  # released, handed out again first
        self.events_made = 0

    # ---- DeviceStreams ---------------------------------------------------------------------------

    def current_stream(self) -> SimStream:
        return self.compute

    def new_stream(self) -> SimStream:
        stream = SimStream(f"side{len(self.streams)}")
        self.streams.append(stream)
        return stream

    def new_event(self) -> SimEvent:
        if self.free_events:
            event = self.free_events.pop()
            event.released = False
            return event
        self.events_made += 1
        return SimEvent()

    def release(self, event: SimEvent) -> None:
        event.held()
        event.released = True
        self.free_events.append(event)

    def record(self, event: SimEvent, stream: SimStream) -> None:
        event.held()
        event.marker = _Marker(stream)
        stream.ops.append(("mark", event.marker, f"record {event.name} on {stream.name}"))

    def wait(self, stream: SimStream, event: SimEvent) -> None:
        marker = event.recorded()
        stream.ops.append(("wait", marker, f"{stream.name} waits {event.name} ({marker.stream.name})"))

    def copy(self, stream: SimStream, plan) -> None:
        """Issue a job's copies (:class:`~kvtier.copy.runs.ByteRuns` or page pairs), carried out
        with torch on the same memory when the stream gets there. A staged job
        (:class:`~kvtier.copy.staged_runs.StagedRuns`) runs on two lanes: ``stream`` (host copies)
        and a kernel stream paired with it (gathers, scatters), as on a GPU."""
        self.plans.append(plan)
        if hasattr(plan, "issue"):
            self.copy_calls.append((stream, plan.num_runs))
            lanes = self.lanes.get(stream.name)
            if lanes is None:
                lanes = self.lanes[stream.name] = SimLanes(self, stream, self.new_stream())
            plan.issue(lanes)
            return
        dsts, srcs = plan.views()
        self._issue(stream, list(dsts), list(srcs))

    def _issue(self, stream: SimStream, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        assert len(dsts) == len(srcs) and all(d.shape == s.shape for d, s in zip(dsts, srcs))
        self.copy_calls.append((stream, len(dsts)))
        self.enqueue(stream, lambda: torch._foreach_copy_(dsts, srcs), f"copy {len(dsts)} runs on {stream.name}")

    def query(self, event: SimEvent) -> bool:
        return event.recorded().done

    def synchronize(self, event: SimEvent) -> None:
        marker = event.recorded()
        self.run_until(lambda: marker.done, f"synchronize {event.name}")

    def elapsed_seconds(self, start: SimEvent, end: SimEvent) -> float:
        first, last = start.recorded(), end.recorded()
        assert first.done and last.done and first.stream is last.stream, "elapsed time of unfinished events"
        return (last.tick - first.tick) * 1e-6

    def close(self) -> None:
        self.closed = True

    # ---- driving the simulation (tests) ---------------------------------------------------------

    def enqueue(self, stream: SimStream, kernel: Callable[[], object], label: str) -> None:
        """Issue a kernel (any Python callable) on ``stream``; it runs when the stream gets there."""
        stream.ops.append(("run", kernel, label))

    def step(self, stream: SimStream) -> bool:
        """Run the operation at the head of ``stream`` if it can run; whether it did."""
        if not stream.ops:
            return False
        kind, payload, label = stream.ops[0]
        if kind == "wait" and not payload.done:
            return False
        stream.ops.popleft()
        self.clock += 1
        if kind == "run":
            payload()
        elif kind == "mark":
            payload.done, payload.tick = True, self.clock
        self.executed.append(label)
        return True

    def advance(self, stream: SimStream) -> int:
        """Run ``stream`` until it is empty or blocked on a wait; how many operations ran."""
        ran = 0
        while self.step(stream):
            ran += 1
        return ran

    def side_streams(self) -> list[SimStream]:
        return [s for s in self.streams if s is not self.compute]

    def advance_side_streams(self) -> int:
        """Advance every stream but the compute stream, as far as each can go without it."""
        total = 0
        while True:
            ran = sum(self.advance(s) for s in self.side_streams())
            if not ran:
                return total
            total += ran

    def run_until(self, condition: Callable[[], bool], what: str) -> None:
        while not condition():
            if not sum(self.advance(s) for s in self.streams):
                raise DeviceStuck(f"{what}: nothing can run; pending {self.streams}")

    def run_all(self) -> None:
        """Run every stream to the end."""
        self.run_until(lambda: not any(s.ops for s in self.streams), "run_all")


class SimLanes:
    """:class:`~kvtier.copy.staged_runs.StagingLanes` on the simulated device: the TRANSFER lane is the
    side stream, the KERNEL lane a stream of its own; marks are simulated events (one per mark,
    re-recorded by each job, as on a GPU)."""

    def __init__(self, device: SimDevice, transfer: SimStream, kernel: SimStream):
        from kvtier.copy.staged_runs import Lane

        self.device = device
        self.streams = {Lane.TRANSFER: transfer, Lane.KERNEL: kernel}
        self.events: dict[int, SimEvent] = {}
        self.Lane = Lane

    def upload(self, plan):
        index = plan.row_index()
        device_index = torch.empty(len(index), dtype=torch.int64)
        source = torch.from_numpy(index.copy())
        self.kernel(lambda: device_index.copy_(source), "upload the row index")
        return device_index

    def begin(self) -> None:
        self.mark(self.Lane.TRANSFER, -1)
        self.wait(self.Lane.KERNEL, -1)

    def kernel(self, work: Callable[[], object], what: str) -> None:
        self.device.enqueue(self.streams[self.Lane.KERNEL], work, what)

    def gather(self, plan, index, first: int, pages: int, buffer: int) -> None:
        self.kernel(lambda: plan.torch_gather(index, first, pages, buffer), f"gather pages {first}+{pages}")

    def scatter(self, plan, index, first: int, pages: int, buffer: int) -> None:
        self.kernel(lambda: plan.torch_scatter(index, first, pages, buffer), f"scatter pages {first}+{pages}")

    def transfer(self, plan, chunk: int) -> None:
        dsts, srcs = plan.chunk_runs(chunk).views()
        self.device._issue(self.streams[self.Lane.TRANSFER], list(dsts), list(srcs))

    def mark(self, lane, mark: int) -> None:
        event = self.events.setdefault(mark, SimEvent())
        self.device.record(event, self.streams[lane])

    def wait(self, lane, mark: int) -> None:
        self.device.wait(self.streams[lane], self.events[mark])

    def finish(self) -> None:
        self.mark(self.Lane.KERNEL, -2)
        self.wait(self.Lane.TRANSFER, -2)


# ---- deliberately broken devices: each drops one ordering the engine asks for ------------------


class LanesIgnoreEachOther(SimDevice):
    """A staged job's two lanes do not wait for each other (a host copy may read a staging buffer
    before its gather ran, or a scatter run before the chunk arrived)."""

    def wait(self, stream: SimStream, event: SimEvent) -> None:
        if any(stream in lanes.streams.values() and event in lanes.events.values() for lanes in self.lanes.values()):
            return
        super().wait(stream, event)


class SideStreamsIgnoreCompute(SimDevice):
    """Side streams do not wait for events of the compute stream (a store may read pages the
    forward has not written yet; a load may overwrite pages earlier kernels still read)."""

    def wait(self, stream: SimStream, event: SimEvent) -> None:
        if stream is not self.compute and event.stream is self.compute:
            return
        super().wait(stream, event)


class ComputeIgnoresSideStreams(SimDevice):
    """The compute stream does not wait for the side streams (the forward may read a load's pages
    before they arrived)."""

    def wait(self, stream: SimStream, event: SimEvent) -> None:
        if stream is self.compute:
            return
        super().wait(stream, event)


class QueryAlwaysTrue(SimDevice):
    """Events look complete as soon as recorded (a poll that does not look at the device)."""

    def query(self, event: SimEvent) -> bool:
        event.recorded()
        return True

    def elapsed_seconds(self, start: SimEvent, end: SimEvent) -> float:
        return 0.0  # the events may not have completed: no time to report


class SynchronizeReturnsAtOnce(SimDevice):
    """Synchronize does not wait for anything."""

    def synchronize(self, event: SimEvent) -> None:
        event.recorded()


class CopyFailsHalfway(SimDevice):
    """The batched copy issues its first half of the copies, then raises (a device error mid-job)."""

    def copy(self, stream: SimStream, plan) -> None:
        dsts, srcs = plan.views()
        half = len(dsts) // 2
        if half:
            self._issue(stream, list(dsts)[:half], list(srcs)[:half])
        raise RuntimeError("simulated device error while issuing copies")


class PoolStreams(SimDevice):
    """Side streams come from a pool of ``size`` streams handed out round robin, as torch's are,
    and the compute stream is one of them (vLLM's is): every ``size``-th new stream is it."""

    def __init__(self, size: int = 4):
        super().__init__()
        self.pool = [self.compute] + [SimStream(f"pool{i}") for i in range(1, size)]
        self.streams = list(self.pool)
        self.handed = 0

    def new_stream(self) -> SimStream:
        stream = self.pool[self.handed % len(self.pool)]
        self.handed += 1
        return stream
