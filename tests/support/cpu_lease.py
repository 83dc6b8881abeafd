"""One CPU per test worker (pytest-xdist), and all of them for the tests that need them.

An engine of the real-engine tests computes on one CPU (vLLM-CPU reserves the other for its
scheduler; the harness runs one compute thread), so a run of the suite on 2 CPUs left one idle
most of the time. Under ``pytest -n N`` each worker is pinned to a CPU of its own
(:func:`pin_worker`: every engine, server and subprocess it starts inherits that), and runs each
test holding that CPU's lease: a lock file, so no two tests compute on one CPU at once even where
there are more workers than CPUs.

A test marked ``all_cores`` (tensor parallelism 2 with a rank per CPU, two engines run at once on
CPUs of their own, thread-placement checks) holds every CPU's lease and runs with the worker's
affinity widened to all CPUs: it waits for the tests running on the other CPUs to end, and the
other workers wait for it (:class:`CpuLease` says how the locks avoid starving and deadlock).
Consecutive all_cores tests of a worker (a marked module) keep the lease between them.

Without ``-n`` nothing is pinned and nothing is locked. Locks are ``flock`` on files in a folder
the controller creates (:func:`prepare_controller`) and removes at the end of the run; the kernel
drops a dead worker's locks. Threading: called from pytest's hooks (the main thread).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

LOCKS_ENV = "KVTIER_TEST_CPU_LOCKS"  # the lock folder, set by the controller for its workers
CPUS_ENV = "KVTIER_TEST_ALL_CPUS"  # the CPUs the whole run may use ("0,1"), before any pinning
HOME_ENV = "KVTIER_TEST_HOME_CPU"  # a worker's own CPU, set by pin_worker


def all_cpus() -> list[int]:
    """The CPUs the whole test run may use: the controller's affinity under pytest-xdist (a
    worker's own is one CPU), else this process's."""
    text = os.environ.get(CPUS_ENV)
    if text:
        return [int(cpu) for cpu in text.split(",")]
    return sorted(os.sched_getaffinity(0))


def home_cpus() -> set[int]:
    """The CPUs this test process computes on between all_cores tests: a worker's own CPU, else
    this process's affinity. A helper process that outlives one test (the engine zygote) starts
    on these, whichever test starts it: what it sets up at import (OpenMP's thread pool is sized
    by the affinity it starts with) must not depend on that."""
    home = os.environ.get(HOME_ENV)
    return {int(home)} if home else set(os.sched_getaffinity(0))


def prepare_controller() -> None:
    """In the controller, before its workers start: the lock folder and the CPU list they inherit."""
    os.environ[CPUS_ENV] = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    os.environ[LOCKS_ENV] = tempfile.mkdtemp(prefix="kvtier-test-cpus-")


def finish_controller() -> None:
    folder = os.environ.pop(LOCKS_ENV, None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


class CpuLease:
    """A worker's CPU and the locks that lease CPUs to its tests.

    Locks: ``cpuN`` per CPU, held by the test computing on it; ``gate``, which a test passes
    before it takes CPU locks: a normal test takes its CPU's lock and lets the gate go, an
    ``all_cores`` test keeps the gate until it holds every CPU lock. So while an all_cores test
    waits for the CPUs to come free, the other workers' next tests wait at the gate instead of
    taking their CPU back first (flock is not fair), and the only lock ever held while waiting
    for another is the gate or, taken in CPU order, a lower CPU's: no deadlock."""

    def __init__(self, worker_index: int, cpus: list[int], folder: Path):
        self.cpus = cpus
        self.own = cpus[worker_index % len(cpus)]
        self.folder = folder
        self._held: list[int] = []  # open lock files, each holding its flock
        self._all = False  # holding every CPU, affinity widened

    def pin(self) -> None:
        os.sched_setaffinity(0, {self.own})

    def begin(self, *, all_cores: bool) -> None:
        """Before a test: take this worker's CPU, or every CPU (affinity widened to them). An
        all_cores test right after another one of this worker keeps the lease it still holds."""
        if all_cores and self._all:
            return
        gate = self._lock("gate")
        try:
            for cpu in sorted(self.cpus if all_cores else [self.own]):
                self._held.append(self._lock(f"cpu{cpu}"))
        finally:
            os.close(gate)
        if all_cores:
            os.sched_setaffinity(0, set(self.cpus))
            self._all = True

    def end(self, *, keep_all: bool = False) -> None:
        """After a test: give the CPUs back, unless an all_cores test comes next (``keep_all``)."""
        if self._all and keep_all:
            return
        if self._all:
            os.sched_setaffinity(0, {self.own})
            self._all = False
        while self._held:
            os.close(self._held.pop())  # (closing the file releases its lock)

    def _lock(self, name: str) -> int:
        fd = os.open(self.folder / name, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        return fd


def pin_worker(worker_id: str) -> CpuLease | None:
    """In an xdist worker (``gw0``, ``gw1``, ...): pin it to its CPU; None outside such a run."""
    folder = os.environ.get(LOCKS_ENV)
    if not folder:
        return None
    lease = CpuLease(int(worker_id.removeprefix("gw")), all_cpus(), Path(folder))
    lease.pin()
    os.environ[HOME_ENV] = str(lease.own)
    return lease
