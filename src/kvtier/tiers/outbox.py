"""Where a tier's worker threads post outcomes for the caller's thread, with a bell to wait on.

A tier's workers (disk reads and writes, Redis batches and probes) never touch the tier's index:
they :meth:`Outbox.put` what they did and the caller's thread applies it in
:meth:`~kvtier.tiers.base.SecondaryTier.poll`. Each put also rings a bell (a
:class:`threading.Event`); the orchestrator gives every tier the same bell
(:meth:`Outbox.share_bell`), so a caller with nothing else to do, such as an engine step that
computes nothing while a request waits for blocks a tier is reading, can block until the next
outcome of any tier instead of spinning. A spinning engine loop holds the GIL and makes every
worker wait up to the interpreter's switch interval (5 ms) each time it needs it back: for a
Redis read that is once per socket read, and a 12 MB value then took a second instead of ms.

Threading: :meth:`put` from any thread; everything else from the caller's (orchestrator's) thread.
"""

from __future__ import annotations

import queue
import threading
from typing import Any


class Outbox:
    """A FIFO of posted outcomes (any item the tier understands) and the bell each post rings."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.bell = threading.Event()

    def share_bell(self, bell: threading.Event) -> None:
        """Ring ``bell`` (shared by several tiers) from now on; rings it now if posts are waiting."""
        self.bell = bell
        if not self._queue.empty():
            bell.set()

    def put(self, item: Any) -> None:
        self._queue.put(item)
        self.bell.set()

    def get_nowait(self) -> Any:
        """The oldest post; ``queue.Empty`` if none."""
        return self._queue.get_nowait()

    def get(self, timeout: float) -> Any:
        """The oldest post, waiting up to ``timeout`` seconds; ``queue.Empty`` if none came."""
        return self._queue.get(timeout=max(0.0, timeout))

    def empty(self) -> bool:
        return self._queue.empty()


def wait_for_any(outboxes: list[Outbox], bell: threading.Event, timeout: float) -> bool:
    """Block until one of ``outboxes`` (all ringing ``bell``) holds a post, at most ``timeout``
    seconds; True if one does. No post is lost between the check and the wait: the bell is
    cleared before the outboxes are looked at, and every later post rings it again."""
    bell.clear()
    if any(not box.empty() for box in outboxes):
        return True
    return bell.wait(timeout)
