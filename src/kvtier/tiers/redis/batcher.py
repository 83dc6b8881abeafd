"""Coalescing of the Redis tier's jobs into batches (what is submitted together goes out together),
on the tier's worker threads (:class:`~kvtier.tiers.workers.WorkerPool`, whose threads start with
the tier: a thread started lazily inside ``submit`` would take the GIL in the middle of the
caller's run of submissions and split the batch).

A :class:`Batcher` sits in front of one pool. :meth:`Batcher.submit` (the caller's
thread) appends a job to a queue and, if no drain is pending, hands ONE drain task to the pool.
When a worker runs it, the drain takes every job queued by then, up to ``max_bytes`` (and
``max_items``), and runs them as one batch (one pipeline, one round trip per server); if jobs
remain it schedules another drain, which an idle worker of the pool picks up in parallel.

So the jobs of one lookup, submitted in one go on the caller's thread, form one batch: the
caller does not release the GIL between them, and the worker cannot start before it does. Under
load, jobs that queue while every worker is busy are coalesced into bigger batches, bounded by
``max_bytes`` so that a reply never exceeds a sane client-output-buffer on the server.

Threading: :meth:`submit` and :meth:`cancel` are called on the caller's thread, drains run on
the pool's threads; the queue is guarded by a lock.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from kvtier.tiers.workers import WorkerPool

__all__ = ["Batcher", "WorkerPool"]

T = TypeVar("T")


class Batcher(Generic[T]):
    """Queue of jobs drained in batches by ``run_batch`` on ``pool``."""

    def __init__(
        self,
        pool: WorkerPool,
        run_batch: Callable[[list[T]], None],
        *,
        max_bytes: int,
        max_items: int = 1 << 30,
    ) -> None:
        if max_bytes < 1 or max_items < 1:
            raise ValueError("max_bytes and max_items must be >= 1")
        self._pool = pool
        self._run_batch = run_batch
        self._max_bytes = max_bytes
        self._max_items = max_items
        self._lock = threading.Lock()
        self._queue: deque[tuple[T, int]] = deque()
        self._scheduled = False

    def submit(self, job: T, nbytes: int) -> None:
        """Queue ``job`` (``nbytes``: its size toward ``max_bytes``)."""
        with self._lock:
            self._queue.append((job, nbytes))
            if self._scheduled:
                return
            self._scheduled = True
        self._pool.submit(self._drain)

    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def cancel(self) -> list[T]:
        """Take every job not yet in a batch (the tier is closing)."""
        with self._lock:
            jobs = [job for job, _ in self._queue]
            self._queue.clear()
            return jobs

    def _drain(self) -> None:
        batch: list[T] = []
        with self._lock:
            total = 0
            queue = self._queue
            while queue and len(batch) < self._max_items:
                nbytes = queue[0][1]
                if batch and total + nbytes > self._max_bytes:
                    break
                batch.append(queue.popleft()[0])
                total += nbytes
            more = bool(queue)
            if not more:
                self._scheduled = False
        if more:
            try:
                self._pool.submit(self._drain)
            except RuntimeError:  # the pool is shutting down: cancel() collects the rest
                pass
        if batch:
            self._run_batch(batch)
