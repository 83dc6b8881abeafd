"""A vLLM engine without a model, for the connector's own tests (fast: no weights, no processes).

Everything vLLM-side is real: vLLM's ``Scheduler`` (which builds the scheduler-side
``KVTierConnector`` and drives it), its ``Request``, ``SchedulerOutput``, ``KVCacheConfig``,
``ModelRunnerOutput`` and ``KVConnectorOutput``. The worker side is kvtier's real worker connector
on real KV tensors in host memory (vLLM-CPU's page layout), called in the order vLLM's model runner
calls it (``handle_preemptions``, ``bind_connector_metadata``, ``start_load_kv`` before the forward
for sync loads, the forward, ``wait_for_save``, ``get_transfer_results``,
``get_block_ids_with_load_errors``, ``build_connector_worker_meta``, ``clear_connector_metadata``).

Only the model is fake (:class:`FakeModel`), and it is built so that wrong KV cannot go unseen:

- the KV it writes for position ``p`` of every layer is a function of the model's weights (a seed
  stored in a real ``model.safetensors``, so kvtier fingerprints it like real weights) and of the
  whole token prefix up to ``p`` (a hash chain), like real attention KV;
- every token it samples is a hash of *all* KV bytes of the sequence as it reads them from the
  engine's pages through the block table. One wrong byte anywhere, and the outputs change.

It also checks the KV directly: before each forward, every already-computed position of every
scheduled request must hold exactly the bytes the model would have written
(:attr:`FakeModel.kv_mismatches` records any that do not).

``sliding_window`` W: a hybrid model as vLLM's hybrid allocator sees it (Gemma-2/3 style): layer 0
full attention (KV cache group 0), layer 1 sliding-window attention (group 1, its own block
table, blocks below the window freed while a request runs). The sliding layer reads, checks and
samples from its last W positions only, as sliding attention does.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from safetensors.torch import save_file  # noqa: E402
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

from kvtier.vllm.connector import KVTierConnector  # noqa: E402

VOCAB = 1000
LAYER_NAMES = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
_ids = itertools.count()


def write_model(folder: Path, seed: int, *, num_layers: int = 2, kv_heads: int = 1, head_size: int = 4) -> Path:
    """A model folder: a small Llama config.json and a model.safetensors holding the model's seed
    (its "weights"). Two folders with the same config and another seed are two fine-tunes."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": kv_heads * head_size * 4,
        "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": kv_heads,
        "head_dim": head_size, "num_hidden_layers": num_layers, "vocab_size": VOCAB,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True,
    }
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"seed": torch.tensor([seed], dtype=torch.int64)}, str(folder / "model.safetensors"))
    return folder


def read_seed(folder: Path) -> int:
    from safetensors.torch import load_file

    return int(load_file(str(folder / "model.safetensors"))["seed"][0])


class FakeModel:
    """The model half of the simulated engine; see the module docstring."""

    def __init__(self, seed: int, kv: dict[str, torch.Tensor], block_size: int, kv_heads: int, head_size: int,
                 replicas: list[dict[str, torch.Tensor]] | None = None, sliding_window: int | None = None):
        self.seed = seed
        self.kv = kv
        self.replicas = replicas or []  # other ranks' KV, the same bytes (replicated MLA latent)
        self.block_size = block_size
        self.width = kv_heads * 2 * head_size  # floats per position per layer
        self.kv_heads = kv_heads
        self.head_size = head_size
        self.sliding_window = sliding_window
        self.layer_group = (0, 1) if sliding_window else (0, 0)  # KV cache group of each layer
        self.block_tables: dict[str, list[list[int]]] = {}  # one table per group
        self._prefix: dict[str, list[bytes]] = {}
        self.kv_mismatches: list[tuple[str, int]] = []
        self.forward_tokens = 0  # positions computed (the prefill work kvtier saves)

    # --- the KV a position must hold ------------------------------------------------------
    def _prefix_hashes(self, req_id: str, tokens: list[int], upto: int) -> list[bytes]:
        chain = self._prefix.setdefault(req_id, [])
        if len(chain) > upto:
            return chain
        prev = chain[-1] if chain else self.seed.to_bytes(8, "little")
        for p in range(len(chain), upto):
            prev = hashlib.blake2b(prev + tokens[p].to_bytes(4, "little"), digest_size=16).digest()
            chain.append(prev)
        return chain

    def expected(self, prefix_hash: bytes, layer: int) -> torch.Tensor:
        raw = hashlib.blake2b(prefix_hash + bytes([layer]), digest_size=4 * self.width).digest()
        return torch.frombuffer(bytearray(raw), dtype=torch.int32).to(torch.float32).view(self.kv_heads, 2 * self.head_size)

    def _page_slot(self, table: list[int], p: int) -> tuple[int, int]:
        return table[p // self.block_size], p % self.block_size

    def _first_read(self, layer: int, end: int) -> int:
        """The first position layer ``layer`` reads when its last computed position is ``end - 1``."""
        return max(0, end - self.sliding_window) if self.layer_group[layer] else 0

    # --- one forward ----------------------------------------------------------------------
    def update_tables(self, so: SchedulerOutput) -> None:
        """Keep block tables as vLLM's worker does (new requests, appended or resumed blocks)."""
        groups = max(self.layer_group) + 1
        for req in so.scheduled_new_reqs:
            self.block_tables[req.req_id] = [list(ids) for ids in req.block_ids]
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.block_tables[req_id] = [list(ids) for ids in new] if new else [[] for _ in range(groups)]
            elif new:
                tables = self.block_tables.setdefault(req_id, [[] for _ in range(groups)])
                for table, ids in zip(tables, new, strict=True):
                    table.extend(ids)
        for req_id in so.finished_req_ids:
            self.block_tables.pop(req_id, None)
            self._prefix.pop(req_id, None)

    def forward(self, so: SchedulerOutput, requests: dict[str, Request]) -> dict[str, list[int]]:
        """Check the KV of computed positions, write the new positions' KV, sample from all KV."""
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        sampled: dict[str, list[int]] = {}
        for req_id, n in so.num_scheduled_tokens.items():
            request = requests[req_id]
            tokens = list(request.all_token_ids)
            start, end = computed[req_id], computed[req_id] + n
            tables = self.block_tables[req_id]
            chain = self._prefix_hashes(req_id, tokens, end)
            for kv in [self.kv, *self.replicas]:  # every rank must hold the right KV
                for layer, name in enumerate(LAYER_NAMES):
                    table = tables[self.layer_group[layer]]
                    for p in range(self._first_read(layer, start + 1), start):
                        block, offset = self._page_slot(table, p)
                        if not torch.equal(kv[name][block, :, offset, :], self.expected(chain[p], layer)):
                            self.kv_mismatches.append((req_id, p))
                            break
                    for p in range(start, end):
                        block, offset = self._page_slot(table, p)
                        kv[name][block, :, offset, :] = self.expected(chain[p], layer)
            self.forward_tokens += n
            if end < len(tokens):
                sampled[req_id] = []  # a prefill chunk: nothing sampled yet
                continue
            digest = hashlib.blake2b(self.seed.to_bytes(8, "little"), digest_size=8)
            for layer, name in enumerate(LAYER_NAMES):
                table = tables[self.layer_group[layer]]
                for p in range(self._first_read(layer, end), end):
                    block, offset = self._page_slot(table, p)
                    digest.update(self.kv[name][block, :, offset, :].numpy().tobytes())
            sampled[req_id] = [3 + int.from_bytes(digest.digest(), "little") % (VOCAB - 3)]
        return sampled


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

    def __post_init__(self) -> None:
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
        self.kv_cache_config = KVCacheConfig(
            num_blocks=self.num_blocks,
            kv_cache_tensors=[KVCacheTensor(size=page * self.num_blocks, layers=[name], layer_stride=0,
                                            block_stride=page) for name in LAYER_NAMES],
            kv_cache_groups=groups,
        )
        rank_kv = [self._kv_tensors(page) for _ in range(self.mla_ranks)]
        self.kv = rank_kv[0]
        self.workers: list[KVTierConnector] = []
        if self.kvtier is not None:
            parallel = self.vllm_config.parallel_config
            for rank, kv in enumerate(rank_kv):
                parallel.rank = rank  # what each worker process's config says; read in the constructor
                worker = KVTierConnector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
                worker.register_kv_caches(kv)
                self.workers.append(worker)
            parallel.rank = 0
        self.worker: KVTierConnector | None = self.workers[0] if self.workers else None
        self._aggregator = KVOutputAggregator(expected_finished_count=self.mla_ranks)
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=self.block_size, hash_block_size=self.block_size, log_stats=True,
        )
        self.model = FakeModel(read_seed(self.model_dir), self.kv, self.block_size, self.kv_heads, self.head_size,
                               replicas=rank_kv[1:], sliding_window=self.sliding_window)

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
        return config

    # --- requests ---------------------------------------------------------------------------
    @property
    def connector(self) -> KVTierConnector | None:
        return self.scheduler.connector  # type: ignore[return-value]

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 4, **request_kwargs) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        request = Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=params,
                          pooling_params=None, block_hasher=self._hasher, **request_kwargs)
        self.scheduler.add_request(request)
        return request

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    # --- stepping ---------------------------------------------------------------------------
    def step(self, before_forward=None) -> SchedulerOutput:
        """One engine step, as vLLM's engine core and model runner do it."""
        so = self.scheduler.schedule()
        self.steps += 1
        self.model.update_tables(so)
        meta = so.kv_connector_metadata
        for worker in self.workers:
            worker.handle_preemptions(meta)
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
        for worker in self.workers:
            if not so.has_sync_kv_loads:
                worker.start_load_kv(None)
            worker.wait_for_save()
            results = worker.get_transfer_results(so.finished_req_ids)
            output = KVConnectorOutput(
                finished_sending=results.finished_sending, finished_recving=results.finished_recving,
                failed_recving=results.failed_recving,
                invalid_block_ids=worker.get_block_ids_with_load_errors(),
                kv_connector_stats=worker.get_kv_connector_stats(),
                kv_connector_worker_meta=worker.build_connector_worker_meta(),
            )
            worker.clear_connector_metadata()
            rank_outputs.append(runner_output(output))
        output_of_step = self._aggregator.aggregate(rank_outputs) if rank_outputs else runner_output(None)
        engine_outputs = self.scheduler.update_from_output(so, output_of_step)
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
        return so

    def run(self, max_steps: int = 2000, before_forward=None, idle_timeout: float = 60.0) -> None:
        """Step until no request is left (and the connector has nothing in flight).

        Bounded twice, as a deadlock detector: at most ``max_steps`` steps that schedule tokens,
        and at most ``idle_timeout`` seconds of steps that schedule none (the engine waiting for
        the connector's background copies, which a loaded machine may make slow)."""
        busy_steps = 0
        idle_since: float | None = None
        while self.scheduler.has_requests() or self._connector_busy():
            so = self.step(before_forward)
            if so.total_num_scheduled_tokens:
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


def settle(sim: SimEngine, timeout: float = 15.0) -> None:
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
