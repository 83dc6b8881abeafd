"""The ``kvtier bench`` modes that run vLLM's own offloading (``OffloadingConnector``).

Every native mode uses kvtier's ``KVTierOffloadingSpec`` (vLLM's tiering spec with a worker for
vLLM's CPU backend; on GPUs it is vLLM's own) with vLLM's CPU tier of ``--kv-offloading-size`` GiB,
and one secondary tier:

* ``native-cpu`` -- the CPU tier alone;
* ``native-fs`` -- + vLLM's own ``fs`` tier (size-checked files, no bound);
* ``native-kvtier-disk`` -- + kvtier's disk tier (checksummed, namespaced, ``--disk-size`` GiB);
* ``native-kvtier-redis`` -- + kvtier's Redis tier (a loopback redis-server the runner starts).

``<mode>-restart`` (the three with a secondary tier): a first engine serves the workload and stops
gracefully; a fresh engine on the same root (or server) is measured on the first use of every
prefix, which only the secondary tier holds: the restart case.

Pure data: builds ``kv_connector_extra_config`` and a description; :mod:`kvtier.bench.servers`
turns it into a command line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

NATIVE_MODES = ("native-cpu", "native-fs", "native-kvtier-disk", "native-kvtier-redis")
RESTART = "-restart"
RESTART_MODES = tuple(mode + RESTART for mode in NATIVE_MODES[1:])
SPEC = {"spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier.vllm.native"}
_TIERS = {"native-cpu": "vLLM's CPU tier alone", "native-fs": "vLLM's CPU tier + vLLM's fs tier",
          "native-kvtier-disk": "vLLM's CPU tier + kvtier_disk", "native-kvtier-redis": "vLLM's CPU tier + kvtier_redis"}


def base_mode(mode: str) -> str:
    return mode.removesuffix(RESTART)


def needs_redis(mode: str) -> bool:
    return base_mode(mode) == "native-kvtier-redis"


def extra_config(mode: str, *, cpu_bytes: int, disk_bytes: int, root: Path, redis_url: str | None) -> dict[str, Any]:
    """``kv_connector_extra_config`` of native ``mode``: chunks of one engine block (vLLM's default)."""
    base = base_mode(mode)
    tiers: list[dict[str, Any]] = []
    if base == "native-fs":
        tiers.append({"type": "fs", "root_dir": str(root)})
    elif base == "native-kvtier-disk":
        tiers.append({"type": "kvtier_disk", "root_dir": str(root), "capacity_bytes": disk_bytes})
    elif base == "native-kvtier-redis":
        if redis_url is None:
            raise ValueError(f"the {mode} mode needs the URL of its redis-server")
        tiers.append({"type": "kvtier_redis", "url": redis_url})
    return {**SPEC, "cpu_bytes_to_use": cpu_bytes, "secondary_tiers": tiers}


def describe(mode: str, root: Path) -> str:
    where = "" if base_mode(mode) in ("native-cpu", "native-kvtier-redis") else f" on {root}"
    text = f"vLLM's OffloadingConnector (KVTierOffloadingSpec): {_TIERS[base_mode(mode)]}{where}"
    if mode.endswith(RESTART):
        text += ("; a fresh engine after a first engine served the workload (a restart): the first use of "
                 "every prefix comes from the secondary tier")
    return text
