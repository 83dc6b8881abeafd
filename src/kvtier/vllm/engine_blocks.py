"""Which engine blocks hold a kvtier block's pages, and which engine blocks stores still read.

Scheduler side, on vLLM's scheduler thread only (no locks). Two jobs, both about vLLM's block
tables across KV cache groups (one group without the hybrid allocator):

- :meth:`EngineBlocks.pages_of`: the ``(sub, group, engine block id)`` of every page of a kvtier
  block, or None when a group holds no block for one of them (a null entry: below a sliding
  window). A Mamba / linear-attention state group's page is the block vLLM hands over, in this
  step's ``SchedulerOutput.kv_connector_block_state``, for the state at the kvtier block's end
  (its bytes are guaranteed for that step only: call :meth:`begin_step` first, every step).
- the reuse fence: every engine block a store job reads is fenced from :meth:`fence` until
  :meth:`unfence`; :meth:`jobs_to_flush` names the fenced jobs whose blocks vLLM hands to a
  request in this step (new and resumed tables, appended blocks, this step's load destinations,
  copy-on-write targets): the workers must finish those stores before the step writes anything.
  That holds where ``handle_preemptions`` runs before the step's first write (vLLM's V1 runner);
  where the runner zeroes or copies blocks first (V2, :mod:`kvtier.vllm.runner`), the scheduler
  voids the stores :meth:`jobs_reading` names for those blocks.
  This is what makes a store safe whenever vLLM frees a block while the copy is in flight (a
  running request's sliding blocks below its window, Mamba states it retires, a preempted
  request's blocks), with no delayed frees.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from vllm.v1.core.sched.output import SchedulerOutput

from kvtier.vllm.geometry import EngineGeometry

from kvtier.vllm.runner import NULL_BLOCK_ID


class EngineBlocks:
    def __init__(self, geometry: EngineGeometry):
        self.geometry = geometry
        self._fenced: dict[int, set[int]] = {}  # engine block id -> store jobs in flight reading it
        self._states: dict[tuple[str, int, int], int] = {}  # (request, group, boundary) -> block, this step
        self._load_blocks: set[int] = set()  # engine blocks this step's loads write

    def begin_step(self, scheduler_output: SchedulerOutput) -> None:
        """Take this step's Mamba boundary-state hand-offs (earlier steps' are stale)."""
        block_state = scheduler_output.kv_connector_block_state
        offers = block_state.boundary_state_offloads if block_state is not None else {}
        self._states = {
            (req_id, group, boundary): block_id
            for req_id, request_offers in offers.items()
            for group, block_id, boundary in request_offers
        }

    def pages_of(self, req_id: str, block_ids: Sequence[Sequence[int]], first_page: int,
                 num_pages: int, *, with_state: bool = True) -> list[tuple[int, int, int]] | None:
        """``(sub, group, engine block id)`` of every group's pages ``first_page + sub`` (sub <
        ``num_pages``) of request ``req_id`` whose tables are ``block_ids``, or None when a group
        holds no block for one of them. A state group's page is the block handed over this step
        for the state after the pages' last token (one page: a kvtier block is one engine block);
        ``with_state=False`` leaves state groups out (a block stored with its attention pages only)."""
        pages = []
        end_token = (first_page + num_pages) * self.geometry.engine_block_tokens
        for group, group_ids in enumerate(block_ids):
            if group in self.geometry.state_groups:
                if not with_state:
                    continue
                state_block = self._states.get((req_id, group, end_token))
                if state_block is None:
                    return None
                pages.append((0, group, state_block))
                continue
            for sub in range(num_pages):
                if first_page + sub >= len(group_ids) or group_ids[first_page + sub] == NULL_BLOCK_ID:
                    return None
                pages.append((sub, group, group_ids[first_page + sub]))
        return pages

    def note_load_destinations(self, block_ids: Iterable[int]) -> None:
        """Engine blocks a load planned in this step writes (before :meth:`jobs_to_flush`)."""
        self._load_blocks.update(block_ids)

    def fence(self, job_id: int, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            self._fenced.setdefault(block_id, set()).add(job_id)

    def unfence(self, job_id: int, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            jobs = self._fenced.get(block_id)
            if jobs is not None:
                jobs.discard(job_id)
                if not jobs:
                    del self._fenced[block_id]

    def jobs_reading(self, block_ids: Iterable[int]) -> set[int]:
        """Store jobs in flight that read any of ``block_ids``."""
        jobs: set[int] = set()
        for block_id in block_ids:
            jobs |= self._fenced.get(block_id, set())
        return jobs

    def jobs_to_flush(self, scheduler_output: SchedulerOutput) -> set[int]:
        """Store jobs reading an engine block vLLM hands to a request in this step; ends the
        step's load-destination record."""
        allocated, self._load_blocks = self._load_blocks, set()
        if not self._fenced:
            return set()
        for req in scheduler_output.scheduled_new_reqs:
            for group_ids in req.block_ids:
                allocated.update(group_ids)
        for new_ids in scheduler_output.scheduled_cached_reqs.new_block_ids:
            for group_ids in new_ids or ():
                allocated.update(group_ids)
        for copy in scheduler_output.kv_cache_block_copies or ():
            allocated.add(copy.dst_block_id)
        allocated.discard(NULL_BLOCK_ID)
        return self.jobs_reading(allocated)
