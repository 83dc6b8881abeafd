"""Cost of fleet keys: fresh engines served from signed, encrypted and plain records (disk, Redis).

A fresh engine served from Redis and from disk with records signed (MAC) and encrypted
(AES-256-GCM) against plain records, and the per-byte cost of each check beside memcpy. Prints a
table and one JSON object (last line).

Per mode (plain, auth, encrypt), engine A (the embedded default model, one process) computes the
prompts with a disk tier and a throwaway loopback redis-server as its secondary tiers, both under
that mode's settings. Then fresh engine processes, one with only the disk tier and one with only
the Redis tier, serve the same prompts ``--rounds`` times; before every round but the first, vLLM's
prefix cache is emptied, and their host tier (``--host-bytes``) holds fewer prompts' KV than are
sent in turn, so every request's blocks come from that tier and are checked (and decrypted) on
the way in (``cached_fraction`` and ``bytes_read_per_prompt`` show it): one
engine start gives ``prompts x rounds`` tier-hit latencies (its first request, which also warms
the engine up, is left out). Prompts are sent one at a time.

The fresh engines run ``--reps`` times, the modes interleaved (plain, auth, encrypt, plain, ...)
so that load from other processes falls on every mode alike. Each request of auth (encrypt) is
paired with the same request (same round, same prompt, same repetition) of plain; the figure is the
median of those paired ratios, with a 95% interval from a two-level bootstrap (repetitions drawn
with replacement, then requests within each), which counts the spread between engine starts as
well as within one. Goals on this machine: auth <= 1.05x, encrypt <= 1.15x: ``met`` when the
whole interval is within, ``missed`` when all of it is above, else ``not shown``.

Per byte (one thread, one block-sized buffer, best of several passes): memcpy, xxh3, the read and
write paths of each mode as the tiers run them (``throughput_gb_s``), and the candidate MACs on the
read path run as a reader runs them, with their extra nanoseconds per byte over plain records'
xxh3 (``read_paths``: keyed BLAKE3, BLAKE3 with its threads, GMAC, Poly1305): the measurement by
which the MAC was chosen. ``modelled_over_plain`` is what the per-byte rates alone predict.

Tier reads (no engine): a fresh DiskTier / RedisTier of each mode reads the same 16 blocks of
``--block-bytes`` (16 read threads; the disk's files in the page cache, as for the fresh engine),
``--tier-reps`` times with the modes interleaved; the least time per mode is the figure.
``tier_projected_over_plain`` adds each mode's extra read seconds for the bytes a fresh request
loads to plain's median fresh latency.

    python benchmarks/bench_sealing.py [--prompts 8] [--words 1400] [--rounds 3] [--reps 4] [--host-bytes 160000000]
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
from typing import Any

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
    plain_header, _ = PLAIN.seal(namespace=ns, key=block, parent=bytes(32), num_tokens=1, source=source)
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
        "plain_read_copy_and_check": lambda: open_with(PLAIN, plain_header, source),
        "mac_write": lambda: mac.seal(namespace=ns, key=block, parent=bytes(32), num_tokens=1, source=source),
        "mac_read_copy_and_check": lambda: open_with(mac, mac_header, source),
        "aes_gcm_encrypt_write": lambda: aead.seal(namespace=ns, key=block, parent=bytes(32), num_tokens=1,
                                                   source=source),
        "aes_gcm_decrypt_read": lambda: open_with(aead, header, ciphertext),
    }
    return {name: round(nbytes / best_seconds(run, repeats) / 1e9, 2) for name, run in passes.items()}


def best_seconds(run: Any, repeats: int) -> float:
    """The least time of ``repeats`` calls of ``run`` (the one least disturbed by other work)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def read_paths(nbytes: int, repeats: int = 7) -> dict[str, dict[str, float]]:
    """The candidate MACs on the read path, each run as a reader runs it: copy a record's payload
    into the destination piece by piece, checking each piece while it is in cache. GB/s (one
    thread, best of ``repeats``) and the extra nanoseconds per byte over plain records' xxh3."""
    import blake3
    import xxhash
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    source = memoryview(bytearray(os.urandom(nbytes)))
    dest = memoryview(bytearray(nbytes))
    key, nonce = os.urandom(32), os.urandom(12)

    def gmac() -> Any:
        return Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()

    def pieces(step: int, make: Any, feed: str) -> Any:
        def run() -> None:
            state = make()
            for start in range(0, nbytes, step):
                piece = dest[start : start + step]
                piece[:] = source[start : start + step]
                getattr(state, feed)(piece)
        return run

    def blake3_threads() -> None:
        dest[:] = source
        blake3.blake3(dest, key=key, max_threads=blake3.blake3.AUTO).digest()

    mib = 1 << 20
    candidates = {
        "plain_xxh3": pieces(256 * 1024, xxhash.xxh3_64, "update"),
        "keyed_blake3": pieces(mib, lambda: blake3.blake3(key=key), "update"),
        "keyed_blake3_max_threads": blake3_threads,
        "gmac": pieces(mib, gmac, "authenticate_additional_data"),
        "poly1305": pieces(256 * 1024, lambda: Poly1305(key), "update"),
    }
    out: dict[str, dict[str, float]] = {}
    for name, run in candidates.items():
        best = best_seconds(run, repeats)
        out[name] = {"gb_s": round(nbytes / best / 1e9, 2), "seconds": best}
    plain = out["plain_xxh3"]["seconds"]
    for row in out.values():
        row["extra_ns_per_byte"] = round((row.pop("seconds") - plain) / nbytes * 1e9, 4)
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


def spec(model: str, prompts: list[str], max_tokens: int, tiers: list[dict], rounds: int = 1,
         host_bytes: int = 1_000_000_000) -> dict:
    """An engine that serves ``prompts`` ``rounds`` times, vLLM's prefix cache emptied before every
    round but the first. With a host tier (``host_bytes``) smaller than the prompts' KV, sent in
    order each round, the host tier has evicted a prompt's blocks before it comes back, so they
    come from ``tiers`` again. (Not kvtier's reset: it also empties a local disk tier.)"""
    return {"model": model, "prompts": prompts, "rounds": [{}] + [{"reset_prefix_cache": True}] * (rounds - 1),
            "max_tokens": max_tokens, "kv_cache_memory_bytes": 128 * 2**20, "max_model_len": 2048,
            "kv_connector_extra_config": {"cpu_bytes_to_use": host_bytes, "secondary_tiers": tiers}}


def paired_ratios(runs: dict, mode: str, name: str) -> list[list[float]]:
    """Per repetition, the ratio of each request's latency in ``mode`` to the same request's (same
    round, same prompt) in plain, on tier ``name``."""
    return [[m / p for m, p in zip(mine, plain)]
            for mine, plain in zip(runs[(mode, name)], runs[("plain", name)])]


def summarise(ratios: list[list[float]], seed: int = 0, draws: int = 2000) -> dict:
    """Median paired ratio over every request of every repetition, each repetition's median, and
    a 95% interval from a two-level bootstrap (repetitions drawn with replacement, then requests
    within each): it counts the spread between engines, not only within one."""
    import random

    rng = random.Random(seed)
    pooled = [r for rep in ratios for r in rep]
    medians = []
    for _ in range(draws):
        sample = []
        for rep in rng.choices(ratios, k=len(ratios)):
            sample += rng.choices(rep, k=len(rep))
        medians.append(statistics.median(sample))
    medians.sort()
    return {"median": round(statistics.median(pooled), 3),
            "ci95": [round(medians[int(0.025 * draws)], 3), round(medians[int(0.975 * draws) - 1], 3)],
            "per_rep_median": [round(statistics.median(rep), 3) for rep in ratios], "requests": len(pooled)}


def verdict(summary: dict, goal: float) -> str:
    """``met`` when the whole interval is within the goal, ``missed`` when all of it is above,
    else ``not shown`` (the measurement cannot tell)."""
    low, high = summary["ci95"]
    return "met" if high <= goal else "missed" if low > goal else "not shown"


def modelled(fresh: dict, rates: dict) -> dict[str, float]:
    """The ratio the per-byte rates alone predict for each mode and tier (see the module docstring)."""
    read_path = {"plain": rates["plain_read_copy_and_check"], "auth": rates["mac_read_copy_and_check"],
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
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--words", type=int, default=1400, help="words per prompt (~1.08 tokens each)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="times each fresh engine serves the prompts (every request a tier hit)")
    parser.add_argument("--host-bytes", type=int, default=160_000_000,
                        help="fresh engines' host tier: under the prompts' KV, so every round reads the tier")
    parser.add_argument("--max-tokens", type=int, default=1, help="output tokens per request (1 = TTFT)")
    parser.add_argument("--block-bytes", type=int, default=5_898_240,
                        help="buffer of the throughput passes (the default model's 256-token block: 5.9 MB)")
    parser.add_argument("--skip-engines", action="store_true", help="only the throughput passes")
    parser.add_argument("--reps", type=int, default=4, help="fresh engines per mode and tier (interleaved)")
    parser.add_argument("--tier-reps", type=int, default=7, help="tier-level reads per mode and tier (interleaved)")
    args = parser.parse_args()
    os.environ["KVTIER_BENCH_KEY"] = os.urandom(32).hex()  # the engines inherit it; never printed
    began = time.monotonic()
    load = [round(os.getloadavg()[0], 2)]
    rates = throughput(args.block_bytes)
    print("throughput, GB/s (one thread, %d-byte buffer): %s" % (args.block_bytes, rates))
    paths = read_paths(args.block_bytes)
    print(f"read-path candidates (copy + check), GB/s and ns per byte over plain: {paths}")
    fresh: dict[str, dict[str, dict]] = {}
    writers: dict[str, float] = {}
    tiers_read: dict[str, dict] = {}
    runs: dict[tuple[str, str], list[list[float]]] = {}
    if not args.skip_engines:
        from kvtier.bench.redis_server import LocalRedis

        model = str(ensure_default_model("float32"))
        prompts = long_prompts(args.prompts, args.words, seed=7)
        with tempfile.TemporaryDirectory(prefix="kvtier-bench-sealing-") as tmp:
            redis = LocalRedis.start(Path(tmp) / "redis", maxmemory_bytes=8 * 2**30)
            try:
                tiers_read = tier_reads(args.block_bytes, args.tier_reps, redis.url, tmp)
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
                for rep in range(args.reps):
                    for name in ("disk", "redis"):
                        for mode in MODES:
                            result = run_engine(spec(model, prompts, args.max_tokens, [tiers[mode][name]],
                                                     args.rounds, args.host_bytes), tmp, f"b-{mode}-{name}-{rep}",
                                                False)
                            rows = [r for rnd in result["rounds"] for r in rnd]
                            # the engine's first request also warms it up (first forward pass): left out
                            runs.setdefault((mode, name), []).append([r["seconds"] for r in rows[1:]])
                            row = fresh.setdefault(mode, {}).setdefault(name, {"outputs_equal": True})
                            row["outputs_equal"] &= all([r["token_ids"] for r in rnd] == reference
                                                        for rnd in result["rounds"])
                            row["cached_fraction"] = round(sum(r["num_cached_tokens"] for r in rows)
                                                           / sum(r["prompt_tokens"] for r in rows), 3)
                            # counters: the last round's figures are the engine's totals
                            moved = sum(v for k, v in result["round_metrics"][-1].items()
                                        if k.startswith("kvtier_transfer_bytes_total")
                                        and ("disk_to_host" in k or "remote_to_host" in k))
                            row["bytes_read_per_prompt"] = int(moved / len(rows))
                            print(f"rep {rep} {name} {mode}: median {statistics.median(runs[(mode, name)][-1]):.4f} s, "
                                  f"cached {row['cached_fraction']:.1%}, {moved / len(rows) / 1e6:.1f} MB read "
                                  "per request", flush=True)
                for (mode, name), seconds in runs.items():
                    fresh[mode][name].update(
                        seconds_median=round(statistics.median(s for rep in seconds for s in rep), 4),
                        per_rep_median=[round(statistics.median(rep), 4) for rep in seconds],
                        seconds_per_request=[[round(x, 4) for x in rep] for rep in seconds],
                        writer_seconds_median=round(writers[mode], 4))
            finally:
                redis.stop()
    ratios = {f"{mode}_{name}": summarise(paired_ratios(runs, mode, name))
              for mode in ("auth", "encrypt") for name in ("disk", "redis") if (mode, name) in runs}
    if fresh:
        print(f"{'mode':>8} {'tier':>6} {'fresh s':>8} {'cached':>7} {'/plain':>7} {'95% interval':>14} {'equal':>6}")
        for mode, tiers in fresh.items():
            for name, row in tiers.items():
                r = ratios.get(f"{mode}_{name}", {"median": 1.0, "ci95": [1.0, 1.0]})
                print(f"{mode:>8} {name:>6} {row['seconds_median']:>8.3f} {row['cached_fraction']:>7.1%} "
                      f"{r['median']:>7.3f} {str(r['ci95']):>14} {str(row['outputs_equal']):>6}")
    projected = {}
    for mode in ("auth", "encrypt"):
        for name in ("disk", "redis"):
            if fresh and tiers_read:
                per_byte = (tiers_read[name][mode] - tiers_read[name]["plain"]) / (16 * args.block_bytes)
                extra = per_byte * fresh["plain"][name]["bytes_read_per_prompt"]
                projected[f"{mode}_{name}"] = round(1 + extra / fresh["plain"][name]["seconds_median"], 3)
    load.append(round(os.getloadavg()[0], 2))
    print(f"load average (1 min) at start and end: {load} on {os.cpu_count()} CPUs; "
          f"{time.monotonic() - began:.0f} s in all")
    print(json.dumps({
        "benchmark": "fleet_key_cost", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "throughput_gb_s": rates, "read_paths": paths, "block_bytes": args.block_bytes,
        "prompts": args.prompts, "words": args.words, "rounds": args.rounds, "max_tokens": args.max_tokens,
        "reps": args.reps, "load_average": load, "cpus": os.cpu_count(),
        "seconds": round(time.monotonic() - began), "fresh": fresh,
        "fresh_over_plain": ratios, "modelled_over_plain": modelled(fresh, rates) if fresh else {},
        "tier_reads_seconds": tiers_read, "tier_projected_over_plain": projected,
        "goals": GOALS,
        "goals_met": {k: verdict(v, GOALS[k.split("_")[0]]) for k, v in ratios.items()},
    }))


if __name__ == "__main__":
    main()
