"""Key spec "kvtier/1": pinned vectors so the spec cannot drift silently."""

import dataclasses
import os
import subprocess
import sys

import blake3
from hypothesis import given
from hypothesis import strategies as st

from kvtier.core.keys import BlockExtras, Namespace, block_key, chain_block_keys

NS = Namespace("SmolLM2-135M-Instruct", "0" * 32, "float32", 30, 3, 64, "mha", 128, "cpu:default")


def test_namespace_canonical_json_and_digest_are_pinned():
    assert NS.canonical_json() == (
        '{"attention_kind":"mha","block_tokens":128,"head_size":64,"kv_dtype":"float32",'
        '"model_digest":"00000000000000000000000000000000","model_name":"SmolLM2-135M-Instruct",'
        '"num_kv_heads":3,"num_layers":30,"page_format":"cpu:default","pp_rank":0,"pp_size":1,'
        '"spec_version":"kvtier/1","tp_rank":0,"tp_size":1}'
    )
    assert NS.digest.hex() == "71b2536663476fda1334024fdab208f840bd56aa959598e22636f147f0a4767e"


def test_block_key_is_blake3_of_parent_tokens_le_u32_and_extras():
    assert block_key(b"", [1, 2, 3]).hex() == "df07f4904a7ccb203dc935dae7baf4a4c1f0ab9279a863a69109be74f26032ef"
    manual = blake3.blake3(b"\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00").hexdigest()
    assert block_key(b"", [1, 2, 3]).hex() == manual


def test_chained_keys_are_pinned():
    keys = chain_block_keys(NS.digest, list(range(256)), 128)
    assert keys[1].hex() == "13f0e80649984bd3a9bc178fded7c40db882833c7f46a4c43b2fffbb49e0eb58"
    assert keys[1] == block_key(keys[0], list(range(128, 256)))
    salted = chain_block_keys(NS.digest, list(range(128)), 128, BlockExtras(lora_name="a", cache_salt="t"))
    assert salted[0].hex() == "11b74d867946ec88471d6722230e35cc110ed4571085bd0390220fb881e2380f"
    mm = chain_block_keys(NS.digest, list(range(128)), 128, BlockExtras(mm_hashes=("h1",)))
    assert mm[0].hex() == "12b87f37748d328149bdca9a2bb40df5f50979f071f63f9045c6178a710b61a5"


def test_keys_identical_in_a_fresh_process_with_another_hash_seed():
    code = (
        "from kvtier.core.keys import *;"
        "ns=Namespace('SmolLM2-135M-Instruct','0'*32,'float32',30,3,64,'mha',128,'cpu:default');"
        "print(chain_block_keys(ns.digest, list(range(256)), 128)[1].hex())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "13f0e80649984bd3a9bc178fded7c40db882833c7f46a4c43b2fffbb49e0eb58"


def test_partial_block_gets_no_key_and_incremental_extension_matches():
    tokens = list(range(300))
    full = chain_block_keys(NS.digest, tokens, 128)
    assert len(full) == 2
    first = chain_block_keys(NS.digest, tokens[:128], 128)
    rest = chain_block_keys(first[-1], tokens, 128, start_block=1)
    assert first + rest == full


def test_every_namespace_field_changes_the_digest():
    for f in dataclasses.fields(NS):
        value = getattr(NS, f.name)
        changed = value + 1 if isinstance(value, int) else value + "x"
        assert dataclasses.replace(NS, **{f.name: changed}).digest != NS.digest, f.name


def test_rank_namespaces_differ_but_share_the_engine_digest():
    tp = dataclasses.replace(NS, tp_size=2)
    assert tp.for_rank(0).digest != tp.for_rank(1).digest
    assert tp.for_rank(1).rank_independent_digest == tp.digest


@given(
    st.lists(st.integers(0, 2**32 - 1), min_size=8, max_size=8),
    st.one_of(st.none(), st.text(max_size=5)),
    st.one_of(st.none(), st.text(max_size=5)),
    st.lists(st.text(max_size=4), max_size=2),
)
def test_extras_encoding_is_injective_enough(tokens, lora, salt, mm):
    base = chain_block_keys(NS.digest, tokens, 8)[0]
    extras = BlockExtras(lora_name=lora, cache_salt=salt, mm_hashes=tuple(mm))
    keyed = chain_block_keys(NS.digest, tokens, 8, extras)[0]
    assert (keyed == base) == (extras.encode() == b"")
    # swapping the lora name into the salt field must give another key
    if lora is not None and lora != salt:
        swapped = BlockExtras(lora_name=salt, cache_salt=lora, mm_hashes=tuple(mm))
        assert chain_block_keys(NS.digest, tokens, 8, swapped)[0] != keyed
