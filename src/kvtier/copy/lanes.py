"""The two lanes a staged copy job runs on with CUDA (:class:`CudaLanes`: a side stream and a
KERNEL stream paired with it, marks between them, index uploads, kvtier's kernels, job graphs),
and the pools of CUDA events that :class:`~kvtier.copy.streams.TorchCudaStreams` and its lanes
take events from (:class:`EventPool`).

Made and called by :class:`~kvtier.copy.streams.TorchCudaStreams` only, on the thread that issues
the forward; its tests run on CPU through a stand-in device that runs every call on host memory
(``tests/host_device.py``), the real calls in the GPU kit.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvtier.copy.base import Direction
from kvtier.copy.cudagraph import CudaJobGraph
from kvtier.copy.jobgraph import GraphCache, graph_key
from kvtier.copy.kernels import RowKernels
from kvtier.copy.staged_runs import Lane, StagedRuns

if TYPE_CHECKING:
    from kvtier.copy.streams import TorchCudaStreams

logger = logging.getLogger(__name__)


class EventPool:
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


@dataclass(frozen=True, eq=False)
class GraphRepeat:
    """What a job of one staged graph shape needs besides its first slot and engine blocks, for
    :meth:`CudaLanes.repeat`: a job of whole blocks, one host run of consecutive slots (in one
    pinning chunk), issued before as a launch of the graph ``key``. Taken from that job's plan
    (``plan``, kept to report the method): the uploaded numbers but the blocks (``count_word``,
    the page count; ``layer_rows``), each chunk's host offset from the run's start (``starts``)
    and copy size, the host region's address and a slot's bytes."""

    direction: Direction
    key: Hashable
    count: int  # numbers uploaded: 1 + layers + blocks
    count_word: np.ndarray
    layer_rows: np.ndarray
    starts: list[int]  # each chunk's host copy, bytes from the run's first slot
    sizes: list[int]
    host_base: int  # slot 0's address
    slot_bytes: int
    num_bytes: int
    plan: StagedRuns

    @classmethod
    def of(cls, plan: StagedRuns, key: Hashable, run_address: int, host_base: int, slot_bytes: int) -> GraphRepeat:
        """The repeat of ``plan``, one host run from ``run_address`` (its first slot's address;
        slot 0's: ``host_base``), launched as graph ``key``."""
        assert plan.blocks is not None and plan.layer_rows is not None
        parts = plan.kernel_numbers()
        return cls(plan.direction, key, sum(len(part) for part in parts), parts[0], plan.layer_rows,
                   [address - run_address for address in plan.host_addr.tolist()], plan.sizes.tolist(), host_base,
                   slot_bytes, plan.num_bytes, plan)


class CudaLanes:
    """:class:`~kvtier.copy.staged_runs.StagingLanes` on a pair of CUDA streams: ``transfer`` (the
    side stream of a direction) and ``kernel_stream``, with the events of its marks made once
    (ordering only, no timing) and reused by every job of the pair: a wait binds to a mark's
    latest record, and each job records a mark before it waits for it. Events come from the
    runtime where one was found (a third of torch's host time per call), else from torch (an
    :class:`EventPool` of ordering events, which also serves the uploads).

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
            self._transfer, self._kernel = transfer.cuda_stream, kernel_stream.cuda_stream
        else:
            self._transfer, self._kernel = transfer, kernel_stream
        self._ordering = EventPool(streams, timing=False)  # the marks' and the uploads' events
        self._events: dict[int, Any] = {}  # mark -> event, taken at its first record
        cuda = streams._cuda
        self._ring = streams.pinned(self.UPLOAD_RING_BYTES)
        self._ring_words = self._ring.view(torch.int64)
        self._ring_numpy = self._ring_words.numpy()
        self._ring_address = self._ring.data_ptr()
        self._ring_head = 0
        # (first, end) words of the ring, and an event recorded after their uploads on each lane that
        # uploaded from them: fenced every RING_FENCES-th of the ring and at a wrap, not per job
        self._ring_pending: deque[tuple[int, int, list[Any]]] = deque()
        self._ring_open = 0  # the ring's words from here to the head were uploaded since the last fence
        self._ring_lanes: set[Lane] = set()  # the lanes those uploads went on
        self._ring_size = len(self._ring_words)  # words (an int: len() of a tensor is a Python call)
        self._ring_free_end = self._ring_size  # the words from the head to here are free
        with cuda.stream(kernel_stream):
            self._index = torch.empty(64 * 1024, dtype=torch.int64, device=rows.device)
            self._index_size = 64 * 1024
            pick = self._index[:2].copy_(torch.tensor([1, 0]))  # a job of one page: its count, its row
            source = torch.zeros(2, rows.shape[1], dtype=rows.dtype, device=rows.device)
            target = torch.empty(1, rows.shape[1], dtype=rows.dtype, device=rows.device)
            torch.index_select(source, 0, pick[1:], out=target)  # load the kernels now
            source.index_copy_(0, pick[1:], target)
        self.kernels = None
        self.page_bytes = rows.shape[1] * rows.element_size()
        if self.runtime is not None and streams.own_kernels:
            self.kernels = self._load_kernels(rows.device, source, target, pick)
        kernel_stream.synchronize()
        self.raw = self.kernels is not None
        self._graphs: GraphCache[CudaJobGraph] | None = None
        if self.raw and streams.job_graphs and getattr(self.runtime, "graphs", False) and self.kernels.graph_nodes:
            self._graphs = GraphCache(self._retire)
        self._index_address = self._index.data_ptr()
        self._graphs_built_on = self._index_address
        self._retired: deque[tuple[CudaJobGraph | torch.Tensor, Any]] = deque()  # (what, event after its last use)
        self.graph_launches = 0  # jobs issued as a CUDA graph (the kit reports it)

    def _load_kernels(self, device: torch.device, source: torch.Tensor, target: torch.Tensor,
                      pick: torch.Tensor) -> RowKernels | None:
        """kvtier's row kernels, loaded and run once on the KERNEL stream (``pick``: the numbers of
        a job of one page, row 0); None if unavailable."""
        kernels = self.streams.load_kernels(device, self.page_bytes)
        if kernels is None:
            return None
        handle = self.kernel_stream.cuda_stream
        try:
            for kind in ("gather", "scatter"):
                kernels.launch(kind, handle, source.data_ptr(), target.data_ptr(), pick.data_ptr(), 0, 1, self.page_bytes)
        except Exception as exc:  # noqa: BLE001 - any failure: torch's ops instead
            logger.warning("kvtier: kvtier's copy kernels failed a first launch (%s): torch's ops instead", exc)
            self.runtime.get_last_error()
            return None
        return kernels

    def issue(self, plan: StagedRuns) -> Hashable | None:
        """Issue a staged job (``raw`` lanes): as its shape's CUDA graph where it has one (one
        launch on the TRANSFER lane, whose first node uploads the job's numbers from the ring:
        :mod:`kvtier.copy.cudagraph`), else op by op (:meth:`~kvtier.copy.staged_runs.StagedRuns.issue`;
        also a job the ring has no room for now). A graph that cannot be built or launched turns
        graphs off for these lanes (logged); that job goes op by op. Returns the graph's key
        when the job went as a graph launch, else None."""
        if self._retired:
            self._destroy_retired()
        key = graph_key(plan) if self._graphs is not None else None
        if key is not None:
            parts = self._numbers(plan)
            count = sum(len(part) for part in parts)
            if count > self._ring_size:  # its upload node could not read them from the ring: op by op
                plan.issue(self)
                return None
            self._reserve(count)
            graph = self._graph(plan, key, count)
            first = self._stage(parts, count, Lane.TRANSFER) if graph is not None else None
            # no graph, no room in the ring or a failed launch: op by op
            if first is not None and self._launch_graph(graph, plan.direction, plan.host_addr.tolist(),
                                                        plan.sizes.tolist(), first, count):
                return key
        plan.issue(self)
        return None

    def repeat(self, job: GraphRepeat, first_slot: int, blocks: np.ndarray) -> bool:
        """Issue a job of ``job``'s shape whose host run starts at slot ``first_slot`` and whose
        engine blocks are ``blocks`` as a launch of the shape's kept graph, without planning it
        (what :meth:`issue` does for such a job, less the plan: the numbers are ``job``'s page
        count and layer rows and ``blocks``, the host addresses ``job``'s chunk starts past the
        slot's). False, with nothing issued, where it cannot go so (no graph kept for the shape,
        the index buffer grown since, no room in the ring, a failed launch: graphs off as in
        :meth:`issue`): the caller issues the job planned."""
        if self._retired:
            self._destroy_retired()
        graphs = self._graphs
        if graphs is None or self._index_address != self._graphs_built_on:
            return False
        graph = graphs.kept(job.key)
        if graph is None:
            return False
        first = self._stage((job.count_word, job.layer_rows, blocks), job.count, Lane.TRANSFER)
        if first is None:
            return False
        host = job.host_base + first_slot * job.slot_bytes
        return self._launch_graph(graph, job.direction, [host + start for start in job.starts], job.sizes, first, job.count)

    def _launch_graph(self, graph: CudaJobGraph, direction: Direction, host_addrs: list[int],
                      sizes: list[int], first: int, count: int) -> bool:
        """Launch ``graph`` on the TRANSFER lane for a job of these host addresses and sizes, its
        ``count`` numbers staged in the ring from word ``first`` (its first node uploads them);
        False if the launch failed (graphs off, logged; nothing of the job was launched)."""
        try:
            graph.launch(direction, host_addrs, sizes, self._transfer, self._ring_address + 8 * first, count)
        except Exception as exc:  # noqa: BLE001 - the caller issues the job otherwise
            self._graphs_off(f"a launch failed ({exc})")
            return False
        finally:
            self._fence_if_due()
        self.graph_launches += 1
        return True

    def _graph(self, plan: StagedRuns, key: Any, count: int) -> CudaJobGraph | None:
        """``key``'s graph (``plan`` of that shape, ``count`` numbers to upload; the index buffer
        already reserved for them), or None."""
        assert self._graphs is not None
        if self._index_address != self._graphs_built_on:  # the kernels of every graph read the old one
            self._graphs.clear()
            self._graphs_built_on = self._index_address
        try:
            return self._graphs.find(key, lambda: CudaJobGraph.build(
                self.runtime, self.kernels, plan, self._index_address, self.page_bytes, count, self._ring_address))
        except Exception as exc:  # noqa: BLE001 - an optimization only: jobs go op by op
            self._graphs_off(f"one could not be built ({exc})")
            return None

    def _graphs_off(self, why: str) -> None:
        logger.warning("kvtier: staged copies go op by op from now on, not as CUDA graphs: %s", why)
        graphs, self._graphs = self._graphs, None
        if graphs is not None:
            graphs.clear()

    def _retire(self, what: CudaJobGraph | torch.Tensor) -> None:
        """Destroy a graph, or drop an index buffer graphs read, once everything issued so far on
        the TRANSFER lane (every launch of a graph) ran."""
        event = self._ordering.take()
        self.runtime.event_record(event, self._transfer)
        self._retired.append((what, event))

    def _destroy_retired(self) -> None:
        while self._retired and self.runtime.event_query(self._retired[0][1]):
            what, event = self._retired.popleft()
            if isinstance(what, CudaJobGraph):
                what.destroy()
            self._ordering.give(event)

    def _numbers(self, plan: StagedRuns) -> tuple[np.ndarray, ...]:
        """What the job's kernels read, as the parts to upload one after the other: for kvtier's
        kernels its :meth:`~kvtier.copy.staged_runs.StagedRuns.kernel_numbers` (its page count, then one
        number per block of a job of whole blocks, else its row index), for torch's ops its row index."""
        return plan.kernel_numbers() if self.kernels is not None else (plan.row_index(),)

    def _reserve(self, count: int) -> None:
        """The device index buffer at least ``count`` long: grown on the KERNEL stream, whose
        kernels that read the old one are before any reuse of its memory there; graphs (launched
        on the TRANSFER lane) may read it later, so the old one is kept until they ran."""
        if count > self._index_size:
            old = self._index
            with self.streams._cuda.device(old.device), self.streams._cuda.stream(self.kernel_stream):
                self._index = torch.empty(max(count, 2 * len(old)), dtype=torch.int64, device=old.device)
            self._index_size = len(self._index)
            self._index_address = self._index.data_ptr()
            if self.graph_launches:
                self._retire(old)

    def upload(self, plan: StagedRuns) -> torch.Tensor:
        """The job's numbers (:meth:`_numbers`) in the device index buffer, uploaded on the KERNEL lane."""
        parts = self._numbers(plan)
        count = sum(len(part) for part in parts)
        self._reserve(count)
        self._upload(parts, Lane.KERNEL)
        return self._index[:count]

    RING_FENCES = 8  # events recorded per pass over the upload ring (and one at each wrap)

    def _upload(self, parts: tuple[np.ndarray, ...], lane: Lane) -> None:
        """Issue the copy of ``parts``, one after the other, to the start of the device index
        buffer (reserved for them) on ``lane``: from the page-locked ring, or where it has no
        room, from a page-locked buffer of its own."""
        count = sum(len(part) for part in parts)
        first = self._stage(parts, count, lane)
        if first is None:
            host = self.streams.pinned(8 * count).view(torch.int64)
            _fill(host.numpy(), 0, parts)
            stream = self.kernel_stream if lane is Lane.KERNEL else self.transfer_stream
            with self.streams._cuda.device(self._index.device), self.streams._cuda.stream(stream):
                self._index[:count].copy_(host, non_blocking=True)
            return
        if self.runtime is not None:
            self.runtime.memcpy(self._index_address, self._ring_address + 8 * first, 8 * count, self._handle(lane))
        else:
            with self.streams._cuda.stream(self._handle(lane)):
                self._index[:count].copy_(self._ring_words[first:first + count], non_blocking=True)
        self._fence_if_due()

    def _stage(self, parts: tuple[np.ndarray, ...], count: int, lane: Lane) -> int | None:
        """Write ``parts`` (``count`` words) into the ring for an upload on ``lane`` issued next;
        where they start, or None (no room: nothing written)."""
        first = self._take(count)
        if first is not None:
            _fill(self._ring_numpy, first, parts)
            self._ring_lanes.add(lane)
        return first

    def _fence_if_due(self) -> None:
        """:meth:`_fence` once an eighth of the ring was uploaded from since the last fence."""
        if self._ring_head - self._ring_open >= self._ring_size // self.RING_FENCES:
            self._fence()

    def _fence(self) -> None:
        """Record, on each lane that uploaded from them, an event after the uploads from the ring's
        words since the last fence: those words may be written again once the events completed."""
        if self._ring_head == self._ring_open:
            return
        events = []
        for lane in self._ring_lanes:
            event = self._ordering.take()
            if self.runtime is not None:
                self.runtime.event_record(event, self._handle(lane))
            else:
                event.record(self._handle(lane))
            events.append(event)
        self._ring_pending.append((self._ring_open, self._ring_head, events))
        self._ring_open, self._ring_lanes = self._ring_head, set()

    def _uploaded(self, events: list[Any]) -> bool:
        if self.runtime is not None:
            return all(self.runtime.event_query(event) for event in events)
        return all(event.query() for event in events)

    def _take(self, count: int) -> int | None:
        """Where ``count`` words of the ring can be written now, or None (too large, or those
        words' last upload not run yet: never waited for). The ring is written from its head on;
        the words from there to ``_ring_free_end`` are known free, and only when a job needs more
        are the fences' events queried (the fenced words ahead of the head are of earlier passes)."""
        size = self._ring_size
        if count > size:
            return None
        first = self._ring_head
        if first + count > size:  # wrap: the words since the last fence are fenced first
            self._fence()
            first = self._ring_open = self._ring_head = self._ring_free_end = 0
        end = first + count
        if end > self._ring_free_end:
            kept: deque[tuple[int, int, list[Any]]] = deque()
            for entry in self._ring_pending:
                if self._uploaded(entry[2]):
                    for event in entry[2]:
                        self._ordering.give(event)
                else:
                    kept.append(entry)
            self._ring_pending = kept
            self._ring_free_end = min((a for a, _, _ in kept if a >= first), default=size)
            if end > self._ring_free_end:
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
        """kvtier's kernel ``kind`` on the KERNEL lane; ``uploaded``: the job's kernel numbers (see
        :meth:`upload`)."""
        assert self.kernels is not None
        self.kernels.launch(kind, self._kernel, plan.rows_address, plan.buffers.address_list[buffer],
                            uploaded.data_ptr(), first, pages, self.page_bytes, blocks=plan.kernel_blocks())

    def transfer(self, plan: StagedRuns, chunk: int) -> None:
        self.streams._host_copies(self.transfer_stream, plan, chunk)

    def _handle(self, lane: Lane) -> Any:
        """``lane``'s stream: its raw handle with a runtime, else torch's stream."""
        return self._kernel if lane is Lane.KERNEL else self._transfer

    def mark(self, lane: Lane, mark: int) -> None:
        event = self._events.get(mark)
        if event is None:
            event = self._events[mark] = self._ordering.take()
        if self.runtime is not None:
            self.runtime.event_record(event, self._handle(lane))
        else:
            event.record(self._handle(lane))

    def wait(self, lane: Lane, mark: int) -> None:
        if self.runtime is not None:
            self.runtime.stream_wait_event(self._handle(lane), self._events[mark])
        else:
            self._handle(lane).wait_event(self._events[mark])

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
        self.transfer_stream.synchronize()
        if self._graphs is not None:
            self._graphs.clear()
        for what, _ in self._retired:
            if isinstance(what, CudaJobGraph):
                what.destroy()
        self._retired = deque()
        self._ring_pending = deque()
        self._ring = self._ring_words = self._ring_numpy = self._index = None
        self._events = {}
        self._ordering.close()
        if self.kernels is not None:
            self.kernels.close()
            self.kernels = None


def _fill(words: np.ndarray, first: int, parts: tuple[np.ndarray, ...]) -> None:
    """Write ``parts`` one after the other into ``words`` from ``first`` on."""
    for part in parts:
        words[first:first + len(part)] = part
        first += len(part)
