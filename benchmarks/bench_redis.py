"""Redis tier throughput against ``redis-benchmark`` on the same server, value size and pipeline depth.

    PYTHONPATH=src python benchmarks/bench_redis.py [--sizes 5898240,1048576] [--depths 1,4]
        [--ops 96] [--min-mb 500] [--repeat 3] [--unix] [--url redis://host:port/0]

Prints ONE JSON line. For every (value size, pipeline depth) and direction:

- ``kvtier``: a :class:`~kvtier.tiers.redis.RedisTier` (one rank, ``payload_bytes`` = size) driven
  as the orchestrator drives it: ``depth`` jobs submitted together (one pipeline), then
  ``wait()`` + ``poll()`` until they are all done, ``ops / depth`` times. Puts send from, and
  gets land in, a preallocated host buffer of ``depth`` slots; every get is verified (headers,
  checksums) before it counts. The stored value is the payload plus a 136-byte header; MB/s
  counts payload bytes only.
  The tier is built with ``presence_ttl`` ~0, so a put of a block it knows present is still sent.
- ``redis_benchmark``: ``redis-benchmark -c 1 -P depth -d size -n ops -t set,get --csv`` against
  the same server (one client, same depth, same value size, same number of requests).

``ops`` per cell is ``--ops``, raised so that a run moves at least ``--min-mb`` MB (a multiple of
the depth): 96 requests of 1 MiB take ~40 ms, short enough for one scheduler hiccup to move the
ratio by 20 points.

The two runs of a cell are interleaved and repeated ``--repeat`` times; the JSON has the median
of each and ``ratio`` = kvtier / redis-benchmark (the goal is >= 0.8). MB = 10^6 bytes.
Default sizes: 5,898,240 B (one SmolLM2-135M fp32 block of 128 tokens: 30 layers x 196,608 B)
and 1 MiB. Without ``--url`` a throwaway redis-server is started (tests/support/redis_server.py).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kvtier.core.tier_config import RedisTierConfig
from kvtier.tiers.redis import RedisTier

SMOLLM2_BLOCK = 30 * 196608


def redis_benchmark(target: dict, size: int, depth: int, ops: int) -> dict[str, float]:
    """MB/s of SET and GET from redis-benchmark (one client, ``depth`` pipelined requests)."""
    args = [
        "redis-benchmark",
        "-c",
        "1",
        "-n",
        str(ops),
        "-d",
        str(size),
        "-P",
        str(depth),
        "-t",
        "set,get",
        "--csv",
    ]
    if target.get("socket"):
        args += ["-s", target["socket"]]
    else:
        args += ["-h", target["host"], "-p", str(target["port"])]
    out = subprocess.run(args, check=True, capture_output=True, text=True, timeout=600).stdout
    rows = {row["test"]: float(row["rps"]) for row in csv.DictReader(io.StringIO(out))}
    return {"put": rows["SET"] * size / 1e6, "get": rows["GET"] * size / 1e6}


def kvtier_run(
    tier: RedisTier, slots: list[memoryview], size: int, depth: int, ops: int, keys: list[bytes]
) -> dict:
    """MB/s of puts then gets through the tier (submit ``depth`` jobs, poll until done)."""
    rounds = max(1, ops // depth)
    parent = b"\x00" * 32

    def drain(n: int) -> None:
        done = 0
        while done < n:
            results = tier.poll()
            for result in results:
                if not result.ok:
                    raise RuntimeError(f"job failed: {result}")
            done += len(results)
            if done < n:
                tier.wait(1.0)

    start = time.perf_counter()
    for _ in range(rounds):
        for i in range(depth):
            if not tier.submit_write(i, keys[i], parent, 128, [slots[i]]):
                raise RuntimeError("write refused")
        drain(depth)
    put_s = time.perf_counter() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    for _ in range(rounds):
        for i in range(depth):
            tier.submit_read(i, keys[i], [slots[i]])
        drain(depth)
    get_s = time.perf_counter() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    moved = rounds * depth * size / 1e6
    return {"put": moved / put_s, "get": moved / get_s, "minor_faults_per_get": faults / (rounds * depth)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=f"{SMOLLM2_BLOCK},{1 << 20}")
    parser.add_argument("--depths", default="1,4")
    parser.add_argument("--ops", type=int, default=96, help="requests per run (per direction), at least")
    parser.add_argument(
        "--min-mb", type=float, default=500.0, help="raise a cell's requests until a run moves this many MB"
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--unix", action="store_true", help="connect over a unix socket (own server only)")
    parser.add_argument("--url", help="an existing server (default: start one)")
    args = parser.parse_args()

    server = None
    if args.url:
        parts = urlsplit(args.url)
        target = {"host": parts.hostname, "port": parts.port or 6379, "socket": None}
        url = args.url
    else:
        from support.redis_server import RedisServer

        server = RedisServer(unixsocket=args.unix)
        target = {
            "host": "127.0.0.1",
            "port": server.port,
            "socket": server.socket_path if args.unix else None,
        }
        url = f"unix://{server.socket_path}" if args.unix else server.url()
    try:
        cells = []
        for size in (int(s) for s in args.sizes.split(",")):
            for depth in (int(d) for d in args.depths.split(",")):
                ops = max(args.ops, math.ceil(args.min_mb * 1e6 / size))
                ops = -(-ops // depth) * depth
                config = RedisTierConfig(
                    url=url,
                    timeout_s=10.0,
                    connect_timeout_s=2.0,
                    key_prefix="kvbench",
                    max_pending_writes=max(64, depth),
                )
                # presence_ttl ~0: every put is really sent (no "known present" shortcut).
                tier = RedisTier(
                    config,
                    engine_digest=os.urandom(32),
                    rank_digests=[os.urandom(32)],
                    namespace_json="{}",
                    payload_bytes=size,
                    presence_ttl=1e-9,
                )
                host = bytearray(os.urandom(size)) * depth  # the host tier's slots, preallocated
                view = memoryview(host)
                slots = [view[i * size : (i + 1) * size] for i in range(depth)]
                keys = [os.urandom(32) for _ in range(depth)]
                runs: dict[str, list[dict]] = {"kvtier": [], "redis_benchmark": []}
                try:
                    kvtier_run(tier, slots, size, depth, max(depth, ops // 8), keys)  # warm-up
                    for _ in range(args.repeat):
                        runs["kvtier"].append(kvtier_run(tier, slots, size, depth, ops, keys))
                        runs["redis_benchmark"].append(redis_benchmark(target, size, depth, ops))
                    stats = tier.stats
                finally:
                    tier.close()
                cell = {"size": size, "depth": depth, "ops": ops}
                for direction in ("put", "get"):
                    ours = statistics.median(r[direction] for r in runs["kvtier"])
                    theirs = statistics.median(r[direction] for r in runs["redis_benchmark"])
                    cell[direction] = {
                        "kvtier_MBps": round(ours, 1),
                        "redis_benchmark_MBps": round(theirs, 1),
                        "ratio": round(ours / theirs, 3),
                        "kvtier_runs": [round(r[direction], 1) for r in runs["kvtier"]],
                        "redis_benchmark_runs": [round(r[direction], 1) for r in runs["redis_benchmark"]],
                    }
                cell["kvtier_minor_faults_per_get"] = round(
                    statistics.median(r["minor_faults_per_get"] for r in runs["kvtier"]), 1
                )
                cell["kvtier_corrupt"] = stats.corrupt
                cell["kvtier_read_batches"] = stats.read_batches
                cells.append(cell)
        version = subprocess.run(
            ["redis-server", "--version"], capture_output=True, text=True, check=False
        ).stdout.split()
        print(
            json.dumps(
                {
                    "bench": "redis",
                    "transport": "unix" if args.unix else "tcp",
                    "server": next((v for v in version if v.startswith("v=")), "?"),
                    "cpus": os.cpu_count(),
                    "load_avg": [round(x, 2) for x in os.getloadavg()],
                    "python": platform.python_version(),
                    "cells": cells,
                }
            )
        )
    finally:
        if server is not None:
            server.kill()


if __name__ == "__main__":
    main()
