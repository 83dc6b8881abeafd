"""How fast ``kvtier plan --trace`` replays a big trace (issue 41's goal: 100,000 requests of about
2,000 tokens at 16-token blocks, 8 host sizes, in under 60 s on the project's 2-core machine).

Writes a synthetic trace (not timed): chat sessions on a few hundred system prompts whose transcripts
grow turn by turn, and questions about documents of Zipf-skewed popularity, averaging about 2,000
prompt tokens; then times the ``kvtier plan`` command itself (a subprocess, as an operator runs it)
on it with 8 host sizes, kvtier's LRU host tier without tails (the one-pass LRU), and prints one
JSON object. ``--format tokens`` writes ``prompt_token_ids`` lines (what a request log holds; the
command hashes every token), ``access`` kvtier's access log (hashes only; what the connector writes),
``both`` (default) times each.

    python benchmarks/bench_plan_trace.py [--requests 100000] [--format both] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

GOAL_S = 60.0
BLOCK = 16
HOST_SIZES = "4,8,16,32,64,128,256,512"
VOCAB = 50_000


def synthetic_requests(count: int, seed: int = 0):
    """Yields (prompt token ids, output token ids) of ``count`` requests, ~2,000 prompt tokens on average."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, VOCAB, int(rng.integers(200, 600)), dtype=np.uint32) for _ in range(300)]
    docs = [rng.integers(0, VOCAB, int(rng.integers(1000, 2200)), dtype=np.uint32) for _ in range(5000)]
    doc_weights = 1.0 / np.arange(1, len(docs) + 1) ** 0.9
    doc_weights /= doc_weights.sum()
    sessions: list[np.ndarray] = []
    for _ in range(count):
        if rng.random() < 0.45:  # a chat turn: resend the transcript with a new message
            if not sessions or rng.random() < 0.25 or len(sessions) < 50:
                system = systems[int(rng.zipf(1.5)) % len(systems)]
                sessions.append(np.concatenate([system, rng.integers(0, VOCAB, int(rng.integers(200, 900)), dtype=np.uint32)]))
            index = int(rng.integers(max(0, len(sessions) - 2000), len(sessions)))
            prompt = sessions[index]
            output = rng.integers(0, VOCAB, int(rng.integers(20, 300)), dtype=np.uint32)
            message = rng.integers(0, VOCAB, int(rng.integers(20, 200)), dtype=np.uint32)
            grown = np.concatenate([prompt, output, message])
            sessions[index] = grown if len(grown) < 4000 else sessions[index]
        else:  # a question about a document
            doc = docs[int(rng.choice(len(docs), p=doc_weights))]
            system = systems[int(rng.zipf(1.5)) % len(systems)]
            prompt = np.concatenate([system, doc, rng.integers(0, VOCAB, int(rng.integers(20, 120)), dtype=np.uint32)])
            output = rng.integers(0, VOCAB, int(rng.integers(20, 300)), dtype=np.uint32)
        yield prompt, output


def access_line(prompt: np.ndarray, output: np.ndarray, t: float) -> str:
    """kvtier's access-log line for one request (keys: a chain hash of its blocks, 16 bytes)."""
    tokens = np.concatenate([prompt, output[:-1]]).astype("<u4").tobytes()
    step = 4 * BLOCK
    parent = b"\0" * 16
    keys = []
    for start in range(0, len(tokens) - step + 1, step):
        parent = xxhash.xxh3_128_digest(parent + tokens[start:start + step])
        keys.append(parent.hex())
    return json.dumps({"kvtier_access": 1, "t": t, "block_tokens": BLOCK, "prompt_tokens": len(prompt),
                       "tokens": len(prompt) + len(output) - 1, "salt": None, "keys": keys, "tails": []},
                      separators=(",", ":"))


def write_traces(folder: Path, count: int, formats: list[str]) -> dict[str, dict]:
    files = {fmt: open(folder / f"trace-{fmt}.jsonl", "w") for fmt in formats}
    prompt_tokens = 0
    started = time.perf_counter()
    for index, (prompt, output) in enumerate(synthetic_requests(count)):
        prompt_tokens += len(prompt)
        if "tokens" in files:
            files["tokens"].write(json.dumps({"prompt_token_ids": prompt.tolist(), "output_token_ids": output.tolist()},
                                             separators=(",", ":")) + "\n")
        if "access" in files:
            files["access"].write(access_line(prompt, output, float(index)) + "\n")
    for handle in files.values():
        handle.close()
    return {fmt: {"path": str(folder / f"trace-{fmt}.jsonl"), "bytes": (folder / f"trace-{fmt}.jsonl").stat().st_size,
                  "prompt_tokens": prompt_tokens, "write_s": round(time.perf_counter() - started, 1)}
            for fmt in formats}


def time_plan(trace: str) -> dict:
    """``kvtier plan default --trace TRACE`` with 8 host sizes, the one-pass LRU; wall seconds and its report."""
    command = [sys.executable, "-m", "kvtier.cli.main", "plan", "default", "--trace", trace, "--block-size", str(BLOCK),
               "--kv-cache-gib", "4", "--host-sizes", HOST_SIZES, "--kv-config",
               '{"offload_partial_blocks": false}', "--method", "stack", "--json"]
    started = time.perf_counter()
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    if done.returncode != 0:
        return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "error": done.stderr[-2000:]}
    report = json.loads(done.stdout)
    return {
        "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "replay_s": report["replay_seconds"], "requests": report["trace"]["requests"],
        "prompt_tokens": report["trace"]["prompt_tokens"], "distinct_blocks": report["trace"]["distinct_blocks"],
        "engine_fraction": report["engine"]["fraction"],
        "hit_rates": {f"{p['host_bytes'] / 2**30:g}GiB": p["hit_rate"] for p in report["curve"]},
        "knee": report["knee"]["text"], "goal_s": GOAL_S, "goal_met": wall < GOAL_S,
        "peak_rss_mib": round(cpu_after.ru_maxrss / 1024),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--format", choices=["tokens", "access", "both"], default="both")
    parser.add_argument("--keep", type=Path, default=None, help="write the traces here and keep them")
    parser.add_argument("--reuse", action="store_true", help="with --keep: time the traces already there")
    args = parser.parse_args()
    formats = ["tokens", "access"] if args.format == "both" else [args.format]
    folder = args.keep or Path(tempfile.mkdtemp(prefix="kvtier-plan-trace-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        if args.reuse and args.keep is not None:
            traces = {fmt: {"path": str(folder / f"trace-{fmt}.jsonl"), "bytes": (folder / f"trace-{fmt}.jsonl").stat().st_size,
                            "write_s": None} for fmt in formats}
        else:
            traces = write_traces(folder, args.requests, formats)
        result = {"requests": args.requests, "block_tokens": BLOCK, "host_sizes_gib": HOST_SIZES,
                  "cpus": os.cpu_count(), "load_average": os.getloadavg(), "runs": {}}
        for fmt, info in traces.items():
            result["runs"][fmt] = {"trace_bytes": info["bytes"], "trace_write_s": info["write_s"], **time_plan(info["path"])}
        print(json.dumps(result, indent=2))
    finally:
        if args.keep is None:
            for fmt in formats:
                (folder / f"trace-{fmt}.jsonl").unlink(missing_ok=True)
            folder.rmdir()


if __name__ == "__main__":
    main()
