"""The tiny model families of tests/support/tiny_models.py: they write fast and deterministically,
load in transformers with the shared tiny tokenizer, and their greedy outputs depend on the context
(not only on the last token), so a broken KV load would show.

The runs on vLLM with kvtier are in tests/e2e/test_families_e2e.py.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from support.tiny_models import FAMILIES, MARKER, VOCAB_SIZE, build_config, write_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_writes_a_loadable_folder(name, tiny_dir):
    folder = write_tiny_model(name, tiny_dir)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [FAMILIES[name].architecture]
    assert config["vocab_size"] == VOCAB_SIZE
    for file in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER):
        assert (folder / file).is_file()
    assert sum(f.stat().st_size for f in folder.iterdir()) < 20 * 2**20
    if FAMILIES[name].kind == "mla":
        assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576  # what CPU_MLA accepts


def test_reuse_and_determinism(tmp_path):
    first = write_tiny_model("qwen3-moe", tmp_path / "a")
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert write_tiny_model("qwen3-moe", tmp_path / "a") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rewritten
    second = write_tiny_model("qwen3-moe", tmp_path / "b")
    digest = [hashlib.sha256((f / "model.safetensors").read_bytes()).hexdigest() for f in (first, second)]
    assert digest[0] == digest[1]


def test_tokenizer_round_trips():
    from transformers import AutoTokenizer

    folder = write_tiny_model("qwen3-moe", Path(os.environ.get("TMPDIR", "/tmp")) / "kvtier-tiny-tok")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    text = "Zürich 東京 🙂 def f(x): return x**2"
    ids = tokenizer(text)["input_ids"]
    assert max(ids) < VOCAB_SIZE and tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == 2


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.kind in ("moe", "swa", "mla")])
def test_outputs_depend_on_context(name, tiny_dir):
    """Two prompts with the same last token give different next-token logits (transformers, float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = write_tiny_model(name, tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    logits = []
    for prompt in ("The capital of France is", "My favourite colour is"):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            logits.append(model(ids).logits[0, -1])
    assert logits[0].argmax() != logits[1].argmax()


def test_build_config_keeps_family_shapes():
    assert build_config("gemma3-swa").layer_types.count("sliding_attention") == 3
    assert build_config("qwen3-next").linear_key_head_dim == 128
