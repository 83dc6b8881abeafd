"""Scheduler-side lookup cost per block key with 100,000 blocks indexed. Prints one JSON object.

Measures what ``get_num_new_matched_tokens`` does on the scheduler thread, from memory only:
``Orchestrator.leading_run`` (index probe across host + disk) and ``Orchestrator.acquire``
(probe + pin + touch, then release), over runs of keys that hit; and, separately, computing the
chained BLAKE3 key of one 128-token block (done once per block of a request, then cached).

    python benchmarks/bench_lookup.py [--indexed 100000] [--run 64]
"""

from __future__ import annotations

import argparse
import json
import time

from kvtier.core.keys import Namespace, chain_block_keys
from kvtier.policy.admission import StoreAdmission
from kvtier.policy.base import PolicyName
from kvtier.runtime.orchestrator import Orchestrator
from kvtier.tiers.host import HostIndex


def per_key_us(fn, keys_per_call: int, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / (calls * keys_per_call) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--indexed", type=int, default=100_000)
    parser.add_argument("--run", type=int, default=64, help="keys per lookup (a 8k-token prompt = 64 blocks)")
    parser.add_argument("--policy", choices=[p.value for p in PolicyName], default="lru")
    args = parser.parse_args()

    namespace = Namespace("bench", "0" * 32, "float32", 30, 3, 64, "mha", 128, "cpu:default")
    tokens = [i % 49_152 for i in range(args.run * 128)]
    keys = chain_block_keys(namespace.digest, tokens, 128)
    host = HostIndex(args.indexed, PolicyName(args.policy))
    filler = [i.to_bytes(32, "little") for i in range(args.indexed - len(keys))]
    for key in filler + keys:
        host.allocate(key)
        host.commit(key)
    orchestrator = Orchestrator(host, None, [], StoreAdmission(0, 1))

    def acquire_release() -> None:
        orchestrator.acquire("req", keys)
        orchestrator.release("req")

    probe_us = per_key_us(lambda: orchestrator.leading_run(keys), len(keys), 2000)
    acquire_us = per_key_us(acquire_release, len(keys), 2000)
    hash_us = per_key_us(lambda: chain_block_keys(namespace.digest, tokens, 128), len(keys), 200)
    print(
        json.dumps(
            {
                "benchmark": "scheduler_lookup",
                "indexed_blocks": host.used_slots,
                "keys_per_lookup": len(keys),
                "policy": args.policy,
                "probe_us_per_key": round(probe_us, 3),
                "acquire_release_us_per_key": round(acquire_us, 3),
                "key_hash_us_per_block": round(hash_us, 3),
                "target_us_per_key": 5.0,
            }
        )
    )


if __name__ == "__main__":
    main()
