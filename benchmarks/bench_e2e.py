"""Round-2 latency on the embedded default: a prompt served by kvtier vs the same prompt with its
prefill recomputed, from the host tier and, with ``--fresh``, in a fresh engine from Redis or disk.
Prints a table and one JSON object (last line).

Engine A (vLLM's KV space far smaller than the workload): round 1 computes every prompt (and
kvtier stores it); then vLLM's own prefix cache is reset, so in round 2 every full block comes from
kvtier's host tier. With ``--fresh redis`` (or ``disk``), A's only secondary tier is a throwaway
loopback redis-server (or a disk root), and a second, fresh engine process B then sends the same
prompts: its host tier is empty, so every block comes from that tier (what a node that never saw a
prefix gets from the fleet). Prompts run one at a time, so each latency is one request's
end-to-end time. ``--engine inproc`` runs each engine in one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: scheduler, model and kvtier's threads share one
interpreter); ``multiprocess`` is vLLM's default. Ratios compare within one engine mode only.

``--connector native``: vLLM's own OffloadingConnector with kvtier's spec instead (vLLM's CPU tier,
then kvtier_redis or kvtier_disk as its only secondary tier): round 2 is then a hit in vLLM's CPU
tier, and the fresh engine is served from kvtier's tier (goals: at most 0.6x round 1's full compute
and 1.5x round 2's CPU-tier hit, medians).

    python benchmarks/bench_e2e.py [--prompts 8] [--words 1000] [--max-tokens 1]
    python benchmarks/bench_e2e.py --fresh redis --engine inproc --prompts 6 --words 1400 --max-tokens 16
    python benchmarks/bench_e2e.py --connector native --fresh redis --engine inproc --prompts 4 --words 1400 --max-tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kvtier.bench.text import long_prompts
from kvtier.models.default import ensure_default_model

OFFLINE_RUN = Path(__file__).resolve().parents[1] / "tests" / "support" / "offline_run.py"


def run_engine(spec: dict, tmp: str, name: str, multiprocess: bool) -> dict:
    env = {
        # VLLM_CPU_KVCACHE_SPACE would override kv_cache_memory_bytes on vLLM-CPU: keep it unset
        **{k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"},
        "VLLM_CACHE_ROOT": os.path.join(tmp, "vllm"),
        "TMPDIR": os.path.join(tmp, name),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
    }
    os.makedirs(env["TMPDIR"], exist_ok=True)
    proc = subprocess.run([sys.executable, str(OFFLINE_RUN), json.dumps(spec)], env=env, capture_output=True,
                          text=True, check=False)
    if proc.returncode:
        sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def secondary_tiers(fresh: str, tmp: str, redis_url: str | None, *, native: bool = False) -> list[dict]:
    prefix = "kvtier_" if native else ""
    if fresh == "redis":
        return [{"type": prefix + "redis", "url": redis_url}]
    if fresh == "disk":
        return [{"type": prefix + "disk" if native else "fs", "root_dir": os.path.join(tmp, "kv"),
                 "capacity_bytes": 20 * 2**30}]
    return []


NATIVE_SPEC = {"spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier.vllm.native"}


def metric(result: dict, round_index: int, name: str) -> float:
    return result["round_metrics"][round_index].get(name, 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--words", type=int, default=1000, help="words per prompt (~1.08 tokens each)")
    parser.add_argument("--max-tokens", type=int, default=1, help="output tokens per request (1 = TTFT)")
    parser.add_argument("--kv-cache-mib", type=int, default=128, help="vLLM's own KV space")
    parser.add_argument("--host-bytes", type=int, default=1_000_000_000, help="kvtier cpu_bytes_to_use")
    parser.add_argument("--fresh", choices=("none", "redis", "disk"), default="none",
                        help="also serve the prompts in a fresh engine from this tier (A's only secondary tier)")
    parser.add_argument("--engine", choices=("multiprocess", "inproc"), default="multiprocess",
                        help="vLLM's engine mode for every engine of the run")
    parser.add_argument("--connector", choices=("kvtier", "native"), default="kvtier",
                        help="kvtier's connector, or vLLM's OffloadingConnector with kvtier's spec and tiers")
    args = parser.parse_args()
    multiprocess = args.engine == "multiprocess"
    native = args.connector == "native"

    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp:
        redis = None
        if args.fresh == "redis":
            from kvtier.bench.redis_server import LocalRedis

            redis = LocalRedis.start(Path(tmp) / "redis", maxmemory_bytes=8 * 2**30)
        try:
            spec = {
                "model": str(ensure_default_model("float32")),
                "prompts": long_prompts(args.prompts, args.words, seed=7),
                "rounds": [{}, {"reset_prefix_cache": True}],
                "max_tokens": args.max_tokens,
                "kv_cache_memory_bytes": args.kv_cache_mib * 2**20,
                "max_model_len": 2048,
                "kv_connector_extra_config": {
                    **(NATIVE_SPEC if native else {}),
                    "cpu_bytes_to_use": args.host_bytes,
                    "secondary_tiers": secondary_tiers(args.fresh, tmp, redis.url if redis else None, native=native),
                },
                **({"connector": "native"} if native else {}),
            }
            filled = run_engine(spec, tmp, "a", multiprocess)
            fresh = None
            if args.fresh != "none":
                fresh = run_engine({**spec, "rounds": [{}]}, tmp, "b", multiprocess)
        finally:
            if redis is not None:
                redis.stop()

    round1, round2 = filled["rounds"]
    third = fresh["rounds"][0] if fresh else [None] * len(round1)
    rows, fresh_rows = [], []
    print(f"{'prompt':>6} {'tokens':>7} {'cached r2':>9} {'round 1 s':>9} {'round 2 s':>9} {'ratio':>6}"
          + (f" {'cached':>7} {'fresh s':>8} {'/host':>6}" if fresh else ""))
    for index, (first, second, other) in enumerate(zip(round1, round2, third)):
        ratio = second["seconds"] / first["seconds"]
        rows.append(ratio)
        line = (f"{index:>6} {first['prompt_tokens']:>7} {second['num_cached_tokens']:>9} "
                f"{first['seconds']:>9.2f} {second['seconds']:>9.2f} {ratio:>6.1%}")
        if other is not None:
            fresh_rows.append(other["seconds"] / second["seconds"])
            line += f" {other['num_cached_tokens']:>7} {other['seconds']:>8.2f} {fresh_rows[-1]:>6.2f}"
        print(line)
    summary = {
        "benchmark": "e2e_round2_latency",
        "engine": args.engine,
        "connector": args.connector,
        "prompts": len(rows),
        "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in round1),
        "max_tokens": args.max_tokens,
        "round1_seconds_median": statistics.median(r["seconds"] for r in round1),
        "round2_seconds_median": statistics.median(r["seconds"] for r in round2),
        "round2_over_round1_median": round(statistics.median(rows), 3),
        "round2_over_round1_max": round(max(rows), 3),
        "round2_cached_fraction": round(
            sum(r["num_cached_tokens"] for r in round2) / sum(r["prompt_tokens"] for r in round2), 3
        ),
        "outputs_equal": [r["token_ids"] for r in round1] == [r["token_ids"] for r in round2],
        "target_ratio": 0.2,
    }
    if fresh is not None:
        summary.update({
            "fresh_from": args.fresh,
            "fresh_seconds_median": statistics.median(r["seconds"] for r in third),
            "fresh_over_host_hit_median": round(statistics.median(fresh_rows), 3),
            "fresh_over_host_hit_max": round(max(fresh_rows), 3),
            "fresh_cached_fraction": round(
                sum(r["num_cached_tokens"] for r in third) / sum(r["prompt_tokens"] for r in third), 3),
            "fresh_lookups_retried": metric(fresh, 0, "kvtier_lookups_retried_total{}"),
            "fresh_outputs_equal": [r["token_ids"] for r in third] == [r["token_ids"] for r in round1],
            "fresh_target_ratio": 1.5,
            "fresh_over_full_compute_median": round(
                statistics.median(o["seconds"] / f["seconds"] for o, f in zip(third, round1)), 3),
            "fresh_over_full_compute_target": 0.6,
        })
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
