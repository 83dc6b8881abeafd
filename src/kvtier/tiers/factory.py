"""A secondary tier (disk, Redis / Valkey, S3) opened from its validated configuration entry.

Used by kvtier's connector (every configured tier, in cascade order), by the node service (its tiers,
per namespace: :mod:`kvtier.node.tiers`) and by the tiers behind vLLM's own offloading
(:mod:`kvtier.vllm.native.tiers`, one each). :func:`check_tier` finds what in a tier's configuration
would keep it from ever opening (an unwritable root, refused credentials, a bucket that does not
exist) before the namespace is known, so the engine stops at start-up with the key to fix; a server
that is only unreachable is no such error (the tier starts with misses and connects later). The caller gives the namespace the
records belong to (its digest and every rank's digest go into each record's header), the readable
JSON operators see next to the records, and the payload size of a block of one rank. A tier entry
with a fleet key gets its :class:`~kvtier.tiers.sealing.Sealer` here (records signed, or encrypted). Caller's
thread, at start-up only (the constructors create directories, scan files or connect). The Redis
and S3 tiers' modules (redis-py, obstore) are imported only when one is opened.

One start-up probe per server. Where :func:`check_tier` ran first (behind vLLM's offloading, in the
node service), what it found of the server is handed to the :func:`open_tier` of the same entry that
follows (taken once, from any thread, within :data:`FINDING_FRESH_S`): the tier starts from it
instead of asking the server again, so a server that does not answer costs its timeout once (a
tier it found unreachable starts off and its monitor connects in the background; an S3 store it
reached is not listed again). kvtier's connector opens its tiers without a check: each tier's
constructor probes, once.

While a tier opens on a thread of its own (the node service, vLLM's offloading), a caller that asks
for blocks is told to ask again for at most :data:`OPEN_WAIT_S` (:func:`open_wait_ends`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

from kvtier.core.dirs import GROUP_DIR_MODE, OWNER_DIR_MODE, make_dirs
from kvtier.core.keys import Namespace
from kvtier.core.tier_config import DiskTierConfig, RedisTierConfig, S3TierConfig, SecondaryTierConfig
from kvtier.core.values import ConfigError
from kvtier.tiers.base import SecondaryTier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk.layout import Access
from kvtier.tiers.sealing import Sealer

logger = logging.getLogger(__name__)

OPEN_WAIT_S = 5.0
"""While a tier opens (a disk root scanned, a server connected: on a thread of its own), callers that
ask for blocks it may hold are told to ask again for at most this long (a fresh engine's first
requests can still be served from it); then misses until it is open, so a hung mount or server never
keeps requests waiting. The node service per namespace, vLLM's offloading per tier."""


def open_wait_ends(since: float) -> float:
    """When (``time.monotonic()``) callers stop being told to ask again for a tier whose opening
    began at ``since``: :data:`OPEN_WAIT_S` later. Memory only, any thread."""
    return since + OPEN_WAIT_S


FINDING_FRESH_S = 10.0
"""How long what :func:`check_tier` found of a server stands in for the probe of the :func:`open_tier`
that follows: an older finding (the node service's first namespace may open long after its start-up
check) is dropped, and the tier probes the server itself."""


class _Findings:
    """What :func:`check_tier` found of each entry's server (reachable or not), kept for the
    :func:`open_tier` of the same entry that follows it and taken by it once, within
    :data:`FINDING_FRESH_S`. Any thread (a lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._found: dict[SecondaryTierConfig, tuple[bool, float]] = {}

    @staticmethod
    def _entry(config: SecondaryTierConfig) -> SecondaryTierConfig:
        # A record's TTL is no part of what a check finds: behind vLLM's offloading a per-process
        # namespace caps it once the tier opens, after the check (kvtier.vllm.native.tiers).
        return dataclasses.replace(config, ttl_seconds=None) if isinstance(config, RedisTierConfig) else config

    def put(self, config: SecondaryTierConfig, reachable: bool) -> None:
        with self._lock:
            self._found[self._entry(config)] = (reachable, time.monotonic())

    def take(self, config: SecondaryTierConfig) -> bool | None:
        """The finding of ``config``'s server, or None: none, or older than :data:`FINDING_FRESH_S`."""
        with self._lock:
            found = self._found.pop(self._entry(config), None)
        if found is None or time.monotonic() - found[1] > FINDING_FRESH_S:
            return None
        return found[0]


_findings = _Findings()


def open_tier(config: SecondaryTierConfig, *, model_name: str, namespace: Namespace, namespace_json: str,
              payload_bytes: int, where: str = "secondary_tiers") -> SecondaryTier:
    """``where``: how messages name the entry (a ConfigError names its key under it). A Redis or S3
    tier of an entry :func:`check_tier` checked starts from what it found (see the module docstring);
    otherwise its constructor probes the server."""
    reachable = _findings.take(config)
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
                      where=where, reachable=reachable)
    from kvtier.tiers.redis import RedisTier

    return RedisTier(config, engine_digest=namespace.engine_digest, rank_digests=namespace.rank_digests(),
                     namespace_json=namespace_json, payload_bytes=payload_bytes, reachable=reachable)


def check_tier(config: SecondaryTierConfig, *, where: str) -> bool:
    """Raise ConfigError naming the key to fix when ``config`` can never open: a disk root this
    process cannot create or write, a Redis server that refuses the credentials or the ACL, an S3
    store that refuses the credentials or has no such bucket; a ``rediss://`` server that speaks
    plain RESP. Blocks for at most about: Redis, ``connect_timeout_s + timeout_s`` per server
    (one PING exchange each, its deadline; a cluster's slot map first), plus as much again for a
    ``rediss://`` one that failed (a plaintext PING); S3, ``timeout_s``. An unreachable server is
    only logged. Returns whether the server answered (a disk root: True), and keeps that for the
    :func:`open_tier` of this entry that follows, which then does not ask the server again."""
    if isinstance(config, DiskTierConfig):
        _check_root(Path(config.root_dir), where, GROUP_DIR_MODE if config.group_access else OWNER_DIR_MODE)
        return True
    if isinstance(config, RedisTierConfig):
        reachable = _check_redis(config)
    elif isinstance(config, S3TierConfig):
        reachable = _check_s3(config, where)
    else:
        return True
    _findings.put(config, reachable)
    return reachable


def _check_root(root: Path, where: str, mode: int) -> None:
    """ConfigError unless ``root`` is a directory this process can write; a missing root and its
    missing parents are created with exactly ``mode`` (owner-only, or group-shared), as the
    connector creates them (:mod:`kvtier.core.dirs`)."""
    try:
        make_dirs(root, mode)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".kvtier-check-"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{where}: root_dir {str(root)!r} is not usable by this process (uid {os.getuid()}): "
            f"{exc.strerror or exc}. Fix: set 'root_dir' to a directory this user can create and write, "
            "or give it write access."
        ) from None


def _check_redis(config: RedisTierConfig) -> bool:
    from kvtier.tiers.redis.client import RedisClient, describe

    client = RedisClient(config)  # ConfigError: password_env names an unset variable
    try:
        client.connect()  # ConfigError: credentials or ACL refused
        return True
    except ConfigError:
        raise
    except Exception as exc:
        logger.warning("kvtier redis: %s is not reachable at start-up (%s); the tier starts with misses and "
                       "connects when it answers", config.redacted_url(), describe(exc))
        return False
    finally:
        client.close()


def _check_s3(config: S3TierConfig, where: str) -> bool:
    from kvtier.tiers.s3.client import Access, check_access

    if check_access(config, where) is Access.UNREACHABLE:  # ConfigError: refused, no bucket
        logger.warning("kvtier s3: %s is not reachable at start-up; the tier starts with misses and connects "
                       "when it answers", config.location)
        return False
    return True
