"""What a ``vllm serve`` / ``kvtier serve`` line would configure, for ``kvtier doctor``'s checks.

:func:`resolve_setup` works out the :class:`Setup` (the connector, the host buffer, the disk tier,
the model's KV geometry and :func:`kvtier.planning.sizing.make_plan`'s arithmetic for it); each
check (:mod:`kvtier.doctor.checks`, :mod:`kvtier.doctor.model_checks`) turns it into
:class:`Finding` s. A ``MultiConnector`` line also gets one :class:`Setup` per child connector
(:attr:`Setup.children`: the same line and model, the child's own kv-transfer config), which
:func:`kvtier.doctor.audit.audit` checks as it checks a standalone connector. Nothing here starts
vLLM, imports torch or vLLM, or writes files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.launch.cmdline import ServeLine, parse_serve_line
from kvtier.planning.geometry import ModelConfigError, ModelKVGeometry
from kvtier.planning.model_source import ModelSource, find_model_config, is_default_name
from kvtier.planning.sizing import (
    DEFAULT_GPU_MEMORY_GIB,
    GIB,
    KV_DTYPES,
    Plan,
    PlanInputs,
    make_plan,
    model_dtype,
)

SEVERITIES = ("error", "warning", "info")
KVTIER_CONNECTOR = "KVTierConnector"
NATIVE_CONNECTOR = "OffloadingConnector"
MULTI_CONNECTOR = "MultiConnector"
CPU_BLOCK_SIZE = 128


@dataclass(frozen=True)
class Finding:
    """One problem (or fact worth knowing): ``severity`` is error / warning / info."""

    code: str
    severity: str
    title: str
    why: str
    fix: str


@dataclass
class Setup:
    """What a command line would run."""

    line: ServeLine
    model: str | None
    source: ModelSource | None = None
    source_error: str | None = None  # why the model's config.json could not be read (it is there)
    geometry: ModelKVGeometry | None = None
    plan: Plan | None = None
    plan_error: str | None = None
    connector: str | None = None  # KVTierConnector, OffloadingConnector (native), another, or None
    extra: dict[str, Any] | None = None  # the connector's kv_connector_extra_config
    extra_error: str | None = None  # kvtier serve flags that could not be turned into one
    host_bytes: int | None = None  # host buffer, TOTAL across ranks
    host_flag: str = "cpu_bytes_to_use"
    gpu_memory_gib: float = DEFAULT_GPU_MEMORY_GIB
    gpu_memory_assumed: bool = True
    notes: list[str] = field(default_factory=list)
    transfer: dict[str, Any] | None = None  # the connector's own kv-transfer config (a child's, for a child)
    children: list["Setup"] = field(default_factory=list)  # a MultiConnector's, in its order
    child_index: int | None = None  # this setup is the MultiConnector's connectors[child_index]

    @property
    def is_kvtier(self) -> bool:
        return self.connector == KVTIER_CONNECTOR

    @property
    def offloading(self) -> bool:
        return self.connector is not None

    @property
    def is_multi(self) -> bool:
        return self.connector == MULTI_CONNECTOR

    @property
    def where(self) -> str:
        """How findings name this connector: '' for the line's own, else ``connectors[i] (Name)``."""
        return "" if self.child_index is None else f"connectors[{self.child_index}] ({self.connector or '?'})"

    @property
    def disk_dirs(self) -> list[Path]:
        tiers = (self.extra or {}).get("secondary_tiers")
        return [Path(t["root_dir"]).expanduser() for t in tiers or [] if isinstance(t, dict)
                and isinstance(t.get("root_dir"), str) and t["root_dir"]]

    @property
    def gpu_assumption(self) -> str:
        if self.plan and self.plan.assumptions.get("kv_cache_gib_per_device") is not None:
            fixed = self.plan.assumptions["kv_cache_gib_per_device"]
            return f"an engine KV cache of {fixed:g} GiB per device"
        how = "assumed; pass kvtier doctor --gpu-memory N" if self.gpu_memory_assumed else "--gpu-memory"
        return f"{self.gpu_memory_gib:g} GiB per device ({how})"


def _kvtier_serve_extra(setup: Setup) -> None:
    """kvtier serve's own flags -> kv_connector_extra_config, as kvtier serve builds it, or the
    error kvtier serve would refuse the line with (the same rules: :mod:`kvtier.launch.serve_flags`)."""
    import json

    from kvtier.launch.command import ServeConfigError, ServeOptions, build_extra_config
    from kvtier.launch.serve_flags import check_flags, node_uid, s3_entry

    flags = setup.line.kvtier_flags

    def number(flag: str) -> float | None:
        return float(flags[flag] or "") if flag in flags else None

    try:
        kv_config = json.loads(flags["--kv-config"] or "") if "--kv-config" in flags else None
        options = ServeOptions(
            kv_offloading_size_gib=number("--kv-offloading-size") or ServeOptions.kv_offloading_size_gib,
            disk_dir=flags.get("--disk-dir"),
            disk_size_gib=number("--disk-size") or ServeOptions.disk_size_gib,
            no_disk="--no-disk" in flags,
            redis_url=flags.get("--redis-url"),
            redis_password_env=flags.get("--redis-password-env"),
            s3=s3_entry(flags.get("--s3-url"), flags.get("--s3-endpoint"), flags.get("--s3-region"),
                        number("--s3-size"), flags.get("--s3-ca-bundle")),
            fleet_key_env=flags.get("--fleet-key-env"),
            encrypt="--encrypt" in flags,
            eviction_policy=flags.get("--eviction-policy") or ServeOptions.eviction_policy,
            kv_config=kv_config,
            node=flags.get("--node"),
            node_uid=node_uid(flags.get("--node-uid")),
        )
        check_flags(options, disk_flags_given=[f for f in ("--disk-dir", "--disk-size") if f in flags],
                    node_pool_gib=number("--node-pool-size"))
        setup.extra = build_extra_config(options)
    except (ValueError, ServeConfigError) as exc:  # JSONDecodeError and bad floats are ValueErrors
        setup.extra_error = str(exc)


def native_entries(setup: Setup, tier_type: Any, names: tuple[str, ...]) -> list[tuple[str, Any]]:
    """``(secondary_tiers[i], parsed config)`` of each entry behind vLLM's offloading whose type is
    one of ``names``, parsed as a kvtier tier of ``tier_type`` (a
    :class:`~kvtier.core.tier_config.TierType`); entries that do not parse are left out
    (``check_native_resolution`` reports them)."""
    from kvtier.core.tier_config import NATIVE_TIER_KEYS, parse_tier
    from kvtier.core.values import ConfigError

    out: list[tuple[str, Any]] = []
    if setup.connector != NATIVE_CONNECTOR or setup.extra is None:
        return out
    tiers = setup.extra.get("secondary_tiers")
    for index, tier in enumerate(tiers if isinstance(tiers, list) else []):
        if isinstance(tier, dict) and tier.get("type") in names:
            where = f"secondary_tiers[{index}]"
            try:
                out.append((where, parse_tier({k: v for k, v in tier.items() if k not in NATIVE_TIER_KEYS},
                                              tier_type, where)))
            except ConfigError:
                continue
    return out


def _connector(setup: Setup) -> None:
    line = setup.line
    if line.program == "kvtier":
        setup.connector, setup.host_flag = KVTIER_CONNECTOR, "--kv-offloading-size"
        _kvtier_serve_extra(setup)
    elif line.transfer_config is not None:
        _from_transfer(setup, line.transfer_config)
    elif line.has("--kv-offloading-size"):
        backend = line.value("--kv-offloading-backend") or "native"
        setup.connector = NATIVE_CONNECTOR if backend == "native" else "LMCacheMPConnector"
        setup.host_flag = "--kv-offloading-size"
        size = line.number("--kv-offloading-size")
        setup.extra = {"cpu_bytes_to_use": int(size * GIB)} if size is not None else {}
    _host_bytes(setup)


def _from_transfer(setup: Setup, transfer: dict[str, Any]) -> None:
    """The connector and its extra config, from a kv-transfer config (the line's or a child's)."""
    setup.transfer = transfer
    setup.connector = str(transfer.get("kv_connector") or "") or None
    extra = transfer.get("kv_connector_extra_config")
    setup.extra = dict(extra) if isinstance(extra, dict) else {}


def _host_bytes(setup: Setup) -> None:
    raw = (setup.extra or {}).get("cpu_bytes_to_use")
    if isinstance(raw, int | float) and not isinstance(raw, bool) and raw > 0:
        setup.host_bytes = int(raw)


def multi_children(extra: dict[str, Any] | None) -> list[Any]:
    """A MultiConnector's ``connectors`` list as written (entries of any type), or [] if there is none."""
    children = (extra or {}).get("connectors")
    return children if isinstance(children, list) else []


def _children(setup: Setup) -> None:
    """One setup per well-formed child of a MultiConnector line (an object naming a connector);
    :mod:`kvtier.doctor.multi_checks` reports the others."""
    for index, transfer in enumerate(multi_children(setup.extra)):
        if not isinstance(transfer, dict) or not transfer.get("kv_connector"):
            continue
        child = dataclasses.replace(setup, connector=None, extra=None, extra_error=None, host_bytes=None,
                                    host_flag="cpu_bytes_to_use", notes=[], children=[], child_index=index)
        _from_transfer(child, transfer)
        _host_bytes(child)
        setup.children.append(child)


def runs_on_cpu(line: ServeLine) -> bool:
    """Whether the line's vLLM runs on its CPU backend, by the rule docs/operators.md (Limits) states.

    A ``kvtier serve`` line: as ``kvtier serve`` decides it when it starts
    (:func:`kvtier.launch.command.vllm_runs_on_cpu`: a CPU build of vLLM installed, or
    ``VLLM_TARGET_DEVICE=cpu``), since it sets vLLM-CPU's variables itself. A ``vllm serve`` line:
    its own environment only (the line's ``NAME=value`` assignments, else this process's):
    ``VLLM_TARGET_DEVICE=cpu``, or ``VLLM_CPU_KVCACHE_SPACE`` without another ``VLLM_TARGET_DEVICE``.
    The vLLM build and devices of the machine doctor runs on never decide a ``vllm serve`` line: a
    GPU server's line is audited on a laptop or in CI, where vllm-cpu may be what is installed."""
    if line.program == "kvtier":
        import os

        from kvtier.launch.command import vllm_runs_on_cpu

        return vllm_runs_on_cpu({**os.environ, **line.env})
    target = line.getenv("VLLM_TARGET_DEVICE")
    if target:
        return target == "cpu"
    return bool(line.getenv("VLLM_CPU_KVCACHE_SPACE"))


def plan_inputs(setup: Setup) -> PlanInputs:
    """The deployment the line describes, in :class:`~kvtier.planning.sizing.PlanInputs` terms."""
    line = setup.line
    dtype = line.value("--dtype")
    dtype = {"half": "float16", "float": "float32"}.get(dtype or "", dtype)
    if dtype not in ("float16", "bfloat16", "float32"):
        dtype = None  # auto
        if line.program == "kvtier" and (setup.model is None or is_default_name(setup.model)):
            dtype = "float32"  # kvtier serve passes its converted model's dtype
        elif setup.source and model_dtype(setup.source.config) == "float32":
            dtype = "bfloat16"  # vLLM's auto dtype downcasts float32 checkpoints
    kv_dtype = line.value("--kv-cache-dtype") or "auto"
    kv_dtype = "fp8" if kv_dtype.startswith("fp8") else kv_dtype if kv_dtype in KV_DTYPES else "auto"
    kv_bytes = line.number("--kv-cache-memory-bytes")
    cpu = runs_on_cpu(line)
    cpu_space = line.getenv("VLLM_CPU_KVCACHE_SPACE") if cpu else None  # read by vLLM-CPU only
    if cpu and line.program == "kvtier" and not cpu_space and not kv_bytes:
        from kvtier.launch.command import DEFAULT_VLLM_CPU_KVCACHE_SPACE

        cpu_space = DEFAULT_VLLM_CPU_KVCACHE_SPACE  # on vLLM-CPU, kvtier serve sets it itself
    kv_cache_gib = kv_bytes / GIB if kv_bytes else float(cpu_space) if cpu_space else None
    max_len = line.number("--max-model-len")
    return PlanInputs(
        tp=line.tp, dtype=dtype, kv_dtype=kv_dtype, context=int(max_len) if max_len else None, concurrency=1,
        gpu_memory_gib=setup.gpu_memory_gib,
        gpu_memory_utilization=line.number("--gpu-memory-utilization", 0.9) or 0.9,
        block_size=int(line.number("--block-size") or (CPU_BLOCK_SIZE if cpu else 16)),
        kv_cache_gib=kv_cache_gib,
    )


def resolve_setup(argv: Sequence[str], gpu_memory_gib: float | None = None) -> Setup:
    """Parse ``argv`` and work out what it configures (raises CommandLineError if it is no serve line)."""
    line = parse_serve_line(argv)
    model = line.model
    setup = Setup(line=line, model=model)
    if gpu_memory_gib is not None:
        setup.gpu_memory_gib, setup.gpu_memory_assumed = gpu_memory_gib, False
    _connector(setup)
    setup.source, setup.source_error = find_model_config(model or ("default" if line.program == "kvtier" else None))
    if setup.source is not None:
        try:
            setup.geometry = ModelKVGeometry.from_config(setup.source.config)
            inputs = plan_inputs(setup)
            if inputs.context is None and setup.geometry.max_position_embeddings:
                inputs = dataclasses.replace(inputs, context=int(setup.geometry.max_position_embeddings))
            setup.plan = make_plan(setup.source.name, setup.source.config, inputs)
        except (ModelConfigError, ValueError) as exc:
            setup.plan_error = str(exc)
    if setup.is_multi:
        _children(setup)
    return setup
