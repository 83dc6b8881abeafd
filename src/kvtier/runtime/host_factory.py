"""The scheduler side's :class:`~kvtier.runtime.host_side.HostSide`, chosen by the connector config.

Without ``node``: an :class:`~kvtier.runtime.orchestrator.Orchestrator` over the engine's own host
tier (its ranks' shared-memory regions, mapped by the caller) and the configured secondary tiers,
opened here in cascade order. With ``node``: a :class:`~kvtier.runtime.node_host.NodeHost` attached
to the service at that socket (or attaching once it answers), whose hello carries the engine's
namespace for the service's tiers. Caller's thread, at start-up only (tiers open, a socket
connects); raises :class:`~kvtier.core.values.ConfigError` naming the key to fix.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvtier.core.config import KVTierConfig
from kvtier.core.keys import Namespace
from kvtier.core.slots import HostSlotLayout
from kvtier.node.protocol import Role
from kvtier.policy.admission import StoreAdmission
from kvtier.runtime.host_side import HostSide
from kvtier.runtime.node_host import NodeHost, connect_node
from kvtier.runtime.orchestrator import HostBytes, Orchestrator
from kvtier.tiers.factory import open_tier
from kvtier.tiers.host import HostIndex

logger = logging.getLogger(__name__)


def open_host_side(config: KVTierConfig, namespace: Namespace, *, engine_id: str, model_name: str, layout: HostSlotLayout,
                   rank_views: Sequence[memoryview]) -> HostSide:
    """``layout``: the engine's host tier (slots of one block of one rank); ``rank_views``: the
    scheduler's mapping of each stored rank's region (their slots, embedded only)."""
    admission = StoreAdmission(config.store_threshold, config.max_tracker_size)
    if config.node is not None:  # the node's pool is the host tier
        client = connect_node(config.node, engine=engine_id, role=Role.SCHEDULER, slot_bytes=layout.slot_bytes,
                              cap_bytes=config.cpu_bytes_to_use,
                              map_pool=False,  # the scheduler copies nothing (the service runs the tiers)
                              namespace=namespace.config_json(model_name), node_uid=config.node_uid)
        attachment = client.attachment
        logger.info("kvtier: kvtier node at %s (%s); this engine may hold %.2f GiB of it (cpu_bytes_to_use); "
                    "block %d tokens, %.1f MiB per rank", config.node,
                    f"pool {attachment.pool_id}, {attachment.num_slots} slots" if attachment else "not attached yet",
                    config.cpu_bytes_to_use / 2**30, namespace.block_tokens, layout.slot_bytes / 2**20)
        return NodeHost(client, len(rank_views), admission)
    json = namespace.config_json(model_name)
    tiers = [open_tier(tier, model_name=model_name, namespace=namespace, namespace_json=json,
                       payload_bytes=layout.slot_bytes, where=f"secondary_tiers[{index}]")
             for index, tier in enumerate(config.secondary_tiers)]  # disk, then Redis, then S3
    return Orchestrator(HostIndex(layout.num_slots, config.eviction_policy), HostBytes(rank_views, layout.slot_bytes),
                        tiers, admission)
