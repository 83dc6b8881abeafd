"""The scheduler's store jobs: which blocks of its requests go to the host tier when, as copy jobs.

Scheduler side, on vLLM's scheduler thread only (no locks). Owned by
:class:`~kvtier.vllm.scheduler_side.KVTierScheduler`, which hands over, call by call, its request
states (:class:`~kvtier.vllm.request_state.RequestState`) and its key epoch; it shares the
scheduler's host tier (:class:`~kvtier.runtime.host_side.HostSide`), reuse fence
(:class:`~kvtier.vllm.engine_blocks.EngineBlocks`) and book of jobs in flight
(:class:`~kvtier.vllm.job_book.JobBook`), and what a store's end means stays the scheduler's.
:func:`copy_job` builds every copy job the workers get, the scheduler's loads' too. Invariants:

- a store job enters the job book when it is built, before it is sent: its engine blocks are
  fenced and its keys count as being stored from then on;
- :meth:`StoreJobs.step` stores the full blocks each scheduled request completed, each block
  once (``RequestState.next_store_block`` only grows, here), within :func:`offload_limit
  <kvtier.runtime.requests.offload_limit>`, and only while every KV cache group holds its pages;
  a block whose Mamba / linear-attention state vLLM did not keep goes under its
  ``stateless_key``, with its attention pages only; a block holding tokens another connector
  loaded is skipped (``RequestState.note_loaded_elsewhere``);
- a step's host slots are reserved in ONE ``begin_stores`` call (one round trip when attached to
  a node); a block that gets none (stored already, or refused) is not copied;
- a finished request's tails (:meth:`StoreJobs.store_tails`) wait in :attr:`StoreJobs.unsent_tails`
  for the next :meth:`StoreJobs.step`, which sends them first, or for a reset, which voids them
  unsent (:meth:`StoreJobs.void_unsent_tails`): never both;
- a voided store (:meth:`StoreJobs.void_rewritten`, :meth:`StoreJobs.void_unsent_tails`) is
  marked failed and counted in ``stores_voided`` once: its blocks are never published.

Nothing here waits but ``begin_stores`` (a node's round trip), once a step and once a tail.
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm.v1.core.sched.output import SchedulerOutput

from kvtier.copy import PageCopy, page_table, slot_run_of
from kvtier.core.config import KVTierConfig
from kvtier.core.keys import BlockKey, stateless_key
from kvtier.runtime.host_side import HostSide
from kvtier.runtime.requests import offload_limit, tail_ends
from kvtier.tiers.stack import BlockInfo
from kvtier.vllm.engine_blocks import EngineBlocks
from kvtier.vllm.geometry import EngineGeometry
from kvtier.vllm.job_book import Job, JobBook
from kvtier.vllm.kv_events import KVEventTranslator
from kvtier.vllm.metadata import CopyJob
from kvtier.vllm.request_state import RequestState, computed_kv_tokens
from kvtier.vllm.runner import rewritten_before_hooks


def copy_job(host: HostSide, job_id: int, req_id: str, pages: list[PageCopy],
             rank_slots: list[tuple[int, ...]], pool_of: str | None = None) -> CopyJob:
    """A copy job; attached to a node, it names the pool its slots are in (``pool_of``: the
    owner whose hold they are, for a load; else the current attachment's, where a step's stores
    were just reserved) and, when a block's slots differ between ranks, each rank's
    (``rank_slots``: every block's slots, rank order)."""
    pool_id = host.held_pool(pool_of) if pool_of is not None else host.pool_id
    table = page_table(pages)
    sent = slot_run_of(table) or table  # one host run: checked by the workers without a table
    if pool_id is None:  # the engine's own regions
        return CopyJob(job_id, req_id, sent)
    differ = any(len(set(slots)) > 1 for slots in rank_slots)
    return CopyJob(job_id, req_id, sent, pool_id=pool_id,
                   rank_slots={slots[0]: slots for slots in rank_slots} if differ else None,
                   lost=pool_of is not None and host.hold_lost(pool_of))


class StoreJobs:
    """The store jobs of one scheduler; :attr:`unsent_tails`: finished requests' tail stores,
    in the job book already, sent by the next :meth:`step`."""

    def __init__(self, geometry: EngineGeometry, config: KVTierConfig, host: HostSide, engine_blocks: EngineBlocks,
                 jobs: JobBook, events: KVEventTranslator | None) -> None:
        self.geometry = geometry
        self.config = config
        self._host = host
        self._engine_blocks = engine_blocks
        self._jobs = jobs
        self._events = events
        self.unsent_tails: list[CopyJob] = []

    def step(self, scheduler_output: SchedulerOutput, requests: Mapping[str, RequestState],
             epoch: int) -> list[CopyJob]:
        """The store jobs this step sends: the tails held since the last step, then the blocks
        each request completed (``requests``: the scheduler's states by request id)."""
        stores = self.unsent_tails + self._completed_blocks(scheduler_output, requests, epoch)
        self.unsent_tails = []
        return stores

    def void_rewritten(self, scheduler_output: SchedulerOutput) -> None:
        """V2 runner: stores in flight on blocks this step rewrites before ``handle_preemptions``
        may have copied the rewritten bytes, and tail stores sent in this step (their blocks were
        freed at finish) would: they are never published (:mod:`kvtier.vllm.runner`)."""
        rewritten = rewritten_before_hooks(scheduler_output, self.geometry.state_groups)
        for job_id in self._engine_blocks.jobs_reading(rewritten):
            job = self._jobs[job_id]
            if not job.failed:
                job.failed = True
                self._host.stats.stores_voided += len(job.keys)

    def void_unsent_tails(self) -> list[tuple[int, Job]]:
        """A reset: the tails not sent yet would read blocks vLLM freed at finish. Each leaves the
        job book failed (counted voided); returns them, for the scheduler to end."""
        voided = []
        for unsent in self.unsent_tails:
            job = self._jobs.remove(unsent.job_id)
            job.failed = True
            self._host.stats.stores_voided += len(job.keys)
            voided.append((unsent.job_id, job))
        self.unsent_tails = []
        return voided

    def _completed_blocks(self, scheduler_output: SchedulerOutput, requests: Mapping[str, RequestState],
                          epoch: int) -> list[CopyJob]:
        """The step's store jobs: the blocks each request completed, their slots reserved in ONE
        batched call for the whole step (one round trip when attached to a node)."""
        planned: list[tuple[RequestState, list[tuple[BlockKey, int, list, bool]], list[tuple[int, BlockKey]]]] = []
        blocks_asked: list[tuple[BlockKey, BlockInfo]] = []
        scheduled = scheduler_output.num_scheduled_tokens
        computed_before = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed_before.update(zip(cached.req_ids, cached.num_computed_tokens))
        block = self.geometry.block_tokens
        per_block = self.geometry.pages_per_block
        for req_id, before in computed_before.items():
            state = requests.get(req_id)
            if state is None or not state.cacheable:
                continue
            state.note_loaded_elsewhere(before, self.geometry.engine_block_tokens,
                                        record=not self.config.store_loaded_elsewhere)
            limit = self._limit(state, before + scheduled.get(req_id, 0))
            tables = [ids for group, ids in enumerate(state.block_ids) if group not in self.geometry.state_groups]
            num_full = min(limit // block, min(map(len, tables), default=limit) // per_block)
            if num_full <= state.next_store_block:
                continue
            state.extend_keys(num_full)
            wanted: list[tuple[BlockKey, int, list, bool]] = []  # key, block index, its pages, announced
            present: list[tuple[int, BlockKey]] = []
            for index in range(state.next_store_block, num_full):
                if state.loaded_elsewhere and state.loaded_elsewhere_overlaps(index * block, (index + 1) * block):
                    self._host.stats.stores_skipped_loaded_elsewhere += 1
                    continue  # another connector loaded (some of) it: see RequestState.note_loaded_elsewhere
                key = state.keys[index]
                block_pages = self._engine_blocks.pages_of(req_id, state.block_ids, index * per_block, per_block)
                if block_pages is None and self.geometry.state_groups:  # vLLM kept no state at its end
                    key = stateless_key(key)
                    block_pages = self._engine_blocks.pages_of(req_id, state.block_ids, index * per_block, per_block,
                                                               with_state=False)
                if block_pages is None:
                    continue  # a group holds no block for some of it (below a sliding window)
                announced = key == state.keys[index]  # KV events: blocks a request can resume from
                wanted.append((key, index, block_pages, announced))
                blocks_asked.append((key, BlockInfo(state.parent_of(index), block)))
            state.next_store_block = num_full
            planned.append((state, wanted, present))
        slots_of = iter(self._host.begin_stores(blocks_asked))
        jobs: list[CopyJob] = []
        for state, wanted, present in planned:
            keys, blocks, pages, rank_slots = [], [], [], []
            for key, index, block_pages, announced in wanted:
                slots = next(slots_of)
                if slots is None:
                    if announced:
                        present.append((index, key))  # stored already, or refused (learn() checks)
                    continue
                keys.append(key)
                blocks.append(index if announced else -1)
                rank_slots.append(slots)
                pages.extend(PageCopy(slots[0], sub, block_id, group) for sub, group, block_id in block_pages)
            if present and self._events is not None:
                self._events.learn(state.request, present)
            if keys:
                jobs.append(self._new_store(state, keys, pages, epoch, blocks, rank_slots))
        return jobs

    def _new_store(self, state: RequestState, keys: list[BlockKey], pages: list[PageCopy], epoch: int,
                   blocks: list[int] | None = None, rank_slots: list[tuple[int, ...]] | None = None) -> CopyJob:
        """Register a store job of ``state``'s request (its engine blocks fenced until it is done)."""
        req_id = state.request.request_id
        job_id = self._jobs.add_store(req_id, keys, {p.block_id for p in pages}, blocks, epoch)
        state.jobs.add(job_id)
        return copy_job(self._host, job_id, req_id, pages, rank_slots or [])

    def _limit(self, state: RequestState, computed: int) -> int:
        """How many of the request's first tokens may be stored once ``computed`` have their KV."""
        request = state.request
        return offload_limit(computed, len(request.all_token_ids), request.num_prompt_tokens,
                             prompt_only=self.config.offload_prompt_only, max_offload_tokens=state.max_offload_tokens)

    def store_tails(self, state: RequestState, block_ids: tuple[list[int], ...], epoch: int) -> None:
        """Store the finished request's tails, read from the engine blocks that hold them now
        (``block_ids``: vLLM's table at finish, one list per group), within the same limits as
        blocks: its computed tokens (:func:`~kvtier.vllm.request_state.computed_kv_tokens`: not
        those of a step still in flight, under async scheduling) after their last full block (what
        the next turn of a chat resends), and its prompt but the last token after the prompt's last
        full block (what a resend of the same prompt, a "regenerate", can load: a hit leaves one
        token to compute). They go in the next :meth:`step`."""
        request = state.request
        limit = self._limit(state, computed_kv_tokens(request))
        for end in tail_ends(limit, request.num_prompt_tokens):
            self._store_tail(state, block_ids, end, epoch)

    def _store_tail(self, state: RequestState, block_ids: tuple[list[int], ...], limit: int, epoch: int) -> None:
        """Store the tail of the request's first ``limit`` tokens after their last full block."""
        request = state.request
        block = self.geometry.block_tokens
        num_full, tail_tokens = divmod(limit, block)
        if tail_tokens == 0 or state.loaded_elsewhere_overlaps(num_full * block, limit):
            return  # (a tail holding tokens another connector loaded: see RequestState.note_loaded_elsewhere)
        block_pages = self._engine_blocks.pages_of(request.request_id, block_ids,
                                                   num_full * self.geometry.pages_per_block,
                                                   -(-tail_tokens // self.geometry.engine_block_tokens))
        if block_pages is None:
            return
        state.extend_keys(num_full)
        if len(state.keys) < num_full:
            return
        key = state.tail_key_of(num_full, limit)
        [slots] = self._host.begin_stores([(key, BlockInfo(state.parent_of(num_full), tail_tokens, tail=True))])
        if slots is None:
            return
        pages = [PageCopy(slots[0], sub, block_id, group) for sub, group, block_id in block_pages]
        self.unsent_tails.append(self._new_store(state, [key], pages, epoch, rank_slots=[slots]))
