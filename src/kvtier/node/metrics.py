"""Prometheus metrics of a running node service, read from :meth:`NodeServer.snapshot` at scrape time.

Runs on prometheus_client's HTTP thread; takes :attr:`NodeServer.lock` for the snapshot only
(the loop holds it per request: microseconds), so a scrape never stalls an engine for long.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.node.server import NodeServer


class NodeCollector(Collector):
    def __init__(self, server: NodeServer) -> None:
        self._server = server

    def collect(self) -> Iterator[Metric]:
        with self._server.lock:
            s = self._server.snapshot()
        stride = s["slot_stride"]
        yield GaugeMetricFamily("kvtier_node_pool_bytes", "Bytes of the node's pool.", value=s["pool_bytes"])
        yield GaugeMetricFamily("kvtier_node_pool_used_bytes", "Bytes of the pool's slots in use (ready or "
                                "being written).", value=s["used_slots"] * stride)
        yield GaugeMetricFamily("kvtier_node_blocks", "Blocks held by the pool.", value=s["blocks"])
        yield GaugeMetricFamily("kvtier_node_pinned_blocks", "Blocks being written or read (not evictable).",
                                value=s["pinned_blocks"])
        yield GaugeMetricFamily("kvtier_node_attached_engines", "Engines with a live connection.",
                                value=s["attached_engines"])
        yield GaugeMetricFamily("kvtier_node_connections", "Open connections (at most --max-connections).",
                                value=s["connections"])
        yield CounterMetricFamily("kvtier_node_evictions", "Blocks evicted from the pool.", value=s["evictions"])
        yield CounterMetricFamily("kvtier_node_run_evictions", "Of kvtier_node_evictions: cold blocks evicted "
                                  "early to continue a run of consecutive slots.", value=s["run_evictions"])
        yield CounterMetricFamily("kvtier_node_rejected_peers", "Connections refused by their credentials.",
                                  value=s["rejected_peers"])
        yield CounterMetricFamily("kvtier_node_refused_connections", "Connections closed at once because "
                                  "--max-connections were open.", value=s["refused_connections"])
        yield CounterMetricFamily("kvtier_node_accept_errors", "Accepts that failed for want of descriptors or "
                                  "memory (EMFILE, ENFILE, ENOBUFS, ENOMEM): accepting paused briefly.",
                                  value=s["accept_errors"])
        yield CounterMetricFamily("kvtier_node_protocol_errors", "Connections closed for a frame that is not a "
                                  "valid request (answered with the field at fault).", value=s["protocol_errors"])
        yield CounterMetricFamily("kvtier_node_slow_readers", "Connections closed for leaving too many replies "
                                  "unread.", value=s["slow_readers"])
        yield CounterMetricFamily("kvtier_node_internal_errors", "Requests (or tier outcomes) whose handling "
                                  "raised: a bug, logged; the request's connection closed.",
                                  value=s["internal_errors"])
        per_engine = {
            "lookups": ("kvtier_node_lookups", "Lookup requests (one per request's lookup)."),
            "lookup_blocks": ("kvtier_node_lookup_blocks", "Blocks asked for in lookups."),
            "hit_blocks": ("kvtier_node_hit_blocks", "Blocks found in the pool (leading runs)."),
            "stored_blocks": ("kvtier_node_stored_blocks", "Blocks committed into the pool."),
            "duplicate_blocks": ("kvtier_node_duplicate_blocks", "Stores of blocks the pool already held "
                                 "(kept once)."),
            "refused_blocks": ("kvtier_node_refused_blocks", "Stores refused (pool pinned full, or engine cap)."),
        }
        for field, (name, doc) in per_engine.items():
            family = CounterMetricFamily(name, doc, labels=["engine"])
            for engine, stats in s["engines"].items():
                family.add_metric([engine], stats[field])
            yield family
        held = GaugeMetricFamily("kvtier_node_engine_held_bytes", "Bytes of the pool charged to each engine.",
                                 labels=["engine"])
        for engine, stats in s["engines"].items():
            held.add_metric([engine], stats["held_slots"] * stride)
        yield held
        tiers = s.get("tiers")
        if tiers is not None:
            yield from _tier_metrics(tiers)


def _tier_metrics(t: dict) -> Iterator[Metric]:
    """The service's own tiers (``--disk-dir``, ``--redis-url``, ``--s3-url``): cascades and promotions by
    tier (``remote``: Redis)."""
    for name, doc, prefix in (
            ("kvtier_node_cascaded_blocks", "Blocks written from the pool to the service's tiers.", "written_"),
            ("kvtier_node_cascade_dropped_blocks", "Blocks not written to a tier (dropped: no room, server down; or failed: an I/O error).",
             "writes_dropped_"),
            ("kvtier_node_promoted_blocks", "Blocks promoted from the service's tiers into the pool.", "promoted_"),
            ("kvtier_node_tier_evicted_blocks", "Blocks the service's tiers evicted to stay within their capacity "
             "(s3: its capacity sweeps; remote: 0, the server evicts).", "evicted_"),
            ("kvtier_node_tier_unavailable", "Calls to a tier's server that found it unreachable, and reads refused "
             "at once while its circuit breaker was open (each a miss or a write lost; disk: 0).", "unavailable_")):
        family = CounterMetricFamily(name, doc, labels=["tier"])
        for tier in ("disk", "remote", "s3"):
            family.add_metric([tier], t.get(prefix + tier, 0))
        yield family
    for field, doc in (("promotion_failures", "Promotions that failed (the block is a miss)."),
                       ("checksum_failures", "Records that failed their checksum (quarantined, a miss)."),
                       ("auth_failures", "Records without a valid MAC (removed, a miss).")):
        yield CounterMetricFamily(f"kvtier_node_{field}", doc, value=t.get(field, 0))
    yield GaugeMetricFamily("kvtier_node_tier_io_in_flight", "Promotions and tier writes in flight.",
                            value=t["promotions_in_flight"] + t["writes_in_flight"])


def registry_for(server: NodeServer) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(server))
    return registry
