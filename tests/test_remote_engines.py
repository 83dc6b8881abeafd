"""Engines sharing one real redis-server through the connector (vLLM's real scheduler and both
connector roles, tests/support/engine_sim.py; Redis from tests/support/redis_server.py).

Each case compares generated tokens with vLLM alone's (the fake model's tokens hash every KV byte
it reads) and checks the loaded pages, so a wrong, stale, foreign or partial value fails here.
The two-processes version with real vLLM engines is tests/e2e/test_redis_e2e.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from support.engine_sim import (
    SimEngine,
    by_prompt,
    external,
    prompts_of,
    reference_outputs,
    renamed,
    settle,
    tokens_of,
    write_model,
)
from support.redis_server import redis_factory  # noqa: F401  (pytest fixture)

from kvtier.core.values import ConfigError
from kvtier.tiers.base import Medium

HOST_BYTES = 2 * 2**20


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "model", seed=7)


@pytest.fixture
def server(redis_factory):  # noqa: F811
    return redis_factory()


def remote_config(url: str, *, disk: Path | None = None, **redis_keys) -> dict:
    tiers = [{"type": "fs", "root_dir": str(disk), "capacity_bytes": 2**30}] if disk else []
    entry = {"type": "redis", "url": url, "timeout_s": 0.5, "connect_timeout_s": 0.5, **redis_keys}
    return {"cpu_bytes_to_use": HOST_BYTES, "secondary_tiers": [*tiers, entry]}


def redis_tier(sim: SimEngine):
    return sim.kvtier_scheduler.orchestrator.tier(Medium.REMOTE)


def generate_salted(sim: SimEngine, prompts: dict[str, list[int]], max_tokens: int, salt: str | None):
    for req_id, tokens in prompts.items():
        sim.add(req_id, tokens, max_tokens, cache_salt=salt)
    sim.run()
    return {req_id: sim.finished[req_id] for req_id in prompts}


def test_a_second_engine_is_served_from_redis_bit_exact(model, server, tmp_path):
    """Engine A (no disk) fills Redis; engine B (its own, empty disk tier) gets every full block of
    A's prompts from Redis, bit-exact, and cascades them into its disk tier."""
    prompts = prompts_of(3, 4, 90)
    ref = reference_outputs(model, prompts, 3)
    with SimEngine(model, kvtier=remote_config(server.url())) as a:
        assert tokens_of(a.generate(prompts, 3)) == ref
        settle(a)
        assert redis_tier(a).stats.writes_ok >= 4 * 5
    with SimEngine(model, kvtier=remote_config(server.url(), disk=tmp_path / "b-disk")) as b:
        results = b.generate(renamed(prompts, "-b"), 3)
        assert by_prompt(results, "-b") == ref
        assert all(n >= 80 for n in external(results))
        assert b.model.kv_mismatches == []
        assert redis_tier(b).stats.reads_ok >= 4 * 5 and redis_tier(b).stats.probes >= 1
        settle(b)
        assert b.kvtier_scheduler.orchestrator.tier(Medium.DISK).stats.writes_ok >= 4 * 5  # remote -> disk


def test_tenants_with_other_cache_salts_never_share_a_block(model, server):
    prompts = prompts_of(4, 2, 90)
    ref = reference_outputs(model, prompts, 3)
    with SimEngine(model, kvtier=remote_config(server.url())) as a:
        assert tokens_of(generate_salted(a, prompts, 3, "tenant-a")) == ref
        settle(a)
    with SimEngine(model, kvtier=remote_config(server.url())) as b:
        other = generate_salted(b, renamed(prompts, "-b"), 3, "tenant-b")
        assert by_prompt(other, "-b") == ref and external(other) == [0, 0]
        same = generate_salted(b, renamed(prompts, "-a"), 3, "tenant-a")
        assert by_prompt(same, "-a") == ref and all(n >= 80 for n in external(same))
        assert b.model.kv_mismatches == []


@pytest.mark.parametrize("damage", ["garbage", "truncated", "flipped_payload_byte"])
def test_a_damaged_value_is_a_counted_miss_and_is_deleted(model, server, damage):
    prompts = prompts_of(5, 2, 90)
    ref = reference_outputs(model, prompts, 3)
    with SimEngine(model, kvtier=remote_config(server.url())) as a:
        a.generate(prompts, 3)
        settle(a)
    raw = server.client()
    names = [n for n in raw.scan_iter(match=b"kvtier:*", count=1000) if not n.endswith(b":config")]
    assert len(names) >= 2 * 5
    for name in names:
        value = raw.get(name)
        if damage == "garbage":
            value = bytes(len(value))
        elif damage == "truncated":
            value = value[: len(value) - 1]
        else:
            value = value[:-1] + bytes([value[-1] ^ 1])
        raw.set(name, value)
    with SimEngine(model, kvtier=remote_config(server.url())) as b:
        results = b.generate(renamed(prompts, "-b"), 3)
        assert by_prompt(results, "-b") == ref and external(results) == [0, 0]
        assert b.model.kv_mismatches == []
        tier = redis_tier(b)
        assert tier.stats.corrupt >= 2  # the first block of each prompt was read, failed, and is gone
        settle(b)
    # The damaged values b read were deleted, and b stored its recomputed blocks again under the
    # same names; blocks b never read are still damaged and must stay misses for c.
    with SimEngine(model, kvtier=remote_config(server.url())) as c:
        results = c.generate(renamed(prompts, "-c"), 3)
        assert by_prompt(results, "-c") == ref and all(n >= 16 for n in external(results))
        assert c.model.kv_mismatches == []


def test_redis_killed_then_paused_mid_workload_requests_finish_and_hits_resume(model, server):
    """Every request finishes with the right tokens while Redis is down, then hung (SIGSTOP); once it
    answers again the same engine gets hits from it without a restart (its cache resets keep what
    Redis holds: ``keep_tiers_on_reset``)."""
    config = {**remote_config(server.url()), "keep_tiers_on_reset": True}
    waves = [prompts_of(10 + i, 2, 90) for i in range(4)]
    refs = [reference_outputs(model, wave, 3) for wave in waves]
    with SimEngine(model, kvtier=config) as sim:
        tier = redis_tier(sim)
        assert tokens_of(sim.generate(waves[0], 3)) == refs[0]
        server.kill()
        start = time.monotonic()
        assert tokens_of(sim.generate(waves[1], 3)) == refs[1]
        assert sim.reset_prefix_cache(reset_connector=True)  # host tier emptied: Redis is the only warm tier
        assert by_prompt(sim.generate(renamed(waves[0], "-k"), 3), "-k") == refs[0]
        killed_seconds = time.monotonic() - start
        server.start()
        server.pause()
        start = time.monotonic()
        try:
            assert tokens_of(sim.generate(waves[2], 3)) == refs[2]
            results = sim.generate(renamed(waves[1], "-p"), 3)
            assert by_prompt(results, "-p") == refs[1]
        finally:
            server.resume()
        paused_seconds = time.monotonic() - start
        assert killed_seconds < 30 and paused_seconds < 30, (killed_seconds, paused_seconds)
        assert tier.stats.io_errors + tier.stats.breaker_rejects > 0
        deadline = time.monotonic() + 45  # the back-off doubles per failed trial, up to 30 s
        while not tier.breaker.closed:  # the breaker's back-off, then a successful trial
            assert time.monotonic() < deadline, "the Redis tier did not come back"
            sim.kvtier_scheduler.orchestrator.poll()
            time.sleep(0.05)
        sim.generate(waves[3], 3)
        settle(sim)
        assert sim.reset_prefix_cache(reset_connector=True)
        results = sim.generate(renamed(waves[3], "-r"), 3)
        assert by_prompt(results, "-r") == refs[3] and all(n >= 80 for n in external(results))
        assert sim.model.kv_mismatches == []


def test_weights_updated_in_place_after_a_reset_are_never_served_the_old_weights_kv(model, server, tmp_path):
    """Reinforcement learning: ``pause_generation`` resets the connector's cache, the weights are
    updated in place (the files, so kvtier's fingerprint, unchanged), generation resumes. Nothing
    Redis holds from before is loaded (it would be the old weights' KV); what the engine computes
    after is stored and served under the new key epoch; an engine started afresh (its files' weights,
    the old ones) still reads the old blocks."""
    prompts = prompts_of(21, 2, 90)
    ref_old = reference_outputs(model, prompts, 3)
    ref_new = reference_outputs(write_model(tmp_path / "updated", seed=8), prompts, 3)
    assert ref_new != ref_old
    config = remote_config(server.url())
    with SimEngine(model, kvtier=config) as sim:
        assert tokens_of(sim.generate(prompts, 3)) == ref_old
        settle(sim)
        assert sim.reset_prefix_cache(reset_connector=True)
        sim.model.seed = 8  # the weights, updated in place
        results = sim.generate(renamed(prompts, "-u"), 3)
        assert by_prompt(results, "-u") == ref_new and external(results) == [0, 0]
        settle(sim)
        assert sim.reset_prefix_cache()  # vLLM's own cache only (the key epoch stays)
        sim.kvtier_scheduler.orchestrator.clear()  # and kvtier's host tier: Redis serves what follows
        results = sim.generate(renamed(prompts, "-v"), 3)
        assert by_prompt(results, "-v") == ref_new and all(n >= 80 for n in external(results))
        assert sim.model.kv_mismatches == []
    with SimEngine(model, kvtier=config) as restarted:
        results = restarted.generate(renamed(prompts, "-o"), 3)
        assert by_prompt(results, "-o") == ref_old and all(n >= 80 for n in external(results))
        assert restarted.model.kv_mismatches == []


def test_wrong_password_is_a_clear_error_at_start_up(model, redis_factory, monkeypatch):  # noqa: F811
    server = redis_factory(users=[["kv", "on", ">right-pass", "~kvtier:*", "+@all"]])
    monkeypatch.setenv("KV_PASS", "wrong-pass")
    config = remote_config(server.url(), username="kv", password_env="KV_PASS")
    with pytest.raises(ConfigError) as info:
        SimEngine(model, kvtier=config)
    message = str(info.value)
    assert "kv" in message and "KV_PASS" in message and "wrong-pass" not in message
    monkeypatch.setenv("KV_PASS", "right-pass")
    prompts = prompts_of(20, 1, 90)
    with SimEngine(model, kvtier=config) as sim:
        assert tokens_of(sim.generate(prompts, 3)) == reference_outputs(model, prompts, 3)
        settle(sim)
        assert redis_tier(sim).stats.writes_ok >= 5
