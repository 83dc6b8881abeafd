"""A model's KV shape read from its Hugging Face ``config.json``, for ``kvtier plan`` and ``doctor``.

:class:`ModelKVGeometry` says what a model's KV cache holds per token (MHA/GQA/MQA, MLA latents,
sliding-window and stateful layers); :func:`layer_kinds` reads every layer-pattern convention the
configs use. Plain dicts only: no torch, no vLLM. Called by the operator tools (planning, doctor),
never by the runtime, which reads the geometry from the engine itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "float8": 1}
"""Bytes per element of the dtypes plan/doctor understand (fp8: every ``fp8*`` KV dtype of vLLM)."""

FULL, SLIDING, STATEFUL, MLP_ONLY = "full", "sliding", "stateful", "mlp"
"""Layer kinds: full attention (KV grows with the context), sliding-window attention (holds at most
``sliding_window`` tokens), stateful (Mamba / linear attention: a fixed state, no growing KV), MLP
only (NemotronH's ``-``/``E`` layers: no mixer at all)."""

_STATEFUL_WORDS = ("mamba", "linear", "ssm", "conv", "recurrent")


class ModelConfigError(ValueError):
    """The config does not say enough to derive the KV geometry; the message names the key."""


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name (``torch.bfloat16``, ``bf16``, ``fp8_e4m3`` ... accepted)."""
    key = str(name).lower().removeprefix("torch.")
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
               "float": "float32"}
    key = aliases.get(key, key)
    if key.startswith(("fp8", "float8")):
        return 1
    if key not in DTYPE_BYTES:
        raise ModelConfigError(f"unknown dtype {name!r}; use one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    # Gemma-3's config.json lists only what differs from Gemma3TextConfig's defaults.
    "gemma3_text": {"sliding_window_pattern": 6, "vocab_size": 262208, "max_position_embeddings": 131072},
}


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language-model part of a config: ``text_config``/``llm_config`` of multimodal models,
    with the top level's dtype inherited; else the config itself. Keys a model's config class
    defaults (and its config.json therefore omits) are filled in for the few models that need it."""
    merged = dict(config)
    for key in ("text_config", "llm_config", "language_config"):
        inner = config.get(key)
        if isinstance(inner, Mapping) and "num_hidden_layers" in inner:
            merged = dict(inner)
            for field_name in ("torch_dtype", "dtype", "quantization_config", "tie_word_embeddings"):
                if field_name not in merged and field_name in config:
                    merged[field_name] = config[field_name]
            break
    for key, value in _CLASS_DEFAULTS.get(str(merged.get("model_type")), {}).items():
        merged.setdefault(key, value)
    return merged


def _first(config: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def layer_kinds(config: Mapping[str, Any]) -> list[str]:
    """One of FULL / SLIDING / STATEFUL / MLP_ONLY per decoder layer, from whichever pattern the config uses:
    ``layer_types`` (Gemma-3, Qwen3-Next, gpt-oss), ``hybrid_override_pattern`` (NemotronH: ``*``
    attention, ``M`` Mamba, ``-``/``E`` MLP only), ``attn_layer_period``/``offset`` (Jamba),
    ``attn_layer_indices`` (Bamba), ``layers_block_type`` (Zamba, Granite), ``full_attention_interval``
    (Qwen3-Next), ``sliding_window_pattern`` (Gemma-3), Gemma-2's alternation, Qwen2's
    ``use_sliding_window``/``max_window_layers``, else every layer sliding when ``sliding_window``
    is set (Mistral v0.1, Phi-3) and full otherwise."""
    n = int(_first(config, "num_hidden_layers", "n_layer", "num_layers", default=0))
    if n <= 0:
        raise ModelConfigError("config has no positive 'num_hidden_layers'")
    window = config.get("sliding_window")
    if isinstance(config.get("layer_types"), list):
        kinds = []
        for value in config["layer_types"]:
            value = str(value).lower()
            if any(word in value for word in _STATEFUL_WORDS):
                kinds.append(STATEFUL)
            elif "sliding" in value or "local" in value or "chunked" in value:
                kinds.append(SLIDING)
            elif "attention" in value or value in ("full", "global", "attn"):
                kinds.append(FULL)
            else:
                raise ModelConfigError(f"layer_types: unknown layer type {value!r}")
        return kinds
    if isinstance(config.get("hybrid_override_pattern"), str):
        pattern = config["hybrid_override_pattern"]
        return [FULL if c == "*" else STATEFUL if c == "M" else MLP_ONLY for c in pattern]
    if config.get("attn_layer_period"):
        period, offset = int(config["attn_layer_period"]), int(config.get("attn_layer_offset", 0))
        return [FULL if i % period == offset else STATEFUL for i in range(n)]
    if isinstance(config.get("attn_layer_indices"), list):
        wanted = {int(i) for i in config["attn_layer_indices"]}
        return [FULL if i in wanted else STATEFUL for i in range(n)]
    if isinstance(config.get("layers_block_type"), list):
        return [STATEFUL if any(w in str(t).lower() for w in _STATEFUL_WORDS) else FULL
                for t in config["layers_block_type"]]
    if config.get("full_attention_interval"):
        interval = int(config["full_attention_interval"])
        return [FULL if (i + 1) % interval == 0 else STATEFUL for i in range(n)]
    if not window or config.get("use_sliding_window") is False:
        return [FULL] * n
    if config.get("sliding_window_pattern"):
        every = int(config["sliding_window_pattern"])
        return [FULL if (i + 1) % every == 0 else SLIDING for i in range(n)]
    if config.get("model_type") == "gemma2":
        return [SLIDING if i % 2 == 0 else FULL for i in range(n)]
    if config.get("use_sliding_window") and config.get("max_window_layers") is not None:
        first = int(config["max_window_layers"])
        return [SLIDING if i >= first else FULL for i in range(n)]
    return [SLIDING] * n


@dataclass(frozen=True)
class ModelKVGeometry:
    """What a model's KV cache holds per token, read from ``config.json``.

    MHA/GQA/MQA layers hold K and V: ``2 * kv_heads * head_dim`` elements per token. MLA layers
    (DeepSeek-V2/V3, Kimi) hold ONE latent vector of ``mla_latent_dim = kv_lora_rank +
    qk_rope_head_dim`` elements, the same on every TP rank (replicated). Sliding-window layers hold
    at most ``sliding_window`` tokens; stateful layers (Mamba, linear attention) hold no growing KV
    and are not counted (their fixed per-sequence state is not modeled either).
    """

    model_type: str
    num_layers: int
    full_layers: int
    sliding_layers: int
    stateful_layers: int
    sliding_window: int | None
    num_attention_heads: int
    num_kv_heads: int  # before TP; 1 for MLA (one latent per token)
    head_dim: int  # MHA/GQA head size; MLA: the latent size
    mla_latent_dim: int = 0
    max_position_embeddings: int | None = None

    @property
    def is_mla(self) -> bool:
        return self.mla_latent_dim > 0

    @property
    def attention_layers(self) -> int:
        return self.full_layers + self.sliding_layers

    @property
    def attention_kind(self) -> str:
        """``mla``, ``mha``, ``mqa`` or ``gqa``."""
        if self.is_mla:
            return "mla"
        if self.num_kv_heads == self.num_attention_heads:
            return "mha"
        return "mqa" if self.num_kv_heads == 1 else "gqa"

    def tp_split_problem(self, tp: int) -> str | None:
        """Why vLLM cannot split this model's KV heads over ``tp`` ranks (they must divide evenly, or
        ``tp`` be a multiple of them), or None. MLA's one latent is replicated, never split."""
        if self.is_mla or tp == 1 or self.num_kv_heads % tp == 0 or tp % self.num_kv_heads == 0:
            return None
        return f"-tp {tp} does not divide {self.num_kv_heads} KV heads"

    def kv_heads_per_rank(self, tp: int = 1) -> int:
        """KV heads one TP rank holds: ``ceil(kv_heads / tp)`` (replicated when tp > kv_heads); MLA 1."""
        return 1 if self.is_mla else math.ceil(self.num_kv_heads / tp)

    def layer_token_bytes(self, kv_bytes: int, tp: int = 1) -> int:
        """Bytes of one token in one attention layer on one rank."""
        if self.is_mla:
            return self.mla_latent_dim * kv_bytes
        return 2 * self.kv_heads_per_rank(tp) * self.head_dim * kv_bytes

    def kv_bytes_per_token(self, kv_bytes: int, tp: int = 1) -> int:
        """Per rank, every attention layer counted per token (sliding layers included: how vLLM
        allocates them when the hybrid allocator is off, as with KV connectors such as kvtier)."""
        return self.attention_layers * self.layer_token_bytes(kv_bytes, tp)

    def sequence_kv_bytes(
        self, tokens: int, kv_bytes: int, tp: int = 1, block_size: int = 1, window_aware: bool = True
    ) -> int:
        """Per rank, KV bytes of one sequence of ``tokens`` tokens, rounded up to whole blocks.

        ``window_aware``: sliding layers hold at most their window (plus one block); otherwise they
        hold every token like full layers.
        """
        blocks = -(-tokens // block_size)
        per_layer = self.layer_token_bytes(kv_bytes, tp) * block_size
        sliding_blocks = blocks
        if window_aware and self.sliding_window:
            sliding_blocks = min(blocks, -(-self.sliding_window // block_size) + 1)
        return per_layer * (self.full_layers * blocks + self.sliding_layers * sliding_blocks)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "ModelKVGeometry":
        """Read a Hugging Face ``config.json`` (as a dict); multimodal configs use their text part."""
        cfg = text_config(config)
        kinds = layer_kinds(cfg)
        heads = int(_first(cfg, "num_attention_heads", "n_head", "num_heads", default=0))
        hidden = int(_first(cfg, "hidden_size", "n_embd", "d_model", default=0))
        if heads <= 0:
            raise ModelConfigError("config has no positive 'num_attention_heads'")
        kv_lora = cfg.get("kv_lora_rank")
        latent = int(kv_lora) + int(cfg.get("qk_rope_head_dim") or 0) if kv_lora else 0
        if latent:
            kv_heads, head_dim = 1, latent
        else:
            kv_heads = int(_first(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv", default=heads))
            if kv_heads <= 0:
                raise ModelConfigError("config has no positive 'num_key_value_heads'")
            head_dim = int(_first(cfg, "head_dim", "attention_head_size", default=0)) or (hidden // heads)
            if head_dim <= 0:
                raise ModelConfigError("config has neither 'head_dim' nor 'hidden_size'")
        window = cfg.get("sliding_window") if SLIDING in kinds else None
        return cls(
            model_type=str(cfg.get("model_type", "unknown")),
            num_layers=len(kinds),
            full_layers=kinds.count(FULL),
            sliding_layers=kinds.count(SLIDING),
            stateful_layers=kinds.count(STATEFUL),
            sliding_window=int(window) if window else None,
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            mla_latent_dim=latent,
            max_position_embeddings=_first(cfg, "max_position_embeddings", "n_positions", "seq_length"),
        )
