"""kvtier's tiers at the shape GPUs run, end to end on real vLLM-CPU engines (issue "kvtier's tiers
behind vLLM's own offloading, at the shapes GPUs run").

On GPUs vLLM's block is 16 tokens and one offloaded chunk is one block, so a long prefill hands a
tier hundreds of chunks in one step. The nearest vLLM-CPU runs: 32-token engine blocks, one chunk
per block, two prompts of ~4,000 tokens (~125 chunks each; vLLM-CPU prefills 2,048 tokens per step,
so a step cascades ~64 chunks per tier, as many as the Redis tier takes in flight).

- vLLM's OffloadingConnector with kvtier's spec, kvtier_disk + kvtier_redis + kvtier_s3 (a real
  SeaweedFS, tests/support/seaweed.py): an engine computes and stores; a FRESH engine (new process,
  vLLM's CPU tier empty) is served at least 95% of its prompts' whole chunks from kvtier_disk alone,
  another from kvtier_redis alone, and another from kvtier_s3 alone; outputs bit-exact with vLLM
  alone. Before the fix, a fresh engine got ~1% of its tokens from kvtier_redis.
- The disk engine then meets records replaced by a symlink, a directory and a truncated file (its
  index believes them): it finishes, bit-exact, the faults counted, each read once.
- kvtier's own connector with Redis as its only secondary tier: the same, through its host -> Redis
  cascade (50.7% before the fix).

Tiny Qwen3-MoE (random weights: every output depends on every KV value; tests/support/tiny_models.py).
One process per engine, vLLM's one-process mode.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.offline_run import cached, launch, metric, tokens
from support.redis_server import module_redis  # noqa: F401  (pytest fixture)
from support.seaweed import seaweed  # noqa: F401  (pytest fixture)
from support.tiny_models import write_tiny_model

from kvtier.bench.text import long_prompts

pytestmark = pytest.mark.e2e

BLOCK = 32  # engine block = offloaded chunk, as on GPUs (16 there)
MAX_TOKENS = 4
MAX_MODEL_LEN = 4096  # the tiny model's max_position_embeddings
SPEC = {"spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier.vllm.native"}
SHARE = 0.95


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model("qwen3-moe", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def prompts(model) -> list[str]:
    """Two documents of 3,900-4,090 tokens (the tiny tokenizer's count), far apart from the first token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    chosen = []
    for words in range(3000, 3400, 20):  # ~1.24 tokens a word
        texts = long_prompts(2, words, seed=31)
        lengths = [len(tokenizer(t).input_ids) for t in texts]
        if min(lengths) >= 3900 and max(lengths) <= MAX_MODEL_LEN - MAX_TOKENS - 2:
            chosen = texts
            break
    assert chosen, "no document length fits the window"
    return chosen


def whole_chunk_tokens(model: Path, prompts: list[str]) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return sum(len(tokenizer(t).input_ids) // BLOCK * BLOCK for t in prompts)


def spec(model: Path, prompts: list[str], extra: dict | None, *, native: bool, rounds=({},)) -> dict:
    return {
        "model": str(model), "prompts": prompts, "rounds": list(rounds), "max_tokens": MAX_TOKENS,
        "kv_cache_memory_bytes": 64 * 2**20, "max_model_len": MAX_MODEL_LEN, "block_size": BLOCK,
        **({"connector": "native"} if native else {}), "kv_connector_extra_config": extra,
    }


def native(tiers: list[dict]) -> dict:
    return {**SPEC, "cpu_bytes_to_use": 256 * 2**20, "secondary_tiers": tiers}


@pytest.fixture(scope="module")
def redis(module_redis):  # noqa: F811  (the shared fixture, under this module's name)
    return module_redis


@pytest.fixture(scope="module")
def s3_tier(seaweed) -> dict:  # noqa: F811  (the session's SeaweedFS)
    """A kvtier_s3 entry on a prefix of this module's own."""
    import os

    seaweed.ensure_running()
    entry = seaweed.tier(f"gpu-shapes-{os.urandom(4).hex()}")
    return {**{k: v for k, v in entry.items() if k != "type"}, "type": "kvtier_s3"}


@pytest.fixture(scope="module")
def expected(model, prompts, vllm_alone) -> list[list[int]]:
    result = vllm_alone(spec(model, prompts, None, native=False))
    outputs = tokens(result)
    assert len(set(map(tuple, outputs))) == len(outputs)
    return outputs


@pytest.fixture(scope="module")
def warm(model, prompts, redis, s3_tier, expected, tmp_path_factory) -> Path:
    """One engine writes the three tiers (round 0), and is then served from them (round 1, vLLM's
    prefix cache and CPU tier reset): the chunks all landed before it exits."""
    tmp = tmp_path_factory.mktemp("warm")
    root = tmp / "root"
    tiers = [{"type": "kvtier_disk", "root_dir": str(root), "capacity_bytes": 2**30},
             {"type": "kvtier_redis", "url": redis.url()}, s3_tier]
    tiers = [{**tier, "keep_on_reset": True} for tier in tiers]  # round 1 is served by them
    result = launch(spec(model, prompts, native(tiers), native=True,
                         rounds=({}, {"reset_prefix_cache": True, "reset_connector": True})), tmp)
    assert tokens(result, 0) == expected and tokens(result, 1) == expected
    assert metric(result, 0, "kvtier_offload_stores_dropped") == 0
    return root


def test_fresh_engines_are_served_whole_prompts_from_disk_and_from_redis(warm, model, prompts, redis, expected,
                                                                           tmp_path):
    whole = whole_chunk_tokens(model, prompts)
    from_redis = launch(spec(model, prompts, native([{"type": "kvtier_redis", "url": redis.url()}]), native=True),
                        tmp_path)
    assert tokens(from_redis) == expected
    print(f"fresh engine, kvtier_redis alone: {sum(cached(from_redis))} of {whole} whole-chunk prompt tokens")
    assert sum(cached(from_redis)) >= SHARE * whole

    root = warm
    records = sorted(p for p in root.rglob("*.bin") if "quarantine" not in p.parts)
    bad = records[10:13]

    def plant_faults() -> None:
        """A symlink, a directory and a truncated file where three records were."""
        target = records[-1]
        bad[0].unlink()
        bad[0].symlink_to(target)
        bad[1].unlink()
        bad[1].mkdir()
        bad[2].write_bytes(bad[2].read_bytes()[:100])

    from_disk = launch(spec(model, prompts, native([{"type": "kvtier_disk", "root_dir": str(root),
                                                     "capacity_bytes": 2**30, "keep_on_reset": True}]), native=True,
                            rounds=({}, {"pause": True, "reset_prefix_cache": True, "reset_connector": True})),
                       tmp_path, before_round={1: plant_faults})
    assert tokens(from_disk, 0) == expected
    print(f"fresh engine, kvtier_disk alone: {sum(cached(from_disk, 0))} of {whole} whole-chunk prompt tokens")
    assert sum(cached(from_disk, 0)) >= SHARE * whole
    assert tokens(from_disk, 1) == expected  # finished, bit-exact, past the planted faults
    failed = metric(from_disk, 1, "kvtier_offload_failed_reads")
    assert 1 <= failed <= 3, failed  # each read once (the rest of a prompt's prefix waits behind the first)
    assert sum(cached(from_disk, 1)) < sum(cached(from_disk, 0))


def test_a_fresh_engine_is_served_whole_prompts_from_kvtier_s3(warm, model, prompts, s3_tier, expected, tmp_path):
    """kvtier_s3 behind vLLM's OffloadingConnector (issue "An S3-compatible object tier"): 32-token
    blocks, ~4,000-token prompts, a fresh engine with the S3 tier alone."""
    whole = whole_chunk_tokens(model, prompts)
    from_s3 = launch(spec(model, prompts, native([s3_tier]), native=True), tmp_path)
    assert tokens(from_s3) == expected
    print(f"fresh engine, kvtier_s3 alone: {sum(cached(from_s3))} of {whole} whole-chunk prompt tokens")
    assert sum(cached(from_s3)) >= SHARE * whole
    assert metric(from_s3, 0, "kvtier_offload_failed_reads") == 0


def test_kvtiers_connector_keeps_long_prompts_whole_in_redis(model, prompts, redis, expected, tmp_path):
    extra = {"cpu_bytes_to_use": 256 * 2**20, "secondary_tiers": [{"type": "redis", "url": redis.url(),
                                                                    "key_prefix": "kvtier-own"}]}
    first = launch(spec(model, prompts, extra, native=False), tmp_path)
    assert tokens(first) == expected
    fresh = launch(spec(model, prompts, extra, native=False), tmp_path)
    assert tokens(fresh) == expected
    whole = whole_chunk_tokens(model, prompts)
    print(f"fresh engine, kvtier's connector, Redis alone: {sum(cached(fresh))} of {whole} whole-chunk tokens")
    assert sum(cached(fresh)) >= SHARE * whole
