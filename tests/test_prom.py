"""kvtier's Prometheus metrics (kvtier.vllm.prom) without an engine: KVTierStats fields reach their
series through the connector's stats (aggregated across ranks as vLLM does), and every series is
documented in docs/observability.md."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtier.core.stats import KVTierStats
from kvtier.vllm.metadata import KVTierConnectorStats
from kvtier.vllm.prom import _EVENT_COUNTERS, _USAGE_GAUGES, KVTierPromMetrics

DOCS = Path(__file__).resolve().parents[1] / "docs" / "observability.md"


def metrics() -> tuple[KVTierPromMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    types = {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    return KVTierPromMetrics(config, types, ["engine"], {0: ["0"]}), registry


def test_every_tiers_evictions_reach_kvtier_evictions_by_tier_summed_over_ranks():
    ranks = [KVTierStats(host_evictions=1, disk_evictions=2, s3_evictions=3) for _ in range(2)]
    data = KVTierConnectorStats(data=ranks[0].as_dict()).aggregate(KVTierConnectorStats(data=ranks[1].as_dict())).data
    prom, registry = metrics()
    prom.observe(data, 0)
    got = {tier: registry.get_sample_value("kvtier_evictions_total", {"engine": "0", "tier": tier})
           for tier in ("host", "disk", "s3")}
    assert got == {"host": 2.0, "disk": 4.0, "s3": 6.0}


def test_every_kvtier_series_is_documented():
    documented = set(re.findall(r"`(kvtier_[a-z0-9_]+?)(?:_total)?`", DOCS.read_text()))
    exported = {name for name, *_ in _EVENT_COUNTERS.values()} | {name for name, *_ in _USAGE_GAUGES.values()}
    exported |= {"kvtier_transfer_bytes", "kvtier_transfer_seconds"}
    assert exported - documented == set()
    assert {field for field in _EVENT_COUNTERS if not hasattr(KVTierStats(), field)} == set()
