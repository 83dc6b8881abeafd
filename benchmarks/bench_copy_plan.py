"""Host time to plan one CUDA copy job, on this machine's CPU (no GPU needed): the part of
``start_store`` / ``start_load`` that is kvtier's own Python (the address arrays and run merging
of ``kvtier.copy.runs``), for the GPU kit's job of 512 blocks x 32 layers of Llama-3.1-8B-sized
pages (64 KiB) under vLLM's layouts. The whole issue time, ``cudaMemcpyBatchAsync`` included, is
measured on a GPU by ``tests/gpu/bench_copies.py`` (goal: < 0.2 ms).

Also: ``engine_plan``, the CUDA engine's whole planning of a job (``CudaCopyEngine._plan`` under
``auto``, on the tests' simulated device: planning is numpy only) at 8 and 16 KiB pages, the pages
handed as ``PageCopy`` tuples and as a page table; and ``job_wire``, what pickling a 512-page
copy job and unpickling it costs (vLLM pickles kvtier's metadata to every worker each step) with
its pages as tuples and as the page table the scheduler sends.

    python benchmarks/bench_copy_plan.py [--blocks 512] [--layers 32] [--repeats 50]
"""

from __future__ import annotations

import argparse
import json
import pickle
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gpu"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from gpu_layouts import Case, build  # noqa: E402  (vLLM's view arithmetic, checked against vLLM on CPU)
from sim_device import SimDevice  # noqa: E402  (the tests' simulated device: no GPU needed to plan)

from kvtier.copy import BlockCopier, Direction, HostSlots, PageCopy, PagedKV, page_table  # noqa: E402
from kvtier.copy.cuda import CudaCopyEngine  # noqa: E402
from kvtier.copy.runs import RunPlanner  # noqa: E402
from kvtier.core.slots import HostSlotLayout  # noqa: E402


def median_ms(work, repeats: int) -> float:
    seconds = []
    for _ in range(repeats):
        began = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - began)
    return round(statistics.median(seconds) * 1000, 3)


def engine_plan(blocks: int, layers: int, repeats: int) -> list[dict]:
    rows = []
    for heads in (1, 2):
        case = Case("LBNHC", layers=layers, heads=heads, tokens=16, content=256, dtype=torch.bfloat16)
        kv = build(case, blocks + 8, "cpu")
        paged = PagedKV(kv.views, blocks + 8)
        slots = HostSlotLayout(layers, 1, paged.page_bytes, 1, blocks)
        host = HostSlots(torch.empty(slots.region_bytes, dtype=torch.uint8), slots)
        engine = CudaCopyEngine(BlockCopier(paged, host), SimDevice())
        pages = [PageCopy(slot, 0, 1 + (slot * 7919) % blocks) for slot in range(blocks)]
        for form, job in (("tuples", pages), ("page_table", page_table(pages))):
            engine._plan(Direction.STORE, job)  # noqa: SLF001 - what start_store runs before any device call
            rows.append({"page_kib": paged.page_bytes // 1024, "pages_as": form,
                         "plan_ms_median": median_ms(lambda j=job: engine._plan(Direction.STORE, j), repeats)})  # noqa: SLF001
        engine.close()
    return rows


def job_wire(blocks: int, repeats: int) -> list[dict]:
    pages = [PageCopy(slot, 0, 1 + (slot * 7919) % blocks) for slot in range(blocks)]
    rows = []
    for form, job in (("tuples", pages), ("page_table", page_table(pages))):
        wire = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
        rows.append({"pages_as": form, "bytes": len(wire),
                     "dumps_ms_median": median_ms(lambda j=job: pickle.dumps(j, protocol=pickle.HIGHEST_PROTOCOL), repeats),
                     "loads_ms_median": median_ms(lambda w=wire: pickle.loads(w), repeats)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    rows = []
    for layout, pages_per_block in (("LBNHC", 1), ("LBNHC", 2), ("BLHNC", 1)):
        case = Case(layout, layers=args.layers, heads=8, tokens=16, content=256, dtype=torch.bfloat16)
        num_blocks = args.blocks * pages_per_block + 8
        kv = build(case, num_blocks, "cpu")
        paged = PagedKV(kv.views, num_blocks)
        slots = HostSlotLayout(args.layers, pages_per_block, paged.page_bytes, 1, args.blocks)
        planner = RunPlanner(paged, HostSlots(torch.empty(slots.region_bytes, dtype=torch.uint8), slots))
        pages = [PageCopy(slot, sub, 1 + slot * pages_per_block + sub)
                 for slot in range(args.blocks) for sub in range(pages_per_block)]
        seconds = []
        for _ in range(args.repeats):
            began = time.perf_counter()
            plan = planner.plan(Direction.STORE, pages)
            seconds.append(time.perf_counter() - began)
        rows.append({"layout": layout, "pages_per_block": pages_per_block, "pages": plan.num_pages,
                     "runs": plan.num_runs, "plan_ms_median": round(statistics.median(seconds) * 1000, 3),
                     "plan_ms_max": round(max(seconds) * 1000, 3)})
        del kv, paged, planner
    print(json.dumps({"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                      "blocks": args.blocks, "layers": args.layers, "page_bytes": 65536, "rows": rows,
                      "engine_plan": engine_plan(args.blocks, args.layers, args.repeats),
                      "job_wire": job_wire(args.blocks, args.repeats)}, indent=1))


if __name__ == "__main__":
    main()
