"""Parameter count and weight bytes of a model, from its Hugging Face ``config.json`` alone.

Counts the matrices that dominate: embeddings (and the LM head unless tied), attention (MHA/GQA
projections, or DeepSeek's MLA low-rank projections), the MLP (gated: 3 matrices) or the MoE layer
(every routed expert, shared experts, router), Mamba-1 (Jamba), Mamba-2 (NemotronH, Bamba) and
gated-delta-net linear attention (Qwen3-Next) mixers, and RMSNorm weights. Biases, rotary tables,
vision towers and multi-token-prediction layers are left out, so the figure is a slight under-count
(within ~1-3% of the published sizes of the models in ``tests/fixtures/model_configs``).

Pure Python on plain dicts: no torch, no transformers, no vLLM.

Called by :mod:`kvtier.planning.sizing` for ``kvtier plan`` and ``kvtier doctor``, in the command's process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.planning.geometry import (
    FULL,
    MLP_ONLY,
    SLIDING,
    STATEFUL,
    ModelConfigError,
    dtype_bytes,
    layer_kinds,
    text_config,
)


@dataclass(frozen=True)
class ParamCount:
    """Parameters of a model: ``total`` (all weights), ``active`` (used per token: MoE models use
    ``num_experts_per_tok`` routed experts plus shared ones) and ``embedding`` (input embedding plus
    an untied LM head; no FLOPs in prefill beyond a lookup)."""

    total: int
    active: int
    embedding: int


def _int(cfg: Mapping[str, Any], *keys: str, default: int = 0) -> int:
    for key in keys:
        if cfg.get(key) is not None:
            return int(cfg[key])
    return default


def _attention(cfg: Mapping[str, Any], h: int) -> int:
    heads = _int(cfg, "num_attention_heads")
    if cfg.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3): low-rank q and kv projections
        nope, rope = _int(cfg, "qk_nope_head_dim"), _int(cfg, "qk_rope_head_dim")
        v_dim, kv_rank, q_rank = _int(cfg, "v_head_dim"), _int(cfg, "kv_lora_rank"), _int(cfg, "q_lora_rank")
        q = h * q_rank + q_rank + q_rank * heads * (nope + rope) if q_rank else h * heads * (nope + rope)
        kv = h * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim)
        return q + kv + heads * v_dim * h
    kv_heads = _int(cfg, "num_key_value_heads", default=heads)
    head_dim = _int(cfg, "head_dim") or h // heads
    q_out = heads * head_dim * (2 if cfg.get("model_type") == "qwen3_next" else 1)  # gated output
    params = h * q_out + 2 * h * kv_heads * head_dim + heads * head_dim * h
    if cfg.get("attention_bias"):
        params += q_out + 2 * kv_heads * head_dim
    return params


def _stateful(cfg: Mapping[str, Any], h: int) -> int:
    """A Mamba-1, Mamba-2 or gated-delta-net mixer."""
    if cfg.get("linear_num_key_heads"):  # Qwen3-Next gated delta net
        nk, dk = _int(cfg, "linear_num_key_heads"), _int(cfg, "linear_key_head_dim")
        nv, dv = _int(cfg, "linear_num_value_heads"), _int(cfg, "linear_value_head_dim")
        key_dim, value_dim = nk * dk, nv * dv
        conv = (2 * key_dim + value_dim) * _int(cfg, "linear_conv_kernel_dim", default=4)
        return h * (2 * key_dim + 2 * value_dim) + h * 2 * nv + conv + 2 * nv + dv + value_dim * h
    n_heads = _int(cfg, "mamba_num_heads", "mamba_n_heads")
    if n_heads:  # Mamba-2 (NemotronH, Bamba)
        inner = n_heads * _int(cfg, "mamba_head_dim", "mamba_d_head")
        groups = _int(cfg, "n_groups", "mamba_n_groups", default=1)
        state = _int(cfg, "ssm_state_size", "mamba_d_state")
        conv_dim = inner + 2 * groups * state
        kernel = _int(cfg, "conv_kernel", "mamba_d_conv", default=4)
        return h * (inner + conv_dim + n_heads) + conv_dim * (kernel + 1) + 3 * n_heads + inner + inner * h
    if cfg.get("mamba_expand"):  # Mamba-1 (Jamba)
        inner, state = int(cfg["mamba_expand"]) * h, _int(cfg, "mamba_d_state", default=16)
        dt_rank = _int(cfg, "mamba_dt_rank") or -(-h // 16)
        kernel = _int(cfg, "mamba_d_conv", default=4)
        return (h * 2 * inner + inner * (kernel + 1) + inner * (dt_rank + 2 * state)
                + dt_rank * inner + inner + inner * state + inner + inner * h + dt_rank + 2 * state)
    raise ModelConfigError("cannot count the parameters of this model's Mamba/linear-attention layers")


def _ffn(cfg: Mapping[str, Any], h: int, i: int) -> tuple[int, int]:
    """(total, active) parameters of layer ``i``'s MLP or MoE block."""
    mtype = str(cfg.get("model_type", ""))
    dense_inter = _int(cfg, "intermediate_size", "ffn_dim", "n_inner", default=4 * h)
    matrices = 2 if mtype.startswith("nemotron") else 3  # NemotronH: up/down with relu^2; else gated
    experts = _int(cfg, "n_routed_experts", "num_local_experts", "num_experts")
    if experts > 1:
        if mtype.startswith("deepseek"):
            moe = i >= _int(cfg, "first_k_dense_replace") and i % _int(cfg, "moe_layer_freq", default=1) == 0
        elif cfg.get("expert_layer_period"):
            moe = i % int(cfg["expert_layer_period"]) == _int(cfg, "expert_layer_offset")
        else:
            step = _int(cfg, "decoder_sparse_step", default=1)
            moe = i not in (cfg.get("mlp_only_layers") or ()) and (i + 1) % step == 0
        if moe:
            one = matrices * h * _int(cfg, "moe_intermediate_size", default=dense_inter)
            shared = matrices * h * (_int(cfg, "n_shared_experts") * _int(cfg, "moe_intermediate_size")
                                     + _int(cfg, "shared_expert_intermediate_size"))
            fixed = shared + experts * h + (h if cfg.get("shared_expert_intermediate_size") else 0)
            per_token = _int(cfg, "num_experts_per_tok", "num_experts_per_token", default=2)
            return experts * one + fixed, per_token * one + fixed
    dense = matrices * h * dense_inter
    return dense, dense


def tied_embeddings(cfg: Mapping[str, Any]) -> bool:
    """``tie_word_embeddings``; when absent, True for Gemma (its config class default), else False."""
    tied = cfg.get("tie_word_embeddings")
    return bool(tied) if tied is not None else str(cfg.get("model_type", "")).startswith("gemma")


def count_parameters(config: Mapping[str, Any]) -> ParamCount:
    """Count the parameters of a Llama-like dense, MoE, MLA or Mamba-hybrid model from its config.

    Raises :class:`~kvtier.planning.geometry.ModelConfigError` when a layer kind cannot be counted.
    """
    cfg = text_config(config)
    h = _int(cfg, "hidden_size", "n_embd", "d_model")
    vocab = _int(cfg, "vocab_size")
    if h <= 0 or vocab <= 0:
        raise ModelConfigError("config needs 'hidden_size' and 'vocab_size' to count parameters")
    nemotron = str(cfg.get("model_type", "")).startswith("nemotron")
    total = active = h  # final norm
    for i, kind in enumerate(layer_kinds(cfg)):
        mixer = 0
        if kind in (FULL, SLIDING):
            mixer = _attention(cfg, h)
        elif kind == STATEFUL:
            mixer = _stateful(cfg, h)
        if nemotron:  # one block per layer: a mixer or an MLP, one norm
            ffn = ffn_active = _ffn(cfg, h, i)[0] if kind == MLP_ONLY else 0
            norms = h
        else:
            ffn, ffn_active = _ffn(cfg, h, i)
            norms = 2 * h
        total += mixer + ffn + norms
        active += mixer + ffn_active + norms
    embedding = vocab * h * (1 if tied_embeddings(cfg) else 2)
    return ParamCount(total=total + embedding, active=active + embedding, embedding=embedding)


def quantized_bits(config: Mapping[str, Any]) -> float | None:
    """Bits per weight of a quantized checkpoint's linear layers (``quantization_config``), else None."""
    quant = text_config(config).get("quantization_config")
    if not isinstance(quant, Mapping):
        return None
    method = str(quant.get("quant_method", "")).lower()
    if "fp8" in method:
        return 8.0
    if quant.get("load_in_4bit"):
        return 4.0
    if quant.get("load_in_8bit"):
        return 8.0
    if method == "mxfp4":
        return 4.25  # 4-bit values plus one 8-bit scale per 32
    if quant.get("bits"):
        return float(quant["bits"])
    for group in (quant.get("config_groups") or {}).values():  # compressed-tensors
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if isinstance(weights, Mapping) and weights.get("num_bits"):
            return float(weights["num_bits"])
    return None


def weight_bytes(config: Mapping[str, Any], params: ParamCount, dtype: str) -> int:
    """Bytes of the weights in ``dtype``; a quantized checkpoint keeps its linear layers at their
    quantized width (embeddings and norms in ``dtype``)."""
    bits = quantized_bits(config)
    width = dtype_bytes(dtype)
    if bits is None:
        return params.total * width
    return int((params.total - params.embedding) * bits / 8) + params.embedding * width
