"""Soak: a long mixed workload against one real ``kvtier serve``; is every process flat after warm-up?

    python benchmarks/bench_soak.py [--requests 400] [--concurrency 8] [--unique 0.3] [--pool 24]
        [--max-tokens 16] [--warmup 0.2] [--interval 5] [--host-gib 0.25] [--disk-gib 1.0]
        [--kv-cache-mib 128] [--seed 0] [--out DIR]

Prints a human summary, then ONE JSON object (the last line).

One server, started as ``kvtier bench``'s ``kvtier`` mode starts it (:mod:`kvtier.bench.servers`:
vLLM's OpenAI server with the kvtier connector, SmolLM2-135M-Instruct fp32, vLLM KV space
``--kv-cache-mib``), with a host tier of ``--host-gib`` and a disk tier of ``--disk-gib`` on a
scratch folder. Both are smaller than what the workload sends (with the defaults: ~45 host slots
and ~180 disk blocks of 128 tokens, against ~150 blocks of reusable documents plus ~7 new blocks
per unique prompt), so the soak runs host evictions, the cascade to disk, disk -> host promotions
and disk evictions the whole time.

Workload (seeded, deterministic): ``--requests`` completions, ``--concurrency`` in flight, greedy,
``--max-tokens`` output tokens each. A request is, with probability ``--unique``, a fresh document
(never sent before), otherwise one of ``--pool`` documents (drawn uniformly) asked again and
again; documents are ~600-1,000 tokens, each request ends with its own short question.

Sampled every ``--interval`` seconds (and when warm-up ends, when the load ends, and at rest):

- every process of the server's tree (the API server, the EngineCore, any worker; psutil): RSS
  (with its anonymous / file / shared-memory parts from ``/proc/PID/status``), open file
  descriptors, threads;
- kvtier's gauges and counters on the server's ``/metrics`` (``kvtier_tier_used_bytes``,
  ``kvtier_tier_capacity_bytes``, ``kvtier_tier_pinned_blocks``, ``kvtier_hit_tokens_total``, ...);
- the bytes of the ``*.bin`` block files under the disk tier's root (and of ``*.tmp`` files).

Warm-up is the first ``--warmup`` fraction of the requests. At rest: after the load, the server
idles ``--rest-s`` seconds, then answers two tiny prompts (shorter than one block: nothing to
store or load) so that vLLM publishes a fresh sample of kvtier's gauges (an idle server does not
update them), and a last sample is taken. Then the server is stopped with SIGTERM to its main
process, as a service manager does (SIGINT / SIGKILL to the group after ``--stop-grace-s``).

``--mode vllm`` runs the same workload against plain ``vllm serve`` (no connector, no tiers): a
control that tells vLLM's own memory behaviour from kvtier's (the tier verdicts are then null).

Verdicts (each a boolean in the JSON ``verdicts``; the thresholds are in ``thresholds``):

- ``rss_flat``: for every process, RSS at the end of the load minus RSS at the end of warm-up
  <= max(50 MB, 5% of the warm-up RSS), and the least-squares slope of RSS over completed
  requests after warm-up <= 10 MB per 100 requests;
- ``fds_flat`` / ``threads_flat``: for every process, max - min after warm-up <= 16 open file
  descriptors / <= 8 threads (the API server's client sockets come and go with the load);
- ``usage_within_capacity``: host and disk ``kvtier_tier_used_bytes`` never above their
  ``kvtier_tier_capacity_bytes``, and the ``*.bin`` bytes on disk never above the disk capacity;
- ``pinned_zero_at_rest``: ``kvtier_tier_pinned_blocks{tier="host"}`` is 0 at rest;
- ``no_errors``: every request answered.

MB = 10^6 bytes. On the project's 2-core machine the default run took ~37 minutes (2,115 s of load).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from kvtier.bench.client import served_model, stream_completion
from kvtier.bench.driver import RequestResult, run_workload
from kvtier.bench.servers import Server, ServerSettings, launch_spec, make_scratch, start, wait_healthy
from kvtier.bench.text import synthetic_text
from kvtier.bench.workloads import TOKENS_PER_WORD, RequestSpec, Workload, words_for

MB = 1e6
RSS_GROWTH_MB = 50.0
RSS_GROWTH_PCT = 5.0
RSS_SLOPE_MB_PER_100 = 10.0
FDS_SPREAD = 16
THREADS_SPREAD = 8
PROBE_PROMPT = "The soak is over. Say hello:"  # far shorter than one block: nothing stored or loaded

# --- workload ---------------------------------------------------------------------------------


def soak_workload(requests: int, concurrency: int, pool: int, unique_fraction: float, max_tokens: int,
                  seed: int, min_tokens: int = 600, max_tokens_doc: int = 1000) -> Workload:
    """``requests`` requests: a pool of reusable documents drawn uniformly, mixed with fresh ones."""
    rng = random.Random(seed)
    base = seed * 1_000_003

    def document(text_seed: int) -> str:
        words = words_for(rng.randint(min_tokens, max_tokens_doc))
        return synthetic_text(text_seed, words)

    pool_docs = [document(base + 10_000 + index) for index in range(pool)]
    specs, seen = [], set()
    for index in range(requests):
        question = synthetic_text(base + 500_000 + index, rng.randint(6, 12))
        if rng.random() < unique_fraction:
            group, doc, returning = -1, document(base + 2_000_000 + index), False
        else:
            group = rng.randrange(pool)
            doc, returning = pool_docs[group], group in seen
            seen.add(group)
        prompt = f"Document:\n{doc}\n\nQuestion {index}: {question}?\nAnswer:"
        specs.append(RequestSpec(id=f"r{index}", prompt=prompt, max_tokens=max_tokens, group=group, round=0,
                                 returning=returning))
    reusable_words = sum(len(doc.split()) for doc in pool_docs)
    return Workload(name="soak", requests=tuple(specs), concurrency=concurrency,
                    reusable_tokens=int(reusable_words * TOKENS_PER_WORD),
                    params={"requests": requests, "pool": pool, "unique": unique_fraction, "seed": seed,
                            "max_tokens": max_tokens})


# --- sampling ---------------------------------------------------------------------------------

_STATUS_FIELDS = {"RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}


def _status_rss(pid: int) -> dict[str, int]:
    """RSS parts (bytes) from /proc/PID/status."""
    parts: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                key = line.split(":", 1)[0]
                if key in _STATUS_FIELDS:
                    parts[_STATUS_FIELDS[key]] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return parts


def _label(proc: psutil.Process) -> str:
    """A short name: vLLM's process title (``VLLM::EngineCore``...) or the program and module."""
    try:
        cmdline = proc.cmdline()
        name = proc.name()
    except psutil.Error:
        return "?"
    if cmdline and cmdline[0].startswith("VLLM"):
        return cmdline[0].split()[0]
    if any("resource_tracker" in part for part in cmdline):
        return "resource_tracker"
    if name and not name.startswith("python"):
        return name
    if "-m" in cmdline and cmdline.index("-m") + 1 < len(cmdline):
        return " ".join(cmdline[cmdline.index("-m") + 1: cmdline.index("-m") + 3])
    return " ".join(cmdline[:2])[-60:]


def thread_names(pid: int) -> dict[str, int]:
    """How many threads of each name (``/proc/PID/task/*/comm``) the process has."""
    names: dict[str, int] = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return names
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/comm") as comm:
                name = comm.read().strip()
        except OSError:
            continue
        names[name] = names.get(name, 0) + 1
    return names


def sample_processes(leader_pid: int, labels: dict[int, str]) -> list[dict[str, Any]]:
    """One sample of every live process in the leader's tree."""
    try:
        leader = psutil.Process(leader_pid)
        procs = [leader, *leader.children(recursive=True)]
    except psutil.Error:
        return []
    rows = []
    for proc in procs:
        try:
            with proc.oneshot():
                rss, fds, threads = proc.memory_info().rss, proc.num_fds(), proc.num_threads()
        except psutil.Error:
            continue
        if proc.pid not in labels:
            labels[proc.pid] = _label(proc)
        rows.append({"pid": proc.pid, "label": labels[proc.pid], "rss": rss, "fds": fds, "threads": threads,
                     **_status_rss(proc.pid), "thread_names": thread_names(proc.pid)})
    return rows


_SAMPLE_RE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_KEYED = {  # metric -> label that splits it (summed over every other label: engines, models)
    "kvtier_tier_used_bytes": "tier", "kvtier_tier_capacity_bytes": "tier", "kvtier_tier_blocks": "tier",
    "kvtier_tier_pinned_blocks": "tier", "kvtier_hit_tokens_total": "tier", "kvtier_evictions_total": "tier",
    "kvtier_writes_dropped_total": "tier", "kvtier_transfer_bytes_total": "direction",
    "vllm:prompt_tokens_cached_by_source_total": "source",
}


def parse_metrics(text: str) -> dict[str, Any]:
    """kvtier's (and a few of vLLM's) metrics: ``{name: value}`` or ``{name: {label value: value}}``."""
    out: dict[str, Any] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = _SAMPLE_RE.match(line)
        if not match:
            continue
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        if not (name.startswith("kvtier_") or name in _KEYED or name in ("vllm:prompt_tokens_total",)):
            continue
        if name.endswith("_created"):
            continue
        key = _KEYED.get(name)
        if key is None:
            out[name] = out.get(name, 0.0) + value
        else:
            label = dict(_LABEL_RE.findall(labels)).get(key, "?")
            bucket = out.setdefault(name, {})
            bucket[label] = bucket.get(label, 0.0) + value
    return out


def disk_bytes(root: Path) -> dict[str, int]:
    """Bytes and count of ``*.bin`` files (and ``*.tmp`` files) under the disk tier's root."""
    out = {"bin_bytes": 0, "bin_files": 0, "tmp_bytes": 0, "tmp_files": 0}
    for folder, _dirs, files in os.walk(root):
        for name in files:
            kind = "bin" if name.endswith(".bin") else "tmp" if name.endswith(".tmp") else None
            if kind is None:
                continue
            try:
                size = os.stat(os.path.join(folder, name)).st_size
            except OSError:
                continue
            out[f"{kind}_bytes"] += size
            out[f"{kind}_files"] += 1
    return out


@dataclass
class Sample:
    t: float
    completed: int
    phase: str  # "warmup", "load", "rest"
    procs: list[dict[str, Any]]
    metrics: dict[str, Any]
    disk: dict[str, int]


@dataclass
class Sampler:
    server: Server
    disk_root: Path
    interval_s: float
    t0: float = field(default_factory=time.perf_counter)
    samples: list[Sample] = field(default_factory=list)
    labels: dict[int, str] = field(default_factory=dict)
    completed: int = 0
    warmup: int = 0
    load_done: bool = False
    metric_errors: int = 0

    def phase(self) -> str:
        if self.load_done:
            return "rest"
        return "warmup" if self.completed < self.warmup else "load"

    async def take(self, client: httpx.AsyncClient, phase: str | None = None) -> Sample:
        completed, t = self.completed, time.perf_counter() - self.t0
        procs = await asyncio.to_thread(sample_processes, self.server.process.pid, self.labels)
        disk = await asyncio.to_thread(disk_bytes, self.disk_root)
        try:
            response = await client.get(f"{self.server.spec.base_url}/metrics")
            response.raise_for_status()
            metrics = parse_metrics(response.text)
        except httpx.HTTPError:
            self.metric_errors += 1
            metrics = {}
        sample = Sample(t, completed, phase or self.phase(), procs, metrics, disk)
        self.samples.append(sample)
        return sample

    async def run(self, client: httpx.AsyncClient, stop: asyncio.Event, now: asyncio.Event) -> None:
        while not stop.is_set():
            now.clear()
            await self.take(client)
            try:
                await asyncio.wait_for(now.wait(), self.interval_s)
            except TimeoutError:
                pass


# --- analysis ---------------------------------------------------------------------------------


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over xs (None for fewer than 3 points or no spread)."""
    if len(xs) < 3:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def process_report(samples: list[Sample], warmup: int) -> list[dict[str, Any]]:
    """Per process: RSS at end of warm-up / end of load / at rest, growth, slope, fds and threads."""
    by_pid: dict[int, list[tuple[Sample, dict]]] = {}
    for sample in samples:
        for row in sample.procs:
            by_pid.setdefault(row["pid"], []).append((sample, row))
    report = []
    for pid, rows in by_pid.items():
        after = [(s, r) for s, r in rows if s.phase != "warmup" and s.completed >= warmup]
        load = [(s, r) for s, r in after if s.phase == "load"]
        rest = [(s, r) for s, r in after if s.phase == "rest"]
        entry: dict[str, Any] = {"pid": pid, "label": rows[0][1]["label"], "samples": len(rows),
                                 "first_t_s": round(rows[0][0].t, 1), "last_t_s": round(rows[-1][0].t, 1)}
        if not load:
            entry["note"] = "no sample after warm-up"
            report.append(entry)
            continue
        w_row, e_row = load[0][1], load[-1][1]
        warm_rss, end_rss = w_row["rss"] / MB, e_row["rss"] / MB
        growth = end_rss - warm_rss
        fitted = slope([s.completed for s, _ in load], [r["rss"] / MB for _, r in load])
        fitted_anon = slope([s.completed for s, _ in load], [r.get("anon", 0) / MB for _, r in load])
        last = rest[-1][1] if rest else e_row
        names_delta = {name: last["thread_names"].get(name, 0) - w_row["thread_names"].get(name, 0)
                       for name in set(w_row["thread_names"]) | set(last["thread_names"])}
        fds = [r["fds"] for _, r in after]
        threads = [r["threads"] for _, r in after]
        entry.update({
            "rss_warmup_end_mb": round(warm_rss, 1), "rss_end_mb": round(end_rss, 1),
            "rss_rest_mb": round(rest[-1][1]["rss"] / MB, 1) if rest else None,
            "rss_max_mb": round(max(r["rss"] for _, r in rows) / MB, 1),
            "rss_growth_mb": round(growth, 1), "rss_growth_pct": round(100 * growth / warm_rss, 2),
            "rss_slope_mb_per_100_requests": None if fitted is None else round(100 * fitted, 2),
            "anon_warmup_end_mb": round(w_row.get("anon", 0) / MB, 1), "anon_end_mb": round(e_row.get("anon", 0) / MB, 1),
            "anon_slope_mb_per_100_requests": None if fitted_anon is None else round(100 * fitted_anon, 2),
            "shmem_warmup_end_mb": round(w_row.get("shmem", 0) / MB, 1),
            "shmem_end_mb": round(e_row.get("shmem", 0) / MB, 1),
            "fds_min": min(fds), "fds_max": max(fds), "fds_warmup_end": w_row["fds"], "fds_rest": rest[-1][1]["fds"] if rest else None,
            "threads_min": min(threads), "threads_max": max(threads), "threads_warmup_end": w_row["threads"],
            "threads_rest": rest[-1][1]["threads"] if rest else None,
            "thread_names_changed_warmup_end_to_last": {k: v for k, v in sorted(names_delta.items()) if v},
            "post_warmup_samples": len(load),
        })
        bound = max(RSS_GROWTH_MB, RSS_GROWTH_PCT / 100 * warm_rss)
        entry["rss_flat"] = growth <= bound and (fitted is None or 100 * fitted <= RSS_SLOPE_MB_PER_100)
        entry["fds_flat"] = max(fds) - min(fds) <= FDS_SPREAD
        entry["threads_flat"] = max(threads) - min(threads) <= THREADS_SPREAD
        report.append(entry)
    return report


def tier_report(samples: list[Sample], disk_capacity: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tier in ("host", "disk"):
        used = [s.metrics.get("kvtier_tier_used_bytes", {}).get(tier) for s in samples]
        used = [u for u in used if u is not None]
        caps = [s.metrics.get("kvtier_tier_capacity_bytes", {}).get(tier) for s in samples]
        caps = [c for c in caps if c]
        blocks = [s.metrics.get("kvtier_tier_blocks", {}).get(tier) for s in samples]
        blocks = [b for b in blocks if b is not None]
        out[tier] = {
            "used_bytes_max": int(max(used)) if used else None,
            "capacity_bytes": int(max(caps)) if caps else None,
            "blocks_max": int(max(blocks)) if blocks else None,
            "samples_with_metric": len(used),
            "within_capacity": bool(used and caps and max(used) <= min(caps)),
        }
    bins = [s.disk["bin_bytes"] for s in samples]
    out["disk_files"] = {
        "bin_bytes_max": max(bins), "bin_files_max": max(s.disk["bin_files"] for s in samples),
        "tmp_bytes_max": max(s.disk["tmp_bytes"] for s in samples),
        "bin_bytes_rest": samples[-1].disk["bin_bytes"], "capacity_bytes": disk_capacity,
        "within_capacity": max(bins) <= disk_capacity,
    }
    return out


def counters(metrics: dict[str, Any]) -> dict[str, Any]:
    keep = ("kvtier_lookup_tokens_total", "kvtier_hit_tokens_total", "kvtier_stores_total",
            "kvtier_stores_dropped_total", "kvtier_writes_dropped_total", "kvtier_promotions_total",
            "kvtier_promotion_failures_total", "kvtier_load_errors_total", "kvtier_checksum_failures_total",
            "kvtier_evictions_total", "kvtier_lookups_retried_total", "kvtier_transfer_bytes_total",
            "vllm:prompt_tokens_total", "vllm:prompt_tokens_cached_by_source_total")
    def clean(value: Any) -> Any:
        return {k: int(v) for k, v in value.items()} if isinstance(value, dict) else int(value)
    return {name.removesuffix("_total"): clean(metrics[name]) for name in keep if name in metrics}


# --- run --------------------------------------------------------------------------------------


def write_samples(out_dir: Path, samples: list[Sample]) -> None:
    with open(out_dir / "soak_processes.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["t_s", "completed", "phase", "pid", "label", "rss", "anon", "file", "shmem", "fds", "threads"])
        for s in samples:
            for r in s.procs:
                writer.writerow([round(s.t, 2), s.completed, s.phase, r["pid"], r["label"], r["rss"], r.get("anon"),
                                 r.get("file"), r.get("shmem"), r["fds"], r["threads"]])
    with open(out_dir / "soak_samples.json", "w") as handle:
        json.dump([{"t_s": round(s.t, 2), "completed": s.completed, "phase": s.phase, "procs": s.procs,
                    "metrics": s.metrics, "disk": s.disk} for s in samples], handle)


def terminate(server: Server, grace_s: float) -> dict[str, Any]:
    """SIGTERM to the server's main process (as a service manager does); the group is SIGINTed /
    SIGKILLed by :meth:`Server.stop` after ``grace_s`` if it is still there."""
    started = time.perf_counter()
    tree = []
    try:
        tree = [psutil.Process(server.process.pid), *psutil.Process(server.process.pid).children(recursive=True)]
    except psutil.Error:
        pass
    try:
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(timeout=grace_s)
        graceful = True
    except subprocess.TimeoutExpired:
        graceful = False
        code = None
    main_exit_s = time.perf_counter() - started
    _gone, alive = psutil.wait_procs(tree, timeout=max(1.0, grace_s - main_exit_s))
    stop_s = time.perf_counter() - started
    code = server.stop(grace_s=10.0) if code is None or alive else code
    return {"signal": "SIGTERM", "graceful": graceful and not alive, "exit_code": code,
            "main_exit_s": round(main_exit_s, 2), "stop_s": round(stop_s, 2),
            "left_after_grace": [p.pid for p in alive]}


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    from kvtier.models.default import ensure_default_model

    workload = soak_workload(args.requests, args.concurrency, args.pool, args.unique, args.max_tokens, args.seed)
    warmup = math.ceil(args.warmup * args.requests)
    settings = ServerSettings(model=str(ensure_default_model("float32")),
                              kv_cache_memory_bytes=args.kv_cache_mib * 2**20, max_model_len=2048,
                              kv_offloading_size_gib=args.host_gib, disk_size_gib=args.disk_gib, seed=args.seed,
                              block_size=args.block_size or None)
    scratch = make_scratch("soak")
    out_dir = args.out
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    log_path = (out_dir or scratch) / "server.log"
    spec = launch_spec(args.mode, settings, scratch)
    result: dict[str, Any] = {"benchmark": "soak", "mode": args.mode, "summary": spec.summary, "server_log": str(log_path)}
    server = start(spec, log_path)
    try:
        startup_s = await wait_healthy(server, args.startup_timeout_s)
        print(f"server up in {startup_s:.0f} s ({spec.base_url}); log {log_path}", file=sys.stderr)
        async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout_s, connect=30.0)) as client:
            model = await served_model(client, spec.base_url)
            sampler = Sampler(server, scratch / "kvtier-disk", args.interval)
            sampler.warmup = warmup
            stop, now = asyncio.Event(), asyncio.Event()
            sampling = asyncio.create_task(sampler.run(client, stop, now))
            t_start = time.perf_counter()
            errors: list[str] = []

            def on_done(res: RequestResult) -> None:
                sampler.completed += 1
                if res.error:
                    errors.append(f"{res.id}: {res.error}")
                if sampler.completed == warmup:
                    now.set()  # a sample right at the end of warm-up
                if sampler.completed % max(1, args.requests // 20) == 0:
                    print(f"  {sampler.completed}/{args.requests} requests, {time.perf_counter() - t_start:.0f} s,"
                          f" {len(errors)} errors", file=sys.stderr, flush=True)
                if not server.alive():
                    errors.append("server died")

            run = await run_workload(workload, spec.base_url, model, on_done=on_done,
                                     timeout_s=args.request_timeout_s)
            await sampler.take(client, "load")  # the end of the load
            sampler.load_done = True
            stop.set()
            now.set()
            await sampling
            await asyncio.sleep(args.rest_s)
            probes = [await stream_completion(client, spec.base_url, model, PROBE_PROMPT, 1) for _ in range(2)]
            await asyncio.sleep(1.0)
            rest = await sampler.take(client, "rest")
        result["stop"] = await asyncio.to_thread(terminate, server, args.stop_grace_s)
    finally:
        if server.alive():
            server.stop(10.0)
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)

    samples = sampler.samples
    results = run.results
    ok = [r for r in results if r.error is None]
    by_kind = {"reuse": [r for r in ok if r.group >= 0], "unique": [r for r in ok if r.group < 0]}
    procs = process_report(samples, warmup)
    tiers = tier_report(samples, int(args.disk_gib * 2**30))
    pinned_rest = rest.metrics.get("kvtier_tier_pinned_blocks", {}).get("host")
    pinned_seen = [s.metrics.get("kvtier_tier_pinned_blocks", {}).get("host") for s in samples]
    pinned_seen = [p for p in pinned_seen if p is not None]
    error_count = len([r for r in results if r.error]) + sum(1 for p in probes if p.error)
    result.update({
        "requests": args.requests, "concurrency": args.concurrency, "unique_fraction": args.unique, "pool": args.pool,
        "max_tokens": args.max_tokens, "seed": args.seed, "warmup_requests": warmup,
        "host_gib": args.host_gib, "disk_gib": args.disk_gib, "kv_cache_mib": args.kv_cache_mib,
        "block_size": args.block_size or "vLLM default",
        "startup_s": round(startup_s, 1), "load_wall_s": round(run.wall_s, 1),
        "requests_per_s": round(len(results) / run.wall_s, 3),
        "errors": error_count, "error_examples": errors[:5],
        "latency_p50_s": {k: round(statistics.median(r.latency_s for r in v), 2) if v else None for k, v in by_kind.items()},
        "ttft_p50_s": {k: round(statistics.median(r.ttft_s for r in v if r.ttft_s is not None), 2) if v else None
                       for k, v in by_kind.items()},
        "requests_by_kind": {k: len(v) for k, v in by_kind.items()},
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "cached_tokens_usage": sum(r.cached_tokens or 0 for r in ok),
        "samples": len(samples), "interval_s": args.interval, "metric_scrape_errors": sampler.metric_errors,
        "processes": procs, "tiers": tiers, "pinned_host_blocks_rest": pinned_rest,
        "pinned_host_blocks_max_during_load": int(max(pinned_seen)) if pinned_seen else None,
        "counters": counters(rest.metrics),
        "thresholds": {"rss_growth_mb": RSS_GROWTH_MB, "rss_growth_pct": RSS_GROWTH_PCT,
                       "rss_slope_mb_per_100_requests": RSS_SLOPE_MB_PER_100, "fds_spread": FDS_SPREAD,
                       "threads_spread": THREADS_SPREAD,
                       "rule": "rss: end - warm-up end <= max(mb, pct of warm-up RSS) and slope <= bound; "
                               "fds/threads: max - min after warm-up <= spread"},
        "host": platform.node(), "cpus": os.cpu_count(), "load_avg_end": [round(x, 2) for x in os.getloadavg()],
    })
    measured = [p for p in procs if "rss_flat" in p]
    kvtier = args.mode == "kvtier"
    result["verdicts"] = {
        "rss_flat": bool(measured) and all(p["rss_flat"] for p in measured),
        "fds_flat": bool(measured) and all(p["fds_flat"] for p in measured),
        "threads_flat": bool(measured) and all(p["threads_flat"] for p in measured),
        "usage_within_capacity": (tiers["host"]["within_capacity"] and tiers["disk"]["within_capacity"]
                                  and tiers["disk_files"]["within_capacity"]) if kvtier else None,
        "pinned_zero_at_rest": pinned_rest == 0 if kvtier else None,
        "no_errors": error_count == 0,
    }
    result["verdicts"]["all"] = all(v for v in result["verdicts"].values() if v is not None)
    if out_dir:
        write_samples(out_dir, samples)
        (out_dir / "soak_result.json").write_text(json.dumps(result, indent=2))
    return result


def print_summary(result: dict[str, Any]) -> None:
    print(f"soak: {result['requests']} requests (concurrency {result['concurrency']}, "
          f"{result['requests_by_kind']['unique']} unique / {result['requests_by_kind']['reuse']} reuse), "
          f"{result['load_wall_s']:.0f} s, {result['requests_per_s']:.2f} req/s, {result['errors']} errors; "
          f"warm-up {result['warmup_requests']} requests; {result['samples']} samples")
    print(f"{'process':<22} {'pid':>7} {'RSS warm':>9} {'RSS end':>8} {'RSS max':>8} {'growth':>8} {'%':>6} "
          f"{'MB/100r':>8} {'anon w->e':>13} {'fds':>7} {'threads':>7}")
    for p in result["processes"]:
        if "rss_flat" not in p:
            print(f"{p['label'][:22]:<22} {p['pid']:>7}  ({p.get('note')})")
            continue
        print(f"{p['label'][:22]:<22} {p['pid']:>7} {p['rss_warmup_end_mb']:>9.0f} {p['rss_end_mb']:>8.0f} "
              f"{p['rss_max_mb']:>8.0f} {p['rss_growth_mb']:>8.1f} {p['rss_growth_pct']:>6.2f} "
              f"{p['rss_slope_mb_per_100_requests'] if p['rss_slope_mb_per_100_requests'] is not None else '-':>8} "
              f"{p['anon_warmup_end_mb']:>6.0f}->{p['anon_end_mb']:<6.0f} "
              f"{p['fds_min']:>3}-{p['fds_max']:<3} {p['threads_min']:>3}-{p['threads_max']:<3}")
    tiers = result["tiers"]
    for tier in ("host", "disk"):
        t = tiers[tier]
        print(f"{tier} tier: used max {t['used_bytes_max']} of {t['capacity_bytes']} bytes "
              f"({t['blocks_max']} blocks max)")
    d = tiers["disk_files"]
    print(f"disk files: *.bin max {d['bin_bytes_max']} bytes ({d['bin_files_max']} files) of {d['capacity_bytes']}; "
          f"*.tmp max {d['tmp_bytes_max']}")
    print(f"pinned host blocks at rest: {result['pinned_host_blocks_rest']} "
          f"(max during load {result['pinned_host_blocks_max_during_load']})")
    print(f"counters: {json.dumps(result['counters'])}")
    print(f"stop: {json.dumps(result.get('stop'))}")
    print(f"verdicts: {json.dumps(result['verdicts'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--unique", type=float, default=0.3, help="fraction of fresh (never reused) prompts")
    parser.add_argument("--pool", type=int, default=24, help="reusable documents")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--warmup", type=float, default=0.2, help="fraction of the requests that is warm-up")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--host-gib", type=float, default=0.25)
    parser.add_argument("--disk-gib", type=float, default=1.0)
    parser.add_argument("--kv-cache-mib", type=int, default=128, help="vLLM's own KV space")
    parser.add_argument("--block-size", type=int, default=0, help="vLLM --block-size (0: vLLM's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rest-s", type=float, default=10.0, help="idle seconds before the at-rest sample")
    parser.add_argument("--stop-grace-s", type=float, default=60.0)
    parser.add_argument("--startup-timeout-s", type=float, default=900.0)
    parser.add_argument("--request-timeout-s", type=float, default=900.0)
    parser.add_argument("--mode", choices=("kvtier", "vllm"), default="kvtier",
                        help="vllm: the same server without kvtier (a control for the RSS figures)")
    parser.add_argument("--out", type=Path, default=None, help="write samples (CSV, JSON), result and server log here")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (disk tier)")
    args = parser.parse_args()
    result = asyncio.run(soak(args))
    print_summary(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
