"""Benchmark arithmetic: percentiles, per-mode summaries, the greedy-output comparison across
modes, and the issue's goals. Pure functions over :class:`~kvtier.bench.driver.RequestResult`.

Called by :mod:`kvtier.bench.report` in the ``kvtier bench`` process.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.bench.driver import RequestResult

TTFT_GOAL_VS_VLLM = 0.10  # kvtier TTFT p50 on returning prefixes <= 10% of vLLM alone
TTFT_GOAL_VS_EXAMPLE = 0.50  # ... and <= half of ExampleConnector's
THROUGHPUT_GOAL_VS_VLLM = 0.95  # no reuse: kvtier throughput >= 95% of vLLM alone
TTFT_GOAL_KVTIER_DISK_VS_FS = 1.05  # vLLM's own offloading, restart: kvtier_disk TTFT p50 <= 1.05x its fs tier's
TTFT_GOAL_REDIS_VS_HOST = 1.5  # a new node's prompts from Redis: TTFT p50 <= 1.5x kvtier's host-tier hits
TTFT_GOAL_VS_FLOOR = 1.3  # returning turns: TTFT p50 <= 1.3x the floor mode's (only new tokens computed)


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation between order statistics (as
    numpy's default); None for no values."""
    data = sorted(values)
    if not data:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"q must be within [0, 100]; got {q}")
    rank = (len(data) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return data[low] + (data[high] - data[low]) * (rank - low)


def mode_stats(results: Sequence[RequestResult], wall_s: float) -> dict[str, Any]:
    """Per-mode numbers: TTFT percentiles (all requests, returning ones, first uses), latency,
    throughput over the workload's wall time, and cached tokens reported in ``usage``."""
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    returning = [r.ttft_s for r in ok if r.returning and r.ttft_s is not None]
    first = [r.ttft_s for r in ok if not r.returning and r.ttft_s is not None]
    output_tokens = sum(r.output_tokens for r in ok)
    usage_cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    prompt_tokens = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_returning_p50_s": percentile(returning, 50),
        "ttft_first_use_p50_s": percentile(first, 50),
        "latency_p50_s": percentile([r.latency_s for r in ok], 50),
        "output_tokens_per_s_p50": percentile([r.output_tokens_per_s for r in ok if r.output_tokens_per_s], 50),
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else None,
        "usage_prompt_tokens": sum(prompt_tokens) if prompt_tokens else None,
        "usage_cached_tokens": sum(usage_cached) if usage_cached else None,
    }


@dataclass
class Mismatch:
    """A request whose generated tokens differ from the reference mode's."""

    id: str
    mode: str
    reference: str
    first_difference: int  # index of the first differing token
    expected: str  # reference text
    got: str

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class OutputCheck:
    """Whether every mode generated the same tokens for every request id."""

    reference: str | None
    compared: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # "mode:id" without an output (errors)

    @property
    def identical(self) -> bool | None:
        """True only when at least one output was compared and all matched; None when nothing was
        compared (one mode, or no request succeeded in two modes); False otherwise."""
        if self.mismatches or self.missing:
            return False
        return True if self.compared else None

    def to_json(self) -> dict[str, Any]:
        return {"identical": self.identical, "reference": self.reference, "compared": self.compared,
                "mismatches": [m.to_json() for m in self.mismatches], "missing": self.missing}


def _tokens(result: RequestResult) -> list[int] | str:
    """Token ids when the server returned them, else the text (still exact for greedy decoding)."""
    return result.output_token_ids if result.output_token_ids else result.output_text


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return min(len(a), len(b))


def compare_outputs(by_mode: Mapping[str, Sequence[RequestResult]]) -> OutputCheck:
    """Compare each mode's outputs, request id by request id, with the first mode's.

    Mismatches are listed in the reference mode's request order, so ``mismatches[0]`` is the first
    differing request.
    """
    modes = list(by_mode)
    if not modes:
        return OutputCheck(reference=None)
    reference = modes[0]
    check = OutputCheck(reference=reference)
    indexed = {m: {r.id: r for r in by_mode[m]} for m in modes}
    for m in modes:
        check.missing += [f"{m}:{r.id}" for r in by_mode[m] if r.error is not None]
    for ref in by_mode[reference]:
        if ref.error is not None:
            continue
        for m in modes[1:]:
            other = indexed[m].get(ref.id)
            if other is None or other.error is not None:
                continue
            check.compared += 1
            a, b = _tokens(ref), _tokens(other)
            if type(a) is not type(b):  # one mode returned ids, the other only text
                a, b = ref.output_text, other.output_text
            if a != b:
                check.mismatches.append(Mismatch(ref.id, m, reference, _first_difference(a, b),
                                                 ref.output_text, other.output_text))
    return check


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def goals(workload: str, per_mode: Mapping[str, Mapping[str, Any]], outputs_identical: bool | None) -> dict[str, Any]:
    """The issue's goals that this run can judge (a goal needs its modes and workload)."""
    from kvtier.bench.node_pair import node_goals

    out: dict[str, Any] = {"outputs_identical": outputs_identical, **node_goals(dict(per_mode))}
    fs, kvtier_disk = per_mode.get("native-fs-restart"), per_mode.get("native-kvtier-disk-restart")
    if fs is not None and kvtier_disk is not None:
        ratio = _ratio(kvtier_disk.get("ttft_returning_p50_s"), fs.get("ttft_returning_p50_s"))
        out["ttft_restart_kvtier_disk_vs_native_fs_p50"] = ratio
        out["ttft_restart_kvtier_disk_vs_native_fs_p50_ok"] = ratio is not None and ratio <= TTFT_GOAL_KVTIER_DISK_VS_FS
    kv = per_mode.get("kvtier")
    if kv is None:
        return out
    if workload == "unique":
        if "vllm" in per_mode:
            ratio = _ratio(kv.get("requests_per_s"), per_mode["vllm"].get("requests_per_s"))
            out["throughput_vs_vllm"] = ratio
            out["throughput_vs_vllm_ok"] = ratio is not None and ratio >= THROUGHPUT_GOAL_VS_VLLM
        return out
    if "kvtier-redis" in per_mode:
        ratio = _ratio(per_mode["kvtier-redis"].get("ttft_returning_p50_s"), kv.get("ttft_returning_p50_s"))
        out["ttft_redis_vs_host_p50"] = ratio
        out["ttft_redis_vs_host_p50_ok"] = ratio is not None and ratio <= TTFT_GOAL_REDIS_VS_HOST
    for peer, limit in (("vllm", TTFT_GOAL_VS_VLLM), ("example", TTFT_GOAL_VS_EXAMPLE), ("floor", TTFT_GOAL_VS_FLOOR)):
        if peer in per_mode:
            ratio = _ratio(kv.get("ttft_returning_p50_s"), per_mode[peer].get("ttft_returning_p50_s"))
            out[f"ttft_returning_p50_vs_{peer}"] = ratio
            out[f"ttft_returning_p50_vs_{peer}_ok"] = ratio is not None and ratio <= limit
    return out
