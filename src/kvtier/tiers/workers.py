"""A tier's worker threads: ``n`` threads started with the tier, taking tasks from one FIFO queue.

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
from collections.abc import Callable

logger = logging.getLogger(__name__)


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

    def shutdown(self) -> None:
        """Drop the tasks not started yet, let the running ones finish, join the threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()

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
