"""A tier's worker threads: ``n`` threads started with the tier, taking tasks from one FIFO queue
(:class:`WorkerPool`); and a queue of jobs they run one at a time (:class:`JobQueue`).

Used by the Redis tier (:mod:`kvtier.tiers.redis`, behind its batcher) and the S3 tier
(:mod:`kvtier.tiers.s3`). Not a ``ThreadPoolExecutor``: that starts its threads lazily inside
``submit``, and starting a thread makes the caller (the scheduler's thread) wait for it, which
also hands the GIL to the new worker in the middle of the caller's run of submissions.

Threading: :meth:`WorkerPool.submit` and :meth:`WorkerPool.shutdown` from any thread (in the
tiers: the caller's); tasks run on the pool's threads and handle their own failures.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class WorkerPool:
    """``n`` daemon threads named ``{name}-{i}`` running submitted tasks in FIFO order."""

    def __init__(self, n: int, name: str, *, initializer: Callable[[], None] | None = None) -> None:
        if n < 1:
            raise ValueError("a pool needs at least one thread")
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._initializer = initializer
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(n)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, task: Callable[..., object], *args: object) -> None:
        """Queue ``task(*args)``; RuntimeError once shut down."""
        if self._closed:
            raise RuntimeError("the pool is shut down")
        self._queue.put((task, args))

    def shutdown(self, timeout: float | None = None) -> bool:
        """Drop the tasks not started yet, let the running ones finish, join the threads, waiting
        at most ``timeout`` seconds in all (None: for as long as they run). Returns whether every
        thread ended (a thread still running ends after its task; the threads are daemons).
        Idempotent (a second call waits again)."""
        if not self._closed:
            self._closed = True
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            for _ in self._threads:
                self._queue.put(None)
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads if t is not threading.current_thread())

    def _run(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while True:
            item = self._queue.get()
            if item is None:
                return
            task, args = item
            try:
                task(*args)
            except Exception:  # tasks handle their own failures; this is a bug
                logger.exception("kvtier: a task of worker pool %s failed", self.name)


class JobQueue(Generic[T]):
    """Jobs run by ``run`` on ``pool``'s threads, one job per task, oldest first, as many at once as
    the pool has threads. :meth:`cancel` takes the jobs no thread has started (a closing tier fails
    them), so that every job submitted is either run or handed back.

    Threading: :meth:`submit`, :meth:`cancel` and ``len`` from the caller's thread; ``run`` on the
    pool's threads. The deque is guarded by a lock."""

    def __init__(self, pool: WorkerPool, run: Callable[[T], None]) -> None:
        self._pool = pool
        self._run = run
        self._lock = threading.Lock()
        self._jobs: deque[T] = deque()

    def submit(self, job: T) -> None:
        with self._lock:
            self._jobs.append(job)
        try:
            self._pool.submit(self._next)
        except RuntimeError:  # the pool is shut down: cancel() hands the job back
            pass

    def cancel(self) -> list[T]:
        with self._lock:
            jobs = list(self._jobs)
            self._jobs.clear()
        return jobs

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)

    def _next(self) -> None:
        with self._lock:
            if not self._jobs:
                return
            job = self._jobs.popleft()
        self._run(job)
