"""Background threads (stores, disk writes, scans) run at a lower priority than the engine and, in
a process pinned to compute cores, on the spare cores; only they do: the caller's thread and the
disk read threads keep their priority and placement."""

from __future__ import annotations

import os
import threading
import time

import pytest
from support.namespaces import toy_namespace

from kvtier.core.priority import (
    BACKGROUND_NICENESS,
    CpuTopology,
    choose_spare_cpus,
    lower_current_thread_priority,
    parse_cpu_list,
)
from kvtier.tiers.disk import DiskTier

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread nice values are Linux-only"),
    pytest.mark.all_cores,  # thread placement across the run's CPUs, unpinned (support.cpu_lease)
]


def nice_of(native_id: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, native_id)


def test_only_the_calling_thread_gets_nicer():
    base = nice_of(threading.get_native_id())
    seen = {}

    def background():
        seen["ok"] = lower_current_thread_priority()
        seen["nice"] = nice_of(threading.get_native_id())

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    assert seen == {"ok": True, "nice": min(19, base + BACKGROUND_NICENESS)}
    assert nice_of(threading.get_native_id()) == base


def test_disk_tier_writes_run_nicer_than_reads(tmp_path):
    ns = toy_namespace()
    disk = DiskTier(
        root_dir=tmp_path, model_name="toy", engine_digest=ns.digest, rank_digests=[ns.for_rank(0).digest],
        namespace_json=ns.config_json("toy"), payload_bytes=64, capacity_bytes=10**6,
        n_read_threads=1, n_write_threads=1, max_pending_writes=4,
    )
    try:
        base = nice_of(threading.get_native_id())
        write_nice = disk._write_pool.submit(lambda: nice_of(threading.get_native_id())).result(30)
        read_nice = disk._read_pool.submit(lambda: nice_of(threading.get_native_id())).result(30)
        assert write_nice == min(19, base + BACKGROUND_NICENESS) and read_nice == base
    finally:
        disk.close()


def test_cpu_copy_engine_store_thread_runs_nicer():
    from test_transfer import cpu_layers, make_copier

    from kvtier.copy.cpu import CpuCopyEngine

    engine = CpuCopyEngine(make_copier(cpu_layers()))
    try:
        deadline = time.monotonic() + 30
        base = nice_of(threading.get_native_id())
        while nice_of(engine._thread.native_id) != min(19, base + BACKGROUND_NICENESS):
            assert time.monotonic() < deadline, "the store copy thread never lowered its priority"
            time.sleep(0.01)
    finally:
        engine.close()


PINNED_WORKER = """
import json, os, sys, threading
sys.path[:0] = {paths!r}
from kvtier.core.priority import become_background_thread
compute = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {{compute}})  # what vLLM's OpenMP binding does to a CPU worker process
seen = {{}}
def background():
    become_background_thread()
    seen["background"] = sorted(os.sched_getaffinity(0))
thread = threading.Thread(target=background)
thread.start()
thread.join()
seen["main"] = sorted(os.sched_getaffinity(0))
print(json.dumps(seen))
"""


def test_background_thread_leaves_the_compute_core_of_a_pinned_worker():
    """A worker process pinned to its compute core (vLLM's CPU backend) starts a background thread:
    the thread moves to the cores the parent may use and the worker may not; the worker's own
    thread stays where it was."""
    if len(os.sched_getaffinity(0)) < 2:  # (at run time: an all_cores test's affinity is widened then)
        pytest.skip("needs 2+ CPUs")
    import json
    import subprocess
    import sys

    script = PINNED_WORKER.format(paths=[p for p in sys.path if p])
    argv = [sys.executable, "-c", script]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60)
    seen = json.loads(out.stdout)
    compute = min(os.sched_getaffinity(0))
    assert seen["main"] == [compute]
    mine = os.sched_getaffinity(0)
    spare = choose_spare_cpus({compute}, mine, CpuTopology.read(mine))
    # on a machine whose other CPUs are all SMT siblings of `compute` or on other nodes, it stays
    assert seen["background"] == sorted(spare or {compute})
    if len(mine) == 2 and CpuTopology.read(mine).siblings.get(compute) == {compute}:
        assert seen["background"] == sorted(mine - {compute})  # e.g. this project's 2-vCPU machines


def test_background_thread_of_an_unpinned_process_stays_put():
    from kvtier.core.priority import become_background_thread, spare_cpus

    if os.sched_getaffinity(os.getppid()) != os.sched_getaffinity(0):
        pytest.skip("this test process is pinned more narrowly than its parent")
    assert spare_cpus() == frozenset()
    seen = {}

    def background():
        become_background_thread()
        seen["cpus"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    assert seen["cpus"] == os.sched_getaffinity(0)


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("5") == {5}
    with pytest.raises(ValueError):
        parse_cpu_list("0-x")


def test_spare_cpus_are_the_reserved_cores_of_the_own_numa_node():
    """vLLM-CPU, tp=2 on two NUMA nodes of 4 cores x 2 SMT threads (siblings c and c+16), one logical
    CPU per core used: rank 0 computes on 0-2 and has 3 reserved; rank 1 computes on 4-7."""
    siblings = {c: frozenset({c % 16, c % 16 + 16}) for c in list(range(8)) + list(range(16, 24))}
    node = {c: (c % 16) // 4 for c in siblings}
    topology = CpuTopology(siblings, node)
    everything = set(siblings)
    assert choose_spare_cpus({0, 1, 2}, everything, topology) == {3, 19}  # not 16-18, not node 1
    assert choose_spare_cpus({4, 5, 6, 7}, everything, topology) == set()  # no reserved core: stays put
    assert choose_spare_cpus(everything, everything, topology) == set()  # unpinned (a GPU worker)


def test_spare_cpus_without_topology_information():
    assert choose_spare_cpus({0}, {0, 1}, CpuTopology({}, {})) == {1}
    assert choose_spare_cpus({0}, {0, 1}, CpuTopology({0: frozenset({0, 1})}, {})) == set()
