"""A copy engine whose stores land engine steps late, and the engine-sim run that makes the
reuse of blocks by vLLM race those stores (shared by the hybrid-allocator and runner-order tests).

``run_with_late_stores`` uses the sim's hybrid model (full attention + a sliding window of
:data:`WINDOW` tokens): vLLM frees a running request's sliding blocks below the window and hands
them to other requests while the stores reading them are still in flight.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from support.engine_sim import SimEngine, external, prompts_of, reference_outputs

from kvtier.copy.base import CopyEngine, page_list
from kvtier.vllm.runner import HookOrder

HOST = {"cpu_bytes_to_use": 2 * 2**20}
WINDOW = 32  # two 16-token engine blocks


class LateStores(CopyEngine):
    """A copy engine whose stores complete ``lag`` engine steps late (a slow copy stream): a store
    started in step s copies at the end of step s+lag, after that step's forward wrote its KV,
    unless the worker waits for it first (a flush). Loads are the real engine's."""

    def __init__(self, inner: CopyEngine, lag: int = 1):
        self.inner = inner
        self.lag = lag
        self._deferred: list[tuple[int, list, int]] = []
        self._polls = 0
        self.flushed: set[int] = set()

    def start_load(self, job_id, pages, **kwargs):
        self.inner.start_load(job_id, pages, **kwargs)

    def start_store(self, job_id, pages):
        self._deferred.append((job_id, page_list(pages), self._polls))

    def _run(self, jobs):
        for job_id, pages, _ in jobs:
            self.inner.start_store(job_id, pages)
        self.inner.wait([job_id for job_id, _, _ in jobs])

    def poll(self):
        due = [job for job in self._deferred if job[2] + self.lag <= self._polls]
        self._deferred = [job for job in self._deferred if job[2] + self.lag > self._polls]
        self._run(due)
        self._polls += 1
        return self.inner.poll()

    def wait(self, job_ids=None):
        wanted = set(job_ids) if job_ids is not None else {job[0] for job in self._deferred}
        self.flushed |= wanted & {job[0] for job in self._deferred}
        self._run([job for job in self._deferred if job[0] in wanted])
        self._deferred = [job for job in self._deferred if job[0] not in wanted]
        self.inner.wait(job_ids)

    def close(self):
        self._run(self._deferred)
        self._deferred = []
        self.inner.close()


@dataclass
class LateStoresRun:
    wrong: int  # round-2 outputs unlike vLLM alone's
    mismatches: list  # KV positions the fake model found wrong
    flushed: set[int]  # stores the fence made the worker finish before a block was reused
    loaded_tokens: int  # round-2 prompt tokens loaded from kvtier
    voided: int  # blocks never published: their engine blocks were rewritten first (V2)


def run_with_late_stores(model: Path, fence: bool = True, void: bool = True, **engine_options) -> LateStoresRun:
    """Round 1: 6 prompts of 160 tokens in a pool of 32 blocks (a sliding block freed below the
    window is soon handed to another request) with stores landing a step late. Round 2: cuts of
    those prompts at 40..130 tokens, so the sliding pages of early blocks are loaded too.
    ``engine_options``: more SimEngine options (the runner, zeroing, async scheduling).
    ``fence=False`` / ``void=False`` switch off kvtier's flush of stores on reused blocks / its
    voiding of stores on blocks the V2 runner rewrites first (negative controls).

    Under async scheduling the same race takes 36 blocks and stores landing 3 steps late: vLLM
    keeps a running request's sliding blocks for its in-flight tokens too (freed on the processed
    tokens, ``v1/core/kv_cache_manager.py:552-558``, and reserved for ``max_in_flight_tokens``,
    2 x 64 here), so 32 blocks hold one request at a time, and a freed block is handed out again
    later: a store one step late has landed by then."""
    prompts = prompts_of(3, 6, 160, shared_prefix=16)
    cuts = {f"{req_id}-{n}": prompt[:n] for req_id, prompt in prompts.items() for n in (40, 70, 100, 130)}
    engine = dict(sliding_window=WINDOW, num_blocks=32, max_num_batched_tokens=64)
    ref = reference_outputs(model, cuts, 2, **engine)
    lag = 1
    if engine_options.get("async_scheduling"):
        engine["num_blocks"], lag = 36, 3
    with SimEngine(model, kvtier=HOST, **engine, **engine_options) as sim:
        late = LateStores(sim.worker._worker.copies, lag)  # noqa: SLF001
        sim.worker._worker.copies = late  # noqa: SLF001
        if not fence:
            sim.kvtier_scheduler._engine_blocks.jobs_to_flush = lambda scheduler_output: set()  # noqa: SLF001
        if not void:
            sim.kvtier_scheduler.hook_order = HookOrder.PREEMPTIONS_FIRST
        orchestrator = sim.kvtier_scheduler.orchestrator
        taken = []
        take_stats = orchestrator.take_stats
        orchestrator.take_stats = lambda: taken.append(take_stats()) or taken[-1]
        sim.generate(prompts, 8)
        assert sim.reset_prefix_cache()
        second = sim.generate(cuts, 2)
        wrong = sum(second[req_id].tokens != ref[req_id] for req_id in cuts)
        voided = orchestrator.stats.stores_voided + sum(stats.stores_voided for stats in taken)
        return LateStoresRun(wrong, sim.model.kv_mismatches, late.flushed, sum(external(second)), voided)
