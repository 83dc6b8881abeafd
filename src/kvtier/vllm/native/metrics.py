"""A native tier's metrics, through vLLM's offloading metric definitions.

vLLM asks a tier class for its metric definitions in every process that exports metrics
(:func:`definitions`, pure) and the tier object for observations once per step, in the scheduler
(:class:`TierMetrics`). vLLM's tiering manager already counts lookups, hits, bytes and seconds per
tier (``vllm:kv_offload_tiering_*``); these add what only kvtier sees: records refused on read
(bad checksum, short, another namespace), stores dropped, evictions, and usage. Every series is
labelled with the tier's type (``tier``: kvtier_disk, kvtier_redis, kvtier_s3, kvtier_node).
"""

from __future__ import annotations

from collections import Counter

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
)

from kvtier.runtime.chunks.store import ChunkStore
from kvtier.tiers.base import READ_FAILURES, WRITE_FAILURES

FAILED_READS = "kvtier_offload_failed_reads"
STORES_DROPPED = "kvtier_offload_stores_dropped"
EVICTIONS = "kvtier_offload_evictions"
USED_BYTES = "kvtier_offload_used_bytes"
CAPACITY_BYTES = "kvtier_offload_capacity_bytes"
UNAVAILABLE = "kvtier_offload_unavailable"
_DROPS = tuple(sorted({failure.reason for failure in WRITE_FAILURES.values()}))  # chunks not stored


def definitions() -> dict[str, OffloadingMetricMetadata]:
    return {
        FAILED_READS: OffloadingCounterMetadata(
            documentation="Chunks a kvtier tier failed to read, by reason: rejected (checksum, length or "
                          "namespace check failed: quarantined or deleted), unauthenticated (no valid MAC under "
                          "the tier's fleet keys: quarantined or deleted), vanished, io_error. Each is "
                          "a miss, recomputed by vLLM.",
            labelnames=("tier", "reason")),
        STORES_DROPPED: OffloadingCounterMetadata(
            documentation="Chunks a kvtier tier did not store (queue full, no room, write error)",
            labelnames=("tier",)),
        EVICTIONS: OffloadingCounterMetadata(
            documentation="Chunks a kvtier tier evicted to stay within capacity_bytes", labelnames=("tier",)),
        USED_BYTES: OffloadingGaugeMetadata(
            documentation="Bytes a kvtier tier holds (disk: this namespace's files as this engine indexes "
                          "them; Redis: the server's used_memory)", labelnames=("tier",)),
        CAPACITY_BYTES: OffloadingGaugeMetadata(
            documentation="A kvtier tier's bound (disk: capacity_bytes; Redis: maxmemory, 0 = none; "
                          "kvtier_node: the pool's size)",
            labelnames=("tier",)),
        UNAVAILABLE: OffloadingCounterMetadata(
            documentation="Calls a kvtier tier made to its server that found it gone or refusing (kvtier_node: "
                          "the node service down or restarting); each a miss or a dropped store",
            labelnames=("tier",)),
    }


class TierMetrics:
    """Turns a :class:`ChunkStore`'s running totals into per-step observations (deltas)."""

    def __init__(self, tier_label: str):
        self._label = (tier_label,)
        self._reported: Counter[str] = Counter()
        self._evictions = 0
        self._unavailable = 0

    def take(self, store: ChunkStore) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        for reason, _counter in READ_FAILURES.values():
            delta = store.counts[reason] - self._reported[reason]
            if delta:
                stats.increase_counter(FAILED_READS, delta, self._label + (reason,))
        dropped = sum(store.counts[k] for k in _DROPS) - sum(self._reported[k] for k in _DROPS)
        if dropped:
            stats.increase_counter(STORES_DROPPED, dropped, self._label)
        self._reported = Counter(store.counts)
        evictions = store.tier.evictions
        if evictions > self._evictions:
            stats.increase_counter(EVICTIONS, evictions - self._evictions, self._label)
            self._evictions = evictions
        unavailable = store.tier.unavailable
        if unavailable > self._unavailable:
            stats.increase_counter(UNAVAILABLE, unavailable - self._unavailable, self._label)
            self._unavailable = unavailable
        usage = store.usage()
        stats.set_gauge(USED_BYTES, usage.used_bytes, self._label)
        stats.set_gauge(CAPACITY_BYTES, usage.capacity_bytes, self._label)
        return stats
