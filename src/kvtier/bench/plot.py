"""The benchmark figure (``bench.png``): TTFT distribution per mode (empirical CDF, first uses
dashed, returning requests solid) and prompt tokens per mode by where they came from (computed,
or cached by source), as stacked bars. matplotlib with the Agg backend (no display needed).

Called once by :mod:`kvtier.bench.command` at the end of a ``kvtier bench`` run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.bench.metrics import CACHE_SOURCES

_SOURCE_COLORS = {
    "computed": "#bbbbbb", "device": "#4c72b0", "host": "#55a868", "disk": "#c44e52",
    "p2p": "#8172b2", "external_unspecified": "#dd8452",
}


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    """Points of an empirical CDF drawn with ``step(where="post")``, starting from 0."""
    data = sorted(values)
    return [data[0], *data], [0.0, *((i + 1) / len(data) for i in range(len(data)))]


def write_figure(path: Path, results: dict[str, Any]) -> Path | None:
    """Draw the figure from ``results`` (see :func:`kvtier.bench.report.build_results`); returns
    ``path``, or None if no mode finished."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = {name: m for name, m in results["modes"].items() if m["stats"] is not None}
    if not modes:
        return None
    fig, (ax_ttft, ax_src) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (name, mode) in enumerate(modes.items()):
        color = colors[index % len(colors)]
        for returning, style in ((False, "--"), (True, "-")):
            ttft = [r["ttft_s"] * 1000 for r in mode["requests"]
                    if r["error"] is None and r["ttft_s"] is not None and r["returning"] == returning]
            if ttft:
                xs, ys = _cdf(ttft)
                label = f"{name}, {'returning' if returning else 'first use'}"
                ax_ttft.step(xs, ys, where="post", linestyle=style, color=color, label=label)
    ax_ttft.set_xscale("log")
    ax_ttft.set_ylim(0, 1.05)
    ax_ttft.set_xlabel("time to first token (ms, log scale)")
    ax_ttft.set_ylabel("fraction of requests")
    ax_ttft.set_title("TTFT distribution per mode")
    ax_ttft.grid(True, which="both", alpha=0.3)
    ax_ttft.legend(fontsize=8)

    names = list(modes)
    bottoms = [0.0] * len(names)
    for source in ("computed", *CACHE_SOURCES):
        heights = []
        for name in names:
            cache = modes[name]["cache"] or {}
            if source == "computed":
                heights.append(cache.get("computed_tokens") or 0.0)
            else:
                heights.append((cache.get("cached_by_source") or {}).get(source) or 0.0)
        if any(heights):
            ax_src.bar(names, heights, bottom=bottoms, label=source, color=_SOURCE_COLORS.get(source))
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax_src.set_ylabel("prompt tokens")
    ax_src.set_title("prompt tokens by source (computed or cached by tier)")
    ax_src.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    workload = results["workload"]
    fig.suptitle(f"kvtier bench: {workload['name']}, {workload['num_requests']} requests, "
                 f"concurrency {workload['concurrency']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
