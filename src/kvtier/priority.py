"""Background threads yield the CPU to the engine.

kvtier's stores (engine -> host copies, host -> disk writes, directory scans) never sit on a
request's critical path, but on a CPU backend they compete with the forward pass for the same
cores. Threads that run them call :func:`become_background_thread` once, at start:

- nice: on Linux a thread is a task with its own nice value, so the scheduler runs the engine's
  threads first and kvtier's background work in the remaining time;
- placement: vLLM's CPU backend pins each worker process to its compute cores (OpenMP binding)
  and keeps the other cores (``VLLM_CPU_NUM_OF_RESERVED_CPU``) for the engine-core/API processes
  and connectors. A thread started by the worker inherits the pinning, so a background thread
  there would time-share the compute core with the forward pass (and, at nice +10, crawl) while
  the reserved core idles. It moves itself to the spare cores: those its parent process may use
  and its own process may not. Where nothing is pinned (GPU workers, the engine-core process)
  there are no spare cores and nothing moves.

Loads and disk reads (a waiting request's promotion) keep normal priority and placement.
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


def spare_cpus() -> frozenset[int]:
    """CPUs the parent process may use but the calling thread may not (empty where unsupported,
    or where the caller is not pinned more narrowly than its parent). Never raises."""
    if not hasattr(os, "sched_getaffinity"):
        return frozenset()
    try:
        return frozenset(os.sched_getaffinity(os.getppid()) - os.sched_getaffinity(0))
    except OSError:
        return frozenset()


def move_current_thread_to_spare_cpus() -> frozenset[int]:
    """Pin the calling thread (only it: Linux applies ``sched_setaffinity(0)`` to one task) to
    :func:`spare_cpus`. Returns the CPUs it now runs on, or an empty set if it did not move.
    Threads it starts later inherit the placement. Never raises."""
    cpus = spare_cpus()
    if not cpus:
        return frozenset()
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        logger.debug("kvtier: could not move thread %d to CPUs %s: %s", threading.get_native_id(), sorted(cpus), exc)
        return frozenset()
    return cpus


def become_background_thread() -> None:
    """Make the calling thread a background thread: spare cores if its process is pinned to
    compute cores, and a lower priority. Call once, first thing in the thread. Never raises."""
    move_current_thread_to_spare_cpus()
    lower_current_thread_priority()
