"""The GPU kit's verdict (scripts/gpu-check.sh): folds the kit's results into ONE JSON object on
stdout and exits 1 if any check failed or any goal was missed, 0 otherwise. Standard library only.

Inputs (a results directory): ``pytest.xml`` (tests/gpu as JUnit XML), ``bench-<LAYOUT>.json``
(tests/gpu/bench_copies.py, one per layout), ``device.txt``. Fails on:

- a GPU test that failed, errored or was skipped (on a GPU machine nothing may skip), or none ran;
- a benchmark missing or unreadable, or one that skipped (no CUDA device seen);
- a refused batched copy (``batch_refusals`` > 0) or no batched copy where the runtime has one
  (CUDA 12.8+);
- a goal missed on a goal layout (LBNHC, FlashAttention's default, and BLNHC): kvtier's copies
  (method ``auto``) below 0.95 of one cudaMemcpyAsync of the same bytes, at any page size,
  stores or loads, or 0.2 ms or more of host time to issue a 512-block job (the start call, or
  what a job costs the forward's thread all told, timed on a stand-in step), or a GEMM slowed more
  than 1.05x beside a store or more than a plain copy slows it beside a load (tests/gpu/bench_copies.py);
- a measurement error on any layout: a fraction above 1.05 of the single copy (nothing beats one
  copy of the same bytes over the same link: the baseline was measured wrong).

Other layouts are reported, not judged.

Usage: python tests/gpu/summarize.py RESULTS_DIR [--goal-layouts LBNHC,BLNHC]
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

BATCHED_SINCE = 12080  # cudaMemcpyBatchAsync


def checks(xml_path: Path) -> dict[str, str]:
    """Each test's outcome: passed, failed, error or skipped."""
    out = {}
    for case in ElementTree.parse(xml_path).getroot().iter("testcase"):
        outcome = "passed"
        for kind in ("failure", "error", "skipped"):
            if case.find(kind) is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
        out[case.get("name", "?")] = outcome
    return out


def least_load_slowdown(sweep: dict, fraction_goal: float) -> str | None:
    """The cap of kernel blocks (``"page"``: one per page) under which a staged load slowed the
    GEMM least, among those whose copies kept ``fraction_goal`` of one cudaMemcpyAsync both ways
    (ties: the larger cap, which finishes its chunks sooner); None if none did."""
    kept = [(row["slowdown_load"], -(10**9 if cap == "page" else int(cap)), cap) for cap, row in sweep.items()
            if isinstance(row, dict) and min(row.get("store_fraction", 0), row.get("load_fraction", 0)) >= fraction_goal]
    return min(kept)[2] if kept else None


def summarize(results: Path, goal_layouts: tuple[str, ...] = ("LBNHC", "BLNHC")) -> dict:
    failed: list[str] = []
    summary: dict = {"device": (results / "device.txt").read_text().strip() if (results / "device.txt").exists()
                     else None}
    xml = results / "pytest.xml"
    summary["checks"] = checks(xml) if xml.exists() else {}
    if not summary["checks"]:
        failed.append("no GPU test ran (pytest.xml missing or empty)")
    failed += [f"GPU test {name}: {outcome}" for name, outcome in summary["checks"].items() if outcome != "passed"]
    benches = sorted(results.glob("bench-*.json"))
    for goal_layout in goal_layouts:
        if not any(b.name == f"bench-{goal_layout}.json" for b in benches):
            failed.append(f"no benchmark of the goal layout {goal_layout}")
    summary["bandwidth"], summary["issue_ms"], summary["fastest"], summary["contention"] = {}, {}, {}, {}
    for bench_path in benches:
        layout = bench_path.stem.removeprefix("bench-")
        try:
            bench = json.loads(bench_path.read_text())
        except (OSError, ValueError) as exc:
            failed.append(f"benchmark {layout}: unreadable ({exc})")
            continue
        if "skipped" in bench:
            failed.append(f"benchmark {layout}: skipped ({bench['skipped']})")
            continue
        summary.setdefault("card", bench.get("card"))
        summary.setdefault("driver", bench.get("driver"))
        summary.setdefault("cuda_runtime", bench.get("cuda_runtime"))
        if bench.get("batch_refusals"):
            failed.append(f"benchmark {layout}: cudaMemcpyBatchAsync refused {bench['batch_refusals']} job(s)")
        if (bench.get("cuda_runtime") or 0) >= BATCHED_SINCE and not bench.get("batched_copy"):
            failed.append(f"benchmark {layout}: CUDA runtime {bench.get('cuda_runtime')} but copies were not batched")
        fractions, issue, fastest = {}, {}, {}
        goals = bench["goals"]
        for size, result in bench.get("page_sizes", {}).items():
            for direction in ("store", "load"):
                measured = result[direction]
                auto = measured["auto"]["fraction_of_single_copy"]
                fractions[f"{direction} {size}"] = {m: measured[m]["fraction_of_single_copy"]
                                                     for m in ("auto", "runs", "staged")}
                issue[f"{direction} {size}"] = {"call": measured["auto"]["issue_ms"],
                                                 "forward_added": measured["auto"].get("forward", {}).get("added_ms"),
                                                 "call_after_host_work": measured["auto"].get("forward", {}).get(
                                                     "call_after_host_work_ms"),
                                                 "repeated": measured["auto"].get("repeated")}  # reported, not judged
                fastest[f"{direction} {size}"] = (f"{measured['fastest']} (auto moved it as "
                                                  f"{'/'.join(measured['auto'].get('moved_as', ['?']))})")
                if measured["staged"].get("moved_as", ["staged"]) != ["staged"]:
                    failed.append(f"{layout} {direction} {size}: the staged method moved as "
                                  f"{measured['staged']['moved_as']}: staging is off (see bench-{layout}.err)")
                if auto > goals["measurement_error_above"]:
                    failed.append(f"{layout} {direction} {size}: {auto} of one cudaMemcpyAsync is a measurement "
                                  f"error (above {goals['measurement_error_above']}: the baseline was measured wrong)")
                if layout not in goal_layouts:
                    continue
                if auto < goals["fraction_of_single_copy"]:
                    failed.append(f"{layout} {direction} {size}: {auto} of one cudaMemcpyAsync, goal "
                                  f"{goals['fraction_of_single_copy']}")
                if measured["auto"]["issue_ms"] >= goals["issue_ms"]:
                    failed.append(f"{layout} {direction} {size}: {measured['auto']['issue_ms']} ms to issue a "
                                  f"{bench.get('blocks')}-block job, goal < {goals['issue_ms']} ms")
                forward = measured["auto"].get("forward")
                if forward is None:
                    failed.append(f"{layout} {direction} {size}: what a job costs the forward's thread was not measured")
                elif forward["added_ms"] >= goals["issue_ms"]:
                    failed.append(f"{layout} {direction} {size}: a {bench.get('blocks')}-block job costs the forward's "
                                  f"thread {forward['added_ms']} ms, goal < "
                                  f"{goals['issue_ms']} ms")
            contention = result.get("contention")
            if contention is None:
                continue
            summary["contention"].setdefault(layout, {})[size] = contention
            if "kernel_blocks_sweep" in result:  # reported, not judged
                sweep = result["kernel_blocks_sweep"]
                summary.setdefault("kernel_blocks_sweep", {}).setdefault(layout, {})[size] = {
                    **sweep, "least_load_slowdown": least_load_slowdown(sweep, goals["fraction_of_single_copy"])}
            if layout in goal_layouts and contention["slowdown_store"] > goals["store_slowdown"]:
                failed.append(f"{layout} {size}: a store slows the GEMM {contention['slowdown_store']}x, goal <= "
                              f"{goals['store_slowdown']}x")
            tolerance = goals["load_slowdown_over_plain_copy"]
            if layout in goal_layouts and contention["slowdown_load"] > contention["slowdown_single_load"] + tolerance:
                failed.append(f"{layout} {size}: a load slows the GEMM {contention['slowdown_load']}x, one "
                              f"cudaMemcpyAsync of the same bytes {contention['slowdown_single_load']}x")
        if not fractions:
            failed.append(f"benchmark {layout}: no page sizes measured")
        summary["bandwidth"][layout], summary["issue_ms"][layout], summary["fastest"][layout] = fractions, issue, fastest
    summary["goal_layouts"] = list(goal_layouts)
    summary["failed"] = failed
    summary["ok"] = not failed
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--goal-layouts", default="LBNHC,BLNHC")
    args = parser.parse_args()
    summary = summarize(args.results, tuple(args.goal_layouts.split(",")))
    print(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
