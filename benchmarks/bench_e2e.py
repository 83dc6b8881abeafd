"""Round-2 latency on the embedded default: a prompt served from kvtier's host tier vs the same
prompt with its prefill recomputed. Prints a table and one JSON object (last line).

One vLLM engine (default multiprocess mode) with kvtier, a vLLM KV space far smaller than the
workload. Round 1 computes every prompt (and kvtier stores it); then vLLM's own prefix cache is
reset, so in round 2 every full block comes from kvtier's host tier. Prompts run one at a time,
so each latency is one request's end-to-end time.

    python benchmarks/bench_e2e.py [--prompts 8] [--words 1000] [--max-tokens 1]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--words", type=int, default=1000, help="words per prompt (~1.08 tokens each)")
    parser.add_argument("--max-tokens", type=int, default=1, help="output tokens per request (1 = TTFT)")
    parser.add_argument("--kv-cache-mib", type=int, default=128, help="vLLM's own KV space")
    parser.add_argument("--host-bytes", type=int, default=1_000_000_000, help="kvtier cpu_bytes_to_use")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp:
        spec = {
            "model": str(ensure_default_model("float32")),
            "prompts": long_prompts(args.prompts, args.words, seed=7),
            "rounds": [{}, {"reset_prefix_cache": True}],
            "max_tokens": args.max_tokens,
            "kv_cache_memory_bytes": args.kv_cache_mib * 2**20,
            "max_model_len": 2048,
            "kv_connector_extra_config": {"cpu_bytes_to_use": args.host_bytes},
        }
        env = {
            # VLLM_CPU_KVCACHE_SPACE would override kv_cache_memory_bytes on vLLM-CPU: keep it unset
            **{k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"},
            "VLLM_CACHE_ROOT": os.path.join(tmp, "vllm"),
            "TMPDIR": tmp,
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
        }
        proc = subprocess.run(
            [sys.executable, str(OFFLINE_RUN), json.dumps(spec)], env=env, capture_output=True, text=True
        )
        if proc.returncode:
            sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
        result = json.loads(proc.stdout.strip().splitlines()[-1])

    round1, round2 = result["rounds"]
    rows = []
    print(f"{'prompt':>6} {'tokens':>7} {'cached r2':>9} {'round 1 s':>9} {'round 2 s':>9} {'ratio':>6}")
    for index, (first, second) in enumerate(zip(round1, round2)):
        ratio = second["seconds"] / first["seconds"]
        rows.append(ratio)
        print(
            f"{index:>6} {first['prompt_tokens']:>7} {second['num_cached_tokens']:>9} "
            f"{first['seconds']:>9.2f} {second['seconds']:>9.2f} {ratio:>6.1%}"
        )
    summary = {
        "benchmark": "e2e_round2_latency",
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
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
