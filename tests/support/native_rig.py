"""vLLM's own TieringOffloadingManager with kvtier's native tiers, driven as vLLM's connector drives
it, without an engine (tests only, not shipped).

:class:`NativeRig` builds vLLM's ``TieringOffloadingSpec`` from a hand-made ``OffloadingConfig``
(the config vLLM's connector builds from the engine's), so vLLM's real manager, its real CPU tier
(a real shared-memory region) and vLLM's real ``SecondaryTierFactory`` create the tiers; then
initializes vLLM's block-hash seed as the engine core does after building its scheduler
(``init_none_hash``). Rows of the CPU tier are filled with bytes as a GPU->CPU store would, and
read back after a promotion. Each rig stands for one engine process: a second rig on the same root
is a restart or a second engine (``init_none_hash`` runs again, as in a new process).

Keys are vLLM's own chained block hashes (``hash_block_tokens``) of token lists, plus group 0.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import numpy as np
import pytest
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

import kvtier.vllm.native.plugin

TOKENS_PER_BLOCK = 16
BLOCKS_PER_CHUNK = 2
CHUNK_TOKENS = TOKENS_PER_BLOCK * BLOCKS_PER_CHUNK


def make_model(folder: Path, *, weights: bytes = b"weights-0") -> Path:
    """A model folder kvtier can fingerprint: config.json and one weight file."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llama", "num_attention_heads": 4, '
                                        '"num_key_value_heads": 2, "hidden_size": 64}')
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def offloading_config(model: Path, tiers: list[dict], *, engine_id: str, worker_bytes_per_block: int = 4096,
                      world_size: int = 1, tokens_per_block: int = TOKENS_PER_BLOCK,
                      blocks_per_chunk: int = BLOCKS_PER_CHUNK, num_chunks: int = 16,
                      kv_events: bool = False) -> OffloadingConfig:
    row = worker_bytes_per_block * world_size * blocks_per_chunk
    row += -row % 4096
    extra = {"cpu_bytes_to_use": num_chunks * row, "secondary_tiers": [dict(t) for t in tiers]}
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=tokens_per_block, layer_names=("layers.0", "layers.1"),
                                      group_id=0),),
        worker_kv_bytes_per_block=worker_bytes_per_block,
        enable_kv_cache_events=kv_events,
        extra_config=extra,
        engine_id=engine_id,
        model=OffloadingModelConfig(name=str(model), dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_block, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(rank=0, world_size=world_size, tp_size=world_size, pp_size=1,
                                          pcp_size=1, dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False),
    )


def chunk_keys(token_lists: list[list[int]], hash_algo: str = "sha256") -> list[bytes]:
    """vLLM's offload keys of each token list (one chunk each, chained like one request's chunks)."""
    fn = get_hash_fn_by_name(hash_algo)
    keys, parent = [], None
    for tokens in token_lists:
        for start in range(0, CHUNK_TOKENS, TOKENS_PER_BLOCK):
            parent = hash_block_tokens(fn, parent, tokens[start:start + TOKENS_PER_BLOCK])
        keys.append(make_offload_key(parent, 0))
    return keys


def prompt(seed: int, chunks: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 30000, CHUNK_TOKENS).tolist() for _ in range(chunks)]


_OPEN: list[NativeRig] = []
"""Rigs not closed yet: the native_env fixture closes them when a test ends (their /dev/shm region too)."""


class NativeRig:
    """One engine's offloading manager (see the module docstring)."""

    def __init__(self, model: Path, tiers: list[dict], *, hash_algo: str = "sha256", open_timeout: float = 30,
                 **config):
        kvtier.vllm.native.plugin.register()
        self.hash_algo = hash_algo
        self.spec = TieringOffloadingSpec(offloading_config(model, tiers, engine_id=f"rig{secrets.token_hex(4)}",
                                                            **config))
        self.manager = self.spec.get_manager()
        _OPEN.append(self)
        self.tiers = list(self.manager.secondary_tiers)
        init_none_hash(get_hash_fn_by_name(hash_algo))  # what EngineCore does after building its scheduler
        deadline = time.monotonic() + open_timeout
        while any(t._opening.is_set() for t in self.tiers):
            assert time.monotonic() < deadline, "the tiers did not open"
            time.sleep(0.005)
        self.view = self.manager.primary_tier.get_kv_memoryview()
        self.rows = np.frombuffer(self.view, dtype=np.uint8).reshape(self.view.shape[0], -1)
        self._requests = 0
        self.steps = 0

    def keys(self, token_lists: list[list[int]]) -> list[bytes]:
        return chunk_keys(token_lists, self.hash_algo)

    @property
    def payload_bytes(self) -> int:
        """The stored part of a row: every rank's payload (the row's padding is not stored)."""
        run = self.tiers[0].run
        return run.payload_bytes * run.copies

    def stored_part(self, rows: list[bytes | None]) -> list[bytes | None]:
        return [None if row is None else row[: self.payload_bytes] for row in rows]

    def store_prompt(self, seed: int, chunks: int) -> tuple[list[bytes], list[bytes]]:
        """Store the ``chunks`` chunks of prompt ``seed`` with random rows; returns (keys, rows)."""
        keys = self.keys(prompt(seed, chunks))
        rows = [payload_of(self, -1) for _ in keys]
        self.store(keys, rows)
        return keys, rows

    def _context(self) -> ReqContext:
        self._requests += 1
        context = ReqContext(req_id=f"req{self._requests}")
        self.manager.on_new_request(context)
        return context

    def step(self) -> None:
        """The end of a scheduler step (polls the tiers, submits promotions)."""
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        self.steps += 1

    def settle(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        self.step()
        while self.manager.has_pending_work():
            assert time.monotonic() < deadline, "jobs did not finish"
            time.sleep(0.002)
            self.step()

    def store(self, keys: list[bytes], payloads: list[bytes]) -> None:
        """A request's GPU->CPU store of ``keys`` (rows filled with ``payloads``), then vLLM's cascade
        to every secondary tier; waits until the tiers report."""
        context = self._context()
        out = self.manager.prepare_store(keys, context)
        assert out is not None, "the CPU tier has no room"
        rows = {key: int(row) for key, row in zip(out.keys_to_store, out.store_spec.block_ids)}
        for key, payload in zip(keys, payloads):
            if key in rows:
                self.rows[rows[key], : len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        self.manager.complete_store(out.keys_to_store, context)
        self.manager.on_request_finished(context)
        self.settle()

    def fetch(self, keys: list[bytes], *, max_steps: int = 2000) -> list[bytes | None]:
        """vLLM's lookups of a request's keys, step after step until each is HIT or MISS (prefix
        order: stops at the first miss); the bytes of each HIT row (None for the others)."""
        context = self._context()
        found: list[bytes | None] = [None] * len(keys)
        for _ in range(max_steps):
            results = []
            for key in keys:
                result = self.manager.lookup(key, context)
                results.append(result)
                if result is LookupResult.MISS:
                    break
            self.step()
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in results):
                break
            time.sleep(0.002)
        else:
            raise AssertionError(f"lookups never settled: {results}")
        hits = [key for key, r in zip(keys, results) if r is LookupResult.HIT]
        if hits:
            spec = self.manager.prepare_load(hits, context)
            for key, row in zip(hits, spec.block_ids):
                found[keys.index(key)] = self.rows[int(row)].tobytes()
            self.manager.complete_load(hits, context)
        self.manager.on_request_finished(context)
        self.settle()
        return found

    def reset(self) -> None:
        """vLLM's reset_cache: the CPU tier forgets everything; secondary tiers drain and move to a new
        key epoch (unless their entry says ``keep_on_reset``)."""
        self.manager.reset_cache()

    def forget_cpu_tier(self) -> None:
        """vLLM's CPU tier forgets everything, as after a restart, and the secondary tiers keep
        offering what they hold: vLLM's reset_cache, with every tier's ``keep_on_reset`` on for it."""
        kept = [tier.keep_on_reset for tier in self.tiers]
        for tier in self.tiers:
            tier.keep_on_reset = True
        try:
            self.manager.reset_cache()
        finally:
            for tier, keep in zip(self.tiers, kept, strict=True):
                tier.keep_on_reset = keep

    def close(self) -> None:
        """vLLM's shutdown of the manager: tiers, then the CPU tier's region. Idempotent."""
        if self not in _OPEN:
            return
        _OPEN.remove(self)
        self.__dict__.pop("rows", None)  # our view of vLLM's region: vLLM unmaps it at shutdown
        self.manager.shutdown()


def payload_of(rig: NativeRig, seed: int) -> bytes:
    """Random bytes of one whole row (every rank's part, padding included)."""
    return os.urandom(rig.rows.shape[1]) if seed < 0 else np.random.default_rng(seed).bytes(rig.rows.shape[1])


@pytest.fixture
def native_env(tmp_path, monkeypatch):
    """A model folder to fingerprint (fingerprints cached under tmp_path) and no PYTHONHASHSEED."""
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "kvtier-cache"))
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    yield make_model(tmp_path / "model")
    for rig in list(_OPEN):  # a test that failed before closing its rigs
        rig.close()
