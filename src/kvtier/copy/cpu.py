"""The CPU copy engine: loads copied on the caller's thread, stores on one background thread.

For KV tensors in host memory only (vLLM's CPU backend; :func:`kvtier.copy.make_copy_engine`
picks the engine for the KV tensors' device). The engine's KV tensors live in DRAM, so a copy is a
memcpy, one batched ``torch._foreach_copy_`` per job (:meth:`~kvtier.copy.pages.BlockCopier.copy`):

- :meth:`CpuCopyEngine.start_load` copies at once, on the worker's main thread, before the forward
  (a few MB per block: milliseconds), and reports the job done on the next :meth:`~CpuCopyEngine.poll`
  (synchronous or not: done on return is the strongest order);
- :meth:`CpuCopyEngine.start_store` queues the job for the ``kvtier-copy`` thread, which runs jobs
  in FIFO order at background priority, off the compute cores
  (:func:`kvtier.core.priority.become_background_thread`). The forward has finished writing the
  pages when vLLM calls ``wait_for_save``, so no further ordering is needed on CPU.

Threading: every public method is called from the worker's main thread; the background thread
only runs copies and posts completions on a queue; :meth:`~CpuCopyEngine.wait` blocks on a condition.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable

import numpy as np

from kvtier.copy.base import CopyDone, CopyEngine, Direction, Pages, SlotRun
from kvtier.copy.pages import BlockCopier
from kvtier.core.priority import become_background_thread

logger = logging.getLogger(__name__)


class CpuCopyEngine(CopyEngine):
    def __init__(self, copier: BlockCopier):
        if copier.kv.device.type != "cpu":
            raise ValueError(f"kvtier: the CPU copy engine needs KV in host memory, not on {copier.kv.device}")
        self.copier = copier
        self._jobs: queue.SimpleQueue[tuple[int, Direction, Pages] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[CopyDone] = queue.SimpleQueue()
        self._pending: set[int] = set()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvtier-copy", daemon=True)
        self._thread.start()

    def start_load(self, job_id: int, pages: Pages, *, synchronous: bool = True) -> None:
        start = time.perf_counter()
        ok, num_bytes = True, 0
        try:
            num_bytes = self.copier.copy(Direction.LOAD, pages)
        except Exception:  # reported as a failed job: vLLM recomputes the blocks
            logger.exception("kvtier: load job %d failed", job_id)
            ok = False
        self._done.put(CopyDone(job_id, Direction.LOAD, ok, num_bytes, time.perf_counter() - start, "pages"))

    def start_store(self, job_id: int, pages: Pages) -> None:
        with self._cond:
            self._pending.add(job_id)
        self._jobs.put((job_id, Direction.STORE, pages if isinstance(pages, (np.ndarray, SlotRun)) else list(pages)))

    def poll(self) -> list[CopyDone]:
        done: list[CopyDone] = []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                return done

    def wait(self, job_ids: Iterable[int] | None = None) -> None:
        wanted = None if job_ids is None else set(job_ids)
        with self._cond:
            self._cond.wait_for(lambda: not (self._pending if wanted is None else self._pending & wanted))

    def close(self) -> None:
        if self._thread.is_alive():
            self.wait()
            self._jobs.put(None)
            self._thread.join(timeout=30)

    def _run(self) -> None:
        become_background_thread()  # stores are background work: the forward pass goes first
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job_id, direction, pages = item
            start = time.perf_counter()
            ok, num_bytes = True, 0
            try:
                num_bytes = self.copier.copy(direction, pages)
            except Exception:  # a failed copy is reported, never raised into the engine
                logger.exception("kvtier: %s copy of job %d failed", direction.value, job_id)
                ok = False
            self._done.put(CopyDone(job_id, direction, ok, num_bytes, time.perf_counter() - start, "pages"))
            with self._cond:
                self._pending.discard(job_id)
                self._cond.notify_all()
