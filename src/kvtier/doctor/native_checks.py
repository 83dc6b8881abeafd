"""``kvtier doctor`` on lines that use vLLM's own offloading (``OffloadingConnector``), with or without
kvtier's tiers behind it (``secondary_tiers`` of ``TieringOffloadingSpec`` / ``KVTierOffloadingSpec``).

The pitfalls of that stack:

- a random hash seed (``--prefix-caching-hash-algo xxhash`` without ``PYTHONHASHSEED``) with a tier
  meant to outlive the process or be shared: vLLM's keys then differ in every process, so every
  restart and every other engine misses (:func:`check_native_hash_seed`);
- vLLM's ``fs`` tier: it checks only a file's size, so a flipped byte is served, and its evictor is
  for testing only (:func:`check_native_fs_tier`);
- sizes: ``cpu_bytes_to_use`` and a kvtier tier's ``capacity_bytes`` are totals over the engine's
  ranks, not per rank (:func:`check_native_sizes`);
- LoRA with kvtier's tiers: vLLM's keys name an adapter by its name and path only, so an adapter
  retrained in place is served the KV of its old weights after a restart (:func:`check_native_lora`);
- tiers told to keep what they hold across a reset of the cache (``keep_on_reset``, and kvtier's
  own connector's ``keep_tiers_on_reset``): weights updated in place would be served the KV of
  their old weights (:func:`check_kept_on_reset`);
- tiers and specs that will not resolve (kvtier not installed where vLLM runs, plugins filtered by
  ``VLLM_PLUGINS``, a wrong module path or key), and vLLM's own spec on vLLM-CPU, which refuses to
  start there (:func:`check_native_resolution`).

Operator side: reads the command line, this environment's installed packages and nothing else;
never imports vLLM, never writes.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Mapping
from typing import Any

from kvtier.core.tier_config import NATIVE_TIER_KEYS, TierType, parse_tier
from kvtier.core.values import ConfigError
from kvtier.doctor.probes import validate_extra_config
from kvtier.doctor.setup import NATIVE_CONNECTOR, Finding, Setup, runs_on_cpu
from kvtier.planning.sizing import GIB

KVTIER_TYPES = {"kvtier_disk": "fs", "kvtier_redis": "redis", "kvtier_s3": "s3", "kvtier_node": "node",
                "KVTierDiskTier": "fs", "KVTierRedisTier": "redis", "KVTierS3Tier": "s3", "KVTierNodeTier": "node"}
"""kvtier's secondary tier types (short names from its plugin; class names for module_path) -> kvtier's kind."""
KVTIER_MODULE = "kvtier.vllm.native"
KVTIER_SPEC = "KVTierOffloadingSpec"
PERSISTENT_TYPES = ("fs", "obj", "p2p", "kvcr", *KVTIER_TYPES)
"""vLLM tiers that outlive the process or are shared with other engines (all but ``example``)."""
RANDOM_SEED_HASHES = ("xxhash", "xxhash_cbor")


def _native_tiers(s: Setup) -> list[dict[str, Any]]:
    if s.connector != NATIVE_CONNECTOR or s.extra is None:
        return []
    tiers = s.extra.get("secondary_tiers")
    return [t for t in tiers if isinstance(t, dict)] if isinstance(tiers, list) else []


def _spec(s: Setup) -> str:
    return str((s.extra or {}).get("spec_name") or "CPUOffloadingSpec")


def kvtier_plugin_loads(getenv) -> bool:
    """Whether vLLM, run from this environment, loads kvtier's ``vllm.general_plugins`` entry point."""
    names = {e.name for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    allowed = getenv("VLLM_PLUGINS")
    return "kvtier" in names and (allowed is None or "kvtier" in allowed.split(","))


def _cpu_because(line) -> str:  # noqa: ANN001 (a ServeLine)
    """What says the line runs on vLLM-CPU (:func:`kvtier.doctor.setup.runs_on_cpu`'s rule)."""
    if line.program == "kvtier":
        return "kvtier serve runs vLLM's CPU backend here: a CPU build of vLLM, or VLLM_TARGET_DEVICE=cpu"
    if line.getenv("VLLM_TARGET_DEVICE"):
        return "the line's environment has VLLM_TARGET_DEVICE=cpu"
    return ("the line's environment sets VLLM_CPU_KVCACHE_SPACE and no VLLM_TARGET_DEVICE; a GPU server's line "
            "says VLLM_TARGET_DEVICE=cuda")


def _kvtier_spec_fix(s: Setup) -> str:
    """The fix for vLLM's own spec on vLLM-CPU: kvtier's spec in the line's kv-transfer config. A line
    that got vLLM's spec from ``--kv-offloading-size`` has no config to add it to, and that flag
    would replace one given beside it (``offloading-size-replaces-connector``): the fix is then the
    whole ``--kv-transfer-config`` that takes the flag's place."""
    kvtier_keys = f'"spec_name": "{KVTIER_SPEC}", "spec_module_path": "{KVTIER_MODULE}"'
    if s.line.transfer_config is None and s.line.has("--kv-offloading-size"):
        config = json.dumps({"kv_connector": NATIVE_CONNECTOR, "kv_role": "kv_both", "kv_connector_extra_config": {
            "spec_name": KVTIER_SPEC, "spec_module_path": KVTIER_MODULE, "cpu_bytes_to_use": s.host_bytes or 0}})
        return (f"Drop --kv-offloading-size and give --kv-transfer-config '{config}' (vLLM's offloading with "
                "kvtier's spec, which has a CPU worker), or use kvtier's own connector (kvtier serve).")
    return (f"Use {kvtier_keys} in kv_connector_extra_config (vLLM's tiering spec with a CPU worker), or "
            "kvtier's own connector (kvtier serve).")


def check_native_resolution(s: Setup) -> list[Finding]:
    if s.connector != NATIVE_CONNECTOR:
        return []
    out: list[Finding] = []
    spec, extra = _spec(s), s.extra or {}
    plugin = kvtier_plugin_loads(s.line.getenv)
    if spec == KVTIER_SPEC and not extra.get("spec_module_path") and not plugin:
        out.append(Finding(
            "kvtier-spec-unresolved", "error", f"{KVTIER_SPEC} will not resolve",
            "vLLM finds an out-of-tree spec only by spec_module_path, or by a plugin that registers it; "
            "kvtier's plugin is not installed here or VLLM_PLUGINS leaves it out.",
            f"Add \"spec_module_path\": \"{KVTIER_MODULE}\" to kv_connector_extra_config."))
    if spec in ("CPUOffloadingSpec", "TieringOffloadingSpec") and runs_on_cpu(s.line):
        out.append(Finding(
            "native-offloading-on-cpu", "error", f"vLLM's {spec} refuses vLLM's CPU backend",
            "Its worker is CUDA/XPU only: the engine stops at start-up with 'CPU Offloading is currently "
            f"only supported on CUDA-alike and XPU GPUs'. ({_cpu_because(s.line)})",
            _kvtier_spec_fix(s)))
    for index, tier in enumerate(_native_tiers(s)):
        tier_type = str(tier.get("type"))
        if tier_type not in KVTIER_TYPES:
            continue
        where = f"secondary_tiers[{index}] ({tier_type})"
        module = tier.get("module_path")
        if module is None and not plugin:
            out.append(Finding(
                "kvtier-tier-unresolved", "error", f"{where} will not resolve",
                "vLLM knows the types kvtier_disk / kvtier_redis / kvtier_node only from kvtier's vllm.general_plugins entry "
                "point, which is not installed in this environment or is left out by VLLM_PLUGINS.",
                f"pip install kvtier where vLLM runs (and name kvtier in VLLM_PLUGINS if you set it), or add "
                f"\"module_path\": \"{KVTIER_MODULE}\" to the tier's entry."))
        elif module is not None and module != KVTIER_MODULE:
            out.append(Finding(
                "kvtier-tier-module", "error", f"{where}: module_path {module!r}",
                f"kvtier's tiers live in {KVTIER_MODULE}; vLLM looks the type up there by name.",
                f"Set \"module_path\": \"{KVTIER_MODULE}\"."))
        error = _tier_keys_error(tier, KVTIER_TYPES[tier_type], index)
        if error:
            out.append(Finding("kvtier-tier-config", "error", f"Invalid {where}", error,
                               "Fix the entry as the message says (docs/configuration.md, native tiers)."))
    return out


def _tier_keys_error(tier: Mapping[str, Any], kind: str, index: int) -> str | None:
    """The error kvtier would raise at start-up for this tier's keys (checked as kvtier's own tier of
    ``kind``, without creating its directory), or None."""
    entry = {k: v for k, v in tier.items() if k not in NATIVE_TIER_KEYS}
    if kind == TierType.NODE.value:  # not a tier of kvtier's connector: its own parser (contacts nothing)
        try:
            parse_tier(entry, TierType.NODE, f"secondary_tiers[{index}]")
        except ConfigError as exc:
            return str(exc)
        return None
    entry["type"] = kind
    _, error, _ = validate_extra_config({"cpu_bytes_to_use": GIB, "secondary_tiers": [entry]})
    return error.replace("secondary_tiers[0]", f"secondary_tiers[{index}]") if error else None


def check_native_hash_seed(s: Setup) -> list[Finding]:
    algo = s.line.value("--prefix-caching-hash-algo")
    persistent = [str(t.get("type")) for t in _native_tiers(s) if str(t.get("type")) in PERSISTENT_TYPES]
    if algo not in RANDOM_SEED_HASHES or not persistent or s.line.getenv("PYTHONHASHSEED") is not None:
        return []
    return [Finding(
        "native-random-hash-seed", "error",
        f"--prefix-caching-hash-algo {algo} without PYTHONHASHSEED: {', '.join(persistent)} can never hit "
        "after a restart or on another engine",
        f"vLLM seeds {algo} with fresh random bytes in every process (sha256 has a fixed default seed), so the "
        "keys of the same prompt differ in every process: vLLM's fs tier fills its root with files no later "
        "process reads, and kvtier's tiers keep a namespace of this process only (removed at shutdown).",
        "export PYTHONHASHSEED=<one value, the same on every engine> before vllm serve, or drop "
        "--prefix-caching-hash-algo (vLLM's default, sha256, shares keys across processes).")]


def check_native_fs_tier(s: Setup) -> list[Finding]:
    out = []
    for index, tier in enumerate(_native_tiers(s)):
        if tier.get("type") != "fs":
            continue
        suggestion = {"type": "kvtier_disk", "root_dir": tier.get("root_dir", "/var/cache/kvtier"),
                      "capacity_bytes": 200 * 10**9}
        out.append(Finding(
            "native-fs-unchecked", "warning", f"secondary_tiers[{index}]: vLLM's fs tier has no checksums and no bound",
            "It accepts a block file when its size is right, so a flipped byte is served as KV (wrong output, "
            "no error); its evictor is for testing, so the root grows until the disk is full; it does not "
            "check that files come from the same model weights and page layout; and vLLM keeps it across a "
            "reset of its cache, so weights updated in place (RL) are served their old weights' KV (kvtier_disk "
            "then moves to a new key epoch).",
            f"Replace it with kvtier's disk tier (checksummed, namespaced, bounded by capacity_bytes shared "
            f"by every engine on the root): {json.dumps(suggestion)} (size capacity_bytes to your disk)."))
    return out


def check_native_sizes(s: Setup) -> list[Finding]:
    tiers = [(i, t) for i, t in enumerate(_native_tiers(s)) if KVTIER_TYPES.get(str(t.get("type"))) == "fs"]
    out, tp = [], s.line.tp * s.line.pp
    for index, tier in tiers:
        capacity = tier.get("capacity_bytes")
        if not isinstance(capacity, int | float) or isinstance(capacity, bool):
            continue
        if tp > 1:
            out.append(Finding(
                "native-size-total", "info", f"secondary_tiers[{index}].capacity_bytes is the TOTAL of {tp} ranks",
                f"kvtier_disk stores one record per rank and bounds them together: each rank's records get about "
                f"{capacity / tp / GIB:.1f} GiB. cpu_bytes_to_use is a total too (vLLM's CPU tier holds every "
                "rank's pages in one row).",
                f"None if intended; for {capacity / GIB:.1f} GiB per rank give {int(capacity * tp)}."))
        if s.host_bytes is not None and capacity < s.host_bytes:
            out.append(Finding(
                "native-disk-smaller-than-host", "warning",
                f"secondary_tiers[{index}] ({capacity / GIB:.1f} GiB) is smaller than vLLM's CPU tier "
                f"({s.host_bytes / GIB:.1f} GiB)",
                "Every chunk stored in the CPU tier is also written to the disk tier, so a smaller disk tier "
                "holds a subset of what the CPU tier holds and adds almost no hits (a size given per rank?).",
                "Give the disk tier several times cpu_bytes_to_use (both are totals over all ranks)."))
    return out


def lora_enabled(s: Setup) -> bool:
    """Whether the line serves LoRA adapters: ``--enable-lora`` (the last of it and
    ``--no-enable-lora`` wins, as in vLLM's parser)."""
    last = None
    for arg in s.line.argv:
        if arg.split("=", 1)[0] in ("--enable-lora", "--enable_lora", "--no-enable-lora", "--no_enable_lora"):
            last = arg.split("=", 1)
    if last is None:
        return False
    name, value = last[0].replace("_", "-"), (last[1] if len(last) > 1 else None)
    on = value is None or value.lower() in ("1", "true", "yes")
    return on if name == "--enable-lora" else not on


def check_native_lora(s: Setup) -> list[Finding]:
    tiers = [(i, str(t.get("type"))) for i, t in enumerate(_native_tiers(s)) if str(t.get("type")) in KVTIER_TYPES]
    if not tiers or not lora_enabled(s):
        return []
    where = ", ".join(f"secondary_tiers[{i}] ({t})" for i, t in tiers)
    kinds = {KVTIER_TYPES[t] for _, t in tiers}
    target = " / ".join(("DIR" if kind == "fs" else "URL") for kind in sorted(kinds))
    return [Finding(
        "native-lora-retrained", "warning",
        f"LoRA with {where}: an adapter retrained under the same name and path is served its old KV",
        "Behind vLLM's own offloading, a block's key names a LoRA adapter only by its name and path "
        "(vLLM's block hash), not by its weights, and kvtier's tiers see nothing else of the request; "
        "their blocks outlive the engine, so after a restart an adapter retrained in place gets the KV "
        "its previous weights computed: wrong outputs, no error. (kvtier's own connector fingerprints "
        "adapter weights and has no such gap.)",
        f"When you retrain an adapter, give it a new name or path, or purge its model's blocks from these "
        f"tiers before restarting: kvtier purge {target} --model {s.model or 'MODEL'} (the adapter's blocks "
        "cannot be told apart from the base model's there).")]


def check_kept_on_reset(s: Setup) -> list[Finding]:
    """``keep_tiers_on_reset`` (kvtier's connector) or a native tier's ``keep_on_reset``: a reset of
    the cache (``pause_generation``) keeps offering what the tiers hold, wrong after an in-place
    weight update."""
    if s.extra is None:
        return []
    where = []
    if s.is_kvtier and s.extra.get("keep_tiers_on_reset") is True:
        where.append("keep_tiers_on_reset")
    where += [f"secondary_tiers[{i}].keep_on_reset" for i, t in enumerate(_native_tiers(s))
              if t.get("keep_on_reset") is True and str(t.get("type")) in KVTIER_TYPES]
    if not where:
        return []
    return [Finding(
        "kept-on-reset", "info", f"{', '.join(where)}: a reset of the cache keeps offering what the tiers hold",
        "After pause_generation (or reset_prefix_cache(reset_connector=True)) this engine is still offered "
        "the blocks stored before it, by it or by other engines. Right while its weights never change; "
        "weights updated in place (RL rollouts) would be served the KV of their old weights: wrong outputs, "
        "no error.",
        "None if this engine's weights never change while it runs; otherwise remove it (a reset then moves "
        "the engine to a new key epoch: nothing of before is offered to it again).")]
