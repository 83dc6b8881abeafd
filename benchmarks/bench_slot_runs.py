"""How many consecutive runs of host slots a store job gets from the host tier under churn: what
decides whether a CUDA staged job can be issued as a graph (one host run per chunk:
``kvtier.copy.jobgraph.graph_key``) and how many copy descriptors a job needs.

A multi-turn workload on :class:`kvtier.tiers.host.HostIndex` (LRU) alone, no engine: ``sessions``
conversations, one turn at a time in a random order; a turn touches the prefix blocks still
cached, stores the evicted ones again with the turn's ``per_turn`` new blocks (one store job),
and a conversation starts over past ``max_blocks``. Jobs after the first ``warmup`` turns (the
cache full by then) are counted. Prints one JSON: per set-up, the share of jobs whose slots are
one consecutive run, and the mean runs per job.

    python benchmarks/bench_slot_runs.py [--turns 3000] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random

from kvtier.tiers.host import HostIndex

SETUPS = [  # (slots, sessions, blocks per turn)
    (4096, 40, 64), (4096, 200, 32), (16384, 100, 128), (16384, 20, 512),
]


def runs(slots: list[int]) -> int:
    ordered = sorted(slots)
    return 1 + sum(1 for a, b in zip(ordered, ordered[1:]) if b != a + 1)


def churn(num_slots: int, sessions: int, per_turn: int, turns: int, seed: int, warmup: int = 500,
          max_blocks: int = 1500) -> dict:
    index, rng = HostIndex(num_slots), random.Random(seed)
    length, generation = [0] * sessions, [0] * sessions
    counted = one_run = total_runs = 0
    for turn in range(turns):
        s = rng.randrange(sessions)

        def key(i: int) -> bytes:
            return f"{s}:{generation[s]}:{i}".encode()

        prefix = [key(i) for i in range(length[s])]
        index.touch([k for k in prefix if index.is_ready(k)])
        job = [k for k in prefix if k not in index] + [key(i) for i in range(length[s], length[s] + per_turn)]
        slots = []
        for k in job:
            if k in index:  # stored earlier in this job's own loop: never twice
                continue
            slot, _ = index.allocate(k)
            if slot is None:
                continue
            slots.append(slot)
            index.commit(k)
        length[s] += per_turn
        if length[s] > max_blocks:
            length[s], generation[s] = 0, generation[s] + 1
        if turn >= warmup and slots:
            counted += 1
            count = runs(slots)
            one_run += count == 1
            total_runs += count
    return {"slots": num_slots, "sessions": sessions, "blocks_per_turn": per_turn, "jobs": counted,
            "one_run_share": round(one_run / counted, 3), "runs_per_job": round(total_runs / counted, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps({"turns": args.turns, "seed": args.seed,
                      "rows": [churn(*setup, args.turns, args.seed) for setup in SETUPS]}, indent=1))


if __name__ == "__main__":
    main()
