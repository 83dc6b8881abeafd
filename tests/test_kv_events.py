"""KV events from kvtier's tiers: real vLLM requests (vLLM's own block hasher), a real orchestrator
over a host index and a real disk tier; the events are vLLM's BlockStored / BlockRemoved."""

from __future__ import annotations

import time

import pytest
from support.namespaces import toy_namespace
from vllm import SamplingParams
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.request import Request

from kvtier.core.keys import chain_block_keys
from kvtier.policy.admission import StoreAdmission
from kvtier.runtime.orchestrator import BlockInfo, HostBytes, Orchestrator
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostIndex
from kvtier.vllm.kv_events import KVEventTranslator

ENGINE_BLOCK = 4
PAGES = 2  # kvtier block = 2 engine blocks
BLOCK = ENGINE_BLOCK * PAGES
SLOT = 256
NS = toy_namespace(block_tokens=BLOCK)


def published(hashes) -> list:
    """vLLM's hashes as its KV events publish them (ints by default, see VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""
    return [maybe_convert_block_hash(h) for h in hashes]


def make_request(req_id: str, tokens: list[int]) -> Request:
    init_none_hash(sha256)
    return Request(
        req_id, tokens, SamplingParams(max_tokens=1), None,
        block_hasher=get_request_block_hasher(ENGINE_BLOCK, sha256),
    )


def make_orchestrator(tmp_path, num_slots: int) -> Orchestrator:
    disk = None
    if tmp_path is not None:
        disk = DiskTier(
            root_dir=tmp_path, model_name="toy", engine_digest=NS.digest, rank_digests=[NS.for_rank(0).digest],
            namespace_json=NS.config_json("toy"), payload_bytes=SLOT, capacity_bytes=10**7,
            n_read_threads=1, n_write_threads=1, max_pending_writes=16,
        )
    host_bytes = HostBytes([memoryview(bytearray(SLOT * num_slots))], SLOT)
    return Orchestrator(HostIndex(num_slots), host_bytes, [disk] if disk is not None else [], StoreAdmission(0, 10))


def store_blocks(orch: Orchestrator, keys: list[bytes]) -> None:
    for i, key in enumerate(keys):
        assert orch.begin_store(key, BlockInfo(keys[i - 1] if i else NS.digest, BLOCK)) is not None
    orch.finish_store(keys, ok=True)


def settle(orch: Orchestrator) -> None:
    deadline = time.monotonic() + 30
    while orch.has_pending_io():
        assert time.monotonic() < deadline
        orch.poll()
        time.sleep(0.005)


def translator(orch: Orchestrator, self_describing: bool) -> KVEventTranslator:
    return KVEventTranslator(
        orch, block_tokens=BLOCK, engine_block_tokens=ENGINE_BLOCK,
        self_describing=self_describing, group_kinds=("full_attention",),
    )


def test_self_describing_events_carry_vllm_hashes_tokens_and_parent(tmp_path):
    orch = make_orchestrator(tmp_path, num_slots=8)
    events = translator(orch, self_describing=True)
    tokens = list(range(100, 100 + 3 * BLOCK + 3))
    request = make_request("a", tokens)
    keys = chain_block_keys(NS.digest, tokens[: 3 * BLOCK], BLOCK)
    store_blocks(orch, keys)
    events.learn(request, enumerate(keys))
    settle(orch)  # the cascade writes the blocks to disk
    got = events.take_events()
    cpu = [e for e in got if e.medium == "CPU"]
    storage = [e for e in got if e.medium == "STORAGE"]
    assert len(cpu) == 3 and len(storage) == 3 and all(isinstance(e, BlockStored) for e in got)
    for index, event in enumerate(cpu):
        assert event.block_hashes == published(request.block_hashes[index * PAGES : (index + 1) * PAGES])
        assert event.parent_block_hash == (published([request.block_hashes[index * PAGES - 1]])[0] if index else None)
        assert event.token_ids == tokens[index * BLOCK : (index + 1) * BLOCK]
        assert event.block_size == ENGINE_BLOCK and event.group_idx == 0 and event.locality == "LOCAL"
        assert event.kv_cache_spec_kind == "full_attention"
    assert sorted(e.block_hashes for e in storage) == sorted(e.block_hashes for e in cpu)  # any write order

    # Removal from one tier is announced for that tier only; the block stays known while on disk.
    orch.host.delete(keys[0])
    assert orch.disk.delete([keys[1]]) == 1
    removed = events.take_events()
    assert [(type(e), e.medium, e.block_hashes) for e in removed] == [
        (BlockRemoved, "CPU", cpu[0].block_hashes),
        (BlockRemoved, "STORAGE", cpu[1].block_hashes),
    ]
    assert events.num_known == 3
    orch.disk.delete([keys[0]])
    assert [e.medium for e in events.take_events()] == ["STORAGE"]
    assert events.num_known == 2  # gone from every tier: forgotten
    orch.close()


def test_default_events_carry_the_last_engine_block_hash_only():
    orch = make_orchestrator(None, num_slots=1)
    events = translator(orch, self_describing=False)
    tokens = list(range(2 * BLOCK + 1))
    request = make_request("a", tokens)
    keys = chain_block_keys(NS.digest, tokens[: 2 * BLOCK], BLOCK)
    store_blocks(orch, keys[:1])
    events.learn(request, [(0, keys[0])])
    store_blocks(orch, keys[1:])  # one slot: evicts block 0
    events.learn(request, [(1, keys[1])])
    got = events.take_events()
    assert [(type(e).__name__, e.block_hashes) for e in got] == [
        ("BlockStored", published([request.block_hashes[PAGES - 1]])),
        ("BlockRemoved", published([request.block_hashes[PAGES - 1]])),
        ("BlockStored", published([request.block_hashes[2 * PAGES - 1]])),
    ]
    assert got[0].token_ids == [] and got[0].block_size == 0 and got[0].parent_block_hash is None


def test_blocks_never_seen_with_a_request_are_announced_once_a_request_hits_them(tmp_path):
    tokens = list(range(7, 7 + BLOCK))
    keys = chain_block_keys(NS.digest, tokens, BLOCK)
    first = make_orchestrator(tmp_path, num_slots=2)
    store_blocks(first, keys)
    settle(first)
    first.close()

    orch = make_orchestrator(tmp_path, num_slots=2)  # a restart: the block is only on disk
    events = translator(orch, self_describing=True)
    assert orch.media_of(keys[0]) and events.take_events() == []
    request = make_request("b", tokens + [1])
    events.learn(request, [(0, keys[0])])  # served as a hit: now its vLLM hashes are known
    got = events.take_events()
    assert [(e.medium, e.block_hashes) for e in got] == [("STORAGE", published(request.block_hashes[:PAGES]))]
    events.learn(request, [(0, keys[0])])  # learning again announces nothing twice
    assert events.take_events() == []
    orch.close()


@pytest.mark.parametrize("ok", [True, False])
def test_a_failed_store_is_never_announced(ok):
    orch = make_orchestrator(None, num_slots=2)
    events = translator(orch, self_describing=False)
    tokens = list(range(BLOCK + 1))
    request = make_request("c", tokens)
    keys = chain_block_keys(NS.digest, tokens[:BLOCK], BLOCK)
    orch.begin_store(keys[0], BlockInfo(NS.digest, BLOCK))
    orch.finish_store(keys, ok=ok)
    events.learn(request, [(0, keys[0])])
    assert len(events.take_events()) == (1 if ok else 0)


def test_a_new_key_epoch_announces_every_known_block_removed_from_every_medium(tmp_path):
    """After a reset of the cache no block of before can be loaded by the engine, from any tier:
    each is announced removed where it was announced stored, once, and then forgotten."""
    orch = make_orchestrator(tmp_path, num_slots=8)
    events = translator(orch, self_describing=False)
    tokens = list(range(300, 300 + 2 * BLOCK))
    request = make_request("a", tokens)
    keys = chain_block_keys(NS.digest, tokens, BLOCK)
    store_blocks(orch, keys)
    events.learn(request, enumerate(keys))
    settle(orch)
    stored = events.take_events()
    assert sorted(e.medium for e in stored) == ["CPU", "CPU", "STORAGE", "STORAGE"]
    orch.clear()  # the reset: the host tier emptied, the disk keeps its blocks
    events.forget_all()
    removed = events.take_events()
    assert all(isinstance(e, BlockRemoved) for e in removed)
    assert sorted((e.medium, tuple(e.block_hashes)) for e in removed) == sorted(
        (e.medium, tuple(e.block_hashes)) for e in stored)
    assert events.num_known == 0 and all(orch.disk.contains(key) for key in keys)
    orch.disk.delete(keys)  # the old epoch's blocks leaving later: nothing more to announce
    assert events.take_events() == []
    orch.close()
