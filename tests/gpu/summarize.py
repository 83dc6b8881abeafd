"""The GPU kit's verdict (scripts/gpu-check.sh): folds the kit's results into ONE JSON object on
stdout and exits 1 if any check failed or any goal was missed, 0 otherwise. Standard library only.

Inputs (a results directory): ``pytest.xml`` (tests/gpu as JUnit XML), ``bench-<LAYOUT>.json``
(tests/gpu/bench_copies.py, one per layout), ``device.txt``. Fails on:

- a GPU test that failed, errored or was skipped (on a GPU machine nothing may skip), or none ran;
- a benchmark missing or unreadable, or one that skipped (no CUDA device seen);
- a refused batched copy (``batch_refusals`` > 0) or no batched copy where the runtime has one
  (CUDA 12.8+);
- a goal missed on the goal layout (LBNHC, FlashAttention's default): kvtier's copies (method
  ``auto``) below 0.8 of one cudaMemcpyAsync of the same bytes, at any page size, stores or loads,
  or 1 ms or more of host time to issue a 512-block job. Other layouts are reported, not judged.

Usage: python tests/gpu/summarize.py RESULTS_DIR [--goal-layout LBNHC]
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


def summarize(results: Path, goal_layout: str = "LBNHC") -> dict:
    failed: list[str] = []
    summary: dict = {"device": (results / "device.txt").read_text().strip() if (results / "device.txt").exists()
                     else None}
    xml = results / "pytest.xml"
    summary["checks"] = checks(xml) if xml.exists() else {}
    if not summary["checks"]:
        failed.append("no GPU test ran (pytest.xml missing or empty)")
    failed += [f"GPU test {name}: {outcome}" for name, outcome in summary["checks"].items() if outcome != "passed"]
    benches = sorted(results.glob("bench-*.json"))
    if not any(b.name == f"bench-{goal_layout}.json" for b in benches):
        failed.append(f"no benchmark of the goal layout {goal_layout}")
    summary["bandwidth"], summary["issue_ms"], summary["fastest"] = {}, {}, {}
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
        summary.setdefault("cuda_runtime", bench.get("cuda_runtime"))
        if bench.get("batch_refusals"):
            failed.append(f"benchmark {layout}: cudaMemcpyBatchAsync refused {bench['batch_refusals']} job(s)")
        if (bench.get("cuda_runtime") or 0) >= BATCHED_SINCE and not bench.get("batched_copy"):
            failed.append(f"benchmark {layout}: CUDA runtime {bench.get('cuda_runtime')} but copies were not batched")
        fractions, issue, fastest = {}, {}, {}
        for size, result in bench.get("page_sizes", {}).items():
            for direction in ("store", "load"):
                measured = result[direction]
                fractions[f"{direction} {size}"] = {m: measured[m]["fraction_of_single_copy"]
                                                     for m in ("auto", "runs", "staged")}
                issue[f"{direction} {size}"] = measured["auto"]["issue_ms"]
                fastest[f"{direction} {size}"] = f"{measured['fastest']} (auto picks {result.get('auto_picks')})"
                if layout != goal_layout:
                    continue
                if measured["auto"]["fraction_of_single_copy"] < bench["goals"]["fraction_of_single_copy"]:
                    failed.append(f"{layout} {direction} {size}: {measured['auto']['fraction_of_single_copy']} of one "
                                  f"cudaMemcpyAsync, goal {bench['goals']['fraction_of_single_copy']}")
                if measured["auto"]["issue_ms"] >= bench["goals"]["issue_ms"]:
                    failed.append(f"{layout} {direction} {size}: {measured['auto']['issue_ms']} ms to issue a "
                                  f"{bench.get('blocks')}-block job, goal < {bench['goals']['issue_ms']} ms")
        if not fractions:
            failed.append(f"benchmark {layout}: no page sizes measured")
        summary["bandwidth"][layout], summary["issue_ms"][layout], summary["fastest"][layout] = fractions, issue, fastest
    summary["goal_layout"] = goal_layout
    summary["failed"] = failed
    summary["ok"] = not failed
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--goal-layout", default="LBNHC")
    args = parser.parse_args()
    summary = summarize(args.results, args.goal_layout)
    print(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
