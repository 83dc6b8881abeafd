"""Tensor parallelism 2 on vLLM-CPU (two worker processes, one core each) with kvtier.

The engine core (vLLM's scheduler, and kvtier's scheduler side with its tiers) runs in the harness
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); the two ranks are worker processes of vLLM's
multiprocess executor either way, so every rank's host region still crosses processes (worker ->
scheduler). The engine-core process of vLLM's default mode is covered by
tests/e2e/test_vllm_e2e.py and the server tests.

The model is the tiny Qwen3-MoE of tests/support/tiny_models.py: 4 query and 2 KV heads, so each
rank holds a different KV head and its own files (docs/disk-format.md). SmolLM2-135M cannot run at
tp=2 (9 query and 3 KV heads do not split in two; vLLM refuses it).

Shown: outputs with kvtier equal vLLM alone's at tp=2 from the host tier and, after a restart, from
disk; every block has one file per rank, with different payloads; a block whose rank-1 file is
gone is a miss for the whole block (and the prompt's later blocks), never half a block.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.cpu_lease import all_cpus
from support.offline_run import cached, launch, tokens
from support.tiny_models import write_tiny_model

from kvtier.bench.text import long_prompts
from kvtier.tiers.blockfile import HEADER_LEN

pytestmark = [pytest.mark.e2e, pytest.mark.all_cores]  # a rank per CPU (support.cpu_lease)

PROMPTS = long_prompts(3, 220, seed=11)
CPUS = all_cpus()


def spec(folder: Path, rounds: list[dict], root: Path | None) -> dict:
    extra = None if root is None else {
        "cpu_bytes_to_use": 256 * 2**20,
        "secondary_tiers": [{"type": "fs", "root_dir": str(root), "capacity_bytes": 2**30}],
    }
    return {"model": str(folder), "prompts": PROMPTS, "rounds": rounds, "max_tokens": 12,
            "kv_cache_memory_bytes": 64 * 2**20, "max_model_len": 2048, "kv_connector_extra_config": extra,
            "engine": {"tensor_parallel_size": 2}}


@pytest.mark.skipif(len(CPUS) < 2, reason="tp=2 on vLLM-CPU needs two cores (one per worker)")
def test_tp2_bit_exact_from_host_and_disk_and_a_missing_rank_is_a_miss(tmp_path):
    folder = write_tiny_model("qwen3-moe", tmp_path / "models")
    # vLLM-CPU binds each worker's threads to a NUMA node; one node here, so bind by hand: a core each
    bind = {"VLLM_CPU_OMP_THREADS_BIND": f"{CPUS[0]}|{CPUS[1]}"}

    def run(rounds, root=None):
        return launch(spec(folder, rounds, root), tmp_path, env=bind)

    expected = tokens(run([{}]))
    assert len(set(map(tuple, expected))) == len(PROMPTS)

    root = tmp_path / "kv"
    first = run([{}, {"reset_prefix_cache": True}], root)
    assert tokens(first, 0) == expected and tokens(first, 1) == expected
    hits = cached(first, 1)
    assert all(h >= 256 for h in hits), hits

    ranks = sorted(p for p in root.iterdir() if p.is_dir() and p.name[-3:] in ("_r0", "_r1"))
    assert [p.name[-2:] for p in ranks] == ["r0", "r1"]
    files = [{f.relative_to(rank): f for f in rank.rglob("*.bin")} for rank in ranks]
    assert files[0] and files[0].keys() == files[1].keys()  # one file per block per rank
    name = sorted(files[0])[0]
    assert files[0][name].read_bytes()[HEADER_LEN:] != files[1][name].read_bytes()[HEADER_LEN:]  # other heads

    second = run([{}], root)  # restart: the disk tier
    assert tokens(second) == expected and cached(second) == hits

    for path in files[1].values():  # every block loses its rank-1 half: all misses, still bit-exact
        path.unlink()
    third = run([{}], root)
    assert tokens(third) == expected
    assert cached(third) == [0, 0, 0]


@pytest.mark.skipif(len(CPUS) < 2, reason="tp=2 on vLLM-CPU needs two cores (one per worker)")
def test_tp2_mamba_hybrid_under_the_hybrid_allocator_is_bit_exact_from_host_and_disk(tmp_path):
    """Tiny Granite-4.0-H (3 Mamba2 + 1 attention layer, 4 KV cache groups) at tp=2: each rank
    stores its own attention heads and Mamba state shards; round 2 and a fresh engine load the
    prompts' blocks up to the last kept state (768 tokens) and match vLLM alone."""
    from support.tiny_models import FAMILIES

    folder = write_tiny_model("granitemoehybrid", tmp_path / "models")
    bind = {"VLLM_CPU_OMP_THREADS_BIND": f"{CPUS[0]}|{CPUS[1]}"}
    prompts = long_prompts(3, 700, seed=11)

    def run(rounds, root=None):
        hybrid = {**spec(folder, rounds, root), "prompts": prompts}
        hybrid["engine"] = {**hybrid["engine"], **FAMILIES["granitemoehybrid"].engine}
        return launch(hybrid, tmp_path, env=bind)

    expected = tokens(run([{}]))
    root = tmp_path / "kv"
    first = run([{}, {"reset_prefix_cache": True}], root)
    assert tokens(first, 0) == expected and tokens(first, 1) == expected
    assert cached(first, 1) == [768] * 3
    assert sorted(p.name[-3:] for p in root.iterdir() if p.is_dir() and p.name[-3:] in ("_r0", "_r1")) == ["_r0", "_r1"]
    second = run([{}], root)
    assert tokens(second) == expected and cached(second) == [768] * 3
