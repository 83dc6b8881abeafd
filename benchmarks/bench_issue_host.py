"""kvtier's own host time to issue one staged CUDA copy job, on this machine's CPU (no GPU needed):
``start_store`` / ``start_load`` of the GPU kit's job (512 blocks x 32 layers, LBNHC pages of 8, 16
and 64 KiB, consecutive slots, scattered engine blocks) through ``TorchCudaStreams`` and its lanes
on a device whose calls cost nothing (``tests/host_device.py`` with ``execute=False``), each
job shape issued as a CUDA graph (the default from its second job on, ``kvtier.copy.cudagraph``)
and op by op. What it leaves out is the device calls' own cost (ctypes, the runtime, the
driver), measured on a GPU by ``tests/gpu/profile_issue.py``; the goal for the whole start call,
< 0.2 ms, is judged there (``scripts/gpu-check.sh``).

Jobs go as kvtier's scheduler sends them: one host run of consecutive slots, so a ``SlotRun``
(``graph_table``: the same jobs as page tables). Prints one JSON: per page size and direction,
the median and the minimum microseconds of the start call (this machine is shared: the minimum is the steadier figure), and the device calls
one job makes. ``mixed``: jobs of 1 to 512 blocks (seeded, uniform), as serving hands them (a
load is as long as its prompt's hit, a prefill's last chunk varies): the share of jobs that
went as a graph launch and the start call's median, at 16 KiB pages. ``cold_median_us``: the
graph path's start call right after a write to every cache line of 64 MiB (caches and TLB cold, as
when the forward's thread comes to the call from other work). ``blnhc_auto``: the same jobs under
BLNHC with ``auto``, the class of 512 scattered blocks chosen STAGED as on a GPU (a block-outermost
job repeats its graph only where its own run count's class is staged): the start call's median,
warm and cold, and how many jobs went as repeats. On the H200 loans' hosts the start
call cost 2-4x its back-to-back time (0.26-0.7 ms against 0.13-0.17 ms); this machine shows the
same effect without a GPU: the first call of each kind (numpy ufunc, reduction, ctypes, torch)
brings its code and data back, ~8-15 us each.

    python benchmarks/bench_issue_host.py [--jobs 1000]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gpu"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from gpu_layouts import Case, build  # noqa: E402
from host_device import HostDevice, host_streams  # noqa: E402

from kvtier.copy import BlockCopier, Direction, HostSlots, PageCopy, PagedKV, page_table, slot_run_of  # noqa: E402
from kvtier.copy.cuda import CudaCopyEngine  # noqa: E402
from kvtier.copy.choice import TRIALS, TrialKey  # noqa: E402
from kvtier.copy.staging import CopyMethod  # noqa: E402
from kvtier.core.slots import HostSlotLayout  # noqa: E402

BLOCKS, LAYERS = 512, 32


COLD_BYTES = 64 * 2**20
_evicted = np.ones(COLD_BYTES, dtype=np.uint8)


def evict_caches() -> None:
    """Write one byte of every 64-byte line of :data:`COLD_BYTES` (more than this machine's caches)."""
    _evicted[::64] += 1


def choose_staged(engine: CudaCopyEngine, direction: Direction, num_bytes: int, runs: int) -> None:
    """The chooser's class of jobs of ``num_bytes`` in ``runs`` runs decided STAGED, as its trials
    decide it on a GPU where both methods reach the link and staged costs less host time."""
    engine.chooser.pick(direction, num_bytes, runs)
    key = TrialKey(direction, (num_bytes // runs).bit_length() - 1)
    for method, issue_s in ((CopyMethod.STAGED, 1e-4), (CopyMethod.RUNS, 5e-4)):
        for _ in range(TRIALS):
            engine.chooser.observe(key, method, num_bytes, 1e-3, True, issue_s)


def sent(pages: list[PageCopy], form: str):
    """``pages`` as the scheduler sends them (``form`` "scheduler": a SlotRun for a job of one host
    run, else the page table), or as a page table (``form`` "table")."""
    table = page_table(pages)
    return (slot_run_of(table) or table) if form == "scheduler" else table


def issue_times(heads: int, direction: Direction, graphs: bool, jobs: int, mixed: bool = False,
                cold: bool = False, layout: str = "LBNHC", form: str = "scheduler") -> dict:
    case = Case(layout, layers=LAYERS, heads=heads, tokens=16, content=256, dtype=torch.bfloat16)
    kv = build(case, BLOCKS + 8, "cpu")
    paged = PagedKV(kv.views, BLOCKS + 8)
    slots = HostSlotLayout(LAYERS, 1, paged.page_bytes, 1, BLOCKS)
    host = HostSlots(torch.empty(slots.region_bytes, dtype=torch.uint8), slots)
    device = HostDevice(execute=False)
    streams = host_streams(device, job_graphs=graphs)
    method = CopyMethod.STAGED if layout == "LBNHC" else CopyMethod.AUTO
    engine = CudaCopyEngine(BlockCopier(paged, host), streams, method)
    if method is CopyMethod.AUTO:
        choose_staged(engine, direction, BLOCKS * LAYERS * paged.page_bytes, BLOCKS)
    job = sent([PageCopy(slot, 0, 1 + (slot * 7919) % BLOCKS) for slot in range(BLOCKS)], form)
    sizes = np.random.default_rng(0).integers(1, BLOCKS + 1, jobs) if mixed else np.full(jobs, BLOCKS)
    ids = itertools.count()
    seconds, calls = [], Counter()
    for i in range(jobs):
        job = sent([PageCopy(slot, 0, 1 + (slot * 7919) % BLOCKS) for slot in range(int(sizes[i]))], form) \
            if mixed else job
        before = Counter(device.calls)
        if cold:
            evict_caches()
        began = time.perf_counter()
        if direction is Direction.STORE:
            engine.start_store(next(ids), job)
        else:
            engine.start_load(next(ids), job, synchronous=False)
        seconds.append(time.perf_counter() - began)
        if i == jobs - 1:
            calls = device.calls - before
        engine.poll()
    launches = sum(lanes.graph_launches for lanes in streams._lanes.values())  # noqa: SLF001
    repeated = engine.repeated
    engine.close()
    if layout != "LBNHC":
        return {"median_us": round(statistics.median(seconds) * 1e6, 1), "repeated": repeated, "jobs": jobs}
    if mixed:
        return {"median_us": round(statistics.median(seconds) * 1e6, 1), "graph_share": round(launches / jobs, 3)}
    return {"median_us": round(statistics.median(seconds) * 1e6, 1), "min_us": round(min(seconds) * 1e6, 1),
            "device_calls_per_job": dict(sorted(calls.items()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1000)
    args = parser.parse_args()
    rows = []
    for heads in (1, 2, 8):
        for direction in Direction:
            row = {"page_kib": heads * 8, "direction": direction.value}
            for name, graphs in (("graph", True), ("op_by_op", False)):
                row[name] = issue_times(heads, direction, graphs, args.jobs)
            row["graph"]["cold_median_us"] = issue_times(heads, direction, True, args.jobs, cold=True)["median_us"]
            row["graph_table"] = {  # the same jobs sent as page tables (before SlotRun, what the scheduler sent)
                "median_us": issue_times(heads, direction, True, args.jobs, form="table")["median_us"],
                "cold_median_us": issue_times(heads, direction, True, args.jobs, cold=True, form="table")["median_us"]}
            rows.append(row)
    mixed = {direction.value: issue_times(2, direction, True, args.jobs, mixed=True) for direction in Direction}
    blnhc = {f"{heads * 8}KiB {direction.value}": {
        "warm": issue_times(heads, direction, True, args.jobs, layout="BLNHC"),
        "cold_median_us": issue_times(heads, direction, True, args.jobs, cold=True, layout="BLNHC")["median_us"]}
        for heads in (1, 2, 8) for direction in Direction}
    print(json.dumps({"mixed_16KiB": mixed, "blnhc_auto": blnhc, "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                      "blocks": BLOCKS, "layers": LAYERS, "jobs": args.jobs, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
