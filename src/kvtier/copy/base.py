"""The worker-side copy contract: whole pages between the engine's paged KV and one rank's host slots.

This is the counterpart of the tier contract (:mod:`kvtier.tiers.base`) on the worker side. A
vLLM worker process builds one :class:`CopyEngine` per rank when vLLM registers its KV caches
(:func:`kvtier.copy.make_copy_engine` picks the implementation for the KV tensors' device) and
drives it from the worker's main thread only:

- :meth:`CopyEngine.start_load` before the step's forward: host slots -> engine pages;
- :meth:`CopyEngine.start_store` after the forward queued its KV writes: engine pages -> host slots;
- :meth:`CopyEngine.poll` every step: the jobs whose copies have completed;
- :meth:`CopyEngine.wait` only when vLLM is about to reuse engine blocks a store still reads.

Ordering contract (what makes a hit bit-exact on any device):

- a synchronous load's bytes are visible to every engine operation issued after ``start_load``
  returns (on CPU the copy is done on return; on CUDA the compute stream waits for the copy's
  event); an asynchronous load's bytes once the job is polled done (its request is in no batch
  before: vLLM schedules it only after the load is reported finished);
- a store copies the engine pages as they are once every engine write issued before
  ``start_store`` has completed (on CUDA the copy stream first waits for an event recorded on the
  compute stream at the call);
- a job is reported by :meth:`~CopyEngine.poll` only once its copies have completed: only then
  may the scheduler unpin a load's host slots, or publish a store's slots as READY.

Buffers: the engine owns the KV tensors, the host tier owns the slots; the caller keeps the
pages of a job untouched (engine blocks not reused, host slots pinned) until the job is polled.
A failed copy is a :class:`CopyDone` with ``ok=False``, never an exception into the engine; a
failed synchronous load is reported by the first :meth:`CopyEngine.poll` after ``start_load``.
"""

from __future__ import annotations

import enum
import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class Direction(enum.Enum):
    STORE = "engine_to_host"
    LOAD = "host_to_engine"

    __hash__ = object.__hash__  # members are singletons compared by identity; Enum's hash is a Python call


class PageCopy(NamedTuple):
    """One page of every layer of KV cache group ``group``: that group's engine block
    ``block_id`` <-> page ``sub`` of the kvtier block in host ``slot`` (those layers' part of it).
    One group (no hybrid allocator): group 0 is every layer. A tuple, so a job's pages become an
    array in one numpy call (:func:`page_table`) on the thread that issues the forward."""

    slot: int
    sub: int
    block_id: int
    group: int = 0


@dataclass(frozen=True, slots=True, eq=False)
class SlotRun:
    """The pages of a job of one host run: kvtier block ``i`` is host slot ``first_slot + i`` <->
    engine block ``blocks[i]`` (page 0 of group 0: one page per kvtier block, one KV cache group),
    as :func:`page_table` makes it. What kvtier's scheduler sends for such a job (most stores, and
    loads of blocks stored together): a worker checks its bounds on one contiguous column and its
    host run from two integers, instead of reading an ``[n, 4]`` table on the thread that issues
    the forward (:meth:`kvtier.copy.runs.RunPlanner.slot_run_first`). ``blocks``: 1-D int64, owned
    by the job (not changed once sent)."""

    first_slot: int
    blocks: np.ndarray

    def __len__(self) -> int:
        return len(self.blocks)


Pages = Sequence[PageCopy] | np.ndarray | SlotRun
"""A job's pages: :class:`PageCopy` tuples, their :func:`page_table`, or a :class:`SlotRun`: what
kvtier's scheduler sends the workers (vLLM's multiprocess executor pickles it each step: ~10 us for
512 pages as a table, where 512 tuples take ~0.5 ms; the CUDA engine plans from either array form
without converting; ``benchmarks/bench_copy_plan.py``)."""


def slot_run_of(table: np.ndarray) -> SlotRun | None:
    """``table`` (an ``[n, 4]`` :func:`page_table`, n >= 1) as a :class:`SlotRun` when it is one:
    consecutive slots from its first, every page 0 of group 0; else None. For the scheduler, which
    builds the tables (bounds are the worker's to check)."""
    if not len(table) or np.count_nonzero(table[:, 1]) or np.count_nonzero(table[:, 3]):
        return None
    first = run_first(table[:, 0])
    return None if first is None else SlotRun(first, np.ascontiguousarray(table[:, 2]))


def run_first(slots: np.ndarray) -> int | None:
    """``slots[0]`` when ``slots`` (1-D, at least one) are consecutive from it, else None."""
    first, count = int(slots[0]), len(slots)
    if int(slots[-1]) - first != count - 1 or (count > 2 and np.count_nonzero(slots[1:] - slots[:-1] != 1)):
        return None
    return first


def page_table(pages: Pages) -> np.ndarray:
    """A job's pages as an ``[n, 4]`` int64 array of (slot, sub, block_id, group); an array
    already so is returned as is (a :class:`SlotRun` is made one)."""
    if isinstance(pages, np.ndarray):
        if pages.dtype == np.int64 and pages.ndim == 2 and pages.shape[1] == 4:
            return pages
        return pages.reshape(-1, 4).astype(np.int64, copy=False)
    if isinstance(pages, SlotRun):
        table = np.zeros((len(pages.blocks), 4), dtype=np.int64)
        table[:, 0] = np.arange(pages.first_slot, pages.first_slot + len(pages.blocks))
        table[:, 2] = pages.blocks
        return table
    return np.fromiter(itertools.chain.from_iterable(pages), dtype=np.int64, count=4 * len(pages)).reshape(-1, 4)


def page_list(pages: Pages) -> list[PageCopy]:
    """A job's pages as :class:`PageCopy` tuples (the inverse of :func:`page_table`)."""
    if isinstance(pages, (np.ndarray, SlotRun)):
        return [PageCopy(*row) for row in page_table(pages).tolist()]
    return list(pages)


@dataclass(frozen=True, slots=True)
class CopyDone:
    """Completion of one job: bytes moved, the seconds from start to observed completion, and how
    it moved (``method``: a :class:`~kvtier.copy.staging.CopyMethod` value, "" if unknown)."""

    job_id: int
    direction: Direction
    ok: bool
    num_bytes: int
    seconds: float
    method: str = ""


class CopyEngine(ABC):
    """Moves pages of one rank. See the module docstring for the ordering contract."""

    @abstractmethod
    def start_load(self, job_id: int, pages: Pages, *, synchronous: bool = True) -> None:
        """Copy host slots into engine pages, ordered after every engine operation issued before;
        a ``synchronous`` load also before any engine work issued afterwards."""

    @abstractmethod
    def start_store(self, job_id: int, pages: Pages) -> None:
        """Copy engine pages into host slots, ordered after every engine write issued before."""

    @abstractmethod
    def poll(self) -> list[CopyDone]:
        """Jobs completed since the last call, loads and stores. Never blocks."""

    @abstractmethod
    def wait(self, job_ids: Iterable[int] | None = None) -> None:
        """Block until ``job_ids`` (default: every started job) have completed; they are still
        reported by the next :meth:`poll`."""

    @abstractmethod
    def close(self) -> None:
        """Finish every started job, then release threads and streams. Idempotent."""
