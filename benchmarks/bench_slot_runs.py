"""How many consecutive runs of host slots a store job gets from the host tier under churn, with
runs continued (the default, :data:`kvtier.tiers.host.RUN_COLDNESS`) and with the policy's
victims alone (``run_coldness=None``), and what either costs in hit rate.

Runs decide how a CUDA staged job moves: one host copy per run, and a job goes as one CUDA graph
only when each of its chunks is one run (``kvtier.copy.jobgraph.graph_key``; 32 MiB chunks are
16 / 64 / 128 blocks of 32 layers at 64 / 16 / 8 KiB pages).

A multi-turn workload on :class:`kvtier.tiers.host.HostIndex` (LRU) alone, no engine:
``sessions`` conversations, one turn at a time in a random order; a turn touches the prefix
blocks still cached (the hits), stores the missing ones again with the turn's new blocks (one
store job: ``blocks_per_turn`` on average, from half to one and a half times that, so jobs do
not line up with one another), and a conversation starts over past ``max_blocks``. Jobs after
the first ``warmup`` turns (the cache full by then) are counted. Prints one JSON: per set-up and
allocator, the hit rate, the mean runs per job, the share of jobs that are one run, and the share
whose runs break only at chunk boundaries, per chunk size; and what the index costs the
scheduler's thread either way (``costs``: microseconds to reserve and commit a block of a
512-block job in a full index of 65,536 slots, and to touch a hit run of 8,000 keys; the best of
``--repeats``).

    python benchmarks/bench_slot_runs.py [--turns 3000] [--seed 0] [--fixed-turns] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from kvtier.tiers.host import RUN_COLDNESS, HostIndex

SETUPS = [  # (slots, sessions, blocks per turn)
    (4096, 40, 64), (4096, 200, 32), (16384, 100, 128), (16384, 20, 512),
]
CHUNK_BLOCKS = (16, 64, 128)


def run_breaks(slots: list[int]) -> list[int]:
    """Positions in the job where a new run of slots begins (0 first)."""
    return [0] + [i for i in range(1, len(slots)) if slots[i] != slots[i - 1] + 1]


def churn(num_slots: int, sessions: int, per_turn: int, coldness: float | None, turns: int, seed: int,
          fixed: bool = False, warmup: int = 500, max_blocks: int = 1500) -> dict:
    index, rng = HostIndex(num_slots, run_coldness=coldness), random.Random(seed)
    length, generation = [0] * sessions, [0] * sessions
    jobs = one_run = total_runs = hits = asked = 0
    aligned = dict.fromkeys(CHUNK_BLOCKS, 0)
    for turn in range(turns):
        s = rng.randrange(sessions)

        def key(i: int) -> bytes:
            return f"{s}:{generation[s]}:{i}".encode()

        prefix = [key(i) for i in range(length[s])]
        ready = [k for k in prefix if index.is_ready(k)]
        index.touch(ready)
        new = per_turn if fixed else rng.randrange(per_turn // 2, per_turn * 3 // 2 + 1)
        job = [k for k in prefix if k not in index] + [key(i) for i in range(length[s], length[s] + new)]
        slots = []
        for k in job:
            slot, _ = index.allocate(k)
            if slot is None:
                continue
            slots.append(slot)
            index.commit(k)
        length[s] += new
        if length[s] > max_blocks:
            length[s], generation[s] = 0, generation[s] + 1
        if turn >= warmup and slots:
            jobs += 1
            hits, asked = hits + len(ready), asked + len(prefix)
            breaks = run_breaks(slots)
            one_run += len(breaks) == 1
            total_runs += len(breaks)
            for chunk in CHUNK_BLOCKS:
                aligned[chunk] += all(b % chunk == 0 for b in breaks)
    return {"slots": num_slots, "sessions": sessions, "blocks_per_turn": per_turn,
            "run_coldness": coldness, "jobs": jobs, "hit_rate": round(hits / max(asked, 1), 4),
            "runs_per_job": round(total_runs / jobs, 2), "one_run_share": round(one_run / jobs, 3),
            "chunk_aligned_share": {str(c): round(n / jobs, 3) for c, n in aligned.items()},
            "run_evictions": index.run_evictions, "evictions": index.evictions}


def costs(coldness: float | None, repeats: int, slots: int = 65536, job: int = 512, jobs: int = 100,
          hit_run: int = 8000) -> dict:
    """Microseconds per block to reserve and commit (jobs of ``job`` blocks into a full index, a
    third of each job touched again after it) and milliseconds per touch of ``hit_run`` keys."""
    keys = [i.to_bytes(32, "little") for i in range(slots + job * jobs)]
    store = touch = float("inf")
    for _ in range(repeats):
        index = HostIndex(slots, run_coldness=coldness)
        for key in keys[:slots]:
            index.allocate(key)
            index.commit(key)
        began = time.perf_counter()
        for j in range(jobs):
            batch = keys[slots + j * job:slots + (j + 1) * job]
            for key in batch:
                index.allocate(key)
            for key in batch:
                index.commit(key)
            index.touch(batch[::3])
        store = min(store, (time.perf_counter() - began) / (job * jobs) * 1e6)
        run = [k for k in keys if index.is_ready(k)][:hit_run]
        began = time.perf_counter()
        for _ in range(20):
            index.touch(run)
        touch = min(touch, (time.perf_counter() - began) / 20 * 1e3)
    return {"run_coldness": coldness, "store_us_per_block": round(store, 2), "touch_ms_per_8000_keys": round(touch, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fixed-turns", action="store_true",
                        help="every turn adds exactly blocks_per_turn blocks (jobs line up with one another)")
    args = parser.parse_args()
    rows = [churn(*setup, coldness, args.turns, args.seed, args.fixed_turns)
            for setup in SETUPS for coldness in (None, RUN_COLDNESS)]
    print(json.dumps({"turns": args.turns, "seed": args.seed, "fixed_turns": args.fixed_turns, "rows": rows,
                      "costs": [costs(coldness, args.repeats) for coldness in (None, RUN_COLDNESS)]}, indent=1))


if __name__ == "__main__":
    main()
