"""The GPU kit's benchmark (run by scripts/gpu-check.sh; prints one JSON object; needs CUDA).

Store and load jobs of 512 blocks (scattered engine block ids) x 32 layers through kvtier's CUDA
copy engine, between a KV cache laid out as vLLM lays it out on a GPU (``--layout``,
tests/gpu/gpu_layouts.py; LBNHC is FlashAttention's default) and a pinned /dev/shm host region, at
8, 16 and 64 KiB pages (1, 2 and 8 KV heads x 16 tokens x 256 values, bf16: a Llama-3.1-8B-sized
layer at TP 8, 4 and 1), each job moved by every copy method (``runs``: one DMA descriptor per
merged run, ``staged``: gathers/scatters pipelined with large DMAs through device buffers,
``auto``: what kvtier uses, after its method chooser timed its trial jobs).

The baseline is one ``cudaMemcpyAsync`` of the same bytes between the same pinned region and the
device, measured INTERLEAVED with the method's jobs (a single copy, then a job, ``--repeats``
times after ``WARMUPS`` of each; medians), so drift of the link or the host cannot favour either.
A fraction above :data:`MEASUREMENT_ERROR` is reported as a measurement error (nothing beats one
copy of the same bytes over the same link).

Each copy, the single ones too, is queued behind :data:`GATE_MS` of compute on the compute stream,
as kvtier's copies are in serving (a store waits for the forward that wrote its KV, a load for
the work issued before it): the device time measured, from the job's own start and end events,
is then the copy's own, with the host's issue time overlapped by that compute (the issue time is
reported apart). ``idle_fraction`` is ``auto`` again from an idle device, host issue included
(reported, not judged).

Host time: ``issue_ms``, the start call (``start_store`` / an asynchronous ``start_load``, call
to return, median after the warm-ups: the thread that runs the forward issues the job; staged
jobs of a repeated shape go as CUDA graphs from the second on, ``graph_launches``, and a page
table of a size launched twice goes as a repeat of its graph, unplanned: ``repeated``), and
``forward``: what a job costs that thread all told (:func:`forward_cost`, a stand-in step timed
alone and with a job started; it also shows the cost of any issue moved to another thread, which
shares the GIL: measured once and dropped, docs/benchmarks.md). And what kvtier's copies cost
the forward pass on the device: a bf16 GEMM loop on the compute stream
alone and beside an ``auto`` store, an ``auto`` load and one plain ``cudaMemcpyAsync`` of the same
bytes each way (16 KiB pages; slowdown = GEMM time beside / alone, medians of interleaved rounds).

What the SMs kvtier's gather and scatter kernels take costs the GEMM, by how many thread blocks
they may run on (``kernel_blocks_sweep``, at the contention page size): a ``staged`` engine per
cap (one block per page, 4x / 1x / a quarter of the SMs, 8 blocks), its fraction of the single
copy and the GEMM's slowdown beside its store and load (reported, not judged: it decides
:data:`kvtier.copy.streams.KERNEL_BLOCKS`).

Goals (judged by tests/gpu/summarize.py): ``auto`` >= :data:`GOAL_FRACTION` of the single copy at
every page size both ways, < :data:`GOAL_ISSUE_MS` ms to issue (the start call, and the whole
cost to the forward's thread), GEMM slowdown <=
:data:`GOAL_STORE_SLOWDOWN` beside a store and no more than the plain copy's beside a load.

Usage: python tests/gpu/bench_copies.py [--layout LBNHC] [--pages-kib 8,16,64] [--blocks 512]
       [--layers 32] [--repeats 9] [--chunk-mib 64] [--buffers 2] [--kernel-blocks N|page]
       [--sweep-kernel-blocks] [--no-sweep-kernel-blocks]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_layouts import Case, build  # noqa: E402

from kvtier.copy import BlockCopier, Direction, HostSlots, PageCopy, PagedKV, page_table, slot_run_of  # noqa: E402
from kvtier.copy.choice import TRIALS  # noqa: E402
from kvtier.copy.cuda import CudaCopyEngine  # noqa: E402
from kvtier.copy.pinning import pin_host_memory  # noqa: E402
from kvtier.copy.staging import STAGING_BUFFERS, STAGING_CHUNK_BYTES, CopyMethod  # noqa: E402
from kvtier.copy.streams import KERNEL_BLOCKS, TorchCudaStreams  # noqa: E402
from kvtier.core.slots import HostSlotLayout  # noqa: E402
from kvtier.tiers.shm import SharedRegion  # noqa: E402

GOAL_FRACTION = 0.95
MEASUREMENT_ERROR = 1.05
GOAL_ISSUE_MS = 0.2
GOAL_STORE_SLOWDOWN = 1.05
LOAD_SLOWDOWN_TOLERANCE = 0.02  # a load may slow the GEMM as much as one plain copy does, within this noise
WARMUPS = 2
GATE_MS = 25  # compute queued ahead of each measured copy: longer than any job's host issue time
TOKENS, CONTENT = 16, 256  # per head and block: 16 tokens x (K + V: 2 x 128) bf16 values = 8 KiB
METHODS = (CopyMethod.RUNS, CopyMethod.STAGED, CopyMethod.AUTO)


def host_region(size: int, slot_bytes: int):
    """A pinned host region: /dev/shm as the worker makes it, or process memory if /dev/shm is small."""
    stats = os.statvfs("/dev/shm")
    if stats.f_bavail * stats.f_frsize > size + 2**26:
        region = SharedRegion.create(f"kvtier-gpu-bench-{os.getpid()}-{size}", size)
        region.unlink()
        buffer, where = torch.frombuffer(region.view, dtype=torch.uint8), "/dev/shm"
    else:
        buffer, where = torch.empty(size, dtype=torch.uint8), "process memory (/dev/shm too small)"
    return buffer, pin_host_memory(buffer, slot_bytes), where


def gate() -> None:
    """Queue :data:`GATE_MS` of compute on the current (compute) stream."""
    torch.cuda._sleep(int(GATE_MS * CYCLES_PER_MS))


def timed(work, stream, gated: bool = False) -> float:
    """Device seconds of ``work()`` issued on ``stream`` (after a gate of compute if ``gated``)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if gated:
        gate()
        stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        start.record(stream)
        work()
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1000.0


def cycles_per_ms() -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond, measured."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / start.elapsed_time(end)


CYCLES_PER_MS = 2e6  # measured in main()


def run_job(engine: CudaCopyEngine, direction: Direction, pages, job_id: int, gated: bool = True):
    """One job, waited for and polled (so the chooser sees its timing): (device seconds, issue ms, method)."""
    torch.cuda.synchronize()
    if gated:
        gate()
    began = time.perf_counter()
    if direction is Direction.STORE:
        engine.start_store(job_id, pages)
    else:
        engine.start_load(job_id, pages, synchronous=False)
    issue_ms = (time.perf_counter() - began) * 1000
    engine.wait([job_id])
    [done] = [d for d in engine.poll() if d.job_id == job_id]
    assert done.ok, f"{direction.value} job {job_id} failed"
    return done.seconds, issue_ms, done.method


def measure(engine, direction, pages, single, repeats: int, job_ids, gated: bool = True) -> dict:
    """Interleaved single copies and jobs, warm-ups first: medians of each, and how many of the
    measured jobs went as repeats of a graph, unplanned (``CudaCopyEngine.repeated``)."""
    singles, device_s, issue_ms, methods, repeated = [], [], [], set(), 0
    for i in range(WARMUPS + repeats):
        single_s = single(gated)
        before = engine.repeated
        seconds, issued, method = run_job(engine, direction, pages, next(job_ids), gated)
        if i >= WARMUPS:
            singles.append(single_s)
            device_s.append(seconds)
            issue_ms.append(issued)
            methods.add(method)
            repeated += engine.repeated - before
    return {"single_s": statistics.median(singles), "device_s": statistics.median(device_s),
            "issue_ms": statistics.median(issue_ms), "issue_ms_max": max(issue_ms), "methods": sorted(methods),
            "repeated": repeated, "jobs": repeats}


FORWARD_ITERATIONS = 300  # the stand-in step: 300 launches and as many numpy ops, ~3 ms (a 9 ms one varied by 0.5 ms)


def forward_cost(engine, direction, pages, job_ids, rounds: int = 15) -> dict:
    """What starting a job costs the thread that runs the forward pass, all of it: the start call
    and anything the job's issue takes from this thread after it (a thread of its own would share
    the GIL with this one). The forward's host work is stood in for by a loop of small numpy ops and kernel launches (as
    vLLM's input preparation and an eager forward are), long enough to outlast the issue; it is
    timed alone and right after the start call (call included), in pairs; ``added_ms`` is the
    median of the pairs' differences (drift of the host between pairs cancels out).
    ``call_after_host_work_ms`` (reported, not judged): the start call alone when the stand-in
    step's host work, not a wait for the device, came right before it (the kit's ``issue_ms`` is
    timed right after such a wait: the thread's caches cold, as after a sampler's sync)."""
    x = torch.zeros(1024, device=torch.cuda.current_device())

    def step() -> float:
        began = time.perf_counter()
        for i in range(FORWARD_ITERATIONS):
            np.arange(64) * i
            x.add_(1.0)
        return time.perf_counter() - began

    def start() -> None:
        if direction is Direction.STORE:
            engine.start_store(next(job_ids), pages)
        else:
            engine.start_load(next(job_ids), pages, synchronous=False)

    alone, beside, after_work = [], [], []
    for r in range(rounds + WARMUPS):
        torch.cuda.synchronize()
        seconds = step()
        torch.cuda.synchronize()
        began = time.perf_counter()
        start()
        with_job = time.perf_counter() - began + step()
        engine.wait()
        engine.poll()
        torch.cuda.synchronize()
        step()  # host work right before the call, as an engine prepares a step's inputs before it
        began = time.perf_counter()
        start()
        call_after_work = time.perf_counter() - began
        engine.wait()
        engine.poll()
        if r >= WARMUPS:
            alone.append(seconds)
            beside.append(with_job)
            after_work.append(call_after_work)
    a, b = statistics.median(alone), statistics.median(beside)
    added = statistics.median(w - s for s, w in zip(alone, beside))
    return {"step_ms": round(a * 1000, 3), "step_with_job_ms": round(b * 1000, 3), "added_ms": round(added * 1000, 3),
            "call_after_host_work_ms": round(statistics.median(after_work) * 1000, 3)}


def contention(engine, pages, single, job_ids, rounds: int = 21) -> dict:
    """GEMM slowdown beside an ``auto`` store / load and a plain copy each way, in interleaved
    rounds: each case's GEMM time over the GEMM alone of the same round (the device's clocks drift
    between rounds; a ratio of medians taken over all rounds moved by +-0.02 between two runs of
    one configuration on an H200), the median of those ratios, and their quartiles for loads."""
    device = torch.cuda.current_device()
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn_like(a)
    compute = torch.cuda.current_stream()

    def gemm():
        for _ in range(4):
            torch.mm(a, b)

    def beside(copy) -> float:
        torch.cuda.synchronize()
        copy()
        seconds = timed(gemm, compute)
        torch.cuda.synchronize()
        engine.poll()
        return seconds

    cases = {
        "alone": lambda: None,
        "store": lambda: engine.start_store(next(job_ids), pages),
        "single_store": lambda: single[Direction.STORE](False),
        "load": lambda: engine.start_load(next(job_ids), pages, synchronous=False),
        "single_load": lambda: single[Direction.LOAD](False),
    }
    alone: list[float] = []
    ratios: dict[str, list[float]] = {name: [] for name in cases if name != "alone"}
    for r in range(rounds + WARMUPS):
        times = {name: beside(copy) for name, copy in cases.items()}
        if r >= WARMUPS:
            alone.append(times["alone"])
            for name in ratios:
                ratios[name].append(times[name] / times["alone"])
    out = {"gemm_ms": round(statistics.median(alone) * 1000, 3), "rounds": rounds,
           **{f"slowdown_{name}": round(statistics.median(r), 3) for name, r in ratios.items()}}
    for name in ("load", "single_load"):
        q1, _, q3 = statistics.quantiles(ratios[name], n=4)
        out[f"quartiles_{name}"] = [round(q1, 3), round(q3, 3)]
    return out


def bench_page_size(args, device, heads: int, job_ids) -> dict:
    case = Case(args.layout, layers=args.layers, heads=heads, tokens=TOKENS, content=CONTENT, dtype=torch.bfloat16)
    num_blocks = args.blocks + 8
    kv = build(case, num_blocks, device)
    kv.raw.copy_(torch.randint(-128, 128, kv.raw.shape, dtype=torch.int8, device=device))
    paged = PagedKV(kv.views, num_blocks)
    layout = HostSlotLayout(args.layers, 1, paged.page_bytes, 1, args.blocks)
    buffer, pinning, where = host_region(layout.region_bytes, layout.slot_bytes)
    host = HostSlots(buffer, layout)
    # engine blocks in a scattered order, as a serving engine's are (consecutive ids would let
    # block-outermost layouts merge a whole job into one run)
    # as kvtier's scheduler sends a job to the workers: one host run of consecutive slots, so a
    # SlotRun (first slot, engine blocks; kvtier.copy.slot_run_of of its page table)
    table = page_table([PageCopy(slot, 0, 1 + (slot * 7919) % args.blocks) for slot in range(args.blocks)])
    pages = slot_run_of(table) or table
    job_bytes = args.blocks * args.layers * paged.page_bytes
    streams = TorchCudaStreams(device, kernel_blocks=args.kernel_blocks)
    out: dict = {"page_bytes": paged.page_bytes, "job_bytes": job_bytes, "host_region": where,
                 "pinned": pinning.pinned}
    staging = {"chunk_bytes": args.chunk_mib * 2**20, "buffers": args.buffers}
    engines = {method: CudaCopyEngine(BlockCopier(paged, host), streams, method, **staging) for method in METHODS}
    for method in (CopyMethod.RUNS, CopyMethod.STAGED):  # what each method makes of the job (auto: one of them)
        plan, _ = engines[method]._plan(Direction.STORE, pages)  # noqa: SLF001
        out.setdefault("copies_per_job", {})[method.value] = getattr(plan, "num_runs", None)
    auto = engines[CopyMethod.AUTO]
    if auto.staged is not None:
        out["staging_bytes"] = auto.staged.staging_bytes
    for direction in Direction:  # the chooser's trials, before anything is measured
        for _ in range(2 * TRIALS + 1):
            run_job(auto, direction, pages, next(job_ids))
    out["auto_choices"] = auto.chooser.choices()
    contiguous = torch.empty(job_bytes, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device)
    single = {Direction.STORE: lambda gated: timed(lambda: buffer[:job_bytes].copy_(contiguous, non_blocking=True),
                                                   side, gated),
              Direction.LOAD: lambda gated: timed(lambda: contiguous.copy_(buffer[:job_bytes], non_blocking=True),
                                                  side, gated)}
    for direction in Direction:
        name = direction_name(direction)
        measured = {method.value: measure(engine, direction, pages, single[direction], args.repeats, job_ids)
                    for method, engine in engines.items()}
        out[name] = direction_report(job_bytes, measured)
        idle = measure(auto, direction, pages, single[direction], args.repeats, job_ids, gated=False)
        out[name]["auto"]["idle_fraction"] = round(idle["single_s"] / idle["device_s"], 3)
        out[name]["auto"]["forward"] = forward_cost(auto, direction, pages, job_ids)
        out[name]["issue_goal_met"] = (out[name]["auto"]["issue_ms"] < GOAL_ISSUE_MS
                                       and out[name]["auto"]["forward"]["added_ms"] < GOAL_ISSUE_MS)
    if heads * 8 == args.contention_kib:
        out["contention"] = contention(auto, pages, single, job_ids)
        if args.sweep_kernel_blocks:
            out["kernel_blocks_sweep"] = kernel_blocks_sweep(args, device, paged, host, pages, single, job_ids)
    for engine in engines.values():
        engine.wait()
    runtime = streams.runtime
    out["batch_refusals"] = getattr(runtime, "batch_refusals", None)
    out["graph_launches"] = sum(lanes.graph_launches for lanes in streams._lanes.values())  # noqa: SLF001
    streams.close()
    pinning.release()
    del kv
    single.clear()
    contiguous = None  # the single copies' device buffer, freed before the next page size
    torch.cuda.empty_cache()
    return out


def kernel_blocks_sweep(args, device, paged, host, pages, single, job_ids) -> dict:
    """Per cap on the thread blocks of kvtier's gather and scatter launches ("page": one block per
    page), a ``staged`` engine's fraction of the single copy each way and a GEMM's slowdown beside
    its store and load (:func:`contention`)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    out: dict = {"sms": sms}
    for cap in (None, 4 * sms, sms, max(sms // 4, 1), 8):
        name = "page" if cap is None else str(cap)
        engine = None
        try:  # a cap that fails is reported as such: the rest of the kit's results still count
            engine = CudaCopyEngine(BlockCopier(paged, host), TorchCudaStreams(device, kernel_blocks=cap),
                                    CopyMethod.STAGED, chunk_bytes=args.chunk_mib * 2**20, buffers=args.buffers)
            row: dict = {}
            for direction in Direction:
                m = measure(engine, direction, pages, single[direction], 5, job_ids)
                row[f"{direction_name(direction)}_fraction"] = round(m["single_s"] / m["device_s"], 3)
            row.update(contention(engine, pages, single, job_ids))
            engine.wait()
            lanes = list(engine.device._lanes.values())  # noqa: SLF001
            row["kernels"] = sorted({lane.kernels.how if lane.kernels is not None else "torch's ops" for lane in lanes})
            row["graph_launches"] = sum(lane.graph_launches for lane in lanes)
            out[name] = row
        except Exception as exc:  # noqa: BLE001 - reported in the JSON
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            if engine is not None:
                engine.close()
    return out


def direction_name(direction: Direction) -> str:
    return "store" if direction is Direction.STORE else "load"


def driver_version() -> str | None:
    try:
        run = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return run.stdout.strip().splitlines()[0] if run.returncode == 0 and run.stdout.strip() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", default="LBNHC")
    parser.add_argument("--pages-kib", default="8,16,64", help="page sizes in KiB, multiples of 8 (KV heads x 8 KiB)")
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--chunk-mib", type=int, default=STAGING_CHUNK_BYTES // 2**20, help="staging buffer size")
    parser.add_argument("--buffers", type=int, default=STAGING_BUFFERS, help="staging buffers per direction")
    parser.add_argument("--contention-kib", type=int, default=16, help="page size of the GEMM contention rounds")
    parser.add_argument("--kernel-blocks", type=lambda v: None if v == "page" else int(v), default=KERNEL_BLOCKS,
                        help="most thread blocks a gather/scatter launch runs on ('page': one per page; "
                             "default: the engine's)")
    parser.add_argument("--sweep-kernel-blocks", action=argparse.BooleanOptionalAction, default=True,
                        help="at the contention page size, measure staged engines at several kernel block caps")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    device = torch.device("cuda", torch.cuda.current_device())
    global CYCLES_PER_MS
    CYCLES_PER_MS = cycles_per_ms()
    job_ids = iter(range(1, 10**9))
    sizes = {}
    for kib in (int(k) for k in args.pages_kib.split(",")):
        sizes[f"{kib}KiB"] = bench_page_size(args, device, kib // 8, job_ids)
    runtime = TorchCudaStreams(device).runtime
    report = bench_report(sizes, runtime, args)
    report.update({"card": torch.cuda.get_device_name(device), "driver": driver_version(), "torch": torch.__version__,
                   "torch_cuda": torch.version.cuda})
    print(json.dumps(report, indent=1))


def direction_report(job_bytes: int, measured: dict[str, dict]) -> dict:
    """One direction at one page size: per method (``runs``, ``staged``, ``auto``) its numbers
    (:func:`measure`: each against its own interleaved single copies), the fastest method, and
    whether ``auto`` met the goals or measured wrong."""
    result: dict = {}
    for method, m in measured.items():
        fraction = m["single_s"] / m["device_s"]
        result[method] = {"device_ms": round(m["device_s"] * 1000, 3), "GBps": round(job_bytes / m["device_s"] / 1e9, 2),
                          "single_copy_GBps": round(job_bytes / m["single_s"] / 1e9, 2),
                          "fraction_of_single_copy": round(fraction, 3), "issue_ms": round(m["issue_ms"], 3),
                          "issue_ms_max": round(m["issue_ms_max"], 3), "moved_as": m.get("methods", [method]),
                          "repeated": f"{m.get('repeated', 0)} of {m.get('jobs', 0)}"}
    result["fastest"] = max(("runs", "staged"), key=lambda k: result[k]["fraction_of_single_copy"])
    auto = result["auto"]["fraction_of_single_copy"]
    result["measurement_error"] = auto > MEASUREMENT_ERROR
    result["fraction_goal_met"] = GOAL_FRACTION <= auto <= MEASUREMENT_ERROR
    result["issue_goal_met"] = result["auto"]["issue_ms"] < GOAL_ISSUE_MS
    return result


def bench_report(sizes: dict[str, dict], runtime, args) -> dict:
    """The JSON the kit's verdict reads (tests/gpu/summarize.py), but for the card's name."""
    refusals = sum(s["batch_refusals"] or 0 for s in sizes.values())
    contention_met = all(contention_goals_met(s["contention"]) for s in sizes.values() if "contention" in s)
    goals_met = contention_met and all(s[d]["fraction_goal_met"] and s[d]["issue_goal_met"] for s in sizes.values()
                                       for d in ("store", "load"))
    return {
        "cuda_runtime": getattr(runtime, "version", None), "runtime_path": getattr(runtime, "path", None),
        "batched_copy": bool(runtime is not None and runtime.batched and refusals == 0),
        "batch_refusals": refusals, "layout": args.layout, "blocks": args.blocks, "layers": args.layers,
        "repeats": args.repeats, "staging": {"chunk_bytes": args.chunk_mib * 2**20, "buffers": args.buffers},
        "kernel_blocks": args.kernel_blocks if args.kernel_blocks is not None else "page",
        "page_sizes": sizes,
        "goals": {"fraction_of_single_copy": GOAL_FRACTION, "measurement_error_above": MEASUREMENT_ERROR,
                  "issue_ms": GOAL_ISSUE_MS, "store_slowdown": GOAL_STORE_SLOWDOWN,
                  "load_slowdown_over_plain_copy": LOAD_SLOWDOWN_TOLERANCE, "method": "auto"},
        "goals_met": goals_met,
    }


def contention_goals_met(c: dict) -> bool:
    return (c["slowdown_store"] <= GOAL_STORE_SLOWDOWN
            and c["slowdown_load"] <= c["slowdown_single_load"] + LOAD_SLOWDOWN_TOLERANCE)


if __name__ == "__main__":
    main()
