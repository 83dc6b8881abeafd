"""The figure of ``kvtier plan --trace``: hit rate against tier size, one line per combination of
the other tiers' sizes, the knee marked; with the one-pass LRU, the host curve at every size drawn
under the points. matplotlib with the Agg backend (no display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.replay.stack import StackCurve

TIERS = ("host", "disk", "remote")


def axis_tier(curve: list[dict[str, Any]]) -> str:
    """The tier whose size varies most across the points (host when tied)."""
    counts = {tier: len({p[f"{tier}_bytes"] for p in curve}) for tier in TIERS}
    return max(TIERS, key=lambda tier: (counts[tier], tier == "host"))


def write_figure(path: Path, report: dict[str, Any], stack: StackCurve | None = None) -> Path:
    """Draw ``report`` (:meth:`kvtier.replay.curve.CurveRun.result`) into the PNG ``path`` and return
    it. Its folder must exist: no directory is created for it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = report["curve"]
    tier = axis_tier(curve)
    others = [t for t in TIERS if t != tier]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    block = report["settings"]["host_block_bytes"]
    prompt = report["trace"]["prompt_tokens"]
    if stack is not None and tier == "host" and prompt:
        top = max(p["host_bytes"] for p in curve)
        slots = sorted({max(1, round(top / block * i / 400)) for i in range(1, 401)})
        ax.plot([s * block / 2**30 for s in slots], [stack.host_tokens(s) / prompt for s in slots],
                color="#bbbbbb", linewidth=1, label="every host size (one-pass LRU)")
    groups: dict[tuple[int, ...], list[dict[str, Any]]] = {}
    for point in curve:
        groups.setdefault(tuple(point[f"{t}_bytes"] for t in others), []).append(point)
    for key, points in groups.items():
        points.sort(key=lambda p: p[f"{tier}_bytes"])
        label = ", ".join(f"{t} {v / 2**30:.3g} GiB" for t, v in zip(others, key) if v) or f"{tier} tier only"
        ax.plot([p[f"{tier}_bytes"] / 2**30 for p in points], [p["hit_rate"] for p in points], marker="o", label=label)
    knee = report.get("knee") or {}
    if tier == "host" and knee.get("host_bytes"):
        ax.axvline(knee["host_bytes"] / 2**30, color="#c44e52", linestyle="--", linewidth=1,
                   label=f"knee: {knee['fraction']:.0%} of unlimited")
    unlimited = report["unlimited_host"]["hit_rate"]
    ax.axhline(unlimited, color="#55a868", linestyle=":", linewidth=1, label=f"unlimited host: {unlimited:.1%}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"{tier} tier size (GiB)")
    ax.set_ylabel("hit rate (prompt tokens from kvtier's tiers)")
    ax.set_ylim(0, max(0.05, min(1.0, unlimited * 1.15, max(p["hit_rate"] for p in curve) * 1.15)))
    engine = report["engine"]["fraction"]
    ax.set_title(f"{Path(report['trace']['path']).name}: {report['trace']['requests']:,} requests; "
                 f"the engine's own cache serves {engine:.1%}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)  # into a folder that exists: kvtier plan checked it before replaying
    plt.close(fig)
    return path
