"""Key spec "kvtier/2": pinned vectors so the spec cannot drift silently."""

import dataclasses
import json
import os
import subprocess
import sys

import blake3
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.core.keys import (
    KEY_SPEC_VERSION,
    BlockExtras,
    ModelIdentity,
    Namespace,
    PageFormat,
    SpecVersionError,
    block_key,
    chain_block_keys,
    epoch_root,
    stateless_key,
    stored_ranks_of,
    tail_key,
)

NS = Namespace(
    model=ModelIdentity(weights="blake3:" + "0" * 64, config="c" * 32, dtype="float32"),
    ranks=(PageFormat(128, "float32", "LBHNC", "full_attention", ("CPU_ATTN",), 30, 3, 64, 196608, "d" * 32),),
    block_tokens=128,
)
NS_DIGEST = "aeec42fa5ab2e5d95ba5d02b9cfaa2ca53f19cefac7a98d8f46a566e8506d521"
CHAINED = "85547d7c796189f7af4f5c045c80f87f18bccec238a0ef2b102547655a0a558b"  # key of block 1 of 0..255
SALTED = "c81e322b3ec8cfa359e79927bf012978f36f61e078a0397060414f342888e7e2"  # lora "blake3:a", salt "t"
MULTIMODAL = "dab40bc4ce386b909a3f12d67ee20b67ba71acca0cfa77aa7975c1c7ece25e26"  # mm hash "h1"


def test_namespace_canonical_json_and_digest_are_pinned():
    assert NS.canonical_json() == (
        '{"block_tokens":128,"model":{"config":"cccccccccccccccccccccccccccccccc","dtype":"float32",'
        '"overrides":"","quantization":"","weights":"blake3:0000000000000000000000000000000000000000000000000000000000000000"},'
        '"pp_size":1,"rank":0,"ranks":[{"attention":"full_attention","backends":["CPU_ATTN"],'
        '"engine_block_tokens":128,"head_size":64,"kv_dtype":"float32","kv_scales":"","layout":"LBHNC",'
        '"num_kv_heads":3,"num_layers":30,"page_bytes":196608,"pages":"dddddddddddddddddddddddddddddddd"}],'
        '"spec_version":"kvtier/2","tp_size":1}'
    )
    assert NS.digest.hex() == NS_DIGEST


def test_block_key_is_blake3_of_parent_tokens_le_u32_and_extras():
    assert block_key(b"", [1, 2, 3]).hex() == "df07f4904a7ccb203dc935dae7baf4a4c1f0ab9279a863a69109be74f26032ef"
    manual = blake3.blake3(b"\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00").hexdigest()
    assert block_key(b"", [1, 2, 3]).hex() == manual


def test_a_block_stored_without_its_state_has_a_key_of_its_own():
    """Mamba hybrids: a block stored with its attention pages only never answers for the block
    with its state (which alone may end a hit), nor for any block or tail key."""
    key = block_key(NS.digest, list(range(128)))
    variant = stateless_key(key)
    assert variant == blake3.blake3(b"kvtier/attention-only" + key).digest()
    assert variant.hex() == stateless_key(bytes.fromhex(key.hex())).hex()  # deterministic
    assert variant not in {key, block_key(key, list(range(128))), tail_key(key, [1, 2, 3]), stateless_key(variant)}


def test_chained_keys_are_pinned():
    keys = chain_block_keys(NS.digest, list(range(256)), 128)
    assert keys[1].hex() == CHAINED
    assert keys[1] == block_key(keys[0], list(range(128, 256)))
    salted = chain_block_keys(NS.digest, list(range(128)), 128, BlockExtras(lora="blake3:a", cache_salt="t"))
    assert salted[0].hex() == SALTED
    mm = chain_block_keys(NS.digest, list(range(128)), 128, BlockExtras(mm_hashes=("h1",)))
    assert mm[0].hex() == MULTIMODAL


def test_keys_identical_in_a_fresh_process_with_another_hash_seed():
    code = (
        "import sys; sys.path.insert(0, %r); from test_keys import NS; from kvtier.core.keys import chain_block_keys;"
        "print(chain_block_keys(NS.digest, list(range(256)), 128)[1].hex())" % os.path.dirname(__file__)
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == CHAINED


def test_partial_block_gets_no_key_and_incremental_extension_matches():
    tokens = list(range(300))
    full = chain_block_keys(NS.digest, tokens, 128)
    assert len(full) == 2
    first = chain_block_keys(NS.digest, tokens[:128], 128)
    rest = chain_block_keys(first[-1], tokens, 128, start_block=1)
    assert first + rest == full


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, tuple):
        return value + ("x",)
    return value + "x"


def test_every_identity_field_changes_the_digest():
    """The weights, the config, every page-format field, the block size, the parallel layout."""
    for f in dataclasses.fields(NS.model):
        model = dataclasses.replace(NS.model, **{f.name: _changed(getattr(NS.model, f.name))})
        assert dataclasses.replace(NS, model=model).digest != NS.digest, f"model.{f.name}"
    page = NS.ranks[0]
    for f in dataclasses.fields(page):
        other = dataclasses.replace(page, **{f.name: _changed(getattr(page, f.name))})
        assert dataclasses.replace(NS, ranks=(other,)).digest != NS.digest, f"page.{f.name}"
    assert dataclasses.replace(NS, block_tokens=256).digest != NS.digest
    assert dataclasses.replace(NS, tp_size=2, ranks=(page, page)).digest != NS.digest
    assert dataclasses.replace(NS, spec_version="kvtier/1").digest != NS.digest


def test_engine_block_size_alone_changes_the_namespace():
    """The hole of kvtier/1: 64- and 128-token engine pages behind one 256-token offload block."""
    page = NS.ranks[0]
    small = dataclasses.replace(page, engine_block_tokens=64, page_bytes=page.page_bytes // 2)
    big = dataclasses.replace(page, engine_block_tokens=128)
    ns64 = dataclasses.replace(NS, block_tokens=256, ranks=(small,))
    ns128 = dataclasses.replace(NS, block_tokens=256, ranks=(big,))
    assert ns64.digest != ns128.digest
    assert chain_block_keys(ns64.digest, list(range(256)), 256) != chain_block_keys(ns128.digest, list(range(256)), 256)


def test_rank_namespaces_differ_but_share_the_engine_digest():
    page = NS.ranks[0]
    tp = dataclasses.replace(NS, tp_size=2, ranks=(page, page))
    assert tp.for_rank(0).digest != tp.for_rank(1).digest
    assert tp.for_rank(1).engine_digest == tp.digest == tp.rank_digests()[0]


def test_a_replicated_namespace_stores_one_copy_under_its_own_digest():
    """MLA at tp=2: one page format, one digest (rank 0's), which no per-rank namespace has; the
    flag enters the digest only when set (per-rank digests stay those of kvtier/2, pinned above)."""
    page = NS.ranks[0]
    replicated = dataclasses.replace(NS, tp_size=2, ranks=(page,), replicated=True)
    per_rank = dataclasses.replace(NS, tp_size=2, ranks=(page, page))
    assert replicated.rank_digests() == [replicated.digest]
    assert replicated.digest not in per_rank.rank_digests() and replicated.digest != NS.digest
    assert '"replicated":true' in replicated.canonical_json() and "replicated" not in NS.canonical_json()
    assert Namespace.from_dict(replicated.to_dict()) == replicated
    assert Namespace.from_dict(per_rank.to_dict()) == per_rank
    with pytest.raises(ValueError, match="one replicated copy"):
        dataclasses.replace(NS, tp_size=2, ranks=(page, page), replicated=True)


def test_config_json_round_trip_and_display_name_outside_the_digest():
    data = json.loads(NS.config_json("SmolLM2-135M-Instruct"))
    assert data["model_name"] == "SmolLM2-135M-Instruct"
    assert Namespace.from_dict(data) == NS
    assert json.loads(NS.config_json("other name"))["spec_version"] == KEY_SPEC_VERSION == "kvtier/2"


@pytest.mark.parametrize("path, value", [
    (("block_tokens",), float("inf")), (("block_tokens",), 1e999), (("block_tokens",), True), (("block_tokens",), "128"),
    (("block_tokens",), 0), (("tp_size",), 10**13), (("pp_size",), -1), (("rank",), 2**70),
    (("ranks",), "not a list"), (("ranks",), [{}] * 10**4), (("ranks", 0, "page_bytes"), float("inf")),
    (("ranks", 0, "num_layers"), "30"), (("ranks", 0, "backends"), "CPU_ATTN"), (("model", "dtype"), 32),
])
def test_a_namespace_read_from_outside_is_checked_before_use(path, value):
    """config.json (a disk root anyone with write access may edit) and a node hello carry a
    namespace: a number that is not a whole number in range (1e999, a bool, a string) is a
    ValueError or TypeError naming it, never an OverflowError or MemoryError later."""
    data = json.loads(NS.config_json("m"))
    target = data
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    with pytest.raises((ValueError, TypeError)):
        Namespace.from_dict(data)
    if path in (("tp_size",), ("pp_size",)):
        with pytest.raises(ValueError, match=path[0]):
            stored_ranks_of(data)


def test_older_spec_is_refused_by_name():
    with pytest.raises(SpecVersionError, match="kvtier/1"):
        Namespace.from_dict({"spec_version": "kvtier/1", "model_name": "x", "model_digest": "0" * 32})


@given(
    st.lists(st.integers(0, 2**32 - 1), min_size=8, max_size=8),
    st.one_of(st.none(), st.text(max_size=5)),
    st.one_of(st.none(), st.text(max_size=5)),
    st.lists(st.text(max_size=4), max_size=2),
)
def test_extras_encoding_is_injective_enough(tokens, lora, salt, mm):
    base = chain_block_keys(NS.digest, tokens, 8)[0]
    extras = BlockExtras(lora=lora, cache_salt=salt, mm_hashes=tuple(mm))
    keyed = chain_block_keys(NS.digest, tokens, 8, extras)[0]
    assert (keyed == base) == (extras.encode() == b"")
    # swapping the lora name into the salt field must give another key
    if lora is not None and lora != salt:
        swapped = BlockExtras(lora=salt, cache_salt=lora, mm_hashes=tuple(mm))
        assert chain_block_keys(NS.digest, tokens, 8, swapped)[0] != keyed


def test_a_reset_epoch_roots_every_key_elsewhere_and_start_up_keeps_the_spec():
    digest = bytes(range(32))
    assert epoch_root(digest) == digest  # epoch b"": the keys of the spec, unchanged
    epoch = bytes(range(16))
    root = epoch_root(digest, epoch)
    assert root.hex() == "ebebea6411a567498245ebdb84ea585b5203c43c4e20d1b0e9925e0ffaf714c1"  # pinned
    assert root == blake3.blake3(b"kvtier/reset-epoch\0" + digest + epoch).digest()
    assert epoch_root(digest, bytes(16)) not in (root, digest)
    assert epoch_root(bytes(32), epoch) != root
    tokens = list(range(256))
    assert not set(chain_block_keys(root, tokens, 128)) & set(chain_block_keys(digest, tokens, 128))
    with pytest.raises(ValueError, match="16 bytes"):
        epoch_root(digest, b"short")
