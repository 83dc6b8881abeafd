"""Issuing copy jobs off the thread that runs the forward pass, in the order they were started.

Why: issuing a job to a CUDA device is host work (planning, then tens to hundreds of driver calls:
a staged 1 GiB job is 32 chunks of gathers, DMAs and events), 0.5-3 ms measured on an H100 host.
On the worker's main thread that time is taken from the forward pass it also issues. An
:class:`Issuer` does it on a thread of its own instead; torch's ops and ctypes calls release the
GIL while the driver works, so the two threads mostly overlap (the GIL is shared for the Python
in between: see docs/architecture.md for what that costs the forward thread, measured).

Contract:

- **Order**: items are issued one at a time, in the order of the :meth:`submit` and
  :meth:`issue_now` calls that handed them over (a FIFO), whichever thread issues them. An item is
  never issued twice and never dropped while the issuer is open.
- :meth:`submit` returns at once (``background``) after queueing the item; the issuer's thread
  issues it later. Without ``background`` it issues it (after the backlog) on the calling thread.
- :meth:`issue_now` issues the backlog, then the item, on the calling thread, before it returns:
  for work the caller must order itself against (a synchronous load: the compute stream waits for
  its end event, which must exist first).
- :meth:`flush` returns once everything handed over so far was issued (the backlog is issued on the
  calling thread if the issuer's thread has not taken it yet).
- ``issue(item)`` must not raise (the copy engine reports a failed job instead); if it does, the
  exception is logged and the next item is issued: the thread never dies of an item.

Threads: any thread may call every method; ``issue`` runs under one lock (so on one thread at a time).
The thread is started by the first :meth:`submit` (never at construction: a worker process may be
forked after building its engine), is a daemon, and is joined by :meth:`close`. What may block:
:meth:`issue_now` and :meth:`flush` wait for an item being issued on the issuer's thread (one job's
issue time at most) and for the backlog they issue; :meth:`submit` never waits for issuing.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Issuer(Generic[T]):
    def __init__(self, issue: Callable[[T], None], name: str, background: bool = True):
        self._issue = issue
        self._name = name
        self.background = background
        self._pending: deque[T] = deque()
        self._changed = threading.Condition()  # guards _pending, _closing and _thread
        self._issuing = threading.Lock()  # held while items are taken from _pending and issued
        self._closing = False
        self._thread: threading.Thread | None = None

    def submit(self, item: T) -> None:
        if not self.background:
            self.issue_now(item)
            return
        with self._changed:
            if self._closing:
                raise RuntimeError(f"kvtier: {self._name} is closed")
            self._pending.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._changed.notify()

    def issue_now(self, item: T) -> None:
        with self._issuing:
            self._drain()
            self._issue_one(item)

    def flush(self) -> None:
        with self._issuing:
            self._drain()

    @property
    def backlog(self) -> int:
        """Items handed over and not yet taken for issuing."""
        return len(self._pending)

    def close(self) -> None:
        """Issue the backlog, then stop and join the thread. Idempotent."""
        with self._changed:
            self._closing = True
            self._changed.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self.flush()

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._pending and not self._closing:
                    self._changed.wait()
                if not self._pending:
                    return
            with self._issuing:
                self._drain()

    def _drain(self) -> None:
        """Issue every pending item, oldest first (the caller holds ``_issuing``)."""
        while True:
            with self._changed:
                if not self._pending:
                    return
                item = self._pending.popleft()
            self._issue_one(item)

    def _issue_one(self, item: T) -> None:
        try:
            self._issue(item)
        except Exception:  # the engine reports its own failures; this is a last resort
            logger.exception("kvtier: %s could not issue an item", self._name)
