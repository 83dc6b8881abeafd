"""kvtier's tiers behind vLLM's own offloading, end to end on real vLLM-CPU engines (issue "kvtier's
tiers behind vLLM's own offloading"): vLLM's OffloadingConnector with kvtier's KVTierOffloadingSpec
(vLLM's tiering spec with a CPU worker), vLLM's CPU tier, and kvtier_disk / kvtier_redis as its
secondary tiers; every output compared with vLLM alone's.

- a fresh engine on a warm root is served from disk; a third of the records flipped, truncated or
  emptied between two rounds: still bit-exact, each bad record counted (and quarantined);
- a fine-tuned twin (same config.json, other weights) on the same root: misses (and without
  kvtier's plugin: module paths);
- two engines of another engine block size on the same root at the same time: misses, bit-exact,
  and their namespace stays within capacity_bytes while both write;
- kvtier_redis: a second engine PROCESS (vLLM's multiprocess mode: scheduler, worker and the shared
  CPU region in separate processes) is served from a real redis-server; the server stopped mid-run
  costs only misses;
- xxhash without PYTHONHASHSEED: the start-up message, and nothing left that a later process could read;
- weights updated in place after vLLM's reset (an RL step): kvtier_disk's records of the old weights
  are never served (a new key epoch), bit-exact with vLLM alone after the same update;
- vLLM's MultiConnector with vLLM's ExampleConnector first (empty) and the OffloadingConnector with
  kvtier_disk second: a fresh engine is served from kvtier_disk; then ExampleConnector, which stored
  the prompts meanwhile, serves them and the OffloadingConnector loads nothing.

Nine prompts of one 64-token chunk each (plus a partial one vLLM does not offload), so every record
is the first of its prompt: each is looked up, and each bad one read and counted. Tiny Qwen3-MoE
(random weights, tests/support/tiny_models.py): the model family does not matter here. One process
per engine (tests/support/offline_run.py), one-process vLLM mode except the Redis reader.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from support.offline_run import cached, finish, launch, metric, start, tokens
from support.redis_server import module_redis  # noqa: F401  (pytest fixture)
from support.store_files import namespace_bytes, record_files
from support.tiny_models import write_tiny_model

from kvtier.bench.text import long_prompts

pytestmark = pytest.mark.e2e

CHUNK = 64
BLOCK = 64
MAX_TOKENS = 8
PROMPTS = long_prompts(9, 50, seed=5)  # 77-87 tokens each
OTHER_PROMPTS = long_prompts(9, 50, seed=6)
SPEC = {"spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier.vllm.native"}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model("qwen3-moe", tmp_path_factory.mktemp("tiny"))


def run_spec(model: Path, tiers: list[dict] | None, rounds=({},), *, prompts=PROMPTS, block_size: int = BLOCK,
             engine: dict | None = None) -> dict:
    return {
        "model": str(model), "prompts": list(prompts), "rounds": list(rounds), "max_tokens": MAX_TOKENS,
        "kv_cache_memory_bytes": 32 * 2**20, "max_model_len": 512, "block_size": block_size,
        "connector": "native", "engine": engine or {},
        "kv_connector_extra_config": None if tiers is None else {
            **SPEC, "cpu_bytes_to_use": 64 * 2**20, "block_size": CHUNK, "secondary_tiers": tiers},
    }


def disk(root: Path, capacity: int = 2**30, **more) -> dict:
    return {"type": "kvtier_disk", "root_dir": str(root), "capacity_bytes": capacity, **more}


@pytest.fixture(scope="module")
def redis(module_redis):  # noqa: F811  (the shared fixture, under this module's name)
    return module_redis


@pytest.fixture(scope="module")
def expected(model, tmp_path_factory) -> dict[str, list[list[int]]]:
    """vLLM alone on every prompt (each its own request): the reference of every engine below."""
    alone = launch(run_spec(model, None, prompts=PROMPTS + OTHER_PROMPTS), tmp_path_factory.mktemp("alone"))
    outputs = tokens(alone)
    assert len(set(map(tuple, outputs))) == len(outputs), "the model does not tell the prompts apart"
    return {"prompts": outputs[:9], "other": outputs[9:]}


@pytest.fixture(scope="module")
def warm(model, redis, expected, tmp_path_factory):
    """An engine with vLLM's CPU tier + kvtier_disk + kvtier_redis: round 0 computes and stores,
    round 1 (vLLM's prefix cache and CPU tier reset) is served by kvtier_disk in the same process."""
    tmp = tmp_path_factory.mktemp("warm")
    root = tmp / "root"
    result = launch(run_spec(model, [disk(root, keep_on_reset=True),
                                     {"type": "kvtier_redis", "url": redis.url(), "keep_on_reset": True}],
                             rounds=({}, {"reset_prefix_cache": True, "reset_connector": True})), tmp)
    assert tokens(result, 0) == expected["prompts"] and cached(result, 0) == [0] * 9
    assert tokens(result, 1) == expected["prompts"]
    assert cached(result, 1) == [CHUNK] * 9, "round 1 was not served from kvtier_disk"
    assert metric(result, 1, "chunk_hits", "kvtier_disk") == 9
    assert len(record_files(root)) == 9
    return root, result


def test_a_fresh_engine_is_served_from_disk_and_bad_records_are_counted_misses(warm, model, expected, tmp_path):
    root, _ = warm
    files = record_files(root)
    bad = files[::3]  # a third: flipped, truncated, emptied

    def corrupt() -> None:
        for path, how in zip(bad, ("flip", "truncate", "empty"), strict=True):
            data = path.read_bytes()
            if how == "flip":
                path.write_bytes(data[:-7] + bytes([data[-7] ^ 0x10]) + data[-6:])
            elif how == "truncate":
                path.write_bytes(data[:200])
            else:
                path.write_bytes(b"")

    fresh = launch(run_spec(model, [disk(root, keep_on_reset=True)], rounds=(
        {}, {"pause": True, "reset_prefix_cache": True, "reset_connector": True})), tmp_path,
        before_round={1: corrupt})
    assert tokens(fresh, 0) == expected["prompts"]
    assert cached(fresh, 0) == [CHUNK] * 9, "the fresh engine was not served from disk"
    assert tokens(fresh, 1) == expected["prompts"]
    assert sorted(cached(fresh, 1)) == [0] * 3 + [CHUNK] * 6
    assert metric(fresh, 1, "kvtier_offload_failed_reads", "rejected") == 3
    assert len(list((root / "quarantine").glob("*.bin"))) == 3
    print(f"fresh engine: {cached(fresh, 0)} tokens from disk; after corruption {cached(fresh, 1)}")


def make_fine_tune(base: Path, runs: Path) -> Path:
    """The model under the same folder name with other attention weights: same config.json, other KV."""
    import shutil

    from safetensors.torch import load_file, save_file

    target = runs / "step2" / base.name
    shutil.copytree(base, target)
    weights = load_file(str(target / "model.safetensors"))
    for name, tensor in weights.items():
        if name.endswith("v_proj.weight"):
            weights[name] = tensor * 1.5
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    assert (target / "config.json").read_text() == (base / "config.json").read_text()
    return target


def namespaces(root: Path) -> dict[str, dict]:
    """Namespace directory name -> its config.json."""
    return {p.parent.name: json.loads(p.read_text()) for p in root.glob("*/config.json")}


def test_a_fine_tuned_twin_misses_on_the_same_root(warm, model, expected, tmp_path):
    root, _ = warm
    before = namespaces(root)
    twin = make_fine_tune(model, tmp_path / "runs")
    # without kvtier's plugin: the spec and the tier found by module path
    module_paths = [{"type": "KVTierDiskTier", "module_path": "kvtier.vllm.native", "root_dir": str(root),
                     "capacity_bytes": 2**30}]
    tuned = launch(run_spec(twin, module_paths), tmp_path, env={"VLLM_PLUGINS": ""})
    assert cached(tuned) == [0] * 9, "the fine-tuned twin loaded the base model's records"
    assert tokens(tuned) != expected["prompts"], "the twin must compute other outputs for this to mean anything"
    (added,) = set(namespaces(root)) - set(before)  # the twin's own namespace, beside the base model's
    assert namespaces(root)[added]["model"]["weights"] not in {c["model"]["weights"] for c in before.values()}
    # it computed every token itself (nothing loaded): its outputs are vLLM alone's for the twin


RECORD_BYTES = 136 + CHUNK * 2 * 2 * 2 * 32 * 4  # header + 64 tokens x 2 layers x K,V x 2 heads x 32 x fp32


def test_another_block_size_misses_and_capacity_holds_while_two_engines_write_one_root(warm, model, expected,
                                                                                      tmp_path):
    """Two engines with 32-token engine blocks on the warm root at once: the warm (64-token) records
    are misses; their own namespace, bounded to six records, never holds more while both write
    nine each."""
    root, _ = warm
    capacity = 6 * RECORD_BYTES
    procs = [start(run_spec(model, [disk(root, capacity)], prompts=prompts, block_size=32), tmp_path)
             for prompts in (PROMPTS, OTHER_PROMPTS)]

    def theirs() -> list[str]:
        return [name for name, c in namespaces(root).items() if c["ranks"][0]["engine_block_tokens"] == 32]

    def their_bytes() -> int:  # walked under each namespace's ledger lock: no file counted twice
        return sum(namespace_bytes(root, name) for name in theirs())

    largest = 0
    while any(proc.poll() is None for proc, _ in procs):
        largest = max(largest, their_bytes())
        time.sleep(0.02)
    results = [finish(proc, run_dir) for proc, run_dir in procs]
    assert cached(results[0]) == [0] * 9, "an engine of another block size loaded the warm records"
    assert tokens(results[0]) == expected["prompts"] and tokens(results[1]) == expected["other"]
    final = their_bytes()
    assert 0 < largest <= capacity and final <= capacity, (largest, final, capacity)
    assert sum(metric(r, 0, "kvtier_offload_evictions") for r in results) > 0
    left = [p for name in theirs() for p in record_files(root / f"{name}_r0")]
    print(f"capacity {capacity}: at most {largest} bytes of records, {len(left)} records at the end")


def test_redis_serves_a_second_engine_process_and_a_stopped_server_costs_misses(warm, model, redis, expected,
                                                                                tmp_path):
    redis_tier = {"type": "kvtier_redis", "url": redis.url(), "timeout_s": 0.5, "connect_timeout_s": 0.5,
                  "keep_on_reset": True}
    second = launch(run_spec(model, [redis_tier], rounds=(
        {}, {"pause": True, "reset_prefix_cache": True, "reset_connector": True})), tmp_path, multiprocess=True,
        before_round={1: redis.kill})
    assert tokens(second, 0) == expected["prompts"]
    assert cached(second, 0) == [CHUNK] * 9, "the second engine was not served from Redis"
    assert tokens(second, 1) == expected["prompts"]
    assert cached(second, 1) == [0] * 9  # the server is gone: misses, recomputed


def test_a_random_hash_seed_is_said_and_leaves_nothing_a_later_process_could_read(model, expected, tmp_path,
                                                                                 monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # the engine inherits this environment
    root = tmp_path / "root"
    result = launch(run_spec(model, [disk(root, keep_on_reset=True)], engine={"prefix_caching_hash_algo": "xxhash"},
                             rounds=({}, {"reset_prefix_cache": True, "reset_connector": True})), tmp_path)
    assert tokens(result, 0) == expected["prompts"] and tokens(result, 1) == expected["prompts"]
    assert cached(result, 1) == [CHUNK] * 9  # within the process the tier works
    assert "cannot outlive this process or be shared" in result["log"]
    assert not list(root.rglob("*.bin")) and not list(root.glob("*/config.json"))


def test_offloading_with_kvtier_disk_as_a_multiconnector_child_serves_a_fresh_engine(warm, model, expected, tmp_path):
    root, _ = warm
    native = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": run_spec(model, [disk(root)])["kv_connector_extra_config"]}
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "example")}}
    spec = {**run_spec(model, None, rounds=({}, {"reset_prefix_cache": True})), "connectors": [example, native]}
    result = launch(spec, tmp_path)
    assert tokens(result, 0) == expected["prompts"] and tokens(result, 1) == expected["prompts"]
    assert cached(result, 0) == [CHUNK] * 9, "the fresh engine was not served from kvtier_disk"
    assert metric(result, 0, "chunk_hits", "kvtier_disk") == 9
    assert metric(result, 0, "prompt_tokens_cached_by_source", "source=disk") == 9 * CHUNK
    # ExampleConnector (first) serves what it stored in round 0; vLLM's CPU tier holds the chunks too
    # (promoted from kvtier_disk: hits when asked) but the OffloadingConnector loads none of them.
    assert cached(result, 1) == [CHUNK] * 9
    assert metric(result, 1, "prompt_tokens_cached_by_source", "source=external_unspecified") == 9 * CHUNK
    assert metric(result, 1, "chunk_hits", "tier=0:primary") == 9
    for what in (("prompt_tokens_cached_by_source", "source=disk"), ("kv_offload_total_bytes", "CPU_to_GPU")):
        assert metric(result, 1, *what) == metric(result, 0, *what) > 0, what  # (round 0's only)


def test_an_in_place_weight_update_after_vllms_reset_is_never_served_the_old_weights_records(model, tmp_path):
    """As tests/e2e/test_redis_e2e.py's, behind vLLM's offloading: vLLM keeps its secondary tiers'
    data across its reset_cache, and kvtier_disk, drained there, moves to a new key epoch. After
    layer 0's input norm is scaled in place (the weight files unchanged), no prompt is served the
    old weights' records still on disk; every output equals vLLM alone's after the same update."""
    update = {"name": "model.layers.0.input_layernorm.weight", "factor": 1.5}
    rounds = ({}, {"reset_prefix_cache": True, "reset_connector": True, "scale_weights": update},
              {"reset_prefix_cache": True})
    alone = launch(run_spec(model, None, rounds), tmp_path)
    assert tokens(alone, 1) != tokens(alone, 0), "the update does not change the outputs"
    root = tmp_path / "root"
    result = launch(run_spec(model, [disk(root)], rounds), tmp_path)
    for index in range(3):
        assert tokens(result, index) == tokens(alone, index), f"round {index} differs from vLLM alone"
    assert cached(result, 1) == [0] * 9, "records of before the update were served after it"
    assert cached(result, 2) == [CHUNK] * 9  # vLLM's CPU tier: the new weights' chunks
    assert len(record_files(root)) == 2 * 9  # both epochs' records: nothing deleted
