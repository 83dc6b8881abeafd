"""kvtier's Prometheus metrics, registered through vLLM's connector metrics hook, so they appear
on vLLM's ``/metrics`` next to its own: counters ``kvtier_*`` and gauges ``kvtier_tier_*{tier}``
(each tier's usage). The ``tier`` label: ``host``, ``disk``, ``remote`` (the Redis / Valkey tier)
and ``s3`` (the S3-compatible object tier). ``vllm:prompt_tokens_cached_by_source`` there already splits cached prompt
tokens into ``host`` and ``disk`` from kvtier's answers.

vLLM calls :meth:`KVTierPromMetrics.observe` in its logging process with the ``data`` dict of
:class:`~kvtier.vllm.metadata.KVTierConnectorStats` (one interval: additive counters, the latest
usage sample).
"""

from __future__ import annotations

from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    PromMetric,
    PromMetricT,
)

from kvtier.core.stats import KVTierStats

_WRITES_DROPPED_HELP = ("Writes to a secondary tier that did not store their block, by tier: dropped (queue full, "
                        "no room, disk full, server down or full) or failed (I/O error, error reply)")
_UNAVAILABLE_HELP = ("Calls to a tier's server that found it unreachable, and reads refused at once while its "
                     "circuit breaker was open, by tier: each a miss or a write lost")
# stats field -> (metric name, help, extra label name, label value)
_EVENT_COUNTERS: dict[str, tuple[str, str, str | None, str | None]] = {
    "lookups": ("kvtier_lookups", "Prefix lookups answered by kvtier", None, None),
    "lookup_tokens": ("kvtier_lookup_tokens", "Prompt tokens kvtier was asked about", None, None),
    "hit_tokens_host": ("kvtier_hit_tokens", "Prompt tokens served by kvtier, by tier", "tier", "host"),
    "hit_tokens_disk": ("kvtier_hit_tokens", "Prompt tokens served by kvtier, by tier", "tier", "disk"),
    "hit_tokens_remote": ("kvtier_hit_tokens", "Prompt tokens served by kvtier, by tier", "tier", "remote"),
    "hit_tokens_s3": ("kvtier_hit_tokens", "Prompt tokens served by kvtier, by tier", "tier", "s3"),
    "lookups_retried": ("kvtier_lookups_retried",
                        "Lookups answered 'ask again' (promotions or remote presence probes under way)", None, None),
    "stores_submitted": ("kvtier_stores", "Blocks stored into the host tier", None, None),
    "stores_dropped": ("kvtier_stores_dropped",
                       "Blocks not stored in the host tier: no slot (every slot pinned; attached to a kvtier node: the pool "
                       "full of pinned blocks, this engine at its cap, or the service gone before the block was "
                       "committed)", None, None),
    "stores_voided": ("kvtier_stores_voided", "Blocks not published because vLLM's V2 runner rewrote their engine "
                      "blocks (zeroing, copy-on-write) while the store was in flight, or a connector reset "
                      "came before a finished request's tail was sent", None, None),
    "stores_skipped_threshold": ("kvtier_stores_skipped_threshold", "Stores skipped by store_threshold", None, None),
    "stores_skipped_loaded_elsewhere": ("kvtier_stores_skipped_loaded_elsewhere",
                                        "Blocks not stored because another connector of vLLM's MultiConnector "
                                        "loaded them (store_loaded_elsewhere: false)", None, None),
    "disk_writes_dropped": ("kvtier_writes_dropped", _WRITES_DROPPED_HELP, "tier", "disk"),
    "remote_writes_dropped": ("kvtier_writes_dropped", _WRITES_DROPPED_HELP, "tier", "remote"),
    "s3_writes_dropped": ("kvtier_writes_dropped", _WRITES_DROPPED_HELP, "tier", "s3"),
    "promotions": ("kvtier_promotions", "Blocks promoted from the disk, Redis or S3 tier into the host tier", None, None),
    "promotion_failures": ("kvtier_promotion_failures", "Disk, Redis or S3 reads that failed (the block became a miss)", None, None),
    "load_errors": ("kvtier_load_errors", "Loads into the engine that failed (recomputed by vLLM)", None, None),
    "checksum_failures": ("kvtier_checksum_failures", "Disk blocks, Redis values or S3 objects that failed verification (quarantined / deleted; a miss)", None, None),
    "auth_failures": ("kvtier_auth_failures",
                      "Disk, Redis or S3 records without a valid MAC under the tier's fleet keys (removed; a miss)",
                      None, None),
    "uncacheable_requests": ("kvtier_uncacheable_requests",
                             "Requests kvtier neither loads nor stores (prompt embeddings, unidentified LoRA)",
                             None, None),
    "node_unavailable": ("kvtier_node_unavailable", "Calls to the kvtier node service that found it unreachable "
                         "(each a lookup answered as a miss or a store dropped)", None, None),
    **{f"copy_jobs_{method}": ("kvtier_copy_jobs", "Copy jobs between the engine's KV cache and the host tier (per "
                               "rank), by how they moved: staged (gathers pipelined with large DMAs), runs (one DMA "
                               "per run), pages (page by page)", "method", method)
       for method in ("staged", "runs", "pages")},
    "host_evictions": ("kvtier_evictions", "Blocks evicted, by tier", "tier", "host"),
    "host_run_evictions": ("kvtier_run_evictions", "Of kvtier_evictions: cold blocks evicted early to continue a "
                           "run of consecutive slots (a copy job then moves as few large runs)", "tier", "host"),
    "disk_evictions": ("kvtier_evictions", "Blocks evicted, by tier", "tier", "disk"),
    "s3_evictions": ("kvtier_evictions", "Blocks evicted, by tier", "tier", "s3"),
    "remote_unavailable": ("kvtier_tier_unavailable", _UNAVAILABLE_HELP, "tier", "remote"),
    "s3_unavailable": ("kvtier_tier_unavailable", _UNAVAILABLE_HELP, "tier", "s3"),
}
# stats gauge field -> (metric name, help, tier label value)
_USAGE_GAUGES: dict[str, tuple[str, str, str]] = {
    "host_used_bytes": ("kvtier_tier_used_bytes", "Bytes held by each tier (all ranks)", "host"),
    "disk_used_bytes": ("kvtier_tier_used_bytes", "Bytes held by each tier (all ranks)", "disk"),
    "host_capacity_bytes": ("kvtier_tier_capacity_bytes", "Configured size of each tier (all ranks)", "host"),
    "disk_capacity_bytes": ("kvtier_tier_capacity_bytes", "Configured size of each tier (all ranks)", "disk"),
    "remote_used_bytes": ("kvtier_tier_used_bytes", "Bytes held by each tier (all ranks)", "remote"),
    "remote_capacity_bytes": ("kvtier_tier_capacity_bytes", "Configured size of each tier (all ranks)", "remote"),
    "s3_used_bytes": ("kvtier_tier_used_bytes", "Bytes held by each tier (all ranks)", "s3"),
    "s3_capacity_bytes": ("kvtier_tier_capacity_bytes", "Configured size of each tier (all ranks)", "s3"),
    "s3_blocks": ("kvtier_tier_blocks", "Blocks held by each tier", "s3"),
    "host_blocks": ("kvtier_tier_blocks", "Blocks held by each tier", "host"),
    "host_pinned_blocks": ("kvtier_tier_pinned_blocks",
                           "Blocks being written or read (not evictable); 0 whenever no transfer is in flight",
                           "host"),
    "disk_blocks": ("kvtier_tier_blocks", "Blocks held by each tier", "disk"),
}
_DIRECTIONS = ("engine_to_host", "host_to_engine", "host_to_disk", "disk_to_host", "host_to_remote", "remote_to_host",
               "host_to_s3", "s3_to_host")


class KVTierPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        families: dict[str, Any] = {}
        self._counters: dict[tuple[int, str], Any] = {}
        for field, (name, doc, label, value) in _EVENT_COUNTERS.items():
            if name not in families:
                families[name] = self._counter_cls(
                    name=name, documentation=doc, labelnames=labelnames + ([label] if label else [])
                )
            for engine, labels in per_engine_labelvalues.items():
                extra = [value] if label else []
                self._counters[(engine, field)] = families[name].labels(*labels, *extra)
        bytes_family = self._counter_cls(
            name="kvtier_transfer_bytes", documentation="Bytes moved by kvtier, by direction",
            labelnames=labelnames + ["direction"],
        )
        seconds_family = self._counter_cls(
            name="kvtier_transfer_seconds", documentation="Seconds spent moving bytes, by direction",
            labelnames=labelnames + ["direction"],
        )
        for engine, labels in per_engine_labelvalues.items():
            for direction in _DIRECTIONS:
                self._counters[(engine, f"{direction}_bytes")] = bytes_family.labels(*labels, direction)
                self._counters[(engine, f"{direction}_seconds")] = seconds_family.labels(*labels, direction)

        gauge_families: dict[str, Any] = {}
        self._gauges: dict[tuple[int, str], Any] = {}
        for field, (name, doc, tier) in _USAGE_GAUGES.items():
            if name not in gauge_families:
                gauge_families[name] = self._gauge_cls(
                    name=name, documentation=doc, labelnames=labelnames + ["tier"], multiprocess_mode="mostrecent"
                )
            for engine, labels in per_engine_labelvalues.items():
                self._gauges[(engine, field)] = gauge_families[name].labels(*labels, tier)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        stats = KVTierStats.from_dict(transfer_stats_data).as_dict()
        for name, value in stats.items():
            counter = self._counters.get((engine_idx, name))
            if counter is not None and value:
                counter.inc(value)
            gauge = self._gauges.get((engine_idx, name))
            if gauge is not None and value is not None:
                gauge.set(value)

