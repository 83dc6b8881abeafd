"""A vLLM engine without a model, for the connector's own tests (fast: no weights, no processes).

Everything vLLM-side is real: vLLM's ``Scheduler`` (which builds the scheduler-side
``KVTierConnector`` and drives it), its ``Request``, ``SchedulerOutput``, ``KVCacheConfig``,
``ModelRunnerOutput`` and ``KVConnectorOutput``. The worker side is kvtier's real worker connector
on real KV tensors in host memory (vLLM-CPU's page layout), called in the order of one of vLLM's
model runners (``runner``, file:line in vLLM 0.32 unless marked 0.33):

- ``"v1"``, the V1-derived runner (vLLM-CPU's; ``v1/worker/gpu_model_runner.py``):
  ``handle_preemptions`` (``:3969-3971``), then the step's block rewrites (zeroing
  ``new_block_ids_to_zero``, copy-on-write, ``:1199-1208``), ``bind_connector_metadata``,
  ``start_load_kv`` before the forward for sync loads, the forward, ``wait_for_save``,
  ``get_transfer_results``, ``get_block_ids_with_load_errors``, ``build_connector_worker_meta``,
  ``clear_connector_metadata``;
- ``"v2"``, the V2 runner, GPUs' default (``v1/worker/gpu/model_runner.py``): the block rewrites
  first (``:1259-1270``; the Mamba pre-copy ``:1820`` would follow), then ``pre_forward``:
  ``handle_preemptions``, bind, sync loads (``v1/worker/gpu/kv_connector.py:81-89``), the
  forward, then ``post_forward`` as V1 (asynchronous loads first, ``:131-151``);
- ``"v2-speculator"``, V2 with a speculator in vLLM 0.33: ``post_forward`` collects the transfer
  results and worker metadata first and ``finalize_step`` calls ``wait_for_save`` after the
  drafter (0.33 ``v1/worker/gpu/kv_connector.py:136-166``, ``model_runner.py:2259-2344``).

The runner's hook order reaches kvtier's scheduler as it does in vLLM: through
``VllmConfig.use_v2_model_runner`` (here via ``VLLM_USE_V2_MODEL_RUNNER`` while the engine is
built). ``zeroing=True`` makes vLLM's scheduler hand out blocks to zero, as it does for Mamba
layers and mixed-precision caches (``KVCacheConfig.needs_kv_cache_zeroing``), for this
attention-only model. ``after_rewrites`` (a step argument) runs right after the step's rewrites:
where a test lets held store copies go, to play the interleaving a GPU may run.

``async_scheduling=True`` (with any runner; V2 + async is GPUs' default: vLLM 0.32 and 0.33 turn
it on unless pooling, an incompatible speculator or executor, ``config/vllm.py:1585-1644``, 0.33
``:1719``; vLLM-CPU turns it off, ``platforms/cpu.py:331``, 0.33 ``:348``, so only here does
kvtier meet it off a GPU): the scheduler is vLLM's ``AsyncScheduler`` (what
``SchedulerConfig.get_scheduler_cls`` picks, ``config/scheduler.py:228-236``) on a config whose
``async_scheduling`` is True, so ``max_concurrent_batches`` is 2 (``config/vllm.py:576-587``) and
the scheduler defers block frees (``defer_block_free``: a ``kv_both`` connector is a consumer,
``v1/core/sched/scheduler.py:186-192``). :meth:`SimEngine.step` is then the engine core's
``step_with_batch_queue`` (``v1/engine/core.py:698-812``, unchanged in 0.33 ``:708-822``) over
vLLM's one-process executor, which runs a step's worker side when it is handed the step
(``v1/executor/uniproc_executor.py:90-131``): schedule step N+1 and run its worker side, then hand
step N's output (its sampled tokens, its ``KVConnectorOutput``) to ``update_from_output``. So
step N+1 and its connector metadata are built while step N's tokens and transfer reports are
undelivered; ``num_computed_tokens`` counts the in-flight tokens (``Request.num_in_flight_tokens``,
``num_output_placeholders``: ``_update_after_schedule`` ``:1616-1648``, ``async_scheduler.py:25-56``);
a request stopped in step N may have step N+1 in flight; a preempted request's in-flight output is
stale (``_preempt_request`` ``:1571-1614``) and it resumes only once that is delivered (``:934``).
``before_update`` (a step argument) runs where the engine core takes eager aborts, between
scheduling a step and delivering the previous one (``core.py:782``). The fake model takes a
decode step's input token from its own last sample, as the GPU runners do (see its module).

Only the model is fake (:class:`~support.fake_model.FakeModel`), and it is built so that wrong KV
cannot go unseen (see its module).

``sliding_window`` W: a hybrid model as vLLM's hybrid allocator sees it (Gemma-2/3 style): layer 0
full attention (KV cache group 0), layer 1 sliding-window attention (group 1, its own block
table, blocks below the window freed while a request runs). The sliding layer reads, checks and
samples from its last W positions only, as sliding attention does.
"""

from __future__ import annotations

import copy as copy_module
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from support.fake_model import LAYER_NAMES, VOCAB, FakeModel, read_seed, write_model  # noqa: E402, F401
from kvtier.core.stats import KVTierStats  # noqa: E402
from kvtier.vllm.connector import KVTierConnector  # noqa: E402

_ids = itertools.count()


RUNNERS = ("v1", "v2", "v2-speculator")

GPU_DEFAULT = {"runner": "v2", "async_scheduling": True}
"""SimEngine options of vLLM's default on GPUs: the V2 runner under async scheduling."""

cpu_and_gpu_defaults = pytest.mark.parametrize("mode", [pytest.param({}, id="sync-v1"),
                                                        pytest.param(GPU_DEFAULT, id="async-v2")])
"""Run a test (its SimEngine options ``mode``) as vLLM-CPU runs (V1 runner, no async scheduling)
and as vLLM runs on GPUs by default (:data:`GPU_DEFAULT`)."""


class ZeroingKVCacheConfig(KVCacheConfig):
    """A KV cache config for which vLLM's scheduler records new blocks to zero (``zeroing=True``)."""

    @property
    def needs_kv_cache_zeroing(self) -> bool:
        return True


@contextmanager
def _runner_env(runner: str):
    """vLLM decides the runner from ``VLLM_USE_V2_MODEL_RUNNER`` first (``config/vllm.py:703-739``):
    set it while the connectors are built, so kvtier reads the hook order as in a real engine."""
    previous = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0" if runner == "v1" else "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["VLLM_USE_V2_MODEL_RUNNER"]
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = previous


@dataclass
class Finished:
    tokens: list[int]
    local_cached: int  # prompt tokens from vLLM's own prefix cache
    external_cached: int  # prompt tokens loaded by the connector
    reason: str


@dataclass
class SimEngine:
    """One engine: vLLM's scheduler + kvtier's connector (both roles) + :class:`FakeModel`.

    ``kvtier`` is the connector's ``kv_connector_extra_config`` (None: vLLM alone). Call
    :meth:`close` (or use as a context manager) to shut the connector down.

    ``mla_ranks`` > 1: an MLA model (``MLAAttentionSpec``: one latent per token, the same bytes on
    every rank) at tensor parallelism ``mla_ranks``: one worker connector per rank, each with its
    own KV tensors, called in turn as vLLM's workers are, their outputs combined by vLLM's own
    ``KVOutputAggregator``; the model writes and checks every rank's KV.
    """

    model_dir: Path
    kvtier: dict | None = None
    block_size: int = 16
    num_blocks: int = 64
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    enable_prefix_caching: bool = True
    kv_heads: int = 1
    head_size: int = 4
    engine_id: str | None = None
    steps: int = 0
    finished: dict[str, Finished] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    prefill: dict[str, tuple[int, int]] = field(default_factory=dict)  # req -> (local, external) cached
    mla_ranks: int = 1
    sliding_window: int | None = None  # a hybrid model: layer 1 sliding-window, in its own group
    runner: str = "v1"  # the hook order: "v1", "v2" or "v2-speculator" (see the module docstring)
    zeroing: bool = False  # vLLM hands out new blocks to zero (as for Mamba or mixed-precision caches)
    async_scheduling: bool = False  # vLLM's AsyncScheduler and the engine core's batch queue (GPUs' default)

    def __post_init__(self) -> None:
        assert self.runner in RUNNERS, f"runner {self.runner!r} is none of {RUNNERS}"
        logging.getLogger("vllm").setLevel(logging.ERROR)
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(self.block_size, sha256)
        self.vllm_config = self._vllm_config()
        if self.mla_ranks > 1:  # one latent of 2 * head_size floats per token: the same bytes as K and V
            spec = MLAAttentionSpec(block_size=self.block_size, num_kv_heads=1, head_size=2 * self.head_size,
                                    dtype=torch.float32)
            assert self.kv_heads == 1, "an MLA sim has one latent per token (kv_heads=1)"
        else:
            spec = FullAttentionSpec(block_size=self.block_size, num_kv_heads=self.kv_heads,
                                     head_size=self.head_size, dtype=torch.float32)
        page = spec.page_size_bytes
        if self.sliding_window:
            sliding = SlidingWindowSpec(block_size=self.block_size, num_kv_heads=self.kv_heads,
                                        head_size=self.head_size, dtype=torch.float32,
                                        sliding_window=self.sliding_window)
            groups = [KVCacheGroupSpec([LAYER_NAMES[0]], spec), KVCacheGroupSpec([LAYER_NAMES[1]], sliding)]
        else:
            groups = [KVCacheGroupSpec(list(LAYER_NAMES), spec)]
        self.kv_cache_config = (ZeroingKVCacheConfig if self.zeroing else KVCacheConfig)(
            num_blocks=self.num_blocks,
            kv_cache_tensors=[KVCacheTensor(size=page * self.num_blocks, layers=[name], layer_stride=0,
                                            block_stride=page) for name in LAYER_NAMES],
            kv_cache_groups=groups,
        )
        rank_kv = [self._kv_tensors(page) for _ in range(self.mla_ranks)]
        self.kv = rank_kv[0]
        self.workers: list[KVTierConnector] = []
        with _runner_env(self.runner):
            if self.kvtier is not None:
                parallel = self.vllm_config.parallel_config
                for rank, kv in enumerate(rank_kv):
                    parallel.rank = rank  # what each worker process's config says; read in the constructor
                    worker = KVTierConnector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
                    worker.register_kv_caches(kv)
                    self.workers.append(worker)
                parallel.rank = 0
            scheduler_cls = self.vllm_config.scheduler_config.get_scheduler_cls()  # as the engine core
            assert issubclass(scheduler_cls, Scheduler)
            self.scheduler = scheduler_cls(
                vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
                structured_output_manager=StructuredOutputManager(self.vllm_config),
                block_size=self.block_size, hash_block_size=self.block_size, log_stats=True,
            )
        self.worker: KVTierConnector | None = self.workers[0] if self.workers else None
        # the engine core's batch queue (step_with_batch_queue): steps executed, not yet delivered
        self._batch_queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self._batch_queue_size = self.vllm_config.max_concurrent_batches
        assert self._batch_queue_size == (2 if self.async_scheduling else 1)
        self._aggregator = KVOutputAggregator(expected_finished_count=self.mla_ranks)
        self.model = FakeModel(read_seed(self.model_dir), self.kv, self.block_size, self.kv_heads, self.head_size,
                               replicas=rank_kv[1:], sliding_window=self.sliding_window)

    def _rewrite_blocks(self, so: SchedulerOutput, after_rewrites) -> None:
        """What the runner does to blocks before the forward: zero the new blocks vLLM names
        (every rank), then copy-on-write copies."""
        for kv in [self.kv, *self.model.replicas]:
            for block_id in so.new_block_ids_to_zero or ():
                for layer in kv.values():
                    layer[block_id].zero_()
            for copy in so.kv_cache_block_copies or ():
                for layer in kv.values():
                    layer[copy.dst_block_id].copy_(layer[copy.src_block_id])
        if after_rewrites is not None:
            after_rewrites(so)

    def _kv_tensors(self, page: int) -> dict[str, torch.Tensor]:
        """One rank's KV tensors in host memory (vLLM-CPU's page layout), zeroed."""
        buffer = torch.zeros(len(LAYER_NAMES) * page * self.num_blocks, dtype=torch.uint8)
        shape = (self.num_blocks, self.kv_heads, self.block_size, 2 * self.head_size)
        return {
            name: buffer[i * page * self.num_blocks : (i + 1) * page * self.num_blocks].view(torch.float32).view(shape)
            for i, name in enumerate(LAYER_NAMES)
        }

    def _vllm_config(self) -> VllmConfig:
        model_config = ModelConfig(model=str(self.model_dir), skip_tokenizer_init=True, max_model_len=4096,
                                   dtype="float32", seed=0)
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=4096, enable_chunked_prefill=True, is_encoder_decoder=False,
        )
        cache_config = CacheConfig(block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching)
        transfer = None
        if self.kvtier is not None:
            transfer = KVTransferConfig(
                kv_connector="KVTierConnector", kv_connector_module_path="kvtier.vllm", kv_role="kv_both",
                kv_connector_extra_config=dict(self.kvtier),
                engine_id=self.engine_id or f"sim-{os.getpid()}-{next(_ids)}",
            )
        config = VllmConfig(model_config=model_config, cache_config=cache_config,
                            scheduler_config=scheduler_config, kv_transfer_config=transfer,
                            device_config=DeviceConfig("cpu"),
                            parallel_config=ParallelConfig(tensor_parallel_size=self.mla_ranks))
        config.cache_config.num_gpu_blocks = self.num_blocks
        with _runner_env(self.runner):  # (max_concurrent_batches reads the runner)
            # vLLM-CPU's platform turned it off while the config was built (platforms/cpu.py:331)
            config.scheduler_config.async_scheduling = self.async_scheduling
            assert config.max_concurrent_batches == (2 if self.async_scheduling else 1)
        return config

    # --- requests ---------------------------------------------------------------------------
    @property
    def connector(self) -> KVTierConnector | None:
        return self.scheduler.connector  # type: ignore[return-value]

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 4, stop_token_ids: list[int] | None = None,
            **request_kwargs) -> Request:
        """Add a greedy request; ``stop_token_ids``: tokens that stop it (a stop the scheduler learns
        only from the step's output: under async scheduling the next step is in flight then)."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                                stop_token_ids=stop_token_ids)
        request = Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=params,
                          pooling_params=None, block_hasher=self._hasher, **request_kwargs)
        self.scheduler.add_request(request)
        return request

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    # --- stepping ---------------------------------------------------------------------------
    def step(self, before_forward=None, after_rewrites=None, before_update=None) -> SchedulerOutput | None:
        """One engine step, as vLLM's engine core and the chosen model runner do it: the step
        scheduled (None when the batch queue had nothing to schedule). ``before_update(so)`` runs just
        before step ``so``'s output is handed to the scheduler (where the engine core takes eager
        aborts). Under async scheduling that is the previous step's output, or none yet."""
        if not self.async_scheduling:  # EngineCore.step (v1/engine/core.py:657-687)
            so = self.scheduler.schedule()
            output = self._execute(so, before_forward, after_rewrites)
            self._deliver(so, output, before_update)
            return so
        # EngineCore.step_with_batch_queue (v1/engine/core.py:698-812)
        so = None
        if self.scheduler.has_requests():
            so = self.scheduler.schedule()
            self._batch_queue.appendleft((so, self._execute(so, before_forward, after_rewrites)))
            if len(self._batch_queue) < self._batch_queue_size and (
                    so.total_num_scheduled_tokens or self.scheduler.has_requests()):
                return so  # the queue is not full: schedule the next step before this one's output
        elif not self._batch_queue:
            return None
        self._deliver(*self._batch_queue.pop(), before_update)
        return so

    def _execute(self, so: SchedulerOutput, before_forward, after_rewrites) -> ModelRunnerOutput:
        """The step's worker side, in the runner's hook order: its output (sampled tokens and every
        rank's connector output, combined as vLLM's executor does)."""
        self.steps += 1
        self.model.update_tables(so)
        meta = so.kv_connector_metadata
        if self.runner != "v1":
            self._rewrite_blocks(so, after_rewrites)
        for worker in self.workers:
            worker.handle_preemptions(meta)
        if self.runner == "v1":
            self._rewrite_blocks(so, after_rewrites)
        for worker in self.workers:
            worker.bind_connector_metadata(meta)
            if so.has_sync_kv_loads:
                worker.start_load_kv(None)
        if before_forward is not None:
            before_forward(so)
        sampled = self.model.forward(so, self.scheduler.requests) if so.total_num_scheduled_tokens else {}
        req_ids = list(so.num_scheduled_tokens)

        def runner_output(kv_output: KVConnectorOutput | None) -> ModelRunnerOutput:
            return ModelRunnerOutput(
                req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=[sampled.get(r, []) for r in req_ids], kv_connector_output=kv_output,
            )

        rank_outputs = []
        deferred_save = self.runner == "v2-speculator"
        for worker in self.workers:
            if not so.has_sync_kv_loads:
                worker.start_load_kv(None)
            if not deferred_save:
                worker.wait_for_save()
            results = worker.get_transfer_results(so.finished_req_ids)
            output = KVConnectorOutput(
                finished_sending=results.finished_sending, finished_recving=results.finished_recving,
                failed_recving=results.failed_recving,
                invalid_block_ids=worker.get_block_ids_with_load_errors(),
                kv_connector_stats=worker.get_kv_connector_stats(),
                kv_connector_worker_meta=worker.build_connector_worker_meta(),
            )
            if deferred_save:  # finalize_step, after the drafter ran
                worker.wait_for_save()
            worker.clear_connector_metadata()
            rank_outputs.append(runner_output(output))
        return self._aggregator.aggregate(rank_outputs) if rank_outputs else runner_output(None)

    def _deliver(self, so: SchedulerOutput, output: ModelRunnerOutput,
                 before_update: Callable[[SchedulerOutput], None] | None) -> None:
        """Hand a step's output to the scheduler (``update_from_output``) and collect what it returns."""
        if before_update is not None:
            before_update(so)
        engine_outputs = self.scheduler.update_from_output(so, output)
        for outputs in engine_outputs.values():
            for out in outputs.outputs:
                self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
                stats = out.prefill_stats
                if stats is not None:  # the latest prefill (a preempted request prefills again)
                    self.prefill[out.request_id] = (stats.num_local_cached_tokens, stats.num_external_cached_tokens)
                if out.finish_reason is not None:
                    local, external = self.prefill.get(out.request_id, (0, 0))
                    self.finished[out.request_id] = Finished(
                        list(self.outputs[out.request_id]), local, external, str(out.finish_reason))

    def run(self, max_steps: int = 2000, before_forward=None, idle_timeout: float = 60.0, after_rewrites=None,
            before_update=None) -> None:
        """Step until no request is left (and the connector has nothing in flight).

        Bounded twice, as a deadlock detector: at most ``max_steps`` steps that schedule tokens,
        and at most ``idle_timeout`` seconds of steps that schedule none (the engine waiting for
        the connector's background copies, which a loaded machine may make slow)."""
        busy_steps = 0
        idle_since: float | None = None
        while self.scheduler.has_requests() or self._connector_busy() or self._batch_queue:
            so = self.step(before_forward, after_rewrites, before_update)
            if so is not None and so.total_num_scheduled_tokens:
                busy_steps += 1
                idle_since = None
                if busy_steps > max_steps:
                    raise AssertionError(f"engine did not drain in {max_steps} steps (a deadlock?)")
                continue
            now = time.monotonic()
            idle_since = now if idle_since is None else idle_since
            if now - idle_since > idle_timeout:
                raise AssertionError(f"engine waited {idle_timeout:.0f} s for the connector (a deadlock?)")
            time.sleep(0.001)

    def generate(self, prompts: dict[str, list[int]], max_tokens: int = 4, **kwargs) -> dict[str, Finished]:
        """Add ``prompts`` at once, run to completion, return their results."""
        for req_id, prompt in prompts.items():
            self.add(req_id, prompt, max_tokens)
        self.run(**kwargs)
        return {req_id: self.finished[req_id] for req_id in prompts}

    def _connector_busy(self) -> bool:
        connector = self.connector
        return connector is not None and connector.has_pending_push_work()

    def wait_for_copies(self) -> None:
        """Wait until every worker's copies issued so far are done (the next step reports them):
        for a test whose scenario needs a store landed before a later step, whatever the load of
        the machine (a copy thread may otherwise not have run by then)."""
        for worker in self.workers:
            copies = worker._worker.copies if worker._worker is not None else None  # noqa: SLF001
            if copies is not None:
                copies.wait()

    def reset_prefix_cache(self, reset_connector: bool = False) -> bool:
        return self.scheduler.reset_prefix_cache(reset_connector=reset_connector)

    # --- kvtier internals tests look at ----------------------------------------------------
    @property
    def kvtier_scheduler(self):
        connector = self.connector
        return connector._scheduler if connector is not None else None  # noqa: SLF001

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        if self.connector is not None:
            self.connector.shutdown()

    def __enter__(self) -> "SimEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def prompts_of(seed: int, count: int, length: int, shared_prefix: int = 0) -> dict[str, list[int]]:
    """``count`` prompts of ``length`` tokens; the first ``shared_prefix`` tokens shared by all."""
    import random

    rng = random.Random(seed)
    common = [rng.randrange(3, VOCAB) for _ in range(shared_prefix)]
    return {f"r{seed}-{i}": common + [rng.randrange(3, VOCAB) for _ in range(length - shared_prefix)]
            for i in range(count)}


def reference_outputs(model_dir: Path, prompts: dict[str, list[int]], max_tokens: int, **engine) -> dict[str, list[int]]:
    """What vLLM alone generates (no connector)."""
    with SimEngine(model_dir, kvtier=None, **engine) as sim:
        return {req_id: f.tokens for req_id, f in sim.generate(prompts, max_tokens).items()}


def tokens_of(results: dict[str, Finished]) -> dict[str, list[int]]:
    return {req_id: f.tokens for req_id, f in results.items()}


def renamed(prompts: dict[str, list[int]], suffix: str) -> dict[str, list[int]]:
    """The same prompts under new request ids (``suffix`` appended): a second round."""
    return {req_id + suffix: tokens for req_id, tokens in prompts.items()}


def by_prompt(results: dict[str, Finished], suffix: str) -> dict[str, list[int]]:
    """Generated tokens keyed by the original request ids (``suffix`` removed)."""
    return {req_id.removesuffix(suffix): f.tokens for req_id, f in results.items()}


def external(results: dict[str, Finished]) -> list[int]:
    """Prompt tokens each request loaded through the connector."""
    return [f.external_cached for f in results.values()]


def counting(host) -> KVTierStats:
    """Every interval of counters vLLM collects from ``host`` (the scheduler's orchestrator or node
    host), also summed into the stats returned (read it after adding the interval not yet taken:
    ``counted.add(host.stats)``)."""
    counted, take = KVTierStats(), host.take_stats

    def collect() -> KVTierStats:
        stats = take()
        counted.add(copy_module.deepcopy(stats))
        return stats

    host.take_stats = collect
    return counted


def settle(sim: SimEngine, timeout: float = 60.0) -> None:
    """Wait until kvtier's background tier I/O (blocks on their way to disk or Redis) is done."""
    orchestrator = sim.kvtier_scheduler.orchestrator
    deadline = time.monotonic() + timeout
    while orchestrator.has_pending_io():
        assert time.monotonic() < deadline, "tier I/O did not finish"
        time.sleep(0.01)
        orchestrator.poll()


def iter_blocks(tokens: list[int], block_size: int) -> Iterable[list[int]]:
    for start in range(0, len(tokens) - block_size + 1, block_size):
        yield tokens[start : start + block_size]
