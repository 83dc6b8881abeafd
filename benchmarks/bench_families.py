"""Round-2 time to first token as a fraction of round 1, per model family, on vLLM with kvtier.

    python benchmarks/bench_families.py [--families qwen3-moe,...] [--words 700]

Prints one JSON document. For each family one engine (its own process, vLLM's default
multiprocess mode, tests/support/offline_run.py) runs the same prompts twice, one request at a
time and one generated token each (so a request's time is its TTFT, measured around
``LLM.generate``): round 1 computes and stores, then vLLM's own prefix cache is reset and round 2
is served from kvtier's host tier. Outputs of both rounds must be equal (checked). Families: the
tiny random-weight models of tests/support/tiny_models.py and ``gemma-3-270m`` (real weights). On
vLLM-CPU qwen3-moe (the default), gemma3-swa, gemma-3-270m (sliding window + global, 4 KV cache
groups: loads asynchronous, one step) and granitemoehybrid (Mamba2 hybrid, state at block
boundaries) are offloaded; kvtier is inactive for MLA models there (docs/models.md), so their
ratio is about 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.offline_run import cached, launch, tokens  # noqa: E402
from support.tiny_models import FAMILIES, write_tiny_model  # noqa: E402

from kvtier.bench.text import long_prompts  # noqa: E402


def model_folder(name: str, tmp: Path) -> tuple[Path, dict]:
    if name == "gemma-3-270m":
        from kvtier.models.gemma import ensure_gemma_model

        return ensure_gemma_model("float32"), {"kv_cache_memory_bytes": 192 * 2**20}
    return write_tiny_model(name, tmp / "models"), dict(FAMILIES[name].engine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="qwen3-moe",
                        help="comma-separated: tiny families (tests/support/tiny_models.py) or gemma-3-270m")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--words", type=int, default=700)
    args = parser.parse_args()
    prompts = long_prompts(args.prompts, args.words, seed=5)
    out: dict = {"prompts": args.prompts, "words": args.words, "families": {}}
    with tempfile.TemporaryDirectory(prefix="kvtier-families-") as tmp_name:
        tmp = Path(tmp_name)
        for name in args.families.split(","):
            folder, engine = model_folder(name, tmp)
            spec = {
                "model": str(folder), "prompts": prompts, "max_tokens": 1, "max_model_len": 2048,
                "kv_cache_memory_bytes": 64 * 2**20, "rounds": [{}, {"reset_prefix_cache": True}],
                "kv_connector_extra_config": {"cpu_bytes_to_use": 512 * 2**20}, "engine": engine,
            }
            run_dir = tmp / name
            run_dir.mkdir()
            result = launch(spec, run_dir, multiprocess=True, timeout=1800)
            assert tokens(result, 0) == tokens(result, 1), f"{name}: round 2 differs"
            first = [r["seconds"] for r in result["rounds"][0]]
            second = [r["seconds"] for r in result["rounds"][1]]
            out["families"][name] = {
                "prompt_tokens": [r["prompt_tokens"] for r in result["rounds"][0]],
                "round2_cached_tokens": cached(result, 1),
                "round1_ttft_ms_median": round(statistics.median(first) * 1000, 1),
                "round2_ttft_ms_median": round(statistics.median(second) * 1000, 1),
                "round2_over_round1": round(statistics.median(second) / statistics.median(first), 3),
            }
            print(f"{name}: {out['families'][name]}", file=sys.stderr)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
