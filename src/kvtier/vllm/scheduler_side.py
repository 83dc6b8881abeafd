"""Scheduler-side half of the connector: turns vLLM's scheduling decisions into copy jobs.

Runs in vLLM's scheduler process, on the scheduler's thread only. Every hook answers from memory
(the orchestrator's indexes); disk I/O runs on the disk tier's threads and is polled here. The one
wait: a step that schedules nothing while a request waits for a tier's reads or probes blocks
until a tier posts an outcome, at most :data:`IDLE_WAIT_S` (otherwise vLLM's one-process engine
spins through empty steps and starves the tiers' threads of the GIL).

The host tier (:class:`~kvtier.runtime.host_side.HostSide`, chosen by
:func:`~kvtier.runtime.host_factory.open_host_side`) is the engine's own or, with ``node`` in the
config, a ``kvtier node`` service's pool (the same calls, each one round trip, a request's lookup
and a step's stores batched); every copy job then names the pool its slots are in.

Per request it keeps the block keys of its tokens, its engine block ids, how far stores have
got, and its in-flight jobs. This module answers vLLM's hooks: lookups and the load jobs of hits,
each step's block tables and flushes, the workers' reports and what a job's end means, finishes,
resets; which blocks are stored when, as copy jobs, is :mod:`kvtier.vllm.store_jobs`'s, and the
jobs in flight are in :mod:`kvtier.vllm.job_book`. Invariants:

- a request has at most one load job, and none while it has store jobs in flight;
- only host-resident blocks are ever offered, disk blocks are promoted into host slots first
  while vLLM is told to ask again. Loads are asynchronous (the request waits in no batch until
  the workers report its load; vLLM caches its blocks only after a load that succeeded, and
  recomputes the whole request after one that failed);
- host slots a load job reads stay pinned until every worker reported the job;
- no block free is ever delayed (``request_finished`` returns False): vLLM frees a finished
  request's blocks at once, as it frees a preempted request's or a running request's below its
  sliding window, so a reset or a sleep right after finds every block free;
- no engine block is written while a store reads it: every block a store job reads is fenced
  until the job is done, and a step that hands a fenced block to a request (new blocks, load
  destinations, copy-on-write targets) first flushes that job (the workers start it if it is
  this step's own, and wait for it before the step writes anything); under the V2 runner, whose
  rewrites come before that, such stores are voided instead;
- several KV cache groups: a kvtier block holds every group's pages for its tokens and is stored
  only in the step that completes it, when every group still holds it (the geometry refuses
  windows for which that is not so); a page vLLM holds no block for (a null block: below a
  sliding window) is neither stored nor loaded, so a block missing a group's page is not stored
  and a load fills only the pages vLLM allocated;
- Mamba / linear-attention state groups (``EngineGeometry.state_groups``, "align" mode): a block's
  page of such a group is the state after its last token, taken from the exact block vLLM hands
  over for that boundary in the same step (``SchedulerOutput.kv_connector_block_state``; its
  bytes are only guaranteed for that step, and the fence keeps them until the store is done). A
  block whose boundary state vLLM did not keep (a prefill chunk spanning several blocks keeps
  only its end) is stored with its attention pages only, under its ``stateless_key``: it can sit
  inside a hit but not end one. A hit ends at a block stored with its state: vLLM allocates one
  state block, at the hit's last block, and the load fills it. No tails for such models;
- a finished request's tail (its tokens after the last full block, see
  :func:`kvtier.core.keys.tail_key`) is stored in the next step from the engine block that held
  it at finish (freed, fenced like any store's); a reset before that step drops it unsent. A
  lookup that ends its run of full blocks where a stored tail continues the prompt loads the
  longest such tail, and vLLM computes from the middle of the block (its scheduler takes an
  external token count that is not block-aligned).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvtier.copy import PageCopy
from kvtier.core.config import KVTierConfig, parse_max_offload_tokens
from kvtier.core.keys import ModelIdentity, Namespace, draw_epoch, epoch_root
from kvtier.core.stats import KVTierStats
from kvtier.core.values import ConfigError
from kvtier.runtime.fingerprint import AdapterFingerprints
from kvtier.runtime.access_log import AccessLog, access_record
from kvtier.runtime.host_factory import open_host_side
from kvtier.runtime.host_side import HostSide
from kvtier.runtime.node_host import NODE_REGION_BYTES
from kvtier.runtime.orchestrator import Orchestrator
from kvtier.runtime.requests import find_hit
from kvtier.tiers.shm import SharedRegion, region_name
from kvtier.vllm.engine_blocks import NULL_BLOCK_ID, EngineBlocks
from kvtier.vllm.geometry import EngineGeometry
from kvtier.vllm.hit_sources import clip_sources, vllm_sources
from kvtier.vllm.job_book import Job, JobBook, JobKind
from kvtier.vllm.kv_events import KVEventTranslator
from kvtier.vllm.metadata import CopyJob, KVTierConnectorMetadata, KVTierConnectorStats, KVTierWorkerMetadata
from kvtier.vllm.page_format import page_format
from kvtier.vllm.request_state import RequestState, Uncacheable, block_extras, computed_kv_tokens
from kvtier.vllm.runner import HookOrder
from kvtier.vllm.store_jobs import StoreJobs, copy_job

logger = logging.getLogger(__name__)


IDLE_WAIT_S = 0.01
"""The longest an engine step that computes nothing waits for a tier's outcome while a request
waits for its blocks (a new request arriving meanwhile waits at most this long)."""


class KVTierScheduler:
    def __init__(
        self,
        geometry: EngineGeometry,
        config: KVTierConfig,
        model: ModelIdentity,
        *,
        publish_kv_events: bool = False,
        hook_order: HookOrder = HookOrder.REWRITES_FIRST,
    ):
        self.config = config
        self.hook_order = hook_order
        self.geometry = geometry
        layout = geometry.layout
        if config.node is not None and publish_kv_events:
            raise ConfigError(
                "kv_connector_extra_config: 'node' is set and KV cache events are enabled; an engine attached to "
                "a kvtier node does not publish kvtier's KV events yet. Remove 'node', or disable "
                "--kv-events-config's enable_kv_cache_events.")
        region_bytes = layout.region_bytes if config.node is None else NODE_REGION_BYTES
        self._regions = [
            SharedRegion.attach(region_name(geometry.engine_id, rank), region_bytes)
            for rank in range(geometry.stored_ranks)
        ]
        for region in self._regions:
            region.unlink()  # mapped by the workers and us: nothing can leak from here on
        self.namespace = Namespace(
            model=model,
            ranks=tuple(page_format(geometry, region.description) for region in self._regions),
            block_tokens=geometry.block_tokens,
            tp_size=geometry.tp_size,
            pp_size=geometry.pp_size,
            replicated=geometry.replicated,
        )
        self._digest = self.namespace.engine_digest
        self._root = self._digest  # every request's first parent: the digest, or its epoch's root after a reset
        self._epoch = 0
        self._adapters = AdapterFingerprints()
        self.orchestrator: HostSide = open_host_side(config, self.namespace, engine_id=geometry.engine_id,
                                                     model_name=geometry.model_name, layout=layout,
                                                     rank_views=[r.view for r in self._regions])
        if config.node is None:
            self._log_host_tier()
        self._events: KVEventTranslator | None = None
        if publish_kv_events:
            assert isinstance(self.orchestrator, Orchestrator)  # a node's engine was refused above
            self._events = KVEventTranslator(
                self.orchestrator,
                block_tokens=geometry.block_tokens,
                engine_block_tokens=geometry.engine_block_tokens,
                self_describing=config.self_describing_kv_events,
                group_kinds=geometry.group_kinds,
            )
        self._requests: dict[str, RequestState] = {}
        self._step_loads: list[CopyJob] = []
        self._engine_blocks = EngineBlocks(geometry)  # where pages are; the reuse fence
        self._jobs = JobBook(self._engine_blocks, geometry.world_size)
        self._stores = StoreJobs(geometry, config, self.orchestrator, self._engine_blocks, self._jobs, self._events)
        self._tails = config.offload_partial_blocks and not geometry.state_groups
        self._worker_stats = KVTierStats()
        self._reported_gauges: dict[str, int | None] = {}
        self._said_uncacheable: set[Uncacheable] = set()
        self._access_log = AccessLog(config.trace_path) if config.trace_path else None

    def _log_host_tier(self) -> None:
        """Say what the engine's own host tier and disk tier are."""
        geometry, config = self.geometry, self.config
        layout = geometry.layout
        logger.info(
            "kvtier: host tier %d slots x %.1f MiB x %d rank(s)%s = %.2f GiB; block %d tokens%s%s",
            layout.num_slots,
            layout.slot_bytes / 2**20,
            geometry.stored_ranks,
            f" (KV replicated on {geometry.world_size} ranks: stored once)" if geometry.replicated else "",
            layout.region_bytes * geometry.stored_ranks / 2**30,
            geometry.block_tokens,
            f" of {geometry.num_groups} KV cache groups ({geometry.attention}; loads asynchronous)"
            if geometry.num_groups > 1 else "",
            f"; disk tier {config.disk.root_dir} ({config.disk.capacity_bytes / 2**30:.1f} GiB)" if config.disk else "",
        )

    # --- request bookkeeping -------------------------------------------------------------
    def _state(self, request: Request) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            lora, uncacheable = self._request_identity(request)
            state = RequestState(
                request=request,
                tokens=request.all_token_ids,
                arrival=time.time(),
                root=self._root,
                block_tokens=self.geometry.block_tokens,
                extras=block_extras(request, self.geometry.block_tokens, lora),
                max_offload_tokens=parse_max_offload_tokens(request.kv_transfer_params, request.request_id),
                cacheable=uncacheable is None,
                block_ids=[[] for _ in range(self.geometry.num_groups)],
            )
            if uncacheable is not None:
                self.orchestrator.stats.uncacheable_requests += 1
                if uncacheable not in self._said_uncacheable:
                    self._said_uncacheable.add(uncacheable)
                    logger.info("kvtier: %s: such requests are neither loaded from nor stored in kvtier "
                                "(counted in kvtier_uncacheable_requests)", uncacheable.value)
            self._requests[request.request_id] = state
        return state

    def _request_identity(self, request: Request) -> tuple[str | None, Uncacheable | None]:
        """The request's adapter fingerprint, and why the request cannot use the cache (or None).

        Token ids describe a request's KV only when nothing else feeds the model: prompt embeddings
        replace tokens by placeholders, and an adapter is known only by its weights' fingerprint,
        which is computed in the background (until then its requests are misses)."""
        if getattr(request, "prompt_embeds", None) is not None:
            return None, Uncacheable.PROMPT_EMBEDS
        lora = request.lora_request
        if lora is None:
            return None, None
        digest = self._adapters.get(lora.lora_int_id, lora.lora_path)
        return digest, (Uncacheable.LORA_UNIDENTIFIED if digest is None else None)

    # --- lookups -------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._state(request)
        state.lookup_computed, state.own_load_end = num_computed_tokens, 0  # (see RequestState.note_loaded_elsewhere)
        if not state.cacheable or request.skip_reading_prefix_cache:
            # (prompt logprobs, most pooling requests: vLLM reads no cache for them and would drop a
            # hit, as its own offloading does not look them up; their blocks are still stored)
            return 0, False
        if state.jobs:
            return None, False  # stores of an earlier run of this request are still in flight
        if state.load_failed:
            return 0, False  # its load failed once: vLLM computes it
        hit = find_hit(self.orchestrator, request.request_id, state, request.num_tokens, num_computed_tokens,
                       tails=self._tails, state_groups=bool(self.geometry.state_groups), storing=self._jobs.storing)
        if hit is None:
            return None, False
        state.tail_probe = hit.tail_probe
        if not hit.tokens:
            return 0, False
        state.load_first_token = num_computed_tokens
        state.hit_tokens_from = hit.by_source
        # The blocks are in host memory now (disk blocks were promoted first). Asynchronous: vLLM
        # puts a synchronous load's blocks into its prefix cache at allocation and, under
        # "recompute", keeps them there after a failed load for the request to rewrite in place;
        # another request could hit them unwritten first (an abort, a preemption, a chunked
        # recompute). An asynchronous load's blocks are cached only once it succeeded.
        return hit.tokens, True

    def update_state_after_alloc(
        self, request: Request, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        """``block_ids``: the request's engine blocks, one list per KV cache group (null blocks
        where vLLM holds none, as below a sliding window)."""
        state = self._state(request)
        if num_external_tokens == 0:
            if not state.jobs:
                self.orchestrator.release(request.request_id)
            return
        block = self.geometry.block_tokens
        engine_block = self.geometry.engine_block_tokens
        per_block = self.geometry.pages_per_block
        first_token = state.load_first_token
        end_token = first_token + num_external_tokens  # vLLM may accept less than we offered
        first_block = first_token // block
        end_block = -(-end_token // block)
        state.own_load_end = end_token
        self.orchestrator.trim_hold(request.request_id, end_block - first_block)
        keys = self.orchestrator.held(request.request_id)
        assert len(keys) == end_block - first_block, "load plan out of sync with the hold"
        rank_slots = self.orchestrator.held_slots(request.request_id)
        slots = [s[0] for s in rank_slots]
        pages = [
            PageCopy(slots[engine_index // per_block - first_block], engine_index % per_block, group_ids[engine_index],
                     group)
            for engine_index in range(first_token // engine_block, -(-end_token // engine_block))
            for group, group_ids in enumerate(block_ids)
            if engine_index < len(group_ids) and group_ids[engine_index] != NULL_BLOCK_ID
        ]
        self._engine_blocks.note_load_destinations(p.block_id for p in pages)
        job_id = self._jobs.add_load(request.request_id, keys)
        self._step_loads.append(copy_job(self.orchestrator, job_id, request.request_id, pages, rank_slots,
                                         pool_of=request.request_id))
        state.jobs.add(job_id)
        if self._events is not None:  # full blocks only (a tail is no block of vLLM's), with their state
            self._events.learn(request, [(index, key) for index, key in zip(range(first_block, end_token // block), keys)
                                         if key == state.keys[index]])
        stats = self.orchestrator.stats
        for medium, tokens in clip_sources(state.hit_tokens_from, num_external_tokens).items():
            stats.count_hit_tokens(medium, tokens)

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """Where vLLM's ``prompt_tokens_cached_by_source`` should count this request's external
        tokens: host, disk, or (Redis) vLLM's "external_unspecified", its name for a remote store."""
        state = self._requests.get(request.request_id)
        if state is None:
            return {CacheHitSource.HOST: num_external_tokens} if num_external_tokens else {}
        return vllm_sources(state.hit_tokens_from, num_external_tokens)

    # --- per step ------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierConnectorMetadata:
        if not scheduler_output.total_num_scheduled_tokens and not self._step_loads:
            # Nothing to compute or load this step: if a request waits for blocks a tier is reading
            # or probing, let the tiers' threads run until one posts (bounded) instead of spinning.
            # vLLM's one-process engine steps again at once and would hold the GIL all along.
            self.orchestrator.wait_for_tiers(IDLE_WAIT_S)
        self.orchestrator.poll()
        self._engine_blocks.begin_step(scheduler_output)
        scheduled_new = {data.req_id for data in scheduler_output.scheduled_new_reqs}
        for req_id, new_block_ids, is_full_table in yield_req_data(scheduler_output):
            # vLLM 0.32 names the third value "preempted" (resumed requests only), 0.33
            # "is_full_table" (new requests too): either way new_block_ids is then the whole table.
            # A new request's is always its whole table, and under the V2 model runner a resumed
            # (preempted) request comes as a new one (0.32 scheduler.py:1418-1420) with 0.32's
            # third value False: its table replaces the stale one of before the preemption.
            state = self._requests.get(req_id)
            if state is None:
                continue
            if is_full_table or req_id in scheduled_new:
                for group_ids in state.block_ids:
                    group_ids.clear()
            if new_block_ids:
                for group_ids, new_ids in zip(state.block_ids, new_block_ids, strict=True):
                    group_ids.extend(new_ids)
        flush: set[int] = set()
        for req_id in scheduler_output.preempted_req_ids or ():
            state = self._requests.get(req_id)
            if state is not None:
                flush.update(self._jobs.stores(state.jobs))
        flush |= self._engine_blocks.jobs_to_flush(scheduler_output)
        if self.hook_order is HookOrder.REWRITES_FIRST:
            self._stores.void_rewritten(scheduler_output)
        meta = KVTierConnectorMetadata(
            loads=self._step_loads,
            stores=self._stores.step(scheduler_output, self._requests, self._epoch),
            flush_job_ids=flush,
        )
        self._step_loads = []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVTierWorkerMetadata):
            self._worker_stats.engine_to_host.add(meta.engine_to_host)
            self._worker_stats.host_to_engine.add(meta.host_to_engine)
            for method, jobs in meta.copy_methods.items():
                self._worker_stats.count_copy_job(method, jobs)
            for job_id, job in self._jobs.report(meta.failed, meta.completed):
                self._job_done(job_id, job)
        self.orchestrator.poll()

    def _job_done(self, job_id: int, job: Job) -> None:
        """What a job's end (out of the book) means for its request and the tiers."""
        state = self._requests.get(job.req_id)
        if job.kind is JobKind.STORE:
            self.orchestrator.finish_store(job.keys, ok=not job.failed)
            if self._events is not None and state is not None and not job.failed and job.epoch == self._epoch:
                self._events.learn(state.request, [(b, k) for b, k in zip(job.blocks, job.keys) if b >= 0])
        else:
            self.orchestrator.release(job.req_id)
            if job.failed:
                self.orchestrator.stats.load_errors += 1
                if state is not None:
                    state.load_failed = True
        if state is not None:
            state.jobs.discard(job_id)
            if state.finished and not state.jobs:
                del self._requests[job.req_id]

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``block_ids``: the request's engine blocks now, one list per KV cache group."""
        state = self._requests.get(request.request_id)
        if state is None:
            return False, None
        state.finished = True
        if self._access_log is not None and state.cacheable:
            self._access_log.write(access_record(
                state, arrival=state.arrival, num_prompt_tokens=request.num_prompt_tokens,
                num_computed_tokens=computed_kv_tokens(request),
                salt=getattr(request, "cache_salt", None), max_offload_tokens=state.max_offload_tokens,
                probe=state.tail_probe))
        loading = self._jobs.loading(state.jobs)
        if state.cacheable and self._tails and not loading:
            self._stores.store_tails(state, block_ids, self._epoch)  # (not while a load still fills its blocks: aborted)
        if not loading:
            self.orchestrator.release(request.request_id)
        if not state.jobs:
            del self._requests[request.request_id]
        # Never a delayed free: vLLM frees the blocks now, and the reuse fence finishes (or, under
        # the V2 runner's rewrites, voids) any store still reading one before it is written again.
        return False, None

    def has_pending_jobs(self) -> bool:
        return bool(self._jobs)

    def take_stats(self) -> KVTierConnectorStats | None:
        stats = self.orchestrator.take_stats().add(self._worker_stats)
        self._worker_stats = KVTierStats()
        gauges = stats.gauges()
        if not stats.has_counts() and gauges == self._reported_gauges:
            return None  # nothing happened and usage is unchanged
        self._reported_gauges = gauges
        return KVTierConnectorStats(data=stats.as_dict())

    def take_events(self) -> list[KVCacheEvent]:
        return self._events.take_events() if self._events is not None else []

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: ``pause_generation`` does it before a
        weight update or a sleep (whose KV memory comes back undefined), with every request aborted
        or preempted. Tail stores not sent yet would read blocks vLLM freed at finish, so they are
        dropped unsent (counted voided); the host tier (this engine's memory) is emptied. Then,
        unless ``keep_tiers_on_reset``, the engine moves to a new key epoch: weights may have
        changed in place, so nothing stored before (on disk, in Redis, S3 or a node's pool, by this
        engine or any other) is offered to it again, and what it stores from now on is offered to no
        engine of the old weights (:func:`~kvtier.core.keys.epoch_root`). Nothing is deleted: the
        old epoch's blocks serve engines that still have those weights, and age out otherwise."""
        for job_id, job in self._stores.void_unsent_tails():
            self._job_done(job_id, job)
        self.orchestrator.clear()
        if not self.config.keep_tiers_on_reset:
            self._new_epoch()
        return True

    def _new_epoch(self) -> None:
        """Hang every key from now on under a fresh random root (requests alive included: vLLM
        computes their KV again); stores in flight finish under the old keys, unannounced."""
        self._epoch += 1
        self._root = epoch_root(self._digest, draw_epoch())
        for state in self._requests.values():
            state.restart(self._root)
        if self._events is not None:
            self._events.forget_all()
        logger.info("kvtier: the connector's cache was reset: new key epoch %d; what the tiers hold from before "
                    "is not offered to this engine again (keep_tiers_on_reset: false)", self._epoch)

    def shutdown(self) -> None:
        self._adapters.close()
        if self._access_log is not None:
            self._access_log.close()
        self.orchestrator.close()
        for region in self._regions:
            region.close()
