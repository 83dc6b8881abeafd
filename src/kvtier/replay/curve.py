"""``kvtier plan --trace``'s result: the trace replayed at every size point, the knee, and what it saves.

For every point of the grid (host x disk x remote sizes) it reports the prompt tokens served by each
tier (the engine's own prefix cache, kvtier's host, disk and remote tiers, the rest computed), the
hit rate (the fraction of prompt tokens kvtier's tiers serve), the prefill tokens that saves and an
estimate of the time it saves (per-token prefill cost and tier bandwidths from ``kvtier plan``'s own
arithmetic, :mod:`kvtier.planning.sizing`). The knee is the smallest host tier (no disk or remote
tier) that reaches a fraction (95%) of the hit rate an unlimited host tier gives.

Method: the one-pass LRU (:mod:`kvtier.replay.stack`, every host size at once) where kvtier's policy
is LRU over blocks alone; otherwise each point is replayed through kvtier's own code
(:mod:`kvtier.replay.exact`), and the knee is found by bisecting host sizes (a few more replays).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from itertools import product
from typing import Any

from kvtier.planning.sizing import Plan
from kvtier.replay.exact import PointReplay, Served, TierSizes
from kvtier.replay.identity import computed_tokens
from kvtier.replay.stack import StackCurve, stack_applies, stack_pass
from kvtier.replay.trace import Trace
from kvtier.replay.workload import START, ReplaySettings, replay_events
from kvtier.tiers.blockfile import HEADER_LEN

GIB = 2**30
DEFAULT_REMOTE_BW_GBPS = 1.25
"""Redis -> host: one 10 GbE link (kvtier plan has no figure of its own for a remote tier)."""
KNEE_FRACTION = 0.95
DEFAULT_POINTS = 8
_UNITS = {"": GIB, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": GIB, "gb": GIB, "gib": GIB, "t": 2**40, "tb": 2**40, "tib": 2**40}


def parse_sizes(text: str, flag: str) -> list[int]:
    """``"0.5,1,2GiB,512MiB"`` -> bytes (a bare number is GiB; 0 means no such tier)."""
    sizes = []
    for part in (p.strip() for p in text.split(",")):
        match = re.fullmatch(r"(\d+(?:\.\d+)?|\.\d+)\s*([a-zA-Z]*)", part)
        unit = match.group(2).lower() if match else ""
        if not match or unit not in _UNITS:
            raise ValueError(f"{flag}: {part!r} is not a size (a number of GiB, or with a unit: 512MiB, 2GiB)")
        sizes.append(int(float(match.group(1)) * _UNITS[unit]))
    if not sizes:
        raise ValueError(f"{flag}: no size given")
    return sorted(set(sizes))


@dataclass(frozen=True)
class ReplayGeometry:
    """Bytes and rates of the deployment: one kvtier block on each tier, the engine's KV cache in
    blocks, the cost of prefilling a token and of loading one from each tier."""

    host_block_bytes: int
    disk_block_bytes: int
    remote_block_bytes: int
    engine_blocks: int
    engine_kv_bytes: int
    recompute_s_per_token: float
    load_s_per_token: dict[str, float]

    @classmethod
    def from_plans(cls, block_plan: Plan, context_plan: Plan, engine_block_tokens: int,
                   remote_bw_gbps: float = DEFAULT_REMOTE_BW_GBPS) -> "ReplayGeometry":
        """From ``kvtier plan``'s figures: ``block_plan`` planned at one kvtier block (its context),
        ``context_plan`` at the trace's mean prompt (prefill cost per token, load rates)."""
        geo, width, tp = block_plan.geometry, block_plan.kv_dtype_bytes, block_plan.tp
        rank_block = block_plan.offload_sequence_bytes_rank
        copies = block_plan.stored_copies
        engine_page = geo.sequence_kv_bytes(engine_block_tokens, width, tp, engine_block_tokens, window_aware=True)
        tokens = max(1, context_plan.context)
        per_token_rank = context_plan.offload_sequence_bytes_rank / tokens
        host = context_plan.host_load_s / tokens
        disk = context_plan.disk_load_s / tokens
        remote = per_token_rank * copies / (remote_bw_gbps * 1e9) + host
        return cls(
            host_block_bytes=rank_block * copies,
            disk_block_bytes=(rank_block + HEADER_LEN) * copies,
            remote_block_bytes=(rank_block + HEADER_LEN) * copies,
            engine_blocks=block_plan.kv_budget_rank // engine_page if engine_page else 0,
            engine_kv_bytes=block_plan.kv_budget_rank,
            recompute_s_per_token=context_plan.recompute_s / tokens,
            load_s_per_token={"host": host, "disk": disk, "remote": remote},
        )


@dataclass(frozen=True)
class Point:
    host_bytes: int
    disk_bytes: int
    remote_bytes: int


def default_host_sizes(unique_blocks: int, block_bytes: int, knee_bytes: int | None = None,
                       points: int = DEFAULT_POINTS) -> list[int]:
    """The host sizes ``kvtier plan --trace`` sweeps when not given (bytes, ascending): ``points``
    powers of two, the largest the smallest one that holds both the trace's distinct blocks and the
    knee's host tier (``knee_bytes``: what the trace needs to be served, tails included, which can
    be more than its distinct full blocks), each half the next; a size below one block is one block
    (the host tier's least), so a trace of few blocks gets fewer. The knee itself is one of them too."""
    need = max(block_bytes, unique_blocks * block_bytes, knee_bytes or 0)
    top = 1 << (need - 1).bit_length()
    sizes = {max(block_bytes, top >> shift) for shift in range(points)}
    return sorted(sizes | ({knee_bytes} if knee_bytes else set()))


class CurveRun:
    """Replays ``trace`` over a grid of sizes; :meth:`result` is the JSON-ready report."""

    def __init__(self, trace: Trace, settings: ReplaySettings, geometry: ReplayGeometry, *,
                 host_sizes: list[int] | None, disk_sizes: list[int], remote_sizes: list[int],
                 method: str = "auto", progress: Callable[[str], None] | None = None):
        self.trace = trace
        self.settings = settings
        self.geometry = geometry
        self.progress = progress or (lambda message: None)
        self.disk_sizes = disk_sizes or [0]
        self.remote_sizes = remote_sizes or [0]
        self.host_sizes = host_sizes
        self.offered_blocks = sum(computed_tokens(r) // settings.block_tokens for r in trace.requests)
        why_not = stack_applies(settings, any(self.disk_sizes), any(self.remote_sizes))
        host_only = stack_applies(settings, False, False)
        if method == "stack" and why_not:
            raise ValueError(f"--method stack: the one-pass LRU does not model this replay ({why_not}); "
                             "use --method exact (or auto)")
        self.method = "exact" if method == "exact" or why_not else "stack"
        self.knee_method = "exact" if method == "exact" or host_only else "stack"
        self.why_exact = why_not if method != "exact" else "--method exact"
        self._events: list | None = None
        self._stack: StackCurve | None = None
        self._seconds = 0.0

    # --- passes -----------------------------------------------------------------------------
    def events(self) -> list:
        if self._events is None:
            self._events = list(replay_events(self.trace, self.settings))
        return self._events

    def stack(self) -> StackCurve:
        if self._stack is None:
            source = self._events if self._events is not None else replay_events(self.trace, self.settings)
            self._stack = stack_pass(source, self.settings, self.offered_blocks + 1)
        return self._stack

    def replay(self, host_slots: int, disk_bytes: int = 0, remote_bytes: int = 0) -> Served:
        geo = self.geometry
        sizes = TierSizes(host_slots=max(1, host_slots), disk_bytes=disk_bytes, disk_block_bytes=geo.disk_block_bytes,
                          remote_blocks=remote_bytes // geo.remote_block_bytes if remote_bytes else 0)
        point = PointReplay(sizes, self.settings)
        for kind, request in self.events():
            point.feed(kind, request)
        return point.result()

    def unlimited_slots(self) -> int:
        """Host slots that never evict: every block and two tails per request."""
        return self.offered_blocks + 2 * len(self.trace.requests) + 1

    # --- the report ---------------------------------------------------------------------------
    def result(self) -> dict[str, Any]:
        started = time.perf_counter()
        geo, settings = self.geometry, self.settings
        block_bytes = geo.host_block_bytes
        if self.method == "stack" or self.knee_method == "stack":
            self.progress("one pass over the trace (LRU stack distances: every host size at once)")
            curve = self.stack()
            unlimited = self._from_stack(curve, self.unlimited_slots())
            unique = curve.distinct_blocks
        else:
            self.progress("replaying with an unlimited host tier")
            unlimited = self.replay(self.unlimited_slots())
            unique = len({key for kind, request in self.events() if kind == START for key in request.chain.keys})
        knee = self._knee(unlimited)  # first: the default sizes reach it
        if self.host_sizes is None:
            self.host_sizes = default_host_sizes(unique, block_bytes, knee["host_bytes"])
        points: list[dict[str, Any]] = []
        grid = list(product(self.host_sizes, self.disk_sizes, self.remote_sizes))
        for number, (host, disk, remote) in enumerate(grid, 1):
            slots = host // block_bytes
            if self.method == "stack":
                served = self._from_stack(self.stack(), slots)
            else:
                self.progress(f"point {number}/{len(grid)}: host {_gib(host)}, disk {_gib(disk)}, remote {_gib(remote)}")
                served = self.replay(slots, disk, remote)
            points.append(self._point(Point(host, disk, remote), slots, served))
        self._seconds = time.perf_counter() - started
        prompt = unlimited.prompt_tokens
        return {
            "trace": {"path": self.trace.path, "kind": self.trace.kind, "requests": unlimited.requests,
                      "prompt_tokens": prompt, "order": "timestamps" if self.trace.ordered_by_time else "file order",
                      "offered_blocks": self.offered_blocks, "distinct_blocks": unique},
            "settings": {**{k: (v.value if hasattr(v, "value") else v) for k, v in asdict(settings).items()},
                         "engine_kv_bytes": geo.engine_kv_bytes,
                         "host_block_bytes": block_bytes, "disk_block_bytes": geo.disk_block_bytes,
                         "remote_block_bytes": geo.remote_block_bytes,
                         "method": self.method, **({"exact_because": self.why_exact} if self.method == "exact" else {})},
            "engine": {"tokens": unlimited.engine, "fraction": _ratio(unlimited.engine, prompt)},
            "curve": points,
            "unlimited_host": self._point(Point(-1, 0, 0), self.unlimited_slots(), unlimited),
            "knee": knee,
            "assumptions": {"recompute_s_per_token": geo.recompute_s_per_token,
                            "load_s_per_token": geo.load_s_per_token,
                            "time_saved": "tokens served by a tier x (prefill cost per token - its load cost "
                                          "per token), from kvtier plan's arithmetic"},
            "replay_seconds": round(self._seconds, 3),
        }

    def _from_stack(self, curve: StackCurve, slots: int) -> Served:
        return Served(requests=curve.requests, prompt_tokens=curve.prompt_tokens, engine=curve.engine,
                      host=curve.host_tokens(slots))

    def _point(self, point: Point, slots: int, served: Served) -> dict[str, Any]:
        geo = self.geometry
        saved = sum(getattr(served, tier) * (geo.recompute_s_per_token - geo.load_s_per_token[tier])
                    for tier in ("host", "disk", "remote"))
        data: dict[str, Any] = {
            "host_bytes": point.host_bytes, "disk_bytes": point.disk_bytes, "remote_bytes": point.remote_bytes,
            "host_slots": slots, "hit_rate": _ratio(served.kvtier, served.prompt_tokens),
            "tokens_by_tier": served.by_tier(), "prefill_tokens_saved": served.kvtier,
            "time_saved_s": round(saved, 6) + 0.0,  # microseconds: a small trace's saving shows; no -0.0
        }
        if served.counters:
            data["counters"] = served.counters
        if point.host_bytes < 0:
            del data["host_bytes"], data["disk_bytes"], data["remote_bytes"]
        return data

    def _knee(self, unlimited: Served) -> dict[str, Any]:
        """The smallest host tier (alone) reaching :data:`KNEE_FRACTION` of the unlimited hit rate."""
        block_bytes = self.geometry.host_block_bytes
        target = KNEE_FRACTION * unlimited.kvtier
        if unlimited.kvtier == 0:
            return {"fraction": KNEE_FRACTION, "host_bytes": None,
                    "text": "kvtier serves nothing of this trace at any host size (no prefix returns after the "
                            "engine's own cache has lost it)"}
        if self.knee_method == "stack":
            slots = self.stack().smallest_slots_for(target)
            assert slots is not None
            served = self.stack().host_tokens(slots)
        else:
            slots, served = self._bisect_knee(target)
        host_bytes = slots * block_bytes
        rate = _ratio(served, unlimited.prompt_tokens)
        return {
            "fraction": KNEE_FRACTION, "host_bytes": host_bytes, "host_slots": slots, "hit_rate": rate,
            "unlimited_hit_rate": _ratio(unlimited.kvtier, unlimited.prompt_tokens), "method": self.knee_method,
            "text": f"{_gib(host_bytes)} of host reaches {KNEE_FRACTION:.0%} of the hit rate that unlimited host "
                    f"memory gives ({rate:.1%} of {_ratio(unlimited.kvtier, unlimited.prompt_tokens):.1%})",
        }

    def _bisect_knee(self, target: float, max_replays: int = 12) -> tuple[int, int]:
        low, high = 0, self.unlimited_slots()  # low fails (or is 0), high reaches the target
        served_high = None
        for _ in range(max_replays):
            if high - low <= max(1, high // 200):
                break
            middle = (low + high) // 2
            self.progress(f"searching for the knee: replaying host {_gib(middle * self.geometry.host_block_bytes)}")
            served = self.replay(middle).kvtier
            if served >= target:
                high, served_high = middle, served
            else:
                low = middle
        if served_high is None:
            served_high = self.replay(high).kvtier
        return high, served_high


def _ratio(part: float, whole: float) -> float:
    return round(part / whole, 6) if whole else 0.0


def _gib(n: int) -> str:
    if n >= 100 * GIB:
        return f"{n / GIB:,.0f} GiB"
    if n >= GIB:
        return f"{n / GIB:.3g} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.3g} MiB"
    return f"{n} B"
