"""Cost of fleet keys: a fresh engine served from Redis and from disk with records signed (MAC) and
encrypted (AES-256-GCM) against plain records, and the per-byte throughput of each check beside
memcpy. Prints a table and one JSON object (last line).

Per mode (plain, auth, encrypt), engine A (the embedded default model, one process) computes the
prompts with a disk tier and a throwaway loopback redis-server as its secondary tiers, both under
that mode's settings; then two fresh engine processes send the same prompts, one with only the
disk tier and one with only the Redis tier: their host tier is empty, so every block comes from
that tier and is checked (and decrypted) on the way in. The figure per engine is the median
per-prompt latency (prompts one at a time). The fresh engines run ``--reps`` times, the modes
interleaved (plain, auth, encrypt, plain, ...) so that load from other processes on a shared
machine falls on every mode alike; a mode's figure is the median over its repetitions, and the
ratios divide each mode's by plain's on the same tier. Goals on this machine: auth <= 1.05x,
encrypt <= 1.15x. The load average at start and end is printed: on a machine shared with other
work the engine figures are noisy, the per-byte ones below are not; ``modelled_over_plain`` is
what the per-byte rates alone predict (bytes read per prompt x the extra seconds per byte of the
mode's read path, over plain's fresh latency).

Throughput (one thread, one block-sized buffer, best of several passes): memcpy, xxh3 (plain
records' checksum), keyed BLAKE3 (the MAC), AES-256-GCM encryption (a write) and decryption into
the destination (a read), in GB/s.

Tier reads (no engine): a fresh DiskTier / RedisTier of each mode reads the same 16 blocks of
``--block-bytes`` (16 read threads; the disk's files in the page cache, as for the fresh engine),
``--tier-reps`` times with the modes interleaved; the least time per mode is the figure (the one
least disturbed by other work). ``tier_projected_over_plain`` adds each mode's extra read seconds
for the bytes a fresh prompt loads to plain's fastest fresh-engine latency: the engine ratio the
tier measurement predicts.

    python benchmarks/bench_sealing.py [--prompts 6] [--words 1400] [--max-tokens 1] [--reps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import run_engine  # noqa: E402  (the same engine runner as bench_e2e.py)

from kvtier.bench.text import long_prompts  # noqa: E402
from kvtier.core.fleet_key import AuthConfig, FleetKey  # noqa: E402
from kvtier.models.default import ensure_default_model  # noqa: E402
from kvtier.tiers.blockfile import decode_header  # noqa: E402
from kvtier.tiers.sealing import PLAIN, Sealer  # noqa: E402

MODES = {"plain": {}, "auth": {"auth_key_env": "KVTIER_BENCH_KEY"},
         "encrypt": {"auth_key_env": "KVTIER_BENCH_KEY", "encrypt": True}}
GOALS = {"auth": 1.05, "encrypt": 1.15}


def throughput(nbytes: int, repeats: int = 7) -> dict[str, float]:
    """GB/s of each pass over one ``nbytes`` buffer (best of ``repeats``)."""
    import xxhash

    source = memoryview(bytearray(os.urandom(nbytes)))
    dest = memoryview(bytearray(nbytes))
    key = FleetKey(os.urandom(32), "bench")
    mac, aead = Sealer(AuthConfig(key)), Sealer(AuthConfig(key, encrypt=True))
    ns, block = os.urandom(32), os.urandom(32)
    header, ciphertext = aead.seal(namespace=ns, key=block, parent=bytes(32), num_tokens=1, source=source)
    mac_header, _ = mac.seal(namespace=ns, key=block, parent=bytes(32), num_tokens=1, source=source)

    def copy() -> None:
        dest[:] = source

    def open_with(sealer: Sealer, raw: bytes, body: memoryview) -> None:
        opener = sealer.opener(decode_header(raw), raw)
        opener.land(body, dest)
        opener.finish()

    passes = {
        "memcpy": copy,
        "xxh3_checksum": lambda: xxhash.xxh3_64_intdigest(source),
        "plain_read_copy_and_check": lambda: open_with(PLAIN, PLAIN.seal(namespace=ns, key=block, parent=bytes(32),
                                                                        num_tokens=1, source=source)[0], source),
        "blake3_mac_write": lambda: mac.seal(namespace=ns, key=block, parent=bytes(32), num_tokens=1, source=source),
        "blake3_mac_read_copy_and_check": lambda: open_with(mac, mac_header, source),
        "aes_gcm_encrypt_write": lambda: aead.seal(namespace=ns, key=block, parent=bytes(32), num_tokens=1,
                                                   source=source),
        "aes_gcm_decrypt_read": lambda: open_with(aead, header, ciphertext),
    }
    out = {}
    for name, run in passes.items():
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
        out[name] = round(nbytes / best / 1e9, 2)
    return out


def tier_reads(block_bytes: int, reps: int, redis_url: str, tmp: str, blocks: int = 16) -> dict[str, dict]:
    """Least seconds for a fresh tier of each mode to read ``blocks`` blocks (see the module docstring)."""
    from kvtier.core.fleet_key import FleetKey
    from kvtier.core.tier_config import RedisTierConfig
    from kvtier.tiers.disk import DiskTier
    from kvtier.tiers.redis import RedisTier

    key = FleetKey(os.urandom(32), "bench")
    auths = {"plain": None, "auth": AuthConfig(key), "encrypt": AuthConfig(key, encrypt=True)}
    engine, rank = os.urandom(32), os.urandom(32)
    keys = [os.urandom(32) for _ in range(blocks)]
    payload = memoryview(bytearray(os.urandom(block_bytes)))
    dests = [memoryview(bytearray(block_bytes)) for _ in range(blocks)]

    def disk(mode: str) -> DiskTier:
        return DiskTier(root_dir=os.path.join(tmp, f"tier-{mode}"), model_name="bench", engine_digest=engine,
                        rank_digests=[rank], namespace_json="{}", payload_bytes=block_bytes,
                        capacity_bytes=4 * blocks * block_bytes, n_read_threads=16, n_write_threads=4,
                        max_pending_writes=64, sealer=Sealer(auths[mode]))

    def remote(mode: str) -> RedisTier:
        return RedisTier(RedisTierConfig(url=redis_url, key_prefix=f"tier-{mode}", auth=auths[mode]),
                         engine_digest=engine, rank_digests=[rank], namespace_json="{}", payload_bytes=block_bytes)

    def drain(tier, n: int) -> list:
        done: list = []
        while len(done) < n:
            done += tier.poll()
            time.sleep(0.0005)
        return done

    makers = {"disk": disk, "redis": remote}
    for name, make in makers.items():
        for mode in auths:
            tier = make(mode)
            for job, k in enumerate(keys):
                assert tier.submit_write(job, k, bytes(32), 256, [payload])
            assert all(r.ok for r in drain(tier, blocks)), f"{name}/{mode}: writes failed"
            tier.close()
    best: dict[str, dict[str, float]] = {name: {} for name in makers}
    for _ in range(reps):
        for name, make in makers.items():
            for mode in auths:
                tier = make(mode)
                if name == "redis":
                    tier.probe(keys)
                    deadline = time.monotonic() + 10
                    while any(tier.presence(k).value != "present" for k in keys) and time.monotonic() < deadline:
                        tier.poll()
                        time.sleep(0.001)
                start = time.perf_counter()
                for job, (k, dest) in enumerate(zip(keys, dests)):
                    tier.submit_read(job, k, [dest])
                results = drain(tier, blocks)
                seconds = time.perf_counter() - start
                tier.close()
                assert all(r.ok for r in results), f"{name}/{mode}: reads failed"
                assert bytes(dests[0]) == bytes(payload)
                best[name][mode] = min(best[name].get(mode, float("inf")), seconds)
    return {name: {mode: round(s, 4) for mode, s in modes.items()} for name, modes in best.items()}


def spec(model: str, prompts: list[str], max_tokens: int, tiers: list[dict]) -> dict:
    return {"model": model, "prompts": prompts, "rounds": [{}], "max_tokens": max_tokens,
            "kv_cache_memory_bytes": 128 * 2**20, "max_model_len": 2048,
            "kv_connector_extra_config": {"cpu_bytes_to_use": 1_000_000_000, "secondary_tiers": tiers}}


def modelled(fresh: dict, rates: dict) -> dict[str, float]:
    """The ratio the per-byte rates alone predict for each mode and tier (see the module docstring)."""
    read_path = {"plain": rates["plain_read_copy_and_check"], "auth": rates["blake3_mac_read_copy_and_check"],
                 "encrypt": rates["aes_gcm_decrypt_read"]}
    out = {}
    for mode in ("auth", "encrypt"):
        for name, row in fresh.get(mode, {}).items():
            loaded = row["bytes_read_per_prompt"]
            extra = loaded / 1e9 * (1 / read_path[mode] - 1 / read_path["plain"])
            out[f"{mode}_{name}"] = round(1 + extra / fresh["plain"][name]["seconds_median"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--words", type=int, default=1400, help="words per prompt (~1.08 tokens each)")
    parser.add_argument("--max-tokens", type=int, default=1, help="output tokens per request (1 = TTFT)")
    parser.add_argument("--block-bytes", type=int, default=5_898_240,
                        help="buffer of the throughput passes (the default model's 256-token block: 5.9 MB)")
    parser.add_argument("--skip-engines", action="store_true", help="only the throughput passes")
    parser.add_argument("--reps", type=int, default=2, help="fresh engines per mode and tier (interleaved)")
    parser.add_argument("--tier-reps", type=int, default=7, help="tier-level reads per mode and tier (interleaved)")
    args = parser.parse_args()
    os.environ["KVTIER_BENCH_KEY"] = os.urandom(32).hex()  # the engines inherit it; never printed
    rates = throughput(args.block_bytes)
    print("throughput, GB/s (one thread, %d-byte buffer): %s" % (args.block_bytes, rates))
    parser_tier_reps = args.tier_reps
    fresh: dict[str, dict[str, dict]] = {}
    writers: dict[str, float] = {}
    tiers_read: dict[str, dict] = {}
    load = [round(os.getloadavg()[0], 2)]
    if not args.skip_engines:
        from kvtier.bench.redis_server import LocalRedis

        model = str(ensure_default_model("float32"))
        prompts = long_prompts(args.prompts, args.words, seed=7)
        with tempfile.TemporaryDirectory(prefix="kvtier-bench-sealing-") as tmp:
            redis = LocalRedis.start(Path(tmp) / "redis", maxmemory_bytes=8 * 2**30)
            try:
                tiers_read = tier_reads(args.block_bytes, parser_tier_reps, redis.url, tmp)
                print(f"tier reads, least seconds for 16 blocks of {args.block_bytes} bytes: {tiers_read}")
                reference = None
                tiers: dict[str, dict[str, dict]] = {}
                for mode, keys in MODES.items():
                    disk = {"type": "fs", "root_dir": os.path.join(tmp, f"kv-{mode}"),
                            "capacity_bytes": 20 * 2**30, **keys}
                    remote = {"type": "redis", "url": redis.url, "key_prefix": f"kvt-{mode}", **keys}
                    tiers[mode] = {"disk": disk, "redis": remote}
                    writer = run_engine(spec(model, prompts, args.max_tokens, [disk, remote]), tmp, f"a-{mode}", False)
                    reference = reference or [r["token_ids"] for r in writer["rounds"][0]]
                    writers[mode] = statistics.median(r["seconds"] for r in writer["rounds"][0])
                time.sleep(2)  # the writers' last stores land before they exit; let Redis settle
                runs: dict[tuple[str, str], list[float]] = {}
                for rep in range(args.reps):
                    for name in ("disk", "redis"):
                        for mode in MODES:
                            result = run_engine(spec(model, prompts, args.max_tokens, [tiers[mode][name]]), tmp,
                                                f"b-{mode}-{name}-{rep}", False)
                            rows = result["rounds"][0]
                            runs.setdefault((mode, name), []).append(statistics.median(r["seconds"] for r in rows))
                            row = fresh.setdefault(mode, {}).setdefault(name, {"outputs_equal": True})
                            row["outputs_equal"] &= [r["token_ids"] for r in rows] == reference
                            row["cached_fraction"] = round(sum(r["num_cached_tokens"] for r in rows)
                                                           / sum(r["prompt_tokens"] for r in rows), 3)
                            moved = sum(v for k, v in result["round_metrics"][0].items()
                                        if k.startswith("kvtier_transfer_bytes_total")
                                        and ("disk_to_host" in k or "remote_to_host" in k))
                            row["bytes_read_per_prompt"] = int(moved / len(rows))
                for (mode, name), seconds in runs.items():
                    fresh[mode][name].update(seconds_median=round(statistics.median(seconds), 4),
                                             seconds_min=round(min(seconds), 4),
                                             seconds_runs=[round(x, 4) for x in seconds],
                                             writer_seconds_median=round(writers[mode], 4))
            finally:
                redis.stop()
    ratios = {}
    for mode in ("auth", "encrypt"):
        for name in ("disk", "redis"):
            if mode in fresh:
                ratio = fresh[mode][name]["seconds_median"] / fresh["plain"][name]["seconds_median"]
                ratios[f"{mode}_{name}"] = round(ratio, 3)
    if fresh:
        print(f"{'mode':>8} {'tier':>6} {'fresh s':>8} {'cached':>7} {'/plain':>7} {'equal':>6}")
        for mode, tiers in fresh.items():
            for name, row in tiers.items():
                ratio = ratios.get(f"{mode}_{name}", 1.0)
                print(f"{mode:>8} {name:>6} {row['seconds_median']:>8.3f} {row['cached_fraction']:>7.1%} "
                      f"{ratio:>7.3f} {str(row['outputs_equal']):>6}")
    projected = {}
    for mode in ("auth", "encrypt"):
        for name in ("disk", "redis"):
            if fresh and tiers_read:
                per_byte = (tiers_read[name][mode] - tiers_read[name]["plain"]) / (16 * args.block_bytes)
                extra = per_byte * fresh["plain"][name]["bytes_read_per_prompt"]
                # over plain's FASTEST fresh run: the least disturbed, and the larger ratio
                projected[f"{mode}_{name}"] = round(1 + extra / fresh["plain"][name]["seconds_min"], 3)
    load.append(round(os.getloadavg()[0], 2))
    print(f"load average (1 min) at start and end: {load} on {os.cpu_count()} CPUs")
    print(json.dumps({
        "benchmark": "fleet_key_cost", "throughput_gb_s": rates, "block_bytes": args.block_bytes,
        "prompts": args.prompts, "words": args.words, "max_tokens": args.max_tokens, "reps": args.reps,
        "load_average": load, "cpus": os.cpu_count(), "fresh": fresh,
        "fresh_over_plain": ratios, "modelled_over_plain": modelled(fresh, rates) if fresh else {},
        "tier_reads_seconds": tiers_read, "tier_projected_over_plain": projected,
        "goals": GOALS,
        "goals_met": {k: v <= GOALS[k.split("_")[0]] for k, v in ratios.items()},
        "goals_met_projected": {k: v <= GOALS[k.split("_")[0]] for k, v in projected.items()},
    }))


if __name__ == "__main__":
    main()
