"""The ``vllm serve`` command with kvtier configured: what ``kvtier serve`` runs and ``kvtier bench``
starts, and what ``kvtier doctor`` reasons about.

The translation from kvtier's flags to a ``vllm serve`` command is pure and testable without
vLLM: :class:`ServeOptions` holds kvtier's own flags, :func:`build_extra_config` turns them into
``kv_connector_extra_config``, and :func:`build_serve_command` validates everything (with errors
that name the flag) and returns the argv, the environment variables to add and the start-up
summary. Only :func:`launch` starts vLLM (by ``exec``, so signals and the exit code are vLLM's).
The passthrough vLLM arguments are read by :mod:`kvtier.launch.serve_args`; the module vLLM is run
as is chosen by :mod:`kvtier.launch.vllm_entry`.

Importing this module is cheap: standard library and those two modules only; kvtier.core.config and
kvtier.models.default are imported inside the functions that need them, vLLM never.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.core.tier_config import redact_url
from kvtier.launch.serve_args import (  # noqa: F401  (ServeConfigError is part of this API)
    ServeConfigError,
    check_passthrough,
    config_file_model,
    flag_value,
    last_flag,
    split_model,
)
from kvtier.launch.vllm_entry import vllm_entrypoint

CONNECTOR = "KVTierConnector"
CONNECTOR_MODULE = "kvtier.vllm"

DEFAULT_HOST_GIB = 4.0
DEFAULT_DISK_GIB = 20.0
DEFAULT_EVICTION_POLICY = "lru"
EVICTION_POLICIES = ("lru", "arc")
DEFAULT_VLLM_CPU_KVCACHE_SPACE = "4"
"""GiB of vLLM's own KV cache on the CPU backend, unless the user sets it (env or flag)."""

GIB = 2**30


@dataclass(frozen=True)
class ServeOptions:
    """kvtier's own ``serve`` flags. Sizes are GiB (2**30 bytes)."""

    kv_offloading_size_gib: float = DEFAULT_HOST_GIB
    """Host tier size, TOTAL across tensor-parallel ranks (like vLLM's --kv-offloading-size)."""
    disk_dir: str | Path | None = None
    """Disk tier directory; None means ``<kvtier.models.default.default_cache_dir()>/kv``."""
    disk_size_gib: float = DEFAULT_DISK_GIB
    """Disk tier capacity (all ranks)."""
    no_disk: bool = False
    """Host tier only (``disk_dir`` and ``disk_size_gib`` are then ignored)."""
    eviction_policy: str = DEFAULT_EVICTION_POLICY
    """Host tier eviction: ``lru`` or ``arc``."""
    redis_url: str | None = None
    """A shared Redis / Valkey remote tier (after the disk tier, or alone with ``no_disk``)."""
    redis_password_env: str | None = None
    """Name of the environment variable holding the Redis password."""
    s3: Mapping[str, Any] | None = None
    """An S3 tier's entry (``url``, ``endpoint``, ``region``, ``capacity_bytes``, ``ca_bundle``; the
    ``--s3-*`` flags, :func:`kvtier.cli.s3_flags.s3_entry`), below the disk and Redis tiers."""
    fleet_key_env: str | None = None
    """Name of the environment variable holding the fleet key: ``auth_key_env`` of every tier built here."""
    encrypt: bool = False
    """``encrypt: true`` on every tier built here (needs ``fleet_key_env``)."""
    kv_config: Mapping[str, Any] | None = None
    """Extra ``kv_connector_extra_config`` keys, merged last (top-level keys replace)."""
    node: str | Path | None = None
    """A ``kvtier node`` service's socket: its pool is the host tier (``kv_offloading_size_gib`` then
    caps this engine's share); no disk or Redis tier of the engine's own (docs/node.md)."""
    node_uid: int | str | None = None
    """With ``node``: the user (uid or name) the service may run as besides root and the engine's own
    (``node_uid``; a service of anyone else is refused)."""


@dataclass(frozen=True)
class ServeCommand:
    argv: list[str]
    """Full command line; ``argv[0]`` is ``sys.executable``."""
    env: dict[str, str]
    """Only the variables to add to the current environment (never ones already set)."""
    summary: str
    """The ``kvtier: ...`` lines to print before vLLM starts."""


def resolve_disk_dir(options: ServeOptions) -> Path:
    """The absolute disk tier directory ``options`` mean (default ``<cache>/kv``)."""
    if options.disk_dir is None:
        from kvtier.models.default import default_cache_dir

        path = default_cache_dir() / "kv"
    else:
        path = Path(options.disk_dir).expanduser()
    return Path(os.path.abspath(path))


SHUTDOWN_TIMEOUT_S = 30
"""``--shutdown-timeout`` kvtier serve passes unless given: on SIGTERM vLLM lets in-flight requests
finish, then tears the engine down, where kvtier flushes queued block writes (at most 10 s); the
engine process is killed this many seconds after SIGTERM at the latest (vLLM's default, 0, kills it
at once)."""


SERVE_DEFAULTS: Mapping[str, Any] = {"offload_prompt_only": False, "offload_partial_blocks": True}
"""kvtier keys ``kvtier serve`` (and so ``kvtier bench``'s kvtier modes) sets unlike the connector's
vLLM-compatible defaults: keep the KV of generated tokens and the partial last block, so a returning
chat turn or agent step computes only its new tokens (measured in docs/benchmarks.md). ``--kv-config``
overrides them."""


def build_extra_config(options: ServeOptions) -> dict:
    """``kv_connector_extra_config`` for ``options``. Checks the flag values themselves (sizes > 0,
    known policy, ``kv_config`` an object) and raises :class:`ServeConfigError`; the full validation
    (directory writable, ``kv_config`` keys) is :func:`validate_extra_config`'s."""
    extra: dict[str, Any] = {
        "cpu_bytes_to_use": _bytes(options.kv_offloading_size_gib, "--kv-offloading-size"),
        "eviction_policy": options.eviction_policy,
        **SERVE_DEFAULTS,
    }
    if options.eviction_policy not in EVICTION_POLICIES:
        raise ServeConfigError(
            "--eviction-policy",
            f"--eviction-policy {options.eviction_policy}: unknown policy; "
            f"use one of {', '.join(EVICTION_POLICIES)}.",
        )
    tiers: list[dict[str, Any]] = []
    if options.node is not None:
        extra["node"] = os.path.abspath(Path(options.node).expanduser())
        if options.node_uid is not None:
            extra["node_uid"] = options.node_uid
    elif not options.no_disk:
        tiers.append({
            "type": "fs",
            "root_dir": str(resolve_disk_dir(options)),
            "capacity_bytes": _bytes(options.disk_size_gib, "--disk-size"),
        })
    if options.redis_url is not None:
        remote: dict[str, Any] = {"type": "redis", "url": options.redis_url}
        if options.redis_password_env is not None:
            remote["password_env"] = options.redis_password_env
        tiers.append(remote)
    if options.s3 is not None:
        tiers.append({"type": "s3", **options.s3})
    if options.encrypt and options.fleet_key_env is None:
        raise ServeConfigError("--encrypt", "--encrypt needs a fleet key: --fleet-key-env NAME (docs/security.md).")
    if options.fleet_key_env is not None:
        for tier in tiers:
            tier["auth_key_env"] = options.fleet_key_env
            if options.encrypt:
                tier["encrypt"] = True
    if tiers:
        extra["secondary_tiers"] = tiers
    if options.kv_config is not None:
        if not isinstance(options.kv_config, Mapping):
            raise ServeConfigError(
                "--kv-config",
                "must be a JSON object like '{\"store_threshold\": 2}', "
                f"got {type(options.kv_config).__name__}.",
            )
        extra.update(options.kv_config)
    return extra


def validate_extra_config(extra: Mapping[str, Any], options: ServeOptions):
    """Validate ``extra`` with :meth:`kvtier.core.config.KVTierConfig.from_extra_config` and return the
    config; a :class:`~kvtier.core.config.ConfigError` is re-raised as :class:`ServeConfigError` naming
    the flag the bad key came from. Creates nothing: a missing disk directory must be creatable, and
    the connector creates it (owner-only) when vLLM starts, so a refused command leaves no trace."""
    from kvtier.core.config import ConfigError, KVTierConfig

    try:
        return KVTierConfig.from_extra_config(extra, create_dirs=False)
    except ConfigError as exc:
        raise _flag_error(str(exc), extra, options) from None


def build_serve_command(
    model: str,
    options: ServeOptions,
    vllm_args: Sequence[str],
    *,
    environ: Mapping[str, str] | None = None,
    cpu_backend: bool | None = None,
) -> ServeCommand:
    """Validate and translate: the ``vllm serve`` command with kvtier configured.

    ``vllm_args`` are passed through after kvtier's own vLLM arguments, in order. ``environ``
    (default ``os.environ``) decides which variables are already set; ``cpu_backend`` (default:
    detected, see :func:`vllm_runs_on_cpu`) whether vLLM's CPU-backend variables are added.
    Raises :class:`ServeConfigError` on any bad option, before anything is started.
    """
    environ = os.environ if environ is None else environ
    vllm_args = list(vllm_args)
    check_passthrough(vllm_args)
    extra = build_extra_config(options)
    config = validate_extra_config(extra, options)

    transfer = {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    argv = [sys.executable, "-m", vllm_entrypoint(), "serve", str(model)]
    argv += ["--kv-transfer-config", json.dumps(transfer)]
    prefix_flag = last_flag(vllm_args, ("--enable-prefix-caching", "--no-enable-prefix-caching"))
    if prefix_flag is None:
        argv.append("--enable-prefix-caching")
    dtype = embedded_model_dtype(model)
    if dtype is not None and flag_value(vllm_args, "--dtype") is None:
        # vLLM-CPU runs a float32 checkpoint in bfloat16 by default (dtype "auto" picks the
        # platform's preferred dtype), which is slower on AVX2; kvtier's model folders say
        # which dtype they were converted to, so serve them in it.
        argv += ["--dtype", dtype]
    if flag_value(vllm_args, "--shutdown-timeout") is None:
        # vLLM's default 0 makes its process manager SIGKILL the engine right after SIGTERM,
        # before kvtier's connector can flush the block writes still queued.
        argv += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    argv += vllm_args

    if cpu_backend is None:
        cpu_backend = vllm_runs_on_cpu(environ)
    kv_memory_flag = flag_value(vllm_args, "--kv-cache-memory-bytes")
    env: dict[str, str] = {}
    if cpu_backend:
        wanted = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CPU_OMP_THREADS_BIND": "auto"}
        if kv_memory_flag is None:
            wanted["VLLM_CPU_KVCACHE_SPACE"] = DEFAULT_VLLM_CPU_KVCACHE_SPACE
        env = {key: value for key, value in wanted.items() if key not in environ}

    summary = _summary(model, options, config, vllm_args, cpu_backend, kv_memory_flag, environ, env)
    return ServeCommand(argv=argv, env=env, summary=summary)


def embedded_model_dtype(model: str) -> str | None:
    """The dtype of a model folder made by :func:`kvtier.models.default.ensure_default_model` (read from
    its marker file), else None (any other model: vLLM's own dtype choice applies)."""
    from kvtier.models.default import DTYPES, MARKER

    try:
        dtype = json.loads((Path(model) / MARKER).read_text()).get("dtype")
    except (OSError, ValueError, AttributeError):
        return None
    return dtype if dtype in DTYPES else None


def launch(command: ServeCommand) -> None:
    """Replace this process with vLLM (signals reach vLLM directly; its exit code is ours)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command.argv[0], command.argv, {**os.environ, **command.env})


def vllm_runs_on_cpu(environ: Mapping[str, str] | None = None) -> bool:
    """Whether vLLM will run on its CPU backend, decided cheaply (no torch import unless a
    ``/dev/dri`` render node may be an Intel XPU): like vLLM's own platform detection, a CPU build
    of vLLM (``vllm-cpu``) or ``VLLM_TARGET_DEVICE=cpu`` always means CPU; otherwise an NVIDIA or
    AMD device node, or an available XPU, means an accelerator."""
    environ = os.environ if environ is None else environ
    if environ.get("VLLM_TARGET_DEVICE") == "cpu" or sys.platform == "darwin":
        return True
    from importlib.metadata import PackageNotFoundError, version

    try:
        if "cpu" in version("vllm"):
            return True
    except PackageNotFoundError:
        try:
            version("vllm-cpu")
            return True
        except PackageNotFoundError:
            pass
    if glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd"):
        return False
    if glob.glob("/dev/dri/renderD*"):
        try:
            import torch

            return not (hasattr(torch, "xpu") and torch.xpu.is_available())
        except Exception:
            return True
    return True


# -- helpers ---------------------------------------------------------------------------------------


def _bytes(gib: Any, flag: str) -> int:
    if isinstance(gib, bool) or not isinstance(gib, int | float) or not math.isfinite(gib) or gib <= 0:
        shown = f"{gib:g}" if isinstance(gib, float) else repr(gib)
        raise ServeConfigError(flag, f"{flag} {shown}: must be a size in GiB greater than 0 (e.g. {flag} 4).")
    size = int(gib * GIB)
    if size < 1:
        raise ServeConfigError(flag, f"{flag} {gib:g}: rounds to 0 bytes; give a size in GiB (e.g. 0.5).")
    return size


_FLAG_OF_KEY = {
    "cpu_bytes_to_use": "--kv-offloading-size",
    "eviction_policy": "--eviction-policy",
    "root_dir": "--disk-dir",
    "capacity_bytes": "--disk-size",
    "url": "--redis-url",
    "auth_key_env": "--fleet-key-env",
}
S3_FLAG_OF_KEY = {"url": "--s3-url", "endpoint": "--s3-endpoint", "region": "--s3-region",
                  "ca_bundle": "--s3-ca-bundle", "capacity_bytes": "--s3-size"}
"""The ``--s3-*`` flag (``kvtier serve``, ``kvtier node``) that sets each key of an S3 tier entry."""
_MESSAGE = re.compile(
    r"^kv_connector_extra_config: '(?P<key>[^']+)'(?: = '(?:[^']*)')? (?P<reason>.*)$", re.DOTALL
)


def _flag_error(message: str, extra: Mapping[str, Any], options: ServeOptions) -> ServeConfigError:
    """Map a ConfigError message back to the flag the bad key came from."""
    user_keys = set(options.kv_config or ())
    quoted = re.findall(r"'([A-Za-z_][\w.\[\]]*)'", message)
    tops = {key.split("[", 1)[0].split(".", 1)[0] for key in quoted}
    body = message.removeprefix("kv_connector_extra_config: ")
    if "unknown key" in message or tops & user_keys or not quoted:
        spec_conflict = "unknown key" not in message and {"spec_name", "secondary_tiers"} <= tops
        if spec_conflict and "secondary_tiers" not in user_keys:
            body += " (here 'secondary_tiers' comes from --disk-dir/--disk-size; add --no-disk for host only)"
        return ServeConfigError("--kv-config", f"--kv-config: {body}")
    match = _MESSAGE.match(message)
    leaf = re.split(r"[.\]]", quoted[0])[-1]
    flag = _FLAG_OF_KEY.get(leaf)
    index = re.match(r"secondary_tiers\[(\d+)\]", quoted[0])
    tiers = extra.get("secondary_tiers") or []
    if index and int(index[1]) < len(tiers) and tiers[int(index[1])].get("type") == "s3":
        flag = S3_FLAG_OF_KEY.get(leaf, flag)
    if flag is None or match is None:
        return ServeConfigError("--kv-config", f"--kv-config: {body}")
    s3 = options.s3 or {}
    value = {
        "--kv-offloading-size": options.kv_offloading_size_gib,
        "--eviction-policy": options.eviction_policy,
        "--disk-dir": extra.get("secondary_tiers", [{}])[0].get("root_dir") if not options.no_disk else None,
        "--disk-size": options.disk_size_gib,
        "--redis-url": redact_url(options.redis_url or ""),
        "--fleet-key-env": options.fleet_key_env,
        **{name: s3.get(key) for key, name in S3_FLAG_OF_KEY.items()},
    }[flag]
    if flag == "--s3-size" and value is not None:
        value = value / GIB
    value = f"{value:g}" if isinstance(value, float) else value
    reason = match.group("reason")
    reason = reason[3:] if reason.startswith("is ") else reason
    return ServeConfigError(flag, f"{flag} {value}: {reason}")


def _gib(value: float) -> str:
    text = f"{value:.2f}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def _summary(model, options, config, vllm_args, cpu_backend, kv_memory_flag, environ, env) -> str:
    lines = [f"kvtier: model   {model}"]
    total = config.cpu_bytes_to_use / GIB
    tp_text = flag_value(vllm_args, "--tensor-parallel-size")
    try:
        tp = int(tp_text) if tp_text is not None else 1
    except ValueError:
        tp = 0
    per_rank = f" ({_gib(total / tp)} GiB per rank x {tp})" if tp >= 1 else ""
    if config.node is not None:
        served_by = "" if config.node_uid is None else f", served by root, this user or uid {config.node_uid}"
        lines.append(f"kvtier: host    the kvtier node at {config.node} (this engine holds at most {_gib(total)} GiB "
                     f"of its pool{served_by})")
    else:
        lines.append(f"kvtier: host    {_gib(total)} GiB total{per_rank}, {config.eviction_policy.value}")
    disk = config.disk
    if disk is None:
        lines.append("kvtier: disk    off")
    else:
        lines.append(f"kvtier: disk    {disk.root_dir} ({_gib(disk.capacity_bytes / GIB)} GiB)")
    if config.remote is not None:
        lines.append(f"kvtier: remote  {config.remote.redacted_url()}")
    if config.s3 is not None:
        bound = "unbounded" if config.s3.capacity_bytes is None else f"{_gib(config.s3.capacity_bytes / GIB)} GiB"
        lines.append(f"kvtier: s3      {config.s3.location} ({bound})")
    if options.kv_config:
        lines.append(f"kvtier: config  {json.dumps(dict(options.kv_config), separators=(',', ':'))}")
    if kv_memory_flag is not None:
        vllm_kv = f"--kv-cache-memory-bytes {kv_memory_flag}"
    elif cpu_backend:
        space = env.get("VLLM_CPU_KVCACHE_SPACE") or environ.get("VLLM_CPU_KVCACHE_SPACE")
        source = "" if "VLLM_CPU_KVCACHE_SPACE" in env else " (from the environment)"
        vllm_kv = f"VLLM_CPU_KVCACHE_SPACE={space} GiB{source}"
    else:
        vllm_kv = "vLLM's default (--gpu-memory-utilization)"
    lines.append(f"kvtier: vllm kv {vllm_kv}")
    return "\n".join(lines)
