"""The GPU kit's benchmark (run by scripts/gpu-check.sh; prints one JSON object; needs CUDA).

Store and load jobs of 512 blocks (scattered engine block ids) x 32 layers through kvtier's CUDA copy engine, between a KV
cache laid out as vLLM lays it out on a GPU (``--layout``, tests/gpu/gpu_layouts.py; LBNHC is
FlashAttention's default) and a pinned /dev/shm host region, at 8, 16 and 64 KiB pages (1, 2 and
8 KV heads x 16 tokens x 256 values, bf16: a Llama-3.1-8B-sized layer at TP 8, 4 and 1), each job
moved by every copy method (``runs``: one DMA descriptor per merged run, ``staged``: gather/scatter
through a device buffer, ``auto``: what kvtier uses), against one ``cudaMemcpyAsync`` of the same
bytes between the same pinned region and the device. Reported per page size, direction and
method: device time, bandwidth and its fraction of the single copy's (median of ``--repeats``),
and the host time to issue a job (``start_store`` / ``start_load`` from call to return), and
which method won. Goals, for ``auto``: >= 0.8 of the single copy at every page size, < 1 ms to
issue. Also whether every job went out batched (``batch_refusals`` counted after the copies).

Usage: python tests/gpu/bench_copies.py [--layout LBNHC] [--pages-kib 8,16,64] [--blocks 512]
       [--layers 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_layouts import Case, build  # noqa: E402

from kvtier.copy import BlockCopier, Direction, HostSlots, PageCopy, PagedKV  # noqa: E402
from kvtier.copy.cuda import CudaCopyEngine  # noqa: E402
from kvtier.copy.pinning import pin_host_memory  # noqa: E402
from kvtier.copy.staging import CopyMethod  # noqa: E402
from kvtier.copy.streams import TorchCudaStreams  # noqa: E402
from kvtier.core.slots import HostSlotLayout  # noqa: E402
from kvtier.tiers.shm import SharedRegion  # noqa: E402

GOAL_FRACTION = 0.8
GOAL_ISSUE_MS = 1.0
TOKENS, CONTENT = 16, 256  # per head and block: 16 tokens x (K + V: 2 x 128) bf16 values = 8 KiB


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


def timed_single_copy(dst: torch.Tensor, src: torch.Tensor, stream) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        dst.copy_(src, non_blocking=True)
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1000.0


def measure(engine: CudaCopyEngine, direction: Direction, pages, repeats: int, job_ids) -> dict:
    device_s, issue_ms = [], []
    for _ in range(repeats):
        job_id = next(job_ids)
        torch.cuda.synchronize()
        began = time.perf_counter()
        if direction is Direction.STORE:
            engine.start_store(job_id, pages)
        else:
            engine.start_load(job_id, pages, synchronous=False)
        issue_ms.append((time.perf_counter() - began) * 1000)
        engine.wait([job_id])
        [done] = [d for d in engine.poll() if d.job_id == job_id]
        assert done.ok, f"{direction.value} job {job_id} failed"
        device_s.append(done.seconds)
    # the first job of an engine allocates its staging buffer: reported apart, not in the median
    return {"device_s": statistics.median(device_s), "issue_ms": statistics.median(issue_ms[1:] or issue_ms),
            "issue_ms_max": max(issue_ms[1:] or issue_ms), "issue_ms_first": issue_ms[0]}


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
    pages = [PageCopy(slot, 0, 1 + (slot * 7919) % args.blocks) for slot in range(args.blocks)]
    job_bytes = args.blocks * args.layers * paged.page_bytes
    streams = TorchCudaStreams(device)
    out: dict = {"page_bytes": paged.page_bytes, "job_bytes": job_bytes, "host_region": where,
                 "pinned": pinning.pinned}
    engines = {}
    for method in CopyMethod:
        engine = engines[method] = CudaCopyEngine(BlockCopier(paged, host), streams, method)
        plan = engine._plan(Direction.STORE, pages)  # noqa: SLF001 - what the method makes of the job
        out.setdefault("copies_per_job", {})[method.value] = getattr(plan, "num_runs", None)
        if method is CopyMethod.AUTO:
            out["auto_picks"] = "staged" if type(plan).__name__ == "StagedRuns" else "runs"
    contiguous = torch.empty(job_bytes, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device)
    single = {Direction.STORE: statistics.median(timed_single_copy(buffer[:job_bytes], contiguous, side)
                                                 for _ in range(args.repeats)),
              Direction.LOAD: statistics.median(timed_single_copy(contiguous, buffer[:job_bytes], side)
                                                for _ in range(args.repeats))}
    for direction in Direction:
        name = "store" if direction is Direction.STORE else "load"
        measured = {method.value: measure(engine, direction, pages, args.repeats, job_ids)
                    for method, engine in engines.items()}
        out[name] = direction_report(job_bytes, single[direction], measured)
    for engine in engines.values():
        engine.wait()
    runtime = streams.runtime
    out["batch_refusals"] = getattr(runtime, "batch_refusals", None)
    streams.close()
    pinning.release()
    del kv, contiguous
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", default="LBNHC")
    parser.add_argument("--pages-kib", default="8,16,64", help="page sizes in KiB, multiples of 8 (KV heads x 8 KiB)")
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    device = torch.device("cuda", torch.cuda.current_device())
    job_ids = iter(range(1, 10**9))
    sizes = {}
    for kib in (int(k) for k in args.pages_kib.split(",")):
        sizes[f"{kib}KiB"] = bench_page_size(args, device, kib // 8, job_ids)
    runtime = TorchCudaStreams(device).runtime
    report = bench_report(sizes, runtime, args)
    report.update({"card": torch.cuda.get_device_name(device), "torch": torch.__version__,
                   "torch_cuda": torch.version.cuda})
    print(json.dumps(report, indent=1))


def direction_report(job_bytes: int, single_s: float, measured: dict[str, dict]) -> dict:
    """One direction at one page size: per method (``runs``, ``staged``, ``auto``) its numbers
    (:func:`measure`), the fastest method, and whether ``auto`` met the goals."""
    result: dict = {"single_copy_GBps": round(job_bytes / single_s / 1e9, 2)}
    for method, m in measured.items():
        result[method] = {"device_ms": round(m["device_s"] * 1000, 3), "GBps": round(job_bytes / m["device_s"] / 1e9, 2),
                          "fraction_of_single_copy": round(single_s / m["device_s"], 3),
                          "issue_ms": round(m["issue_ms"], 3), "issue_ms_max": round(m["issue_ms_max"], 3),
                          "issue_ms_first": round(m["issue_ms_first"], 3)}
    result["fastest"] = max(("runs", "staged"), key=lambda k: result[k]["fraction_of_single_copy"])
    result["fraction_goal_met"] = result["auto"]["fraction_of_single_copy"] >= GOAL_FRACTION
    result["issue_goal_met"] = result["auto"]["issue_ms"] < GOAL_ISSUE_MS
    return result


def bench_report(sizes: dict[str, dict], runtime, args) -> dict:
    """The JSON the kit's verdict reads (tests/gpu/summarize.py), but for the card's name."""
    refusals = sum(s["batch_refusals"] or 0 for s in sizes.values())
    goals_met = all(s[d]["fraction_goal_met"] and s[d]["issue_goal_met"] for s in sizes.values()
                    for d in ("store", "load"))
    return {
        "cuda_runtime": getattr(runtime, "version", None), "runtime_path": getattr(runtime, "path", None),
        "batched_copy": bool(runtime is not None and runtime.batched and refusals == 0),
        "batch_refusals": refusals, "layout": args.layout, "blocks": args.blocks, "layers": args.layers,
        "repeats": args.repeats, "page_sizes": sizes,
        "goals": {"fraction_of_single_copy": GOAL_FRACTION, "issue_ms": GOAL_ISSUE_MS, "method": "auto"},
        "goals_met": goals_met,
    }


if __name__ == "__main__":
    main()
