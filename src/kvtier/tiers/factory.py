"""A secondary tier (disk, Redis / Valkey, S3) opened from its validated configuration entry.

Used by kvtier's connector (every configured tier, in cascade order) and by the tiers behind vLLM's
own offloading (:mod:`kvtier.vllm.native.tiers`, one each). :func:`check_tier` finds what in a
tier's configuration would keep it from ever opening (an unwritable root, refused credentials, a
bucket that does not exist) before the namespace is known, so the engine stops at start-up with the key to fix; a server
that is only unreachable is no such error (the tier starts with misses and connects later). The caller gives the namespace the
records belong to (its digest and every rank's digest go into each record's header), the readable
JSON operators see next to the records, and the payload size of a block of one rank. A tier entry
with a fleet key gets its :class:`~kvtier.tiers.sealing.Sealer` here (records signed, or encrypted). Caller's
thread, at start-up only (the constructors create directories, scan files or connect). The Redis
and S3 tiers' modules (redis-py, obstore) are imported only when one is opened.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from kvtier.core.keys import Namespace
from kvtier.core.tier_config import DiskTierConfig, RedisTierConfig, S3TierConfig, SecondaryTierConfig
from kvtier.core.values import ConfigError
from kvtier.tiers.base import SecondaryTier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk.layout import Access
from kvtier.tiers.sealing import Sealer


def open_tier(config: SecondaryTierConfig, *, model_name: str, namespace: Namespace, namespace_json: str,
              payload_bytes: int, where: str = "secondary_tiers") -> SecondaryTier:
    """``where``: how messages name the entry (a ConfigError names its key under it)."""
    if isinstance(config, DiskTierConfig):
        return DiskTier(
            root_dir=Path(config.root_dir),
            model_name=model_name,
            engine_digest=namespace.engine_digest,
            rank_digests=namespace.rank_digests(),
            namespace_json=namespace_json,
            payload_bytes=payload_bytes,
            capacity_bytes=config.capacity_bytes,
            n_read_threads=config.n_read_threads,
            n_write_threads=config.n_write_threads,
            max_pending_writes=config.max_pending_writes,
            access=Access.GROUP if config.group_access else Access.OWNER,
            sealer=Sealer(config.auth),
        )
    if isinstance(config, S3TierConfig):
        from kvtier.tiers.s3 import S3Tier

        return S3Tier(config, model_name=model_name, engine_digest=namespace.engine_digest,
                      rank_digests=namespace.rank_digests(), namespace_json=namespace_json, payload_bytes=payload_bytes,
                      where=where)
    from kvtier.tiers.redis import RedisTier

    return RedisTier(config, engine_digest=namespace.engine_digest, rank_digests=namespace.rank_digests(),
                     namespace_json=namespace_json, payload_bytes=payload_bytes)


logger = logging.getLogger(__name__)


def check_tier(config: SecondaryTierConfig, *, where: str) -> None:
    """Raise ConfigError naming the key to fix when ``config`` can never open: a disk root this
    process cannot create or write, a Redis server that refuses the credentials or the ACL, an S3
    store that refuses the credentials or has no such bucket; a ``rediss://`` server that speaks
    plain RESP. Blocks for at most about: Redis, ``connect_timeout_s + timeout_s`` per server
    (one PING exchange each, its deadline; a cluster's slot map first), plus as much again for a
    ``rediss://`` one that failed (a plaintext PING); S3, ``timeout_s``. An unreachable server is
    only logged."""
    if isinstance(config, DiskTierConfig):
        _check_root(Path(config.root_dir), where)
    elif isinstance(config, RedisTierConfig):
        _check_redis(config)
    elif isinstance(config, S3TierConfig):
        _check_s3(config, where)


def _check_root(root: Path, where: str) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".kvtier-check-"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{where}: root_dir {str(root)!r} is not usable by this process (uid {os.getuid()}): "
            f"{exc.strerror or exc}. Fix: set 'root_dir' to a directory this user can create and write, "
            "or give it write access."
        ) from None


def _check_redis(config: RedisTierConfig) -> None:
    from kvtier.tiers.redis.client import RedisClient, describe

    client = RedisClient(config)  # ConfigError: password_env names an unset variable
    try:
        client.connect()  # ConfigError: credentials or ACL refused
    except ConfigError:
        raise
    except Exception as exc:
        logger.warning("kvtier redis: %s is not reachable at start-up (%s); the tier starts with misses and "
                       "connects when it answers", config.redacted_url(), describe(exc))
    finally:
        client.close()


def _check_s3(config: S3TierConfig, where: str) -> None:
    from kvtier.tiers.s3.client import Access, check_access

    if check_access(config, where) is Access.UNREACHABLE:  # ConfigError: refused, no bucket
        logger.warning("kvtier s3: %s is not reachable at start-up; the tier starts with misses and connects "
                       "when it answers", config.location)
