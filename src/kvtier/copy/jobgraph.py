"""A staged job's schedule as a dependency graph, and the cache of graphs by job shape.

Why: issuing a staged job chunk by chunk (:meth:`~kvtier.copy.staged_runs.StagedRuns.issue`) costs
~6 device calls per chunk on the thread that issues the forward (a launch, a host copy, marks and
waits between the two lanes): 4-32 chunks for a 512-block job. Jobs of one shape
(:func:`graph_key`: direction, chunks, one host run per chunk, the last chunk's size rounded up)
differ only in the host addresses and sizes of their copies and in the uploaded numbers, so the
device can replay one graph of the whole schedule: per job, one parameter update per chunk and
one launch (:mod:`kvtier.copy.cudagraph`).

:class:`JobGraph` records the schedule :meth:`~kvtier.copy.staged_runs.StagedRuns.issue` issues,
as :class:`~kvtier.copy.staged_runs.StagingLanes`, into nodes and the nodes each waits for, with
the meaning of streams and events: an operation follows the previous one of its lane, and a
wait makes the lane's next operation follow what the waited mark covered when it was recorded
(the lane's operations up to then, and the waits before them). ``begin`` and ``finish`` add
nothing: a graph launched on the TRANSFER lane starts after everything issued on it before,
and everything issued on it after waits for every node. The upload is not a node of the schedule:
the CUDA graph adds it as the node its first operations follow (:mod:`kvtier.copy.cudagraph`).

:class:`GraphCache` decides when a shape gets a graph (its ``build_at``-th job) and keeps at most
``capacity`` graphs, handing the least recently used back to its owner to retire.

Pure Python, no device: the CUDA graphs are :mod:`kvtier.copy.cudagraph`'s; the tests run a
recorded graph on CPU tensors in any order its edges allow (``tests/test_job_graphs.py``).
Called on the thread that issues the forward only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from kvtier.copy.staged_runs import Lane, StagedRuns


@dataclass(frozen=True, slots=True)
class GraphNode:
    """One operation of a staged job: ``op`` "gather" or "scatter" (pages ``[first, first +
    pages)`` of the job through staging buffer ``buffer``) or "transfer" (chunk ``chunk``'s host
    copy: one run, :attr:`~kvtier.copy.staged_runs.StagedRuns.one_run_per_chunk`); ``after``: the
    indices of the earlier nodes it waits for."""

    op: str
    after: tuple[int, ...]
    first: int = 0
    pages: int = 0
    buffer: int = 0
    chunk: int = 0


class JobGraph:
    """The schedule of one staged job as :class:`GraphNode` s in issue order (every node's
    ``after`` names earlier nodes only). Made by :meth:`record`."""

    def __init__(self, uploaded: torch.Tensor | None = None):
        self.nodes: list[GraphNode] = []
        self._uploaded = uploaded
        self._last: dict[Lane, int | None] = {lane: None for lane in Lane}
        self._waits: dict[Lane, set[int]] = {lane: set() for lane in Lane}
        self._marks: dict[int, frozenset[int]] = {}

    @classmethod
    def record(cls, plan: StagedRuns, uploaded: torch.Tensor | None = None) -> JobGraph:
        """``plan``'s schedule; ``uploaded``: what the recording's upload returns to the schedule
        (the nodes do not keep it)."""
        graph = cls(uploaded)
        plan.issue(graph)
        return graph

    def upload(self, plan: StagedRuns) -> torch.Tensor | None:
        return self._uploaded

    def begin(self) -> None:
        pass

    def finish(self) -> None:
        pass

    def gather(self, plan: StagedRuns, uploaded: torch.Tensor, first: int, pages: int, buffer: int) -> None:
        self._add(Lane.KERNEL, "gather", first=first, pages=pages, buffer=buffer)

    def scatter(self, plan: StagedRuns, uploaded: torch.Tensor, first: int, pages: int, buffer: int) -> None:
        self._add(Lane.KERNEL, "scatter", first=first, pages=pages, buffer=buffer)

    def transfer(self, plan: StagedRuns, chunk: int) -> None:
        if not plan.one_run_per_chunk:
            raise ValueError("a job graph copies one host run per chunk")
        self._add(Lane.TRANSFER, "transfer", chunk=chunk)

    def mark(self, lane: Lane, mark: int) -> None:
        self._marks[mark] = frozenset(self._covered(lane))

    def wait(self, lane: Lane, mark: int) -> None:
        self._waits[lane] |= self._marks[mark]

    def _covered(self, lane: Lane) -> set[int]:
        """The nodes ``lane``'s next operation follows: its last one and what it waited for since."""
        last = self._last[lane]
        return self._waits[lane] | ({last} if last is not None else set())

    def _add(self, lane: Lane, op: str, **where: int) -> None:
        after = self._covered(lane)
        self._waits[lane] = set()
        self._last[lane] = len(self.nodes)
        self.nodes.append(GraphNode(op, tuple(sorted(after)), **where))


def graph_key(plan: StagedRuns) -> Hashable | None:
    """What a job's graph depends on besides the per-job addresses and sizes of its host copies
    and the uploaded numbers (the owner of the graphs retires them when anything else they were
    built on changes: the upload buffer): its direction, chunks, kind of kernel and the pages its
    last chunk's launch is sized for (:func:`graph_pages`; the kernels read the job's page count on
    the device); None when the job cannot be a graph (a chunk of several host runs)."""
    if not plan.num_chunks or not plan.one_run_per_chunk:
        return None
    return (plan.direction, plan.num_chunks, plan.blocks is not None,
            graph_pages(plan.last_chunk_pages, plan.chunk_pages, plan.num_chunks))


def graph_pages(pages: int, chunk_pages: int, chunks: int) -> int:
    """The pages a graph's launch over a chunk of ``pages`` pages is sized for, in a job of
    ``chunks`` chunks: a whole chunk in a job of several (the blocks of the last chunk's launch
    that find no page cost microseconds beside the job's DMA, and one shape per chunk count keeps
    the graphs few), else the next power of two (at most a chunk: the launch runs at most twice the
    blocks it needs, and one-chunk jobs take ~log2 of a chunk's pages shapes)."""
    if chunks > 1:
        return chunk_pages
    return min(chunk_pages, 1 << max(pages - 1, 0).bit_length())


G = TypeVar("G")


class GraphCache(Generic[G]):
    """Graphs by key: :meth:`find` counts the jobs of each key (the last ``remember`` keys) and
    builds a key's graph at its ``build_at``-th job; at most ``capacity`` graphs are kept, the
    least recently used handed to ``retire`` when another is built (the owner destroys it once
    nothing in flight uses it). Calling thread only."""

    def __init__(self, retire: Callable[[G], Any], capacity: int = 32, build_at: int = 2, remember: int = 256):
        self._retire = retire
        self.capacity, self.build_at, self.remember = capacity, build_at, remember
        self._graphs: OrderedDict[Hashable, G] = OrderedDict()
        self._seen: OrderedDict[Hashable, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._graphs)

    def find(self, key: Hashable, build: Callable[[], G]) -> G | None:
        """``key``'s graph: kept, or built now by ``build()`` (which may raise: nothing is kept
        then), or None before the key's ``build_at``-th job."""
        graph = self.kept(key)
        if graph is not None:
            return graph
        seen = self._seen.pop(key, 0) + 1
        if seen < self.build_at:
            self._seen[key] = seen
            while len(self._seen) > self.remember:
                self._seen.popitem(last=False)
            return None
        graph = build()
        self._graphs[key] = graph
        while len(self._graphs) > self.capacity:
            self._retire(self._graphs.popitem(last=False)[1])
        return graph

    def kept(self, key: Hashable) -> G | None:
        """``key``'s graph if one is kept (marked recently used), else None; builds nothing."""
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
        return graph

    def clear(self) -> None:
        """Retire every graph (what they were built on changed); each key's next job builds its
        graph again."""
        graphs, self._graphs = self._graphs, OrderedDict()
        for key, graph in graphs.items():
            self._seen[key] = self.build_at - 1
            self._retire(graph)
