"""The scheduler's book of copy jobs in flight: whose each job is, which kvtier keys it moves, how
many workers have still to report it, and what it holds until then.

Scheduler side, on vLLM's scheduler thread only (no locks), owned by
:class:`~kvtier.vllm.scheduler_side.KVTierScheduler`, which does what a job's end means for the
request and the tiers (:meth:`JobBook.report` and :meth:`JobBook.remove` hand the job back).
Invariants, from :meth:`JobBook.add_load` / :meth:`JobBook.add_store` until the job leaves the book:

- every engine block a store job reads is fenced (:meth:`~kvtier.vllm.engine_blocks.EngineBlocks.fence`);
- :attr:`JobBook.storing` counts, per key, the store jobs in flight that write it (a lookup does
  not offer a block a store is still writing);
- a job leaves once every worker reported it (``world_size`` reports: each rank copies its own
  pages), failed if any worker said so.
"""

from __future__ import annotations

import enum
import itertools
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from kvtier.core.keys import BlockKey
from kvtier.vllm.engine_blocks import EngineBlocks


class JobKind(enum.Enum):
    LOAD = "load"
    STORE = "store"


@dataclass
class Job:
    kind: JobKind
    req_id: str
    keys: list[BlockKey]
    waiting_workers: int
    failed: bool = False
    blocks: list[int] = field(default_factory=list)  # store jobs: each key's block index (-1: not announced)
    sources: set[int] = field(default_factory=set)  # store jobs: the engine blocks read (fenced)
    epoch: int = 0  # the key epoch its keys belong to (KVTierScheduler.reset_cache)


class JobBook:
    """The jobs in flight by id (ids from 1, never reused)."""

    def __init__(self, engine_blocks: EngineBlocks, world_size: int) -> None:
        self._engine_blocks = engine_blocks
        self._world_size = world_size
        self._jobs: dict[int, Job] = {}
        self._ids = itertools.count(1)
        self.storing: Counter[BlockKey] = Counter()  # keys the store jobs in flight write

    def add_load(self, req_id: str, keys: list[BlockKey]) -> int:
        """A load job of ``req_id``'s held ``keys``; its id."""
        job_id = next(self._ids)
        self._jobs[job_id] = Job(JobKind.LOAD, req_id, keys, self._world_size)
        return job_id

    def add_store(self, req_id: str, keys: list[BlockKey], sources: set[int], blocks: list[int] | None,
                  epoch: int) -> int:
        """A store job of ``req_id`` writing ``keys`` from engine blocks ``sources`` (fenced from now
        on); its id."""
        job_id = next(self._ids)
        self._jobs[job_id] = Job(JobKind.STORE, req_id, keys, self._world_size, blocks=blocks or [],
                                 sources=sources, epoch=epoch)
        self._engine_blocks.fence(job_id, sources)
        self.storing.update(keys)
        return job_id

    def __getitem__(self, job_id: int) -> Job:
        return self._jobs[job_id]

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def stores(self, job_ids: Iterable[int]) -> Iterator[int]:
        """The store jobs among ``job_ids``."""
        return (j for j in job_ids if self._jobs[j].kind is JobKind.STORE)

    def loading(self, job_ids: Iterable[int]) -> bool:
        """Whether a load job is among ``job_ids``."""
        return any(self._jobs[j].kind is JobKind.LOAD for j in job_ids)

    def report(self, failed: Iterable[int], completed: Mapping[int, int]) -> list[tuple[int, Job]]:
        """The workers' reports of one step: jobs that failed on some worker, and how many workers
        completed each job. Returns the jobs every worker has now reported, out of the book (ids
        not in it are ignored)."""
        for job_id in failed:
            job = self._jobs.get(job_id)
            if job is not None:
                job.failed = True
        done = []
        for job_id, count in completed.items():
            job = self._jobs.get(job_id)
            if job is None:
                continue
            job.waiting_workers -= count
            if job.waiting_workers <= 0:
                done.append((job_id, self.remove(job_id)))
        return done

    def remove(self, job_id: int) -> Job:
        """Take the job out of the book: its blocks unfenced, its keys no longer being stored."""
        job = self._jobs.pop(job_id)
        self._engine_blocks.unfence(job_id, job.sources)
        if job.kind is JobKind.STORE:
            for key in job.keys:
                left = self.storing[key] - 1
                if left > 0:
                    self.storing[key] = left
                else:
                    del self.storing[key]
        return job
