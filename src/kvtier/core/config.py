"""One frozen, validated configuration, built from vLLM's ``kv_connector_extra_config``.

kvtier accepts the keys of vLLM's OffloadingConnector with the same meaning, so an operator
switches by changing the connector name, and extends them with its own. Validation happens
once, at start-up, in :meth:`KVTierConfig.from_extra_config`: unknown keys, wrong types and
impossible values raise :class:`ConfigError`, whose message names the key and the fix. Nothing
is silently defaulted except documented defaults for absent keys.

Per-request values (``kv_transfer_params``) are not start-up config: bad ones log a warning and
fall back (see :func:`parse_max_offload_tokens`).
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A start-up configuration error. The message names the key and how to fix it."""


class SpecName(str, enum.Enum):
    """vLLM's offloading spec names: host tier only, or host plus secondary tiers."""

    CPU = "CPUOffloadingSpec"
    TIERING = "TieringOffloadingSpec"


class PolicyName(str, enum.Enum):
    """A tier's eviction policy (``eviction_policy``)."""

    LRU = "lru"
    ARC = "arc"


class TierType(str, enum.Enum):
    FS = "fs"


DEFAULT_DISK_FRACTION = 0.5
"""Without ``capacity_bytes``, a disk tier may use this fraction of the free space at start-up."""


@dataclass(frozen=True)
class DiskTierConfig:
    """``secondary_tiers`` entry of ``type: fs``."""

    root_dir: Path
    capacity_bytes: int
    n_read_threads: int = 16
    n_write_threads: int = 16
    max_pending_writes: int = 256


@dataclass(frozen=True)
class KVTierConfig:
    """The validated connector configuration. See ``docs/configuration.md`` for every key."""

    cpu_bytes_to_use: int
    block_size: int | None = None
    eviction_policy: PolicyName = PolicyName.LRU
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    offload_prompt_only: bool = True
    spec_name: SpecName = SpecName.CPU
    secondary_tiers: tuple[DiskTierConfig, ...] = field(default_factory=tuple)
    self_describing_kv_events: bool = False
    model_identity: str | None = None

    @property
    def disk(self) -> DiskTierConfig | None:
        return self.secondary_tiers[0] if self.secondary_tiers else None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "KVTierConfig":
        """Validate ``kv_connector_extra_config``; raise :class:`ConfigError` on any problem."""
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
        spec_name = _enum(extra, "spec_name", SpecName, SpecName.CPU)
        tiers_raw = extra.get("secondary_tiers", [])
        if not isinstance(tiers_raw, list | tuple):
            raise ConfigError(
                "kv_connector_extra_config: 'secondary_tiers' must be a list of tier objects, e.g. "
                '[{"type": "fs", "root_dir": "/var/cache/kvtier"}]'
            )
        tiers = tuple(_disk_tier(raw, f"secondary_tiers[{i}]") for i, raw in enumerate(tiers_raw))
        if len(tiers) > 1:
            raise ConfigError(
                "kv_connector_extra_config: 'secondary_tiers' holds more than one fs tier; kvtier "
                "supports one disk tier. Keep one entry."
            )
        if tiers and spec_name is SpecName.CPU and "spec_name" in extra:
            raise ConfigError(
                "kv_connector_extra_config: 'secondary_tiers' is set but 'spec_name' is "
                "'CPUOffloadingSpec' (host only). Set 'spec_name' to 'TieringOffloadingSpec' or "
                "remove 'secondary_tiers'."
            )
        if tiers:
            spec_name = SpecName.TIERING
        block_size = extra.get("block_size")
        if block_size is not None:
            block_size = _int(extra, "block_size", minimum=1)
        return cls(
            cpu_bytes_to_use=_int(extra, "cpu_bytes_to_use", minimum=1),
            block_size=block_size,
            eviction_policy=_enum(extra, "eviction_policy", PolicyName, PolicyName.LRU),
            store_threshold=_int(extra, "store_threshold", minimum=0, default=0),
            max_tracker_size=_int(extra, "max_tracker_size", minimum=1, default=64_000),
            offload_prompt_only=_bool(extra, "offload_prompt_only", default=True),
            spec_name=spec_name,
            secondary_tiers=tiers,
            self_describing_kv_events=_bool(extra, "self_describing_kv_events", default=False),
            model_identity=_text(extra, "model_identity"),
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
        "spec_name",
        "secondary_tiers",
        "self_describing_kv_events",
        "model_identity",
    }
)
_FS_KEYS = frozenset(
    {"type", "root_dir", "capacity_bytes", "n_read_threads", "n_write_threads", "max_pending_writes"}
)


def _disk_tier(raw: Any, where: str) -> DiskTierConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"kv_connector_extra_config: '{where}' must be an object like " '{"type": "fs", ...}')
    tier_type = raw.get("type")
    if tier_type != TierType.FS.value:
        raise ConfigError(
            f"kv_connector_extra_config: '{where}.type' is {tier_type!r}; kvtier supports 'fs' "
            "(local or shared filesystem). Set \"type\": \"fs\"."
        )
    unknown = sorted(set(raw) - _FS_KEYS)
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config: unknown key(s) {unknown} in '{where}'. "
            f"Known keys: {sorted(_FS_KEYS)}."
        )
    root = raw.get("root_dir")
    if not isinstance(root, str) or not root:
        raise ConfigError(f"kv_connector_extra_config: '{where}.root_dir' is required: a directory path string.")
    root_dir = Path(root).expanduser()
    _check_writable_dir(root_dir, f"{where}.root_dir")
    if "capacity_bytes" in raw:
        capacity = _int(raw, "capacity_bytes", minimum=1, where=where)
    else:
        capacity = int(shutil.disk_usage(root_dir).free * DEFAULT_DISK_FRACTION)
        logger.info(
            "kvtier: %s.capacity_bytes not set; using %.1f GiB (%.0f%% of the free space of %s)",
            where,
            capacity / 2**30,
            DEFAULT_DISK_FRACTION * 100,
            root_dir,
        )
    return DiskTierConfig(
        root_dir=root_dir,
        capacity_bytes=capacity,
        n_read_threads=_int(raw, "n_read_threads", minimum=1, default=16, where=where),
        n_write_threads=_int(raw, "n_write_threads", minimum=1, default=16, where=where),
        max_pending_writes=_int(raw, "max_pending_writes", minimum=1, default=256, where=where),
    )


def _check_writable_dir(path: Path, key: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"kv_connector_extra_config: '{key}' = {str(path)!r} cannot be created: {exc}") from exc
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(
            f"kv_connector_extra_config: '{key}' = {str(path)!r} is not a writable directory. "
            "Point it at a directory this user can write."
        )


def _int(raw: Mapping[str, Any], key: str, minimum: int, default: int | None = None, where: str = "") -> int:
    name = f"{where}.{key}" if where else key
    if key not in raw:
        assert default is not None, f"{name} has no default"
        return default
    value = raw[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"kv_connector_extra_config: '{name}' must be an integer, got {value!r} ({type(value).__name__})."
        )
    if value < minimum:
        raise ConfigError(f"kv_connector_extra_config: '{name}' must be >= {minimum}, got {value}.")
    return value


def _text(raw: Mapping[str, Any], key: str) -> str | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"kv_connector_extra_config: '{key}' must be a non-empty string, got {value!r}.")
    return value.strip()


def _bool(raw: Mapping[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"kv_connector_extra_config: '{key}' must be true or false, got {value!r}.")
    return value


def _enum(raw: Mapping[str, Any], key: str, enum_type: type[enum.Enum], default: enum.Enum) -> Any:
    if key not in raw:
        return default
    try:
        return enum_type(raw[key])
    except ValueError:
        allowed = [member.value for member in enum_type]
        raise ConfigError(
            f"kv_connector_extra_config: '{key}' is {raw[key]!r}; allowed values: {allowed}."
        ) from None


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
