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
  the reserved core idles. It moves itself to the spare cores (:func:`choose_spare_cpus`: its
  parent's CPUs that are neither its own compute cores nor their SMT siblings, on its own NUMA
  node). Where nothing is pinned (GPU workers, the engine-core process) nothing moves.

Loads and disk reads (a waiting request's promotion) keep normal priority and placement.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass
from pathlib import Path

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


SYSFS_CPU = Path("/sys/devices/system/cpu")


@dataclass(frozen=True)
class CpuTopology:
    """Which logical CPUs share a physical core (SMT siblings) and which NUMA node each is on.
    A CPU missing from a mapping has no known siblings / node."""

    siblings: Mapping[int, frozenset[int]]
    node: Mapping[int, int]

    @classmethod
    def read(cls, cpus: Iterable[int], root: Path = SYSFS_CPU) -> CpuTopology:
        """Read ``cpus``' topology from sysfs (Linux); unreadable entries are left out."""
        siblings: dict[int, frozenset[int]] = {}
        node: dict[int, int] = {}
        for cpu in cpus:
            folder = root / f"cpu{cpu}"
            try:
                siblings[cpu] = parse_cpu_list((folder / "topology" / "thread_siblings_list").read_text())
            except (OSError, ValueError):
                pass
            nodes = [name[4:] for name in _names_in(folder) if name.startswith("node") and name[4:].isdigit()]
            if len(nodes) == 1:  # sysfs links cpuN/nodeM for the CPU's one NUMA node
                node[cpu] = int(nodes[0])
        return cls(siblings, node)


def _names_in(folder: Path) -> list[str]:
    try:
        return [entry.name for entry in folder.iterdir()]
    except OSError:
        return []


def parse_cpu_list(text: str) -> frozenset[int]:
    """Parse a kernel CPU list such as ``"0-3,8,10-11"``. Raises ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def choose_spare_cpus(own: Set[int], parent: Set[int], topology: CpuTopology) -> frozenset[int]:
    """The CPUs a background thread of a pinned process should use: those its parent may use,
    minus its own (the compute cores), minus their SMT siblings (they share the compute cores'
    execution units), and only on the NUMA nodes of its own CPUs (elsewhere run other ranks'
    compute cores, and memory is remote). Empty when nothing qualifies: the thread stays put.

    With vLLM-CPU's binding this is the rank's reserved cores (``VLLM_CPU_NUM_OF_RESERVED_CPU``
    takes them from the end of each rank's node); an unpinned process (own == parent) gets none.
    """
    candidates = set(parent) - set(own)
    for cpu in own:
        candidates -= topology.siblings.get(cpu, frozenset())
    own_nodes = {topology.node[cpu] for cpu in own if cpu in topology.node}
    if own_nodes:
        candidates = {cpu for cpu in candidates if topology.node.get(cpu) in own_nodes}
    return frozenset(candidates)


def spare_cpus() -> frozenset[int]:
    """:func:`choose_spare_cpus` for the calling thread, from its and its parent process's
    affinity and sysfs. Empty where unsupported. Never raises."""
    if not hasattr(os, "sched_getaffinity"):
        return frozenset()
    try:
        own, parent = os.sched_getaffinity(0), os.sched_getaffinity(os.getppid())
    except OSError:
        return frozenset()
    if not parent - own:
        return frozenset()
    return choose_spare_cpus(own, parent, CpuTopology.read(own | parent))


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
        logger.debug("kvtier: could not move thread %d to CPUs %s: %s",
                     threading.get_native_id(), sorted(cpus), exc)
        return frozenset()
    return cpus


def become_background_thread() -> None:
    """Make the calling thread a background thread: spare cores if its process is pinned to
    compute cores, and a lower priority. Call once, first thing in the thread. Never raises."""
    move_current_thread_to_spare_cpus()
    lower_current_thread_priority()
