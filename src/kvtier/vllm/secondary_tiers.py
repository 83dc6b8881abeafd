"""The secondary tiers (disk, Redis / Valkey) of one engine, built from its configuration.

Scheduler process, at start-up only (:class:`~kvtier.vllm.scheduler_side.KVTierScheduler`): each
tier is told the engine's namespace (its digest, every rank's digest and the readable JSON) and
the payload size of a block (one host slot per stored rank). The Redis tier's module (redis-py)
is imported only when one is configured.
"""

from __future__ import annotations

from pathlib import Path

from kvtier.core.config import KVTierConfig
from kvtier.core.keys import Namespace
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk.layout import Access
from kvtier.vllm.geometry import EngineGeometry


def open_secondary_tiers(config: KVTierConfig, geometry: EngineGeometry, namespace: Namespace) -> list:
    """The configured tiers below the host tier, in cascade order (disk, then Redis)."""
    tiers: list = []
    digest = namespace.engine_digest
    payload_bytes = geometry.layout.slot_bytes
    if config.disk is not None:
        disk_config = config.disk
        tiers.append(DiskTier(
            root_dir=Path(disk_config.root_dir),
            model_name=geometry.model_name,
            engine_digest=digest,
            rank_digests=namespace.rank_digests(),
            namespace_json=namespace.config_json(geometry.model_name),
            payload_bytes=payload_bytes,
            capacity_bytes=disk_config.capacity_bytes,
            n_read_threads=disk_config.n_read_threads,
            n_write_threads=disk_config.n_write_threads,
            max_pending_writes=disk_config.max_pending_writes,
            access=Access.GROUP if disk_config.group_access else Access.OWNER,
        ))
    if config.remote is not None:
        from kvtier.tiers.redis import RedisTier  # imports redis-py only when configured

        tiers.append(RedisTier(
            config.remote,
            engine_digest=digest,
            rank_digests=namespace.rank_digests(),
            namespace_json=namespace.config_json(geometry.model_name),
            payload_bytes=payload_bytes,
        ))
    return tiers
