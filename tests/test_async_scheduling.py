"""kvtier's connector under vLLM's AsyncScheduler, as vLLM runs on GPUs by default (tests/support/engine_sim.py
``async_scheduling=True``: the engine core's batch queue, the next step scheduled and its connector
metadata built before the previous step's tokens and transfer reports are delivered).

What changes for the connector there: ``num_computed_tokens`` counts the tokens of the step in
flight, whose sampled tokens are not in ``request.all_token_ids`` yet; a request that stops has its
next step in flight when kvtier hears of the finish; a request preempted while a step ran has no
computed tokens and that step's tokens still in flight; the workers' reports arrive a step later;
vLLM defers the free of a finished or preempted request's blocks until its steps in flight are
done. Most connector tests also run in this mode (``cpu_and_gpu_defaults``); these are its own cases.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from support.engine_sim import GPU_DEFAULT, SimEngine, prompts_of, reference_outputs, write_model
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.request import RequestStatus

BLOCK = 32
ENGINE = {"block_size": BLOCK, "num_blocks": 512, "max_num_batched_tokens": 4096, "max_num_seqs": 4}
CONFIG = {"cpu_bytes_to_use": 64 * 2**20, "offload_partial_blocks": True, "offload_prompt_only": False}


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "model", seed=13)


def test_the_mode_schedules_each_step_before_the_last_ones_output_is_delivered(model):
    """The harness's async mode is vLLM's: its AsyncScheduler with deferred block frees, kvtier's
    metadata built with a step undelivered, and decode steps whose input token the scheduler does
    not know yet (the fake model takes it from its own last sample)."""
    prompts = prompts_of(1, 2, 300)
    seen: list[tuple[int, bool]] = []  # (steps undelivered when metadata was built, a decode's input token unknown)
    with SimEngine(model, kvtier=CONFIG, **ENGINE, **GPU_DEFAULT) as sim:
        assert isinstance(sim.scheduler, AsyncScheduler) and sim.scheduler.defer_block_free
        build = sim.kvtier_scheduler.build_connector_meta

        def observed(so):
            requests = sim.scheduler.requests
            cached = so.scheduled_cached_reqs
            unknown = any(n >= len(requests[r].all_token_ids) for r, n in zip(cached.req_ids, cached.num_computed_tokens))
            seen.append((len(sim._batch_queue), unknown))  # noqa: SLF001
            return build(so)

        sim.kvtier_scheduler.build_connector_meta = observed
        results = sim.generate(prompts, 8)
    assert {r: f.tokens for r, f in results.items()} == reference_outputs(model, prompts, 8, **ENGINE)
    assert sum(undelivered == 1 and unknown for undelivered, unknown in seen) >= 6, seen
    assert sim.model.kv_mismatches == []


def test_a_request_that_stops_with_its_next_step_in_flight_stores_what_was_computed(model):
    """A stop token ends each request after 5 tokens. Under async scheduling vLLM has already
    scheduled (and the model computed) its next step when kvtier hears of the finish; kvtier stores
    the KV of the steps delivered: the next turn, which resends prompt and answer, loads all but
    the answer's last token, as without async scheduling (tests/test_tails.py), and generates
    vLLM alone's tokens."""
    first = prompts_of(2, 2, 2007)
    ref = reference_outputs(model, first, 12, **ENGINE)
    stops = {sid: tokens[4] for sid, tokens in ref.items()}
    assert all(stops[sid] not in tokens[:4] for sid, tokens in ref.items())  # each stops at its 5th
    in_flight_at_finish: list[int] = []
    with SimEngine(model, kvtier=CONFIG, **ENGINE, **GPU_DEFAULT) as sim:
        finished = sim.kvtier_scheduler.request_finished
        sim.kvtier_scheduler.request_finished = lambda request, block_ids: (
            in_flight_at_finish.append(request.num_in_flight_tokens) or finished(request, block_ids))
        for sid, prompt in first.items():
            sim.add(sid, prompt, 12, stop_token_ids=[stops[sid]])
        sim.run()
        answers = {sid: sim.finished[sid].tokens for sid in first}
        assert answers == {sid: tokens[:5] for sid, tokens in ref.items()}
        assert sim.reset_prefix_cache()
        rng = random.Random(3)
        second = {f"{sid}-t2": first[sid] + answers[sid] + [rng.randrange(3, 900) for _ in range(9)] for sid in first}
        for req_id, prompt in second.items():
            sim.add(req_id, prompt, 6)
        sim.run()
        assert {r: sim.finished[r].tokens for r in second} == reference_outputs(model, second, 6, **ENGINE)
        for sid in first:
            assert sim.prefill[f"{sid}-t2"] == (0, len(first[sid]) + 5 - 1)
        assert sim.model.kv_mismatches == []
    assert in_flight_at_finish[:2] == [1, 1]  # the step after the stop was in flight


def test_an_abort_taken_between_scheduling_a_step_and_delivering_the_last_one(model):
    """vLLM's engine core takes aborts that arrived while the model ran just before it delivers the
    step's output (``core.py:782``), with the next step in flight: the aborted requests' stores
    and the others' go on, nothing stays pinned or pending, and every prompt comes back bit-exact."""
    prompts = prompts_of(3, 4, 1000)
    ref = reference_outputs(model, prompts, 4, **ENGINE)
    with SimEngine(model, kvtier=CONFIG, **ENGINE, **GPU_DEFAULT) as sim:
        for req_id, tokens in prompts.items():
            sim.add(req_id, tokens, 12)
        aborted: list[str] = []

        def abort_two(so):
            if sim.steps == 3 and not aborted:
                for req_id in ("r3-0", "r3-2"):
                    assert sim.scheduler.requests[req_id].num_in_flight_tokens > 0
                    sim.abort(req_id)
                    aborted.append(req_id)

        sim.run(before_update=abort_two)
        assert aborted and not set(aborted) & (sim.finished.keys() | sim.scheduler.requests.keys())
        assert not sim.kvtier_scheduler.has_pending_jobs()
        assert sim.kvtier_scheduler.orchestrator.host.pinned_slots() == 0
        assert sim.reset_prefix_cache()
        again = {f"{r}-2": tokens for r, tokens in prompts.items()}
        for req_id, tokens in again.items():
            sim.add(req_id, tokens, 4)
        sim.run()
        assert {r: sim.finished[f"{r}-2"].tokens for r in prompts} == ref
        assert all(sim.prefill[r][1] >= 1000 // BLOCK * BLOCK - BLOCK for r in again)
        assert sim.model.kv_mismatches == []


def test_an_abort_of_a_request_preempted_with_its_step_in_flight_is_a_plain_finish(model):
    """``reset_prefix_cache(reset_running_requests=True)`` while a step runs preempts every running
    request with that step's tokens in flight and no computed tokens left (vLLM then fails the
    reset itself: the preempted requests' blocks are deferred frees, ``scheduler.py:2840-2872``).
    A request aborted then finished with computed - in flight < 0 tokens: kvtier read a tail at a
    negative block index, and the IndexError stopped vLLM's scheduler. It is now a finish with
    nothing computed; the other request resumes and generates vLLM alone's tokens."""
    prompts = prompts_of(4, 2, 700)
    ref = reference_outputs(model, prompts, 20, **ENGINE)
    with SimEngine(model, kvtier=CONFIG, **ENGINE, **GPU_DEFAULT) as sim:
        for req_id, tokens in prompts.items():
            sim.add(req_id, tokens, 20)
        for _ in range(4):
            sim.step()
        with pytest.raises(RuntimeError, match="Failed to reset KV cache"):  # vLLM's own
            sim.scheduler.reset_prefix_cache(reset_running_requests=True)
        preempted = sim.scheduler.requests["r4-0"]
        assert preempted.status is RequestStatus.PREEMPTED
        assert preempted.num_computed_tokens == 0 < preempted.num_in_flight_tokens
        sim.abort("r4-0")
        sim.run()
        assert "r4-0" not in sim.scheduler.requests and sim.finished["r4-1"].tokens == ref["r4-1"]
        assert not sim.kvtier_scheduler.has_pending_jobs()
        assert sim.kvtier_scheduler.orchestrator.host.pinned_slots() == 0
        assert sim.model.kv_mismatches == []


def test_a_pause_that_clears_the_cache_drains_the_batch_queue_then_resets(model):
    """vLLM's pause_generation(mode="abort", clear_cache=True) aborts every request, then waits until
    the engine has no work left (no request, no step in flight, no kvtier job) before it resets the
    caches (``EngineCoreProc.pause_scheduler``, ``core.py:2061-2103``). Under async scheduling a
    step is in flight at the abort: the drain finishes it and kvtier's stores, the reset succeeds
    and the engine serves bit-exact again (from a new key epoch: nothing of before is loaded)."""
    prompts = prompts_of(5, 3, 1200)
    ref = reference_outputs(model, prompts, 6, **ENGINE)
    with SimEngine(model, kvtier=CONFIG, **ENGINE, **GPU_DEFAULT) as sim:
        for req_id, tokens in prompts.items():
            sim.add(req_id, tokens, 6 if req_id == "r5-0" else 2)
        while not {"r5-1", "r5-2"} <= sim.finished.keys():
            sim.step()
        assert sim._batch_queue  # noqa: SLF001  (a step in flight)
        sim.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
        sim.run()  # the engine core steps until it has no work (EngineCoreProc._pause_complete)
        assert sim.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
        again = {f"{req_id}-again": tokens for req_id, tokens in prompts.items()}
        for req_id, tokens in again.items():
            sim.add(req_id, tokens, 6)
        sim.run()
        assert {req_id: sim.outputs[f"{req_id}-again"] for req_id in prompts} == ref
        assert all(sim.prefill[r][1] == 0 for r in again)
        assert sim.model.kv_mismatches == []
