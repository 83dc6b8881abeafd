"""One frozen, validated configuration, built from vLLM's ``kv_connector_extra_config``.

kvtier accepts the keys of vLLM's OffloadingConnector with the same meaning, so an operator
switches by changing the connector name, and extends them with its own. Validation happens
once, at start-up, in :meth:`KVTierConfig.from_extra_config`: unknown keys, wrong types and
impossible values raise :class:`ConfigError`, whose message names the key and the fix. Nothing
is silently defaulted except documented defaults for absent keys.

Per-request values (``kv_transfer_params``) are not start-up config: bad ones log a warning and
fall back (see :func:`parse_max_offload_tokens`).

The ``secondary_tiers`` entries are :mod:`kvtier.core.tier_config`'s; the value checks
:mod:`kvtier.core.values`'. Built in every vLLM process that builds the connector.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.core.tier_config import (  # noqa: F401  (re-exported: the config's vocabulary)
    DEFAULT_DISK_FRACTION,
    DiskTierConfig,
    RedisTierConfig,
    S3TierConfig,
    SecondaryTierConfig,
    TierType,
    parse_secondary_tiers,
)
from kvtier.core.values import (  # noqa: F401  (ConfigError is re-exported)
    ConfigError,
    bool_value,
    enum_value,
    int_value,
    text_value,
    uid_value,
)

logger = logging.getLogger(__name__)


class SpecName(str, enum.Enum):
    """vLLM's offloading spec names: host tier only, or host plus secondary tiers."""

    CPU = "CPUOffloadingSpec"
    TIERING = "TieringOffloadingSpec"


class PolicyName(str, enum.Enum):
    """A tier's eviction policy (``eviction_policy``)."""

    LRU = "lru"
    ARC = "arc"


@dataclass(frozen=True)
class KVTierConfig:
    """The validated connector configuration. See ``docs/configuration.md`` for every key."""

    cpu_bytes_to_use: int
    block_size: int | None = None
    eviction_policy: PolicyName = PolicyName.LRU
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    offload_prompt_only: bool = True
    offload_partial_blocks: bool = False
    # Inside vLLM's MultiConnector: also store blocks another connector loaded (docs/multiconnector.md)
    store_loaded_elsewhere: bool = False
    # A reset of the connector's cache keeps offering what the disk, Redis, S3 tiers and a node's pool
    # hold (default: a new key epoch, see kvtier.core.keys.epoch_root; docs/configuration.md)
    keep_tiers_on_reset: bool = False
    spec_name: SpecName = SpecName.CPU
    secondary_tiers: tuple[SecondaryTierConfig, ...] = field(default_factory=tuple)
    self_describing_kv_events: bool = False
    model_identity: str | None = None
    node: str | None = None  # a kvtier node service's socket: its pool is the host tier (docs/node.md)
    node_uid: int | None = None  # the user the node service may run as besides root and the engine's own
    trace_path: str | None = None  # the access log for `kvtier plan --trace` (kvtier.runtime.access_log)

    @property
    def disk(self) -> DiskTierConfig | None:
        return next((t for t in self.secondary_tiers if isinstance(t, DiskTierConfig)), None)

    @property
    def remote(self) -> RedisTierConfig | None:
        return next((t for t in self.secondary_tiers if isinstance(t, RedisTierConfig)), None)

    @property
    def s3(self) -> S3TierConfig | None:
        return next((t for t in self.secondary_tiers if isinstance(t, S3TierConfig)), None)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None, *, create_dirs: bool = True) -> "KVTierConfig":
        """Validate ``kv_connector_extra_config``; raise :class:`ConfigError` on any problem.
        ``create_dirs``: a missing disk root is created, owner-only (the connector at start-up), or
        only checked to be creatable, nothing made (False: ``kvtier serve`` and ``kvtier doctor``
        checking a configuration before anything runs)."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _TOP_LEVEL_KEYS)
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config: unknown key(s) {unknown}. Known keys: "
                f"{sorted(_TOP_LEVEL_KEYS)}. Remove or correct the key."
            )
        if "cpu_bytes_to_use" not in extra:
            raise ConfigError(
                "kv_connector_extra_config: 'cpu_bytes_to_use' is required: the host tier's size in "
                "bytes, total across all tensor-parallel ranks (e.g. 8000000000 for 8 GB)."
            )
        spec_name = enum_value(extra, "spec_name", SpecName, SpecName.CPU)
        tiers = parse_secondary_tiers(extra.get("secondary_tiers", []), create_dirs=create_dirs)
        if tiers and spec_name is SpecName.CPU and "spec_name" in extra:
            raise ConfigError(
                "kv_connector_extra_config: 'secondary_tiers' is set but 'spec_name' is "
                "'CPUOffloadingSpec' (host only). Set 'spec_name' to 'TieringOffloadingSpec' or "
                "remove 'secondary_tiers'."
            )
        if tiers:
            spec_name = SpecName.TIERING
        node = text_value(extra, "node")
        if node is not None and tiers:
            raise ConfigError(
                "kv_connector_extra_config: 'node' and 'secondary_tiers' are both set; an engine attached "
                "to a kvtier node service has no disk or Redis tier of its own: the service owns the node's. "
                "Give them to the service (kvtier node ... --disk-dir DIR --disk-size GIB --redis-url URL) and "
                "remove 'secondary_tiers', or remove 'node' to keep an embedded host tier with them."
            )
        node_uid = uid_value(extra, "node_uid")
        if node_uid is not None and node is None:
            raise ConfigError("kv_connector_extra_config: 'node_uid' names the user a kvtier node service may run as; "
                              "it needs 'node' (the service's socket). Give 'node', or remove 'node_uid'.")
        return cls(
            cpu_bytes_to_use=int_value(extra, "cpu_bytes_to_use", minimum=1),
            block_size=int_value(extra, "block_size", minimum=1, default=None),
            eviction_policy=enum_value(extra, "eviction_policy", PolicyName, PolicyName.LRU),
            store_threshold=int_value(extra, "store_threshold", minimum=0, default=0),
            max_tracker_size=int_value(extra, "max_tracker_size", minimum=1, default=64_000),
            offload_prompt_only=bool_value(extra, "offload_prompt_only", default=True),
            offload_partial_blocks=bool_value(extra, "offload_partial_blocks", default=False),
            store_loaded_elsewhere=bool_value(extra, "store_loaded_elsewhere", default=False),
            keep_tiers_on_reset=bool_value(extra, "keep_tiers_on_reset", default=False),
            spec_name=spec_name,
            secondary_tiers=tiers,
            self_describing_kv_events=bool_value(extra, "self_describing_kv_events", default=False),
            model_identity=text_value(extra, "model_identity"),
            node=node,
            node_uid=node_uid,
            trace_path=text_value(extra, "trace_path"),
        )

    def offload_block_tokens(self, engine_block_size: int) -> int:
        """Tokens per kvtier block: ``block_size`` if set (a multiple of the engine's), else the engine's."""
        if self.block_size is None:
            return engine_block_size
        if self.block_size % engine_block_size:
            raise ConfigError(
                f"kv_connector_extra_config: 'block_size'={self.block_size} must be a multiple of the "
                f"engine's KV block size ({engine_block_size} tokens). Use "
                f"{-(-self.block_size // engine_block_size) * engine_block_size}, or omit it."
            )
        return self.block_size



_TOP_LEVEL_KEYS = frozenset(
    {
        "cpu_bytes_to_use",
        "block_size",
        "eviction_policy",
        "store_threshold",
        "max_tracker_size",
        "offload_prompt_only",
        "offload_partial_blocks",
        "store_loaded_elsewhere",
        "keep_tiers_on_reset",
        "spec_name",
        "secondary_tiers",
        "self_describing_kv_events",
        "model_identity",
        "node",
        "node_uid",
        "trace_path",
    }
)


def parse_max_offload_tokens(params: Mapping[str, Any] | None, request_id: str = "?") -> int | None:
    """Per-request ``kv_transfer_params.max_offload_tokens``: a non-negative int caps how many of
    the request's tokens are offloaded (0 disables offload for it). Anything else (bool, negative,
    non-int) logs a warning and means no cap."""
    raw = params.get("max_offload_tokens") if params else None
    if raw is None:
        return None
    if type(raw) is int and raw >= 0:
        return raw
    logger.warning(
        "kvtier: request %s: kv_transfer_params.max_offload_tokens must be a non-negative integer, "
        "got %r; ignoring it (no cap).",
        request_id,
        raw,
    )
    return None
