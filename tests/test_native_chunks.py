"""The vLLM-free part of kvtier's native tiers (kvtier.runtime.chunks): pinned key and seed
derivations (a change that moves them orphans every record written), which hash seeds are shared,
the namespace of a run, and rows cut into per-rank payloads."""

from __future__ import annotations

import pytest

from kvtier.core.keys import ModelIdentity
from kvtier.runtime.chunks.identity import HashSeed, SeedKind
from kvtier.runtime.chunks.rows import Rows
from kvtier.runtime.chunks.run import EngineRun, GroupFacts, namespace
from kvtier.runtime.chunks.store import chunk_key

MODEL = ModelIdentity(weights="blake3:00", config="c", dtype="bfloat16")


def run(**changes) -> EngineRun:
    facts = dict(model_name="m", kv_dtype="bfloat16", groups=(GroupFacts(0, 16, ("l0", "l1")),), tokens_per_hash=16,
                 blocks_per_chunk=4, worker_kv_bytes_per_block=4096, world_size=2, tp_size=2)
    return EngineRun(**{**facts, **changes})


def test_key_and_seed_derivations_are_pinned():
    assert chunk_key(bytes(range(32)), b"\x01" * 32 + b"\x00" * 4).hex() == (
        "de49e4f8d35f3e2b95bd435a0354b31d3e272efe322ca75620de1f5461e0d7a0")
    assert HashSeed.of("sha256", SeedKind.FIXED, b"\x02" * 32).digest == "c1c3ebef74eee488e00c100818541ec5"


def test_which_seeds_other_processes_share():
    assert SeedKind.of("sha256", None) is SeedKind.FIXED
    assert SeedKind.of("sha256_cbor", None) is SeedKind.FIXED
    assert SeedKind.of("xxhash", None) is SeedKind.RANDOM and SeedKind.of("xxhash_cbor", None) is SeedKind.RANDOM
    assert SeedKind.of("xxhash", "0") is SeedKind.ENVIRONMENT
    assert not HashSeed.of("xxhash", SeedKind.RANDOM, b"x").shared


def test_namespace_changes_with_everything_that_makes_the_bytes():
    seed = HashSeed.of("sha256", SeedKind.FIXED, b"\x02" * 32)
    base = namespace(run(), MODEL, seed)
    assert len(base.rank_digests()) == 2 and len(set(base.rank_digests())) == 2
    others = [
        namespace(run(blocks_per_chunk=2), MODEL, seed),
        namespace(run(groups=(GroupFacts(0, 32, ("l0", "l1")),)), MODEL, seed),
        namespace(run(worker_kv_bytes_per_block=2048), MODEL, seed),
        namespace(run(kv_dtype="fp8"), MODEL, seed),
        namespace(run(kv_cache_layout="HND"), MODEL, seed),
        namespace(run(device="cuda"), MODEL, seed),
        namespace(run(world_size=4, tp_size=4), MODEL, seed),
        namespace(run(), ModelIdentity(weights="blake3:01", config="c", dtype="bfloat16"), seed),
        namespace(run(), MODEL, HashSeed.of("sha256", SeedKind.ENVIRONMENT, b"\x03" * 32)),
        namespace(run(), MODEL, HashSeed.of("xxhash", SeedKind.FIXED, b"\x02" * 32)),
    ]
    digests = {ns.engine_digest for ns in others}
    assert base.engine_digest not in digests and len(digests) == len(others)
    assert namespace(run(), MODEL, seed).engine_digest == base.engine_digest
    replicated = namespace(run(replicated=True), MODEL, seed)
    assert replicated.replicated and len(replicated.rank_digests()) == 1


def test_rows_are_cut_into_rank_payloads_and_padding_is_never_a_payload():
    region = bytearray(range(256)) * 3  # 3 rows of 256 bytes
    rows = Rows(memoryview(region).cast("B", (3, 256)), copies=2, payload_bytes=100)
    first, second = rows.payloads(1)
    assert bytes(first) == bytes(region[256:356]) and bytes(second) == bytes(region[356:456])
    with pytest.raises(IndexError):
        rows.payloads(3)
    with pytest.raises(ValueError, match="disagree"):
        Rows(memoryview(region).cast("B", (3, 256)), copies=3, payload_bytes=100)
