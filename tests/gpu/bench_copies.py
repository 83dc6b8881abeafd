"""The GPU kit's benchmark (run by scripts/gpu-check.sh; prints one JSON object; needs CUDA).

A store job and a load job of 512 blocks x 32 layers of Llama-3.1-8B-sized pages (8 KV heads x
128 dims, K and V, bf16, 16-token blocks: 64 KiB a page, 1 GiB a job) through kvtier's CUDA copy
engine, between vLLM's default GPU layout (LBNHC, tests/gpu/gpu_layouts.py) and a pinned /dev/shm
host region, against one ``cudaMemcpyAsync`` of the same bytes between the same pinned region and
the device (``Tensor.copy_(non_blocking=True)`` of one contiguous 1 GiB buffer). Reported per
direction: device time and bandwidth (median of ``--repeats``), the fraction of the single copy's
bandwidth (goal: >= 0.8), and the host time to issue a job, ``start_store`` / ``start_load``
from call to return (goal: < 1 ms).

Usage: python tests/gpu/bench_copies.py [--layout LBNHC] [--blocks 512] [--layers 32] [--repeats 7]
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
from kvtier.copy.streams import TorchCudaStreams  # noqa: E402
from kvtier.core.slots import HostSlotLayout  # noqa: E402
from kvtier.tiers.shm import SharedRegion  # noqa: E402

GOAL_FRACTION = 0.8
GOAL_ISSUE_MS = 1.0


def host_region(size: int, slot_bytes: int):
    """A pinned host region: /dev/shm as the worker makes it, or process memory if /dev/shm is small."""
    stats = os.statvfs("/dev/shm")
    if stats.f_bavail * stats.f_frsize > size + 2**26:
        region = SharedRegion.create(f"kvtier-gpu-bench-{os.getpid()}", size)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", default="LBNHC")
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    device = torch.device("cuda", torch.cuda.current_device())
    case = Case(args.layout, layers=args.layers, heads=8, tokens=16, content=256, dtype=torch.bfloat16)
    num_blocks = args.blocks + 8
    kv = build(case, num_blocks, device)
    kv.raw.copy_(torch.randint(-128, 128, kv.raw.shape, dtype=torch.int8, device=device))
    paged = PagedKV(kv.views, num_blocks)
    layout = HostSlotLayout(args.layers, 1, paged.page_bytes, 1, args.blocks)
    buffer, pinning, where = host_region(layout.region_bytes, layout.slot_bytes)
    streams = TorchCudaStreams(device)
    engine = CudaCopyEngine(BlockCopier(paged, HostSlots(buffer, layout)), streams)
    pages = [PageCopy(slot, 0, 1 + slot) for slot in range(args.blocks)]
    job_bytes = args.blocks * args.layers * paged.page_bytes

    results = {}
    job_id = 0
    for direction in (Direction.STORE, Direction.LOAD):
        device_s, issue_ms = [], []
        for _ in range(args.repeats):
            job_id += 1
            torch.cuda.synchronize()
            began = time.perf_counter()
            if direction is Direction.STORE:
                engine.start_store(job_id, pages)
            else:
                engine.start_load(job_id, pages, synchronous=False)
            issue_ms.append((time.perf_counter() - began) * 1000)
            engine.wait([job_id])
            [done] = [d for d in engine.poll() if d.job_id == job_id]
            assert done.ok
            device_s.append(done.seconds)
        results[direction] = (statistics.median(device_s), statistics.median(issue_ms), max(issue_ms))

    contiguous = torch.empty(job_bytes, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device)
    d2h = statistics.median(timed_single_copy(buffer[:job_bytes], contiguous, side) for _ in range(args.repeats))
    h2d = statistics.median(timed_single_copy(contiguous, buffer[:job_bytes], side) for _ in range(args.repeats))

    def report(direction: Direction, single: float) -> dict:
        seconds, issue, worst = results[direction]
        fraction = single / seconds
        return {"device_ms": round(seconds * 1000, 3), "GBps": round(job_bytes / seconds / 1e9, 2),
                "fraction_of_single_copy": round(fraction, 3), "issue_ms_median": round(issue, 3),
                "issue_ms_max": round(worst, 3), "fraction_goal_met": fraction >= GOAL_FRACTION,
                "issue_goal_met": issue < GOAL_ISSUE_MS}

    runtime = streams.runtime
    plan = engine.runs.plan(Direction.STORE, pages) if engine.runs is not None else None
    print(json.dumps({
        "card": torch.cuda.get_device_name(device), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cuda_runtime": getattr(runtime, "version", None), "batched_copy": getattr(runtime, "batched", False),
        "layout": args.layout, "blocks": args.blocks, "layers": args.layers, "page_bytes": paged.page_bytes,
        "job_bytes": job_bytes, "copies_per_job": None if plan is None else plan.num_runs,
        "host_region": where, "pinned": pinning.pinned, "repeats": args.repeats,
        "single_copy": {"d2h_GBps": round(job_bytes / d2h / 1e9, 2), "h2d_GBps": round(job_bytes / h2d / 1e9, 2)},
        "store": report(Direction.STORE, d2h), "load": report(Direction.LOAD, h2d),
        "goals": {"fraction_of_single_copy": GOAL_FRACTION, "issue_ms": GOAL_ISSUE_MS},
    }, indent=1))
    engine.close()
    pinning.release()  # the region itself is unlinked already and unmapped at exit


if __name__ == "__main__":
    main()
