"""The body of ``kvtier bench``: turn the flags into a workload and server settings, run the
modes, then write results.json and bench.png, print the table and the one-line summary."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from kvtier.bench import workloads
from kvtier.bench.servers import MODES, NODE_MODE, ServerSettings


def parse_modes(text: str) -> list[str]:
    """``"vllm,kvtier"`` -> ``["vllm", "kvtier"]``, checked, duplicates refused."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise click.BadParameter(f"unknown mode(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(MODES)}",
                                 param_hint="--modes")
    if len(set(modes)) != len(modes):
        raise click.BadParameter("a mode is listed twice", param_hint="--modes")
    return modes


def check_node_flag(node: str | None, modes: list[str]) -> None:
    """``--node`` is for the kvtier-node mode only."""
    if node is not None and NODE_MODE not in modes:
        raise click.BadParameter(f"only the {NODE_MODE} mode attaches to a kvtier node: add it to --modes "
                                 "or drop --node", param_hint="--node")


DEFAULT_CONCURRENCY = {"multi-turn": 1, "prefix-repetition": 2, "unique": 2}
"""--concurrency when not given: chat turns one conversation at a time (on a 2-core machine a second
conversation's prefill would dominate every TTFT), the others two requests at a time."""


def parse_kv_config(text: str | None) -> dict[str, Any] | None:
    """``--kv-config``: a JSON object of kvtier keys (validated with the server's config later)."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--kv-config") from None
    if not isinstance(value, dict):
        raise click.BadParameter("must be a JSON object like '{\"offload_prompt_only\": true}'",
                                 param_hint="--kv-config")
    return value


def make_workload(opts: dict[str, Any]) -> workloads.Workload:
    """The workload the flags describe."""
    concurrency = opts["concurrency"] or DEFAULT_CONCURRENCY[opts["workload"]]
    common = dict(output_tokens=opts["output_tokens"], concurrency=concurrency, seed=opts["seed"])
    if opts["workload"] == "prefix-repetition":
        return workloads.prefix_repetition(num_prefixes=opts["prefixes"], prefix_tokens=opts["prefix_tokens"],
                                           suffix_tokens=opts["suffix_tokens"], num_prompts=opts["prompts"], **common)
    if opts["workload"] == "multi-turn":
        return workloads.multi_turn(sessions=opts["sessions"], turns=opts["turns"], context_tokens=opts["context_tokens"],
                                    message_tokens=opts["message_tokens"], **common)
    return workloads.unique(num_prompts=opts["prompts"], prompt_tokens=opts["prefix_tokens"] + opts["suffix_tokens"],
                            **common)


def footprint_notes(workload: workloads.Workload, opts: dict[str, Any]) -> list[str]:
    """Does the workload's reusable footprint exceed vLLM's KV space (>= 2x) and fit kvtier's tiers?"""
    if workload.reusable_tokens == 0:
        return [f"workload {workload.name}: no reuse"]
    footprint = workload.footprint_bytes(opts["kv_bytes_per_token"])
    vllm_kv = opts["kv_cache_memory_bytes"]
    tiers = (opts["kv_offloading_size"] + opts["disk_size"]) * 2**30
    notes = [f"reusable prefixes: ~{workload.reusable_tokens:,} tokens = {footprint / 2**20:,.0f} MiB of KV "
             f"= {footprint / vllm_kv:.1f}x vLLM's KV space ({vllm_kv / 2**20:,.0f} MiB)"]
    if footprint < 2 * vllm_kv:
        notes.append("note: below 2x vLLM's KV space, vLLM's own prefix cache may keep much of it")
    if footprint > tiers:
        notes.append("note: larger than kvtier's host + disk tiers")
    return notes


def _settings_json(settings: ServerSettings | None, opts: dict[str, Any]) -> dict[str, Any]:
    data = dict(settings.__dict__) if settings else {}
    data.update({k: opts[k] for k in ("kv_cache_memory_bytes", "max_model_len", "base_url")})
    data["extra_vllm_args"] = list(data.get("extra_vllm_args", ()))
    return data


def run_command(opts: dict[str, Any]) -> int:
    """Run ``kvtier bench``; returns the exit code (0, or 1 if a mode failed or outputs differ)."""
    from kvtier.bench.plot import write_figure
    from kvtier.bench.progress import Progress
    from kvtier.bench.report import build_results, comparison_table, summary, verdict_lines, write_json
    from kvtier.bench.runner import RunOptions, run_bench

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
    base_url = opts["base_url"]
    modes = ["external"] if base_url else parse_modes(opts["modes"])
    check_node_flag(opts.get("node"), modes)
    try:
        workload = make_workload(opts)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    out_dir = Path(opts["out_dir"] or Path("bench-results") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)  # --out was checked; a refusal only creating shows (/proc)
    except OSError as exc:
        raise click.BadParameter(f"{out_dir} cannot be created: {exc.strerror or exc}", param_hint="'--out'") from None

    settings = None
    if not base_url:
        model = opts["model"]
        if model is None:
            from kvtier.models.default import DefaultModelError, ensure_default_model

            console.print("preparing the embedded model (SmolLM2-135M-Instruct, float32) ...")
            try:
                model = str(ensure_default_model("float32"))
            except DefaultModelError as exc:
                raise click.ClickException(str(exc)) from None
        settings = ServerSettings(
            model=model, kv_cache_memory_bytes=opts["kv_cache_memory_bytes"], max_model_len=opts["max_model_len"],
            kv_offloading_size_gib=opts["kv_offloading_size"], disk_size_gib=opts["disk_size"], seed=opts["seed"],
            block_size=opts["block_size"] or None, redis_size_gib=opts["redis_size"],
            kv_config=parse_kv_config(opts.get("kv_config")),
        )
    console.print(f"kvtier bench: workload {workload.name}, {len(workload.requests)} requests, "
                  f"concurrency {workload.concurrency}; modes {', '.join(modes)}; output {out_dir}")
    for note in footprint_notes(workload, opts):
        console.print(f"  {note}")

    options = RunOptions(startup_timeout_s=opts["startup_timeout"], request_timeout_s=opts["request_timeout"])
    runs, wall = asyncio.run(run_bench(workload, modes, settings, out_dir, Progress(console), options, base_url,
                                            node=opts.get("node")))

    results = build_results(workload, runs, wall, _settings_json(settings, opts),
                            opts["kv_bytes_per_token"], command=list(sys.argv))
    results_path = out_dir / "results.json"
    figure_path = write_figure(out_dir / "bench.png", results)
    results["figure"] = str(figure_path) if figure_path else None
    write_json(results_path, results)

    console.print()
    console.print(comparison_table(results))
    for line in verdict_lines(results):
        console.print(line, markup=False)
    for name, mode in results["modes"].items():
        if mode["error"]:
            console.print(f"{name} failed: {mode['error']}", markup=False)
    if opts.get("save_trace"):
        from kvtier.bench.trace import trace_mode, write_trace

        mode = trace_mode(runs)
        if mode is None:
            console.print(f"--save-trace {opts['save_trace']}: no mode finished with the prompts' token ids; "
                          "no trace written", markup=False)
        else:
            count = write_trace(Path(opts["save_trace"]), mode)
            console.print(f"trace: {count} requests of the {mode.mode} mode in {opts['save_trace']}", markup=False)
    console.print(f"wall time {wall:.0f} s; results: {results_path}; figure: {figure_path}", markup=False)
    console.file.flush()
    click.echo(json.dumps(summary(results, results_path, figure_path), separators=(",", ":")))
    failed = any(m["error"] for m in results["modes"].values())
    return 1 if failed or results["outputs"]["identical"] is False else 0
