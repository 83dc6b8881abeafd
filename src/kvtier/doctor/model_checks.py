"""``kvtier doctor`` checks that need the model's config: what kvtier (or another connector) can
serve (MLA, Mamba/linear-attention hybrids, sliding windows, pipeline parallelism), tensor-parallel
head splits, fp8 KV calibration and ``--max-model-len`` against the positions and the KV budget.
Each takes a :class:`kvtier.doctor.setup.Setup` and returns findings; :data:`kvtier.doctor.checks.CHECKS`
runs them.
"""

from __future__ import annotations

from kvtier.doctor import probes
from kvtier.doctor.probes import kv_scales_present
from kvtier.doctor.setup import NATIVE_CONNECTOR, Finding, Setup
from kvtier.planning.sizing import GIB, TP_SPLIT_FIX, TP_SPLIT_WHY


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def check_model_support(s: Setup) -> list[Finding]:
    geo, tp, out = s.geometry, s.line.tp, []
    if geo is None or not s.offloading:
        return []
    if geo.is_mla and s.is_kvtier and probes.vllm_cpu_mla_without_prefix_caching():
        out.append(Finding(
            "kvtier-inactive", "error", "kvtier will be inactive: vLLM-CPU runs MLA without prefix caching",
            "vLLM's CPU build (here without AMX MLA kernels) forces prefix caching and chunked prefill off "
            "for MLA models and cannot compute on a cached context, so kvtier neither loads nor stores "
            "blocks for this model (loading would serve wrong KV).",
            "Serve this model on a GPU (or a CPU with AMX) to use kvtier, or serve it without kvtier."))
    elif geo.is_mla and s.is_kvtier:
        stored = (f" The latent is the same on all {tp} ranks: kvtier stores it once (rank 0's copy) and "
                  "every rank loads it." if tp > 1 else "")
        out.append(Finding(
            "mla-kvtier", "info", "MLA model with kvtier",
            "kvtier offloads MLA's latent cache (one vector per token, one KV cache group)." + stored
            + " Not run end to end on GPUs yet (vLLM-CPU runs MLA without prefix caching, where kvtier "
            "stays inactive); the page copies and the store-once path are unit-tested.", "None needed."))
    elif geo.is_mla and s.connector != NATIVE_CONNECTOR:
        out.append(Finding(
            "mla-connector", "info", f"MLA model with {s.connector}",
            "Not every KV connector handles MLA's single latent (no separate K and V).",
            f"Check that {s.connector} supports MLA, or use vLLM's native --kv-offloading-size."))
    if s.is_kvtier and geo.stateful_layers:
        out.append(Finding(
            "mamba-kvtier", "info", "Mamba/linear-attention hybrid: state offloaded at block boundaries",
            f"{geo.stateful_layers} of {geo.num_layers} layers keep recurrent state. kvtier stores each "
            "block's attention pages with the state vLLM keeps at the block's end (prefix caching's "
            "'align' mode; blocks without a kept state: attention pages only), and a hit ends at a "
            "block with its state: where vLLM itself would resume (the prompt's last block boundary, "
            "prefill chunk ends). kvtier's block_size must be the engine's.",
            "None needed; speculative decoding makes kvtier inactive for these models."))
    elif s.is_kvtier and geo.sliding_layers:
        out.append(Finding(
            "sliding-kvtier", "info", "Sliding-window layers: only the window on the accelerator",
            f"vLLM keeps its hybrid allocator on with kvtier: the {geo.sliding_layers} sliding layers "
            f"(window {geo.sliding_window}) hold only their window on the accelerator. kvtier stores "
            "every layer's pages of each block (host and disk hold every token, so any prefix can "
            "resume) and a load fills only the pages of the window.",
            "None needed; kvtier plan sizes both. Keep kvtier's block_size within the window plus one "
            "engine block (the connector refuses larger ones at start-up)."))
    if s.is_kvtier and s.line.pp > 1:
        out.append(Finding(
            "pipeline-parallel", "error", "kvtier does not support pipeline parallelism yet",
            "The connector refuses pipeline_parallel_size > 1 at start-up.",
            "Use tensor parallelism only (-tp), or serve without kvtier."))
    return out


def check_tp(s: Setup) -> list[Finding]:
    problem = s.geometry.tp_split_problem(s.line.tp) if s.geometry is not None else None
    if problem is None:
        return []
    return [Finding("tp-kv-heads", "error", problem, TP_SPLIT_WHY, TP_SPLIT_FIX)]


def check_fp8_scales(s: Setup) -> list[Finding]:
    kv_dtype = s.line.value("--kv-cache-dtype") or "auto"
    if not kv_dtype.startswith("fp8"):
        return []
    if s.source is None:
        return [Finding("fp8-kv-scales", "info", "fp8 KV: calibration not checked",
                        "The model's config is not readable here.",
                        "Check that the checkpoint ships KV scales.")]
    if kv_scales_present(s.source.config, s.source.folder):
        return []
    calculate = s.line.has("--calculate-kv-scales")
    until = " until --calculate-kv-scales measures them on the first batch" if calculate else ""
    return [Finding(
        "fp8-kv-scales", "info" if calculate else "warning",
        f"--kv-cache-dtype {kv_dtype} on a checkpoint without calibrated KV scales",
        "The checkpoint has no kv_cache_scheme / kv_cache_quant_algo and no k_scale/v_scale tensors, "
        f"so vLLM uses a scale of 1.0{until}: values outside fp8's range clip and accuracy can drop.",
        "Use a checkpoint with calibrated KV scales (llm-compressor kv_cache_scheme, NVIDIA ModelOpt), "
        "add --calculate-kv-scales, or drop --kv-cache-dtype (fp8 halves KV; kvtier plan shows both).")]


def check_max_model_len(s: Setup) -> list[Finding]:
    geo, plan, line = s.geometry, s.plan, s.line
    if geo is None:
        return []
    flag = line.number("--max-model-len")
    max_pos, out = geo.max_position_embeddings, []
    if flag and max_pos and flag > max_pos:
        allowed = line.getenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN") == "1"
        out.append(Finding(
            "max-model-len", "warning" if allowed else "error",
            f"--max-model-len {int(flag)} exceeds the model's {max_pos} positions",
            "Beyond max_position_embeddings the model was not trained: outputs degrade. vLLM refuses it "
            "unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.", f"--max-model-len {max_pos} or less."))
    if plan is None:
        return out
    suggestion = max(plan.block_size, plan.tokens_fit // 4 // 1024 * 1024)
    if plan.kv_budget_rank == 0:
        out.append(Finding(
            "weights-do-not-fit", "error", "The weights leave no room for the KV cache",
            f"{_gib(plan.weight_bytes_rank)} of weights per device (tp={plan.tp}) plus a "
            f"{plan.assumptions['reserve_gib_per_device']:g} GiB reserve exceed "
            f"{plan.assumptions['gpu_memory_utilization']:g} x {s.gpu_assumption}.",
            "Raise -tp, use bigger devices (kvtier doctor --gpu-memory N if the assumption is wrong) or "
            "a quantized checkpoint."))
    elif plan.sequences_fit < 1:
        out.append(Finding(
            "max-model-len", "error",
            f"One sequence of {plan.context} tokens does not fit in the accelerator's KV cache",
            f"It needs {_gib(plan.sequence_bytes_rank)} per rank; the KV budget is "
            f"{_gib(plan.kv_budget_rank)} ({s.gpu_assumption}). vLLM refuses to start.",
            f"Lower --max-model-len (e.g. {suggestion}), raise -tp or --gpu-memory-utilization."))
    elif plan.sequences_fit < 4:
        which = "--max-model-len" if flag else "The default max-model-len (max_position_embeddings)"
        out.append(Finding(
            "max-model-len", "warning",
            f"Only {plan.sequences_fit} sequence(s) of {plan.context} tokens fit on the accelerator",
            f"{which} is far above what fits ({plan.tokens_fit:,} tokens in the KV pool, "
            f"{s.gpu_assumption}): long requests run almost alone and preempt each other. Offloading "
            "keeps returning prefixes; it does not add room for concurrent ones.",
            f"Set --max-model-len to your traffic's longest prompt + output (e.g. {suggestion})."))
    elif not flag and max_pos and max_pos > 32768:
        out.append(Finding("max-model-len", "info", f"--max-model-len not set: vLLM uses {max_pos}",
                           "The default is the model's max_position_embeddings.",
                           "Set --max-model-len to what your traffic needs."))
    return out
