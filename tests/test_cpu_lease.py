"""The test suite's CPU leases (tests/support/cpu_lease.py): what keeps two workers' tests off one
CPU and lets an all_cores test run alone. Real flocks in a temporary folder; each simulated worker
is a thread (an affinity set with ``sched_setaffinity(0, ...)`` is the calling thread's)."""

from __future__ import annotations

import fcntl
import os
import threading
import time

import pytest
from support.cpu_lease import CpuLease, all_cpus

CPUS = all_cpus()  # (a pinned worker's threads may still take the run's other CPUs)
pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="leases of two CPUs")


def in_thread(body) -> tuple[threading.Thread, threading.Event]:
    done = threading.Event()

    def run():
        body()
        done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, done


def wait_until_held(folder, name: str, timeout: float = 30.0) -> None:
    """Until another holder has lock ``name`` (a non-blocking try fails; a try that succeeds lets go)."""
    deadline = time.monotonic() + timeout
    fd = os.open(folder / name, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            fcntl.flock(fd, fcntl.LOCK_UN)
            assert time.monotonic() < deadline, f"nobody took {name}"
            time.sleep(0.005)
    finally:
        os.close(fd)


def test_an_all_cores_test_waits_for_the_other_cpu_then_runs_on_all(tmp_path):
    a, b = CpuLease(0, CPUS[:2], tmp_path), CpuLease(1, CPUS[:2], tmp_path)
    a.begin(all_cores=False)  # worker a runs a test on its CPU
    seen = {}

    def all_cores_test():
        b.begin(all_cores=True)
        seen["cpus"] = sorted(os.sched_getaffinity(0))
        b.end()
        seen["after"] = sorted(os.sched_getaffinity(0))

    thread, done = in_thread(all_cores_test)
    assert not done.wait(0.3), "ran while the other CPU's test was running"
    a.end()
    assert done.wait(30)
    assert seen == {"cpus": CPUS[:2], "after": [CPUS[1]]}


def test_a_waiting_all_cores_test_is_not_starved_by_the_next_tests(tmp_path):
    a, b = CpuLease(0, CPUS[:2], tmp_path), CpuLease(1, CPUS[:2], tmp_path)
    order = []
    a.begin(all_cores=False)

    def all_cores_test():
        b.begin(all_cores=True)
        order.append("all")
        time.sleep(0.2)
        b.end()

    _, done = in_thread(all_cores_test)
    wait_until_held(tmp_path, "gate")  # b now waits (at the gate, holding it) for a's CPU
    a.end()
    a.begin(all_cores=False)  # a's next test asks at once, as a worker does: it must wait for b's
    order.append("next")
    a.end()
    assert done.wait(30)
    assert order == ["all", "next"]


def test_consecutive_all_cores_tests_keep_the_lease_and_others_wait(tmp_path):
    a, b = CpuLease(0, CPUS[:2], tmp_path), CpuLease(1, CPUS[:2], tmp_path)
    b.begin(all_cores=True)
    b.end(keep_all=True)  # the next test is all_cores too
    _, done = in_thread(lambda: (a.begin(all_cores=False), a.end()))
    assert not done.wait(0.3), "another worker's test got a CPU between two all_cores tests"
    b.begin(all_cores=True)  # (already held: returns at once)
    b.end()
    assert done.wait(30)


def test_two_workers_own_cpus_do_not_wait_for_each_other(tmp_path):
    a, b = CpuLease(0, CPUS[:2], tmp_path), CpuLease(1, CPUS[:2], tmp_path)
    assert (a.own, b.own) == (CPUS[0], CPUS[1])
    a.begin(all_cores=False)
    _, done = in_thread(lambda: (b.begin(all_cores=False), b.end()))
    assert done.wait(30)
    a.end()
    assert CpuLease(2, CPUS[:2], tmp_path).own == CPUS[0]  # a third worker shares the first CPU's lease
