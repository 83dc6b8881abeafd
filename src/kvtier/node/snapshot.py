"""The node service's counters and gauges as one map: the ``stats`` reply, ``kvtier inspect`` and
``/metrics`` (:mod:`kvtier.node.metrics`) read it.

Called on the loop thread, or on any thread holding :attr:`NodeServer.lock`. Cheap enough for any
admitted peer to ask for often (each connection gets a few per turn of the loop): O(engines +
connections + the tiers' namespaces), never O(blocks) (the pinned count is a counter of the
index), and all three are bounded (engines by :mod:`kvtier.node.roster` and
``--max-connections``, namespaces by :data:`kvtier.node.tiers.MAX_NAMESPACES`). The lookups'
service-time percentiles (0.7 ms over a full window) are recomputed at most every
:data:`PERCENTILES_EVERY_S`.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from kvtier.node.conn import percentiles

if TYPE_CHECKING:
    from kvtier.node.server import NodeServer

PERCENTILES_EVERY_S = 0.25
"""The lookups' service-time percentiles are recomputed at most this often."""


def snapshot(server: NodeServer) -> dict[str, Any]:
    """The service's counters and gauges (see the module docstring)."""
    index = server.index
    attached: dict[str, int] = {}
    for conn in server.conns.values():
        if conn.session is not None:
            attached[conn.session.engine] = attached.get(conn.session.engine, 0) + 1
    engines = {}
    if index is not None:
        for name, stats in index.engines.items():
            engines[name] = {**vars(stats), "held_slots": index.charged.get(name, 0),
                             "sessions": attached.get(name, 0)}
    now = time.monotonic()
    if now - server.percentiles[0] >= PERCENTILES_EVERY_S:
        server.percentiles = (now, percentiles(server.lookup_seconds))
    options = server.options
    return {
        "socket": str(options.socket_path),
        "service_pid": os.getpid(),
        "pool_id": server.pool_id,
        "uptime_s": round(time.time() - server.started_at, 3),
        "policy": options.policy.value,
        "pool_bytes": options.pool_bytes,
        "slot_bytes": server.slot_bytes,
        "slot_stride": server.stride,
        "num_slots": index.num_slots if index else 0,
        "used_slots": index.used_slots if index else 0,
        "blocks": index.blocks if index else 0,
        "pinned_blocks": index.pinned_entries if index else 0,
        "evictions": index.evictions if index else 0,
        "run_evictions": index.run_evictions if index else 0,
        "connections": len(server.conns),
        "max_connections": options.max_connections,
        "attached_engines": len(attached),
        "sessions_released": server.sessions_released,
        "lookup_service_us": server.percentiles[1],
        "rejected_peers": server.rejected_peers,
        "refused_connections": server.refused_connections,
        "accept_errors": server.accepting.failures,
        "protocol_errors": server.protocol_errors,
        "internal_errors": server.internal_errors,
        "slow_readers": server.slow_readers,
        "max_queued_reply_bytes": server.max_queued,
        "engines": engines,
        "tiers": server.below.snapshot() if server.below is not None else None,
    }
