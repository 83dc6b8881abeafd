"""The S3 tier against the raw obstore client on the same SeaweedFS, and a fresh engine's TTFT from S3
vs from disk vs from Redis, in one run.

    PYTHONPATH=src python benchmarks/bench_s3.py [--sizes 262144,4194304,11796480] [--concurrency 16]
        [--min-mb 256] [--repeat 3] [--prompts 4] [--words 1500] [--no-engines] [--no-throughput]

Prints ONE JSON line.

``throughput``: for every object size, PUTs then GETs of distinct keys, ``concurrency`` requests in
flight, by

- ``kvtier``: an :class:`~kvtier.tiers.s3.S3Tier` (one rank, ``payload_bytes`` = size,
  ``max_concurrency`` = ``concurrency``) driven as a tier stack drives it: ``concurrency`` host slots,
  a new job submitted as each one completes (``poll``/``wait``). A GET is bounded by the value's
  size, and every one is verified (header, namespace, key, checksum) as it lands in its slot;
- ``obstore``: ``concurrency`` threads calling ``obstore.put`` / ``obstore.get(...).bytes()`` on
  the same server with objects of the same size (the tier's value: size + a 136-byte header).

For each direction the two clients run back to back (in alternating order), ``--repeat`` times;
the JSON has the median objects/s and MB/s (of payload, MB = 10^6 bytes), the client process's CPU
seconds per request, and ``ratio``: the median over the repeats of kvtier / obstore of the two
back-to-back runs (the goal is >= 0.8). The raw client neither copies nor checks what it gets; the
tier lands every GET in its slot, checksummed (or its MAC checked) as it copies, and checksums every
PUT: on a machine whose cores the store shares, that CPU is the store's too.

``ttft``: SmolLM2-135M (fp32, 256-token kvtier blocks), ``--prompts`` documents of ``--words``
words; one engine fills a disk tier, a Redis server and an S3 prefix at once (kvtier's connector,
``secondary_tiers`` [fs, redis, s3]); then three fresh engines, each with ONE of those tiers, and
vLLM alone, answer the same prompts with ``max_tokens`` 1 (a request's time is its TTFT). The
fresh engines' first round is the one compared (a new process: the tier's presence or index just
opened). The Redis and S3 engines run a second round after vLLM's prefix cache and kvtier's host
tier are reset (``reset_connector``), from their tier again; the disk engine does not: a reset
clears the local disk tier too (by design: only shared tiers survive one engine's reset). Medians
per round, and the prompt tokens each tier served (``kvtier_hit_tokens``). One process per engine,
vLLM's one-process mode (tests/support/offline_run.py); SeaweedFS and redis-server on loopback
(tests/support/seaweed.py, tests/support/redis_server.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kvtier.core.tier_config import TierType, parse_tier
from kvtier.tiers.s3 import S3Tier

SMOLLM2_256 = 30 * 2 * 3 * 64 * 4 * 256  # one SmolLM2-135M fp32 block of 256 tokens (11.8 MB)
PARENT = b"\x00" * 32


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def tier_run(tier: S3Tier, slots: list[memoryview], keys: list[bytes], put: bool) -> float:
    """Seconds to PUT (or GET) ``keys``, one slot per job in flight."""
    free = list(range(len(slots)))
    busy: dict[int, int] = {}
    submitted = done = 0
    start = time.perf_counter()
    while done < len(keys):
        while free and submitted < len(keys):
            slot = free.pop()
            busy[submitted] = slot
            if put:
                if not tier.submit_write(submitted, keys[submitted], PARENT, 1, [slots[slot]]):
                    raise RuntimeError("the tier refused a write")
            else:
                tier.submit_read(submitted, keys[submitted], [slots[slot]])
            submitted += 1
        results = tier.poll()
        for result in results:
            if not result.ok:
                raise RuntimeError(f"job failed: {result}")
            free.append(busy.pop(result.job_id))
        done += len(results)
        if not results:
            tier.wait(1.0)
    return time.perf_counter() - start


def raw_run(store, paths: list[str], value: bytes | None, concurrency: int) -> float:
    """Seconds for ``concurrency`` threads to PUT ``value`` at (or GET) every path."""
    import obstore

    lock = threading.Lock()
    work = iter(paths)
    failures: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                path = next(work, None)
            if path is None:
                return
            try:
                if value is not None:
                    obstore.put(store, path, value, use_multipart=False)
                else:
                    obstore.get(store, path).bytes()
            except BaseException as exc:  # noqa: BLE001 (reported after the run)
                failures.append(exc)
                return

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise RuntimeError(f"raw obstore request failed: {failures[0]}")
    return time.perf_counter() - start


def throughput(server, sizes: list[int], concurrency: int, min_mb: float, repeat: int) -> list[dict]:
    cells = []
    store = server.store()
    for size in sizes:
        ops = max(4 * concurrency, -(-int(min_mb * 1e6) // size))
        raw = {k: v for k, v in server.tier(f"bench-{os.urandom(4).hex()}", max_concurrency=concurrency,
                                            max_pending_writes=concurrency, timeout_s=60.0).items() if k != "type"}
        config = parse_tier(raw, TierType.S3, "bench")
        tier = S3Tier(config, model_name="bench", engine_digest=os.urandom(32), rank_digests=[os.urandom(32)],
                      namespace_json="{}", payload_bytes=size)
        host = memoryview(bytearray(os.urandom(size)) * concurrency)
        slots = [host[i * size:(i + 1) * size] for i in range(concurrency)]
        value = os.urandom(size + 136)
        runs: dict[str, dict[str, list[tuple[float, float]]]] = {
            "kvtier": {"put": [], "get": []}, "obstore": {"put": [], "get": []}}
        try:
            tier_run(tier, slots, [os.urandom(32) for _ in range(concurrency)], put=True)  # warm-up
            for attempt in range(repeat):
                keys = [os.urandom(32) for _ in range(ops)]
                paths = [f"{config.prefix}/raw/{attempt}/{i}" for i in range(ops)]
                for direction in ("put", "get"):  # the two clients back to back, per direction
                    put = direction == "put"
                    for client in ("kvtier", "obstore") if attempt % 2 == 0 else ("obstore", "kvtier"):
                        cpu = cpu_seconds()
                        seconds = (tier_run(tier, slots, keys, put=put) if client == "kvtier"
                                   else raw_run(store, paths, value if put else None, concurrency))
                        runs[client][direction].append((seconds, cpu_seconds() - cpu))
            stats = tier.stats
        finally:
            tier.close()
        cell: dict = {"size": size, "ops": ops, "concurrency": concurrency}
        for direction in ("put", "get"):
            summary = {}
            for client in ("kvtier", "obstore"):
                seconds = statistics.median(s for s, _ in runs[client][direction])
                summary[client] = {"objects_per_s": round(ops / seconds, 1), "MBps": round(ops * size / seconds / 1e6, 1),
                                   "cpu_ms_per_request": round(1000 * statistics.median(c for _, c in
                                                                                         runs[client][direction]) / ops, 3),
                                   "runs_objects_per_s": [round(ops / s, 1) for s, _ in runs[client][direction]]}
            # each repeat's kvtier / obstore, the two runs back to back (the machine's load drifts
            # between repeats far more than within one)
            paired = [o / k for (k, _), (o, _) in zip(runs["kvtier"][direction], runs["obstore"][direction])]
            summary["ratio"] = round(statistics.median(paired), 3)
            summary["ratio_runs"] = [round(r, 3) for r in paired]
            cell[direction] = summary
        cell["kvtier_failures"] = stats.io_errors + stats.corrupt
        cells.append(cell)
        import obstore

        for chunk in obstore.list(store, config.prefix + "/", chunk_size=1000):
            obstore.delete(store, [meta["path"] for meta in chunk])
    return cells


def ttft(server, redis, work: Path, prompts_count: int, words: int) -> dict:
    from support.offline_run import launch, metric, tokens

    from kvtier.bench.text import long_prompts
    from kvtier.models.default import ensure_default_model

    model = str(ensure_default_model("float32"))
    prompts = long_prompts(prompts_count, words, seed=77)
    prefix = f"bench-ttft-{os.urandom(4).hex()}"
    tiers = {"disk": {"type": "fs", "root_dir": str(work / "disk"), "capacity_bytes": 8 * 2**30},
             "redis": {"type": "redis", "url": redis.url(), "timeout_s": 10.0},
             "s3": server.tier(prefix, timeout_s=30.0)}

    def spec(tier_list: list[dict] | None, rounds: list[dict], max_tokens: int = 1) -> dict:
        return {"model": model, "prompts": prompts, "rounds": rounds, "max_tokens": max_tokens,
                "kv_cache_memory_bytes": 256 * 2**20, "max_model_len": 2048, "block_size": 128,
                "kv_connector_extra_config": None if tier_list is None else {
                    "cpu_bytes_to_use": 1_500_000_000, "block_size": 256, "secondary_tiers": tier_list}}

    alone = launch(spec(None, [{}, {"reset_prefix_cache": True}]), work)
    expected = tokens(alone)
    # the filling engine's second round: its own host-tier hit (vLLM's prefix cache reset), the
    # issue's reference for a fresh engine's round from S3
    filling = launch(spec([tiers["disk"], tiers["redis"], tiers["s3"]],
                          [{"settle": True}, {"reset_prefix_cache": True, "settle": True}]), work)
    assert tokens(filling) == expected, "the filling engine's outputs differ from vLLM alone's"
    host_hit = statistics.median(r["seconds"] for r in filling["rounds"][1])
    result: dict = {"prompt_tokens": [r["prompt_tokens"] for r in alone["rounds"][0]],
                    "vllm_alone": {"round_medians_s": [round(statistics.median(r["seconds"] for r in rnd), 4)
                                                       for rnd in alone["rounds"]]},
                    "filling_host_hit_median_s": round(host_hit, 4)}
    label = {"disk": "tier=disk", "redis": "tier=remote", "s3": "tier=s3"}
    again = {"reset_prefix_cache": True, "reset_connector": True}
    for name in ("disk", "redis", "s3"):
        fresh = launch(spec([tiers[name]], [{}] if name == "disk" else [{}, again]), work)
        rounds = len(fresh["rounds"])
        served = [metric(fresh, i, "kvtier_hit_tokens", label[name]) for i in range(rounds)]
        result[name] = {
            "round_medians_s": [round(statistics.median(r["seconds"] for r in rnd), 4) for rnd in fresh["rounds"]],
            "served_tokens": [served[0]] + [b - a for a, b in zip(served, served[1:])],
            "bit_exact": all(tokens(fresh, i) == expected for i in range(rounds)),
            "startup_s": round(fresh["startup_seconds"], 1),
        }
    recompute = result["vllm_alone"]["round_medians_s"][0]
    for name in ("disk", "redis", "s3"):
        first = result[name]["round_medians_s"][0]
        result[name]["first_round_vs_disk"] = round(first / result["disk"]["round_medians_s"][0], 2)
        result[name]["first_round_vs_recompute"] = round(first / recompute, 2)
        result[name]["first_round_vs_filling_host_hit"] = round(first / host_hit, 2)
    result["s3_goal"] = {"first_round_vs_filling_host_hit_at_most": 2.0,
                         "met": result["s3"]["first_round_vs_filling_host_hit"] <= 2.0}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=f"{256 * 1024},{4 << 20},{SMOLLM2_256}")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--min-mb", type=float, default=256.0)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--words", type=int, default=1500, help="words per prompt (~1.1 tokens each)")
    parser.add_argument("--no-engines", action="store_true", help="skip the TTFT engines")
    parser.add_argument("--no-throughput", action="store_true", help="skip the throughput cells")
    args = parser.parse_args()

    from support.redis_server import RedisServer
    from support.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedServer

    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-s3-"))
    os.environ.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    server = SeaweedServer(work / "seaweed")
    server.start()
    redis = None
    try:
        out: dict = {"benchmark": "s3", "machine": platform.machine(), "cpus": os.cpu_count(),
                     "load_average_before": os.getloadavg(), "store": "SeaweedFS (weed mini) on 127.0.0.1"}
        if not args.no_throughput:
            out["throughput"] = throughput(server, [int(s) for s in args.sizes.split(",")], args.concurrency,
                                           args.min_mb, args.repeat)
        if not args.no_engines:
            redis = RedisServer(work / "redis")
            out["ttft"] = ttft(server, redis, work, args.prompts, args.words)
        out["load_average_after"] = os.getloadavg()
        print(json.dumps(out))
    finally:
        server.stop()
        if redis is not None:
            redis.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
