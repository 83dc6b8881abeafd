"""Scrape a server's Prometheus ``/metrics``, diff two scrapes, and summarize the counters the
benchmark reports.

Counters read (real names on vLLM 0.32 with kvtier; the text format adds ``_total``):

* ``vllm:prompt_tokens`` -- prompt tokens of finished prefills;
* ``vllm:prompt_tokens_by_source{source=local_compute|local_cache_hit|external_kv_transfer}``;
* ``vllm:prompt_tokens_cached_by_source{source=device|host|p2p|disk|external_unspecified}`` --
  cached prompt tokens by the tier that supplied them (vLLM's own prefix cache is ``device``,
  kvtier reports ``host``, ``disk`` and, for its Redis tier, ``external_unspecified`` (vLLM has
  no remote source), as does an uninstrumented connector such as ExampleConnector);
* ``kvtier_transfer_bytes{direction=...}`` / ``kvtier_transfer_seconds{direction=...}`` (kvtier only),
  directions ``engine_to_host``, ``host_to_engine``, ``host_to_disk``, ``disk_to_host``,
  ``host_to_remote``, ``remote_to_host`` (Redis), ``host_to_s3``, ``s3_to_host``.

Samples are summed over every other label (model name, engine index).

Called by :mod:`kvtier.bench.runner` in the ``kvtier bench`` process, before and after each mode's workload.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

Key = tuple[str, tuple[tuple[str, str], ...]]
"""(sample name, sorted (label, value) pairs)."""

PROMPT_TOKENS = "vllm:prompt_tokens_total"
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
TRANSFER_BYTES = "kvtier_transfer_bytes_total"
TRANSFER_SECONDS = "kvtier_transfer_seconds_total"
CACHE_SOURCES = ("device", "host", "disk", "p2p", "external_unspecified")
DIRECTIONS = ("engine_to_host", "host_to_engine", "host_to_disk", "disk_to_host", "host_to_remote", "remote_to_host",
              "host_to_s3", "s3_to_host")


def parse_counters(text: str) -> dict[Key, float]:
    """Every counter sample (``*_total``) of a ``/metrics`` text, keyed by name and labels."""
    samples: dict[Key, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "counter":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return samples


def diff(before: dict[Key, float], after: dict[Key, float]) -> dict[Key, float]:
    """``after - before`` for every counter in ``after`` (a counter absent before counts from 0)."""
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def total(samples: dict[Key, float], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(
        value for (sample_name, pairs), value in samples.items()
        if sample_name == name and all(dict(pairs).get(k) == v for k, v in labels.items())
    )


def by_label(samples: dict[Key, float], name: str, label: str) -> dict[str, float]:
    """Samples called ``name`` summed per value of ``label``."""
    out: dict[str, float] = defaultdict(float)
    for (sample_name, pairs), value in samples.items():
        labels = dict(pairs)
        if sample_name == name and label in labels:
            out[labels[label]] += value
    return dict(out)


@dataclass
class CacheSummary:
    """What one mode's workload did to the counters (a diff of two scrapes)."""

    prompt_tokens: float = 0.0
    computed_tokens: float = 0.0
    cached_by_source: dict[str, float] = field(default_factory=dict)
    transfer_bytes: dict[str, float] = field(default_factory=dict)
    transfer_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def cached_tokens(self) -> float:
        return sum(self.cached_by_source.values())

    def bandwidth(self) -> dict[str, float]:
        """Bytes per second of transfer time, per direction that moved bytes."""
        return {
            d: self.transfer_bytes[d] / self.transfer_seconds[d]
            for d in self.transfer_bytes
            if self.transfer_bytes[d] > 0 and self.transfer_seconds.get(d, 0) > 0
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "computed_tokens": self.computed_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_by_source": self.cached_by_source,
            "transfer_bytes": self.transfer_bytes,
            "transfer_seconds": self.transfer_seconds,
            "bandwidth_bytes_per_s": self.bandwidth(),
        }


def summarize(delta: dict[Key, float]) -> CacheSummary:
    """The benchmark's view of a counter diff."""
    cached = by_label(delta, CACHED_BY_SOURCE, "source")
    return CacheSummary(
        prompt_tokens=total(delta, PROMPT_TOKENS),
        computed_tokens=total(delta, BY_SOURCE, source="local_compute"),
        cached_by_source={s: cached.get(s, 0.0) for s in sorted(set(CACHE_SOURCES) | set(cached), key=_source_order)},
        transfer_bytes=by_label(delta, TRANSFER_BYTES, "direction"),
        transfer_seconds=by_label(delta, TRANSFER_SECONDS, "direction"),
    )


def _source_order(source: str) -> tuple[int, str]:
    return (CACHE_SOURCES.index(source) if source in CACHE_SOURCES else len(CACHE_SOURCES), source)


async def scrape(client: httpx.AsyncClient, base_url: str) -> tuple[str, dict[Key, float]]:
    """Fetch ``/metrics``; returns the raw text and its counters (empty if the server has none)."""
    try:
        response = await client.get(f"{base_url}/metrics")
    except httpx.HTTPError:
        return "", {}
    if response.status_code != 200:
        return "", {}
    return response.text, parse_counters(response.text)
