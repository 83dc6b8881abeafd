"""The CUDA copy engine: stores and loads on two side streams, ordered against the compute stream by events.

For KV tensors on a CUDA device (:func:`kvtier.copy.make_copy_engine`). How each rule of the
contract in :mod:`kvtier.copy.base` holds, per job (the scheme of vLLM's own CPU-offload handler,
``v1/kv_offload/cpu/gpu_worker.py:645-687``):

- ``start_store``: an event ``ready`` is recorded on the compute stream at the call, so it marks
  every engine write issued before; the store stream waits on it, then the job's copies are issued
  on the store stream (one batched call, :mod:`kvtier.copy.runs`; small pages through a staging
  buffer, :mod:`kvtier.copy.staging`), then an event ``end`` is recorded there. Stores run in FIFO order: they share one stream.
- ``start_load``: ``ready`` on the compute stream likewise (kernels issued earlier may still read
  the engine blocks being overwritten, and vLLM zeroes newly allocated blocks there); the load
  stream waits on it, issues the copies and records ``end``. A *synchronous* load also makes the
  compute stream wait on ``end``, so every kernel issued after ``start_load`` returns sees the
  loaded bytes. An *asynchronous* one does not: its request is in no batch until the job is
  polled done (vLLM keeps it in WAITING_FOR_REMOTE_KVS; aborted there, its blocks are freed only
  once the load is reported, vLLM 0.32 ``v1/core/sched/scheduler.py:2700-2706``), and holding the
  compute stream would stall every other request behind the copy. Loads share the other stream
  (FIFO).
- ``poll``: per direction, the leading jobs whose ``end`` completed (event query, never blocks).
- ``wait``: blocks on the jobs' ``end`` events; ``close`` on every job's.

Events go back to the device (:meth:`~kvtier.copy.streams.DeviceStreams.release`, which hands
them out again) once nothing will name them: ``ready`` as soon as the side stream's wait on it is
issued (a wait binds to the record current then), ``start`` and ``end`` when the job is polled.

Side streams are kvtier's own (:meth:`~kvtier.copy.streams.DeviceStreams.new_stream`), so no
other work of the process queues on them. Where the device can only hand out torch's pool streams
(no runtime library found: round robin, vLLM's compute stream among them, vLLM
``utils/torch_utils.py:802-857``), a side stream found equal to the compute stream (or to the
other side stream) is replaced before use; kvtier's own streams are never compared.

No call synchronizes a stream per job; only ``wait`` and ``close`` block the calling thread.

Threading: every method is called from the worker's main thread, the one issuing the forward on
the compute stream; the engine has no thread of its own (the device runs the copies).

Buffers: engine pages and host slots of a job must stay untouched until the job is polled (the
copies are in flight until then). The host region should be page-locked
(:func:`kvtier.copy.pinning.pin_host_memory`); pageable memory is copied correctly but synchronously.

Failures: an exception while planning or issuing a job (a page out of range, a device error) is
logged and the job is reported failed, never raised. ``end`` is still recorded after whatever was
issued. When it is reported:

- a failed *synchronous load* at once, by the next :meth:`~CudaCopyEngine.poll` (vLLM discards the
  token sampled on unloaded blocks only if the error arrives in the same step's output, vLLM 0.32
  ``v1/core/sched/scheduler.py:2062-2090``); the compute stream still waits on its ``end``, so a
  partial copy lands before the recompute writes those blocks;
- a failed store or asynchronous load once ``end`` completed if any of its copies may have been
  issued (a partial copy must not outlive the report: the scheduler reuses the host slots and
  engine blocks on it), at once otherwise;
- if even ``end`` cannot be recorded the device is unusable: at once.

The device calls go through :class:`~kvtier.copy.streams.DeviceStreams` (``torch.cuda`` in
production, a simulated device in the tests).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.copy.base import CopyDone, CopyEngine, Direction, Pages, SlotRun
from kvtier.copy.choice import MethodChooser, TrialKey
from kvtier.copy.lanes import GraphRepeat
from kvtier.copy.pages import BlockCopier, CopyPlan
from kvtier.copy.runs import ByteRuns, RunPlanner, SlotJob
from kvtier.copy.staged_runs import StagedRuns
from kvtier.copy.staging import CopyMethod, StagedPlanner, StagingUnavailable
from kvtier.copy.streams import DeviceStreams

logger = logging.getLogger(__name__)

_STREAM_TRIES = 64  # more than torch's pool of streams per priority (32): every pool stream is tried
_REPEATS = 2048  # job sizes (per direction) kept as graph repeats: every size of a 1,024-block job both ways


@dataclass(slots=True)
class _InFlight:
    """A job issued to the device, not yet reported (``reported``: its failure already was).
    ``start`` is None when the job failed; ``plan`` keeps the copy arrays alive while in flight."""

    job_id: int
    direction: Direction
    ok: bool
    num_bytes: int
    start: Any
    end: Any
    issued_at: float
    plan: ByteRuns | StagedRuns | CopyPlan | None
    reported: bool = False
    trial: TrialKey | None = None  # a timed trial of the method chooser
    issue_seconds: float = 0.0  # host time start_load / start_store took


class CudaCopyEngine(CopyEngine):
    """``method``: how jobs of dense pages move (:class:`~kvtier.copy.staging.CopyMethod`; AUTO
    picks per job, by measurement, :mod:`kvtier.copy.choice`); strided pages always go page by
    page. ``staging``: options of the :class:`~kvtier.copy.staging.StagedPlanner` (chunk bytes,
    buffers)."""

    def __init__(self, copier: BlockCopier, device: DeviceStreams, method: CopyMethod = CopyMethod.AUTO,
                 **staging: int):
        self.copier = copier
        self.device = device
        self.runs = RunPlanner(copier.kv, copier.host) if copier.kv.flat else None
        self.method = method
        self.staged = None
        if self.runs is not None and method is not CopyMethod.RUNS:
            if StagedPlanner.fits(copier.kv):
                self.staged = StagedPlanner(copier.kv, self.runs, copier.host.buffer, **staging)
            else:
                logger.info("kvtier: KV pages are not rows of one storage: copies go as runs, never staged")
        self._streams: dict[Direction, Any] = {}
        self._own_side_streams = bool(getattr(device, "owns_side_streams", False))  # else compared per job
        compute = device.current_stream()
        for direction in Direction:
            self._streams[direction] = self._distinct_stream(compute, direction)
        self._prepare_staging()
        self.chooser = MethodChooser(method, staged=self.staged is not None)
        self._in_flight: dict[Direction, deque[_InFlight]] = {direction: deque() for direction in Direction}
        # (direction, blocks) -> how a one-run job of that size went as a graph launch, and whether
        # its method depended on its run count: later ones go so unplanned (_repeat_of);
        # _planned_run: the first slot of the last plan that may be one, and that dependence
        self._repeats: dict[tuple[Direction, int], tuple[GraphRepeat, bool]] = {}
        self._planned_run: int | None = None
        self._planned_by_count = False
        self._launched_sizes: set[tuple[Direction, int]] = set()  # sizes that went as a graph launch once
        self.repeated = 0  # jobs issued as repeats
        self._unordered: list[CopyDone] = []  # failures reported at once (see the module docstring)
        self._closed = False

    def start_load(self, job_id: int, pages: Pages, *, synchronous: bool = True) -> None:
        self._start(job_id, Direction.LOAD, pages, synchronous)

    def start_store(self, job_id: int, pages: Pages) -> None:
        self._start(job_id, Direction.STORE, pages, False)

    def poll(self) -> list[CopyDone]:
        done, self._unordered = self._unordered, []
        for jobs in self._in_flight.values():
            while jobs and self.device.query(jobs[0].end):
                job = jobs.popleft()
                if job.reported:
                    self._release(job.start, job.end)
                    continue
                if job.ok:
                    seconds = self.device.elapsed_seconds(job.start, job.end)
                else:
                    seconds = time.perf_counter() - job.issued_at
                self._release(job.start, job.end)
                method = _method_of(job.plan)
                if job.trial is not None:
                    self.chooser.observe(job.trial, method, job.num_bytes, seconds, job.ok, job.issue_seconds)
                done.append(CopyDone(job.job_id, job.direction, job.ok, job.num_bytes, seconds, method.value))
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
            self._unordered = self.poll()  # every job completed: reported by a later poll, its events released
            self._closed = True
            self.device.close()

    def _prepare_staging(self) -> None:
        """Everything staged jobs need, made now (at registration, the device idle) rather than at
        a first job behind the forward pass: the staging buffers, and the device's lanes (streams,
        events, index uploads, the gather/scatter kernels loaded). Staging that cannot be had is
        logged and off: jobs go as runs."""
        if self.staged is None:
            return
        try:
            for direction in Direction:
                buffers = self.staged.buffers(direction)
                prepare = getattr(self.device, "prepare_staging", None)
                if prepare is not None:
                    prepare(self._streams[direction], buffers.rows[0])
        except (StagingUnavailable, RuntimeError) as exc:
            logger.warning("kvtier: staged copies are off (%s); copies go as runs", exc)
            self.staged = None

    def _distinct_stream(self, compute: Any, direction: Direction) -> Any:
        """A side stream for ``direction`` that is neither ``compute`` nor the other side stream."""
        others = [compute, *(s for d, s in self._streams.items() if d is not direction)]
        for _ in range(_STREAM_TRIES):
            stream = self.device.new_stream()
            if not any(stream == other for other in others):
                return stream
        raise RuntimeError("kvtier: the device hands out no side stream distinct from the compute stream")

    def _side_stream(self, direction: Direction, compute: Any) -> Any:
        stream = self._streams[direction]
        if not self._own_side_streams and stream == compute:
            logger.info("kvtier: the %s side stream is the compute stream now; taking another", direction.value)
            stream = self._streams[direction] = self._distinct_stream(compute, direction)
        return stream

    def _plan(self, direction: Direction, pages: Pages, table: np.ndarray | None = None
              ) -> tuple[ByteRuns | StagedRuns | CopyPlan, TrialKey | None]:
        """The job's copies and, if it is one, the chooser's trial it is. Jobs of whole one-page
        blocks (most) are planned per block (:class:`~kvtier.copy.runs.SlotJob`), others per
        (block, layer). ``table``: ``pages`` checked already (``runs.table``), if it was."""
        if self.runs is None:
            return self.copier.plan(direction, pages), None
        self._planned_run = None
        table = self.runs.table(pages) if table is None else table
        slots = self.runs.slot_job(table)
        entries = self.runs.entries(table) if slots is None else None
        breaks = None
        decided = True  # whether the method does not depend on the job's engine blocks
        if slots is not None:
            num_bytes = len(slots) * self.runs.num_layers * self.runs.page_bytes
            runs = 1
            if self.method is CopyMethod.AUTO:
                runs = self.runs.fewest_slot_runs(slots)
                decided = self.chooser.decided_by(num_bytes, runs, self.runs.most_slot_runs(slots))
                if not decided:
                    if slots.first_slot is None:  # (the staged plan of a one-run job needs none)
                        breaks = self.runs.block_breaks(slots)
                    runs = self.runs.count_slot_runs(slots, breaks)  # the count decides: make it exact
        else:
            assert entries is not None
            num_bytes = int(entries.sizes.sum())
            runs = self.runs.count_runs(entries) if self.method is CopyMethod.AUTO else len(entries)
        method, trial = self.chooser.pick(direction, num_bytes, runs)
        if method is CopyMethod.STAGED and self.staged is not None:
            try:
                plan = self.staged.plan_slots(direction, slots, breaks) if slots is not None else \
                    self.staged.plan(direction, entries)
                if slots is not None and slots.first_slot is not None and trial is None:
                    self._planned_run = slots.first_slot  # a later job of its size may repeat it
                    self._planned_by_count = not decided  # ... if its own count is staged too
                return plan, trial
            except StagingUnavailable as exc:
                logger.warning("kvtier: %s; copies go as runs from now on", exc)
                self.staged = None
                self._repeats.clear()
                self.chooser = MethodChooser(self.method, staged=False)
                trial = None
        merged = self.runs.merge_slots(direction, slots) if slots is not None else None
        if merged is None:
            merged = self.runs.merge(direction, entries if entries is not None else self.runs.entries(table))
        return merged, trial

    def _start(self, job_id: int, direction: Direction, pages: Pages, synchronous: bool) -> None:
        if self._closed:
            raise RuntimeError(f"kvtier: job {job_id} started on a closed copy engine")
        device = self.device
        issued_at = time.perf_counter()
        ok, num_bytes, start, plan, copying, trial = True, 0, None, None, False, None
        compute = stream = ready = end = None
        try:
            compute = device.current_stream()
            stream = self._side_stream(direction, compute)
            # views and arrays only: a bad page fails before any device call
            repeat, first, blocks, table = self._repeat_of(direction, pages)
            plan, trial = (repeat.plan, None) if repeat is not None else self._plan(direction, pages, table)
            ready = device.new_event()
            device.record(ready, compute)
            device.wait(stream, ready)
            device.release(ready)
            ready = None
            start = device.new_event()
            device.record(start, stream)
            planned = repeat.num_bytes if repeat is not None else plan.num_bytes  # a repeat's is kept: no torch call
            if planned:
                copying = True
                if repeat is not None and device.repeat(stream, repeat, first, blocks):
                    self.repeated += 1
                else:
                    if repeat is not None:  # it could not go unplanned (see CudaLanes.repeat): planned
                        del self._repeats[(direction, len(blocks))]
                        plan, trial = self._plan(direction, pages, table)
                    self._issue(direction, stream, plan)
            num_bytes = planned
        except Exception:  # reported as a failed job (a load's blocks are recomputed), never raised
            logger.exception("kvtier: %s copy of job %d failed", direction.value, job_id)
            self._release(ready, start)
            ok, num_bytes, start = False, 0, None
        try:
            end = device.new_event()
            device.record(end, stream)  # after whatever was issued, ok or not
            if direction is Direction.LOAD and synchronous:
                device.wait(compute, end)
        except Exception:
            logger.exception("kvtier: cannot order %s job %d on the device; reported failed", direction.value, job_id)
            self._unordered.append(CopyDone(job_id, direction, False, 0, time.perf_counter() - issued_at))
            self._release(start)  # end stays out of the pool: a record of it may still be pending
            return
        at_once = not ok and (not copying or (direction is Direction.LOAD and synchronous))
        if at_once:
            self._unordered.append(CopyDone(job_id, direction, False, 0, time.perf_counter() - issued_at))
        self._in_flight[direction].append(
            _InFlight(job_id, direction, ok, num_bytes, start, end, issued_at, plan, reported=at_once, trial=trial,
                      issue_seconds=time.perf_counter() - issued_at))


    def _repeat_of(self, direction: Direction, pages: Pages
                   ) -> tuple[GraphRepeat | None, int, np.ndarray | None, np.ndarray | None]:
        """(the repeat, its first slot, its engine blocks, the checked page table or None) when
        ``pages`` is a job that can go as a repeat of an earlier job's graph
        (:meth:`TorchCudaStreams.repeat`: a page table or :class:`~kvtier.copy.base.SlotRun` of a
        size seen before as such, one host run, and where the method of that size depends on the
        run count, one whose own count is staged); else (None, 0, None, the table if it was checked
        on the way, or None). A :class:`~kvtier.copy.base.SlotRun` is checked without a table
        (:meth:`~kvtier.copy.runs.RunPlanner.slot_run_first`). IndexError naming a page out of range."""
        if not self._repeats:
            return None, 0, None, None
        kind = type(pages)
        if kind is SlotRun:
            kept = self._repeats.get((direction, len(pages.blocks)))
            if kept is None:
                return None, 0, None, None
            table, first, blocks = None, self.runs.slot_run_first(pages), pages.blocks
        elif kind is np.ndarray:
            kept = self._repeats.get((direction, len(pages)))
            if kept is None:
                return None, 0, None, None
            table = self.runs.table(pages)
            first = self.runs.one_run_first(table)
            blocks = table[:, 2]
        else:
            return None, 0, None, None
        repeat, by_count = kept
        if first is None or (by_count and not self._count_stages(direction, blocks, first)):
            return None, 0, None, table  # (a table checked already: the plan takes it)
        return repeat, first, blocks, table

    def _count_stages(self, direction: Direction, blocks: np.ndarray, first: int) -> bool:
        """Whether the chooser stages the one-run job of engine ``blocks`` from slot ``first``
        (checked) by its exact run count, with no trial: a job whose class depends on its engine
        blocks (block-outermost layouts, where a run is as many consecutive blocks as the engine
        holds in a row) repeats only where its own class was chosen STAGED."""
        job = SlotJob(np.arange(first, first + len(blocks)), blocks, first)
        num_bytes = len(job) * self.runs.num_layers * self.runs.page_bytes
        method, trial = self.chooser.pick(direction, num_bytes, self.runs.count_slot_runs(job))
        return method is CopyMethod.STAGED and trial is None

    def _issue(self, direction: Direction, stream: Any, plan: ByteRuns | StagedRuns | CopyPlan) -> None:
        """``device.copy`` of a planned job; a one-run staged job of whole blocks that went as a
        graph launch, of a size that did so before, is kept as the repeat of its size (a size
        seen once is only noted: sizes that never come back cost no repeat; at most
        :data:`_REPEATS` sizes of each)."""
        key = self.device.copy(stream, plan)
        first = self._planned_run
        if key is None or first is None or not isinstance(plan, StagedRuns) or plan.blocks is None \
                or self.staged is None:
            return
        size = (direction, len(plan.blocks))
        if size not in self._launched_sizes:
            if len(self._launched_sizes) >= _REPEATS:
                self._launched_sizes.clear()
            self._launched_sizes.add(size)
            return
        if len(self._repeats) >= _REPEATS:
            self._repeats.clear()
        staged = self.staged
        self._repeats[size] = (GraphRepeat.of(plan, key, staged.host_address(first), staged.host_address(0),
                                              staged.slot_stride), self._planned_by_count)

    def _release(self, *events: Any) -> None:
        """Hand the events that exist of ``events`` back to the device."""
        for event in events:
            if event is not None:
                self.device.release(event)


def _method_of(plan: ByteRuns | StagedRuns | CopyPlan | None) -> CopyMethod:
    """How a job moved (PAGES: page pairs, strided layouts or a job that failed before planning)."""
    if isinstance(plan, StagedRuns):
        return CopyMethod.STAGED
    if isinstance(plan, ByteRuns):
        return CopyMethod.RUNS
    return CopyMethod.PAGES
