"""Background threads yield the CPU to the engine.

kvtier's stores (engine -> host copies, host -> disk writes, directory scans) never sit on a
request's critical path, but on a CPU backend they compete with the forward pass for the same
cores. Threads that run them call :func:`lower_current_thread_priority` once, at start: on Linux a
thread is a task with its own nice value, so the scheduler then runs the engine's threads first
and kvtier's background work in the remaining time. Loads and disk reads (a waiting request's
promotion) keep normal priority.
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger(__name__)

BACKGROUND_NICENESS = 10
"""How much nicer than the engine the background threads are (Linux nice units, 0..19)."""


def lower_current_thread_priority(increment: int = BACKGROUND_NICENESS) -> bool:
    """Raise the calling thread's nice value by ``increment``. Returns False where unsupported.

    Only this thread changes (Linux applies ``setpriority(PRIO_PROCESS, tid)`` to one task);
    threads it starts later inherit the value. Never raises.
    """
    if not hasattr(os, "setpriority"):
        return False
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except OSError as exc:
        logger.debug("kvtier: could not lower the priority of thread %d: %s", tid, exc)
        return False
    return True
