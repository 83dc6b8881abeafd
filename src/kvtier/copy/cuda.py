"""The CUDA copy engine: stores and loads on two side streams, ordered against the compute stream by events.

For KV tensors on a CUDA device (:func:`kvtier.copy.make_copy_engine`). How each rule of the
contract in :mod:`kvtier.copy.base` holds, per job (the scheme of vLLM's own CPU-offload handler):

- ``start_store``: an event ``ready`` is recorded on the compute stream at the call, so it marks
  every engine write issued before; the store stream waits on it, then the job's device->host
  copies are issued on the store stream (one batched call, no Python copy per page), then an
  event ``end`` is recorded there. Stores run in FIFO order: they share one stream.
- ``start_load``: ``ready`` on the compute stream likewise (kernels issued earlier may still read
  the engine blocks being overwritten); the load stream waits on it, issues the host->device
  copies and records ``end``; the compute stream waits on ``end``, so every kernel issued after
  ``start_load`` returns sees the loaded bytes. Loads share the other stream (FIFO).
- ``poll``: per direction, the leading jobs whose ``end`` completed (event query, never blocks).
- ``wait``: blocks on the jobs' ``end`` events; ``close`` on every job's.

No call synchronizes a stream per job; only ``wait`` and ``close`` block the calling thread.

Threading: every method is called from the worker's main thread, the one issuing the forward on
the compute stream; the engine has no thread of its own (the device runs the copies).

Buffers: engine pages and host slots of a job must stay untouched until the job is polled (the
copies are in flight until then). The host region should be page-locked
(:func:`kvtier.copy.pin_host_memory`); pageable memory is copied correctly but synchronously.

Failures: an exception while planning or issuing a job (a page out of range, a device error) is
logged and the job is reported by :meth:`~CudaCopyEngine.poll` with ``ok=False``, never raised.
``end`` is still recorded after whatever was issued, and a failed load still holds back the
compute stream, so a partial copy can neither land on blocks vLLM recomputes nor outlive the
job's report. If even ``end`` cannot be recorded, the device is unusable: the job is reported
failed at once.

The device calls go through :class:`~kvtier.copy.streams.DeviceStreams` (``torch.cuda`` in
production, a simulated device in the tests).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.copy.base import CopyDone, CopyEngine, Direction, PageCopy
from kvtier.copy.pages import BlockCopier
from kvtier.copy.streams import DeviceStreams

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _InFlight:
    """A job issued to the device, not yet reported. ``start`` is None when it failed before its copies."""

    job_id: int
    direction: Direction
    ok: bool
    num_bytes: int
    start: Any
    end: Any
    issued_at: float


class CudaCopyEngine(CopyEngine):
    def __init__(self, copier: BlockCopier, device: DeviceStreams):
        self.copier = copier
        self.device = device
        self._streams = {direction: device.new_stream() for direction in Direction}
        self._in_flight: dict[Direction, deque[_InFlight]] = {direction: deque() for direction in Direction}
        self._unordered: list[CopyDone] = []  # failed jobs whose end event could not be recorded
        self._closed = False

    def start_load(self, job_id: int, pages: Sequence[PageCopy]) -> None:
        self._start(job_id, Direction.LOAD, pages)

    def start_store(self, job_id: int, pages: Sequence[PageCopy]) -> None:
        self._start(job_id, Direction.STORE, pages)

    def poll(self) -> list[CopyDone]:
        done, self._unordered = self._unordered, []
        for jobs in self._in_flight.values():
            while jobs and self.device.query(jobs[0].end):
                job = jobs.popleft()
                if job.ok:
                    seconds = self.device.elapsed_seconds(job.start, job.end)
                else:
                    seconds = time.perf_counter() - job.issued_at
                done.append(CopyDone(job.job_id, job.direction, job.ok, job.num_bytes, seconds))
        return done

    def wait(self, job_ids: Iterable[int] | None = None) -> None:
        wanted = None if job_ids is None else set(job_ids)
        for jobs in self._in_flight.values():
            for job in list(jobs):
                if wanted is None or job.job_id in wanted:
                    self.device.synchronize(job.end)

    def close(self) -> None:
        if not self._closed:
            self.wait()
            self._closed = True

    def _start(self, job_id: int, direction: Direction, pages: Sequence[PageCopy]) -> None:
        if self._closed:
            raise RuntimeError(f"kvtier: job {job_id} started on a closed copy engine")
        device, stream = self.device, self._streams[direction]
        issued_at = time.perf_counter()
        ok, num_bytes, start = True, 0, None
        try:
            plan = self.copier.plan(direction, pages)  # views only: a bad page fails before any device call
            ready = device.new_event()
            device.record(ready, device.current_stream())
            device.wait(stream, ready)
            start = device.new_event()
            device.record(start, stream)
            if plan.dsts:
                device.copy(stream, plan.dsts, plan.srcs)
            num_bytes = plan.num_bytes
        except Exception:  # reported as a failed job (a load's blocks are recomputed), never raised
            logger.exception("kvtier: %s copy of job %d failed", direction.value, job_id)
            ok, num_bytes, start = False, 0, None
        try:
            end = device.new_event()
            device.record(end, stream)  # after whatever was issued, ok or not
            if direction is Direction.LOAD:
                device.wait(device.current_stream(), end)
        except Exception:
            logger.exception("kvtier: cannot order %s job %d on the device; reported failed", direction.value, job_id)
            self._unordered.append(CopyDone(job_id, direction, False, 0, time.perf_counter() - issued_at))
            return
        self._in_flight[direction].append(_InFlight(job_id, direction, ok, num_bytes, start, end, issued_at))
