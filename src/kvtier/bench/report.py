"""Benchmark results: the full ``results.json`` document, the comparison table (rich) and the
one-line JSON summary that ends the command's output."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from kvtier.bench.metrics import CACHE_SOURCES, DIRECTIONS
from kvtier.bench.runner import ModeRun
from kvtier.bench.servers import FLOOR_MODE
from kvtier.bench.stats import compare_outputs, goals, mode_stats
from kvtier.bench.workloads import Workload

FORMAT_VERSION = 1


def machine() -> dict[str, Any]:
    """Where the numbers were measured."""
    info: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    try:
        info["load_average"] = os.getloadavg()
    except OSError:
        pass
    return info


def build_results(workload: Workload, runs: Sequence[ModeRun], wall_s: float, settings: dict[str, Any],
                  kv_bytes_per_token: int | None, command: list[str] | None = None) -> dict[str, Any]:
    """Everything measured, as plain JSON data."""
    finished = {m.mode: m for m in runs if m.run is not None}
    per_mode = {name: mode_stats(m.run.results, m.run.wall_s) for name, m in finished.items()}
    # The floor mode runs another block size: a timing reference, its outputs are not compared.
    check = compare_outputs({name: m.run.results for name, m in finished.items() if name != FLOOR_MODE})
    workload_json = workload.to_json()
    kv_bytes = settings.get("kv_cache_memory_bytes")
    if kv_bytes_per_token:
        footprint = workload.footprint_bytes(kv_bytes_per_token)
        workload_json["footprint"] = {
            "kv_bytes_per_token": kv_bytes_per_token, "reusable_bytes": footprint,
            "vllm_kv_bytes": kv_bytes, "ratio_to_vllm_kv": footprint / kv_bytes if kv_bytes else None,
        }
    modes: dict[str, Any] = {}
    for m in runs:
        modes[m.mode] = {
            "description": m.description, "base_url": m.base_url, "model": m.model, "server_log": m.log_path,
            "startup_s": m.startup_s, "error": m.error, "stats": per_mode.get(m.mode),
            "cache": m.cache.to_json() if m.cache else None,
            "requests": [r.to_json() for r in m.run.results] if m.run else [],
            **({"extra": m.extra} if m.extra else {}),
        }
    return {
        "format": FORMAT_VERSION, "command": command, "machine": machine(), "wall_s": wall_s,
        "settings": settings, "workload": workload_json, "modes": modes, "outputs": check.to_json(),
        "goals": goals(workload.name, per_mode, check.identical),
    }


def write_json(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, sort_keys=False) + "\n")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f} ms"


def _num(value: float | None, fmt: str = "{:,.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def _tokens(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def comparison_table(results: dict[str, Any]) -> Table:
    """Rows = measures, columns = modes."""
    modes = results["modes"]
    title = (f"kvtier bench: {results['workload']['name']} "
             f"({results['workload']['num_requests']} requests, concurrency {results['workload']['concurrency']})")
    table = Table(title=title, min_width=len(title) + 4)
    table.add_column("measure")
    for name in modes:
        table.add_column(name, justify="right")

    def row(label: str, cell) -> None:
        table.add_row(label, *(cell(m) if m["stats"] else ("failed" if m["error"] else "-") for m in modes.values()))

    row("TTFT p50", lambda m: _ms(m["stats"]["ttft_p50_s"]))
    row("TTFT p90", lambda m: _ms(m["stats"]["ttft_p90_s"]))
    row("TTFT p99", lambda m: _ms(m["stats"]["ttft_p99_s"]))
    row("TTFT p50, first uses", lambda m: _ms(m["stats"]["ttft_first_use_p50_s"]))
    row("TTFT p50, returning", lambda m: _ms(m["stats"]["ttft_returning_p50_s"]))
    row("latency p50", lambda m: _ms(m["stats"]["latency_p50_s"]))
    row("requests/s", lambda m: _num(m["stats"]["requests_per_s"], "{:,.3f}"))
    row("output tokens/s", lambda m: _num(m["stats"]["output_tokens_per_s"]))
    row("errors", lambda m: str(m["stats"]["errors"]))
    row("prompt tokens", lambda m: _tokens(m["cache"]["prompt_tokens"] if m["cache"] else None))
    row("  computed", lambda m: _tokens(m["cache"]["computed_tokens"] if m["cache"] else None))
    for source in CACHE_SOURCES:
        if any(m["cache"] and m["cache"]["cached_by_source"].get(source) for m in modes.values()):
            row(f"  cached: {source}", lambda m, s=source: _tokens(m["cache"]["cached_by_source"].get(s) if m["cache"] else None))
    row("cached (usage, per request)", lambda m: _tokens(m["stats"]["usage_cached_tokens"]))
    for direction in DIRECTIONS:
        if any(m["cache"] and m["cache"]["transfer_bytes"].get(direction) for m in modes.values()):
            row(f"{direction.replace('_', ' ')}", lambda m, d=direction: _transfer(m, d))
    row("server start-up", lambda m: _num(m["startup_s"], "{:.0f} s"))
    row("workload wall time", lambda m: _num(m["stats"]["wall_s"], "{:.1f} s"))
    return table


def _transfer(mode: dict[str, Any], direction: str) -> str:
    cache = mode["cache"]
    if not cache or not cache["transfer_bytes"].get(direction):
        return "-"
    moved = cache["transfer_bytes"][direction]
    rate = cache["bandwidth_bytes_per_s"].get(direction)
    return f"{moved / 1e6:,.0f} MB" + (f" @ {rate / 1e9:.2f} GB/s" if rate else "")


def verdict_lines(results: dict[str, Any]) -> list[str]:
    """Human-readable outcome of the output check and the goals."""
    lines = []
    outputs = results["outputs"]
    if outputs["identical"] is None:
        lines.append("outputs: not compared (fewer than two modes produced outputs)")
    elif outputs["identical"]:
        lines.append(f"outputs: identical in every mode ({outputs['compared']} comparisons against {outputs['reference']})")
    else:
        lines.append(f"outputs: NOT identical: {len(outputs['mismatches'])} mismatches, {len(outputs['missing'])} missing")
        if outputs["mismatches"]:
            first = outputs["mismatches"][0]
            lines.append(f"  first: request {first['id']} in {first['mode']} differs from {first['reference']} "
                         f"at token {first['first_difference']}: {first['expected']!r} vs {first['got']!r}")
    for key, value in results["goals"].items():
        if key.endswith("_ok") or key == "outputs_identical":
            continue
        ok = results["goals"].get(f"{key}_ok")
        lines.append(f"goal {key}: {_num(value, '{:.3f}')} -> {'met' if ok else 'NOT met'}")
    return lines


def summary(results: dict[str, Any], results_path: Path | None, figure_path: Path | None) -> dict[str, Any]:
    """The compact summary printed as the last stdout line."""
    modes = {}
    for name, m in results["modes"].items():
        s, c = m["stats"], m["cache"]
        modes[name] = None if s is None else {
            "ttft_p50_ms": _round_ms(s["ttft_p50_s"]), "ttft_p90_ms": _round_ms(s["ttft_p90_s"]),
            "ttft_p99_ms": _round_ms(s["ttft_p99_s"]), "ttft_returning_p50_ms": _round_ms(s["ttft_returning_p50_s"]),
            "latency_p50_ms": _round_ms(s["latency_p50_s"]),
            "requests_per_s": _round(s["requests_per_s"], 4), "output_tokens_per_s": _round(s["output_tokens_per_s"], 2),
            "errors": s["errors"],
            "cached_by_source": {k: v for k, v in (c["cached_by_source"] if c else {}).items() if v},
            "computed_tokens": c["computed_tokens"] if c else None,
        }
    return {
        "results": str(results_path) if results_path else None,
        "figure": str(figure_path) if figure_path else None,
        "workload": results["workload"]["name"], "wall_s": _round(results["wall_s"], 1),
        "outputs_identical": results["outputs"]["identical"],
        "errors": {name: m["error"].splitlines()[0] for name, m in results["modes"].items() if m["error"]},
        "goals": {k: (_round(v, 4) if isinstance(v, float) else v) for k, v in results["goals"].items()},
        "modes": modes,
    }


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _round_ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)
