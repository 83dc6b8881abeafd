"""Host tier put/get bandwidth vs a plain memcpy of the same bytes, side by side in one run.

Engine-sized blocks: by default SmolLM2's geometry on vLLM-CPU (30 layers, pages of
[3 kv heads, 128 tokens, 2*64] float32 = 196,608 B, i.e. 5.9 MB per 128-token block). "put" copies
engine pages into host slots in shared memory (what a worker does after a step), "get" copies them
back (a load). The baseline copies the same total bytes with one ``Tensor.copy_`` between two
contiguous buffers, the best case for memcpy. Prints one JSON object.

    python benchmarks/bench_host.py [--blocks 64] [--repeats 5]
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


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm up: page faults, caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64, help="blocks moved per measurement")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--block-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    engine_blocks = args.blocks * 2 + 1
    layers = [
        torch.randn(engine_blocks, args.kv_heads, args.block_tokens, 2 * args.head_size)
        for _ in range(args.layers)
    ]
    kv = PagedKV(layers, engine_blocks)
    layout = HostSlotLayout(args.layers, 1, kv.page_bytes, world_size=1, num_slots=args.blocks)
    region = SharedRegion.create(f"kvtier-bench-{os.getpid()}", layout.region_bytes)
    try:
        host = HostSlots(torch.frombuffer(region.view, dtype=torch.uint8), layout)
        copier = BlockCopier(kv, host)
        pages = [PageCopy(slot, 0, block_id) for slot, block_id in enumerate(range(1, engine_blocks, 2))]
        total = args.blocks * layout.slot_bytes

        put_s = best_seconds(lambda: copier.copy(Direction.STORE, pages), args.repeats)
        get_s = best_seconds(lambda: copier.copy(Direction.LOAD, pages), args.repeats)
        src = torch.empty(total, dtype=torch.uint8).fill_(1)
        dst = torch.empty(total, dtype=torch.uint8)
        memcpy_s = best_seconds(lambda: dst.copy_(src), args.repeats)

        # Bit-exact round trip check (so the speed is of a correct copy).
        originals = [layer[1:engine_blocks:2].clone() for layer in layers]
        copier.copy(Direction.STORE, pages)
        for layer in layers:
            layer[1:engine_blocks:2].zero_()
        copier.copy(Direction.LOAD, pages)
        exact = all(torch.equal(layer[1:engine_blocks:2], orig) for layer, orig in zip(layers, originals))
    finally:
        region.unlink()
    gbps = lambda s: round(total / s / 1e9, 2)  # noqa: E731
    print(
        json.dumps(
            {
                "benchmark": "host_tier_vs_memcpy",
                "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}",
                "torch_threads": torch.get_num_threads(),
                "block_bytes": layout.slot_bytes,
                "blocks": args.blocks,
                "total_bytes": total,
                "memcpy_GBps": gbps(memcpy_s),
                "put_GBps": gbps(put_s),
                "get_GBps": gbps(get_s),
                "put_vs_memcpy": round(memcpy_s / put_s, 3),
                "get_vs_memcpy": round(memcpy_s / get_s, 3),
                "round_trip_bit_exact": exact,
            }
        )
    )


if __name__ == "__main__":
    main()
