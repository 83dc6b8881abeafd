"""``kvtier_node``'s storage (:class:`kvtier.node.pool_tier.NodeTier`) against a real ``kvtier
node`` service process, with plain buffers standing in for vLLM's CPU-tier rows: stores, batched
lookups and loads bit-exact; a block stored by two tier instances (two engines) held once; the
service SIGKILLed: misses and dropped stores, counted, then the tier reattaches by itself to the
new pool; bad entries refused with the key named."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.node_process import NodeProcess

from kvtier.core.tier_config import NodeTierConfig, TierType, parse_tier
from kvtier.core.values import ConfigError
from kvtier.node.pool_tier import NodeTier
from kvtier.tiers.base import IoError, IoKind, IoResult, Presence

PAYLOAD = 8192  # one rank's chunk
WIDTH = 2  # two stored ranks: two slots per block


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    node = NodeProcess(tmp_path_factory.mktemp("node") / "node.sock", "4MiB").start()
    yield node
    node.stop()


def tier(service: NodeProcess, engine: str, **more) -> NodeTier:
    return NodeTier(NodeTierConfig(service.sock, timeout_s=2.0, retry_interval_s=0.2, **more), engine=engine,
                    payload_bytes=PAYLOAD, width=WIDTH)


def payloads(seed: int) -> list[memoryview]:
    return [memoryview(bytearray(os.urandom(PAYLOAD))) for _ in range(WIDTH)] if seed else \
        [memoryview(bytearray(PAYLOAD)) for _ in range(WIDTH)]


def drain(t: NodeTier, want: int, timeout: float = 30.0) -> list[IoResult]:
    """Poll until ``want`` job results came out."""
    results: list[IoResult] = []
    deadline = time.monotonic() + timeout
    while len(results) < want:
        assert time.monotonic() < deadline, f"{len(results)} of {want} results"
        results += t.poll()
        time.sleep(0.005)
    return results


def probe(t: NodeTier, keys: list[bytes], group: str = "req") -> list[Presence]:
    t.group = group
    t.probe(keys)
    t.flush()
    deadline = time.monotonic() + 30
    while t.probing:
        assert time.monotonic() < deadline, "no answer to the probe"
        t.poll()
        time.sleep(0.005)
    return [t.presence(k) for k in keys]


def store(t: NodeTier, keys: list[bytes], sources: list[list[memoryview]]) -> list[IoResult]:
    for job, (key, src) in enumerate(zip(keys, sources, strict=True)):
        assert t.submit_write(job, key, b"p" * 32, 64, src)
    t.flush()
    return drain(t, len(keys))


def load(t: NodeTier, keys: list[bytes]) -> tuple[list[IoResult], list[list[memoryview]]]:
    dests = [payloads(0) for _ in keys]
    for job, (key, dest) in enumerate(zip(keys, dests, strict=True)):
        t.submit_read(100 + job, key, dest)
    t.flush()
    return drain(t, len(keys)), dests


def keys_of(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i}".encode().ljust(32, b"\0") for i in range(n)]


def test_stores_lookups_and_loads_are_bit_exact_and_a_block_of_two_engines_is_held_once(service):
    a, b = tier(service, "engine-a"), tier(service, "engine-b")
    try:
        keys = keys_of("shared", 4)
        sources = [payloads(1) for _ in keys]
        assert all(r.ok and r.kind is IoKind.WRITE for r in store(a, keys, sources))
        before = service.stats()
        # engine B: never asked before: UNKNOWN, then one lookup round trip for all four keys
        assert [b.presence(k) for k in keys] == [Presence.UNKNOWN] * 4
        trips = b.counts["round_trips"]
        assert probe(b, keys + keys_of("absent", 2)) == [Presence.PRESENT] * 4 + [Presence.ABSENT] * 2
        assert b.counts["round_trips"] - trips <= 2  # the hello (first call) and ONE lookup
        assert service.stats()["engines"]["engine-b"]["lookups"] == 1
        results, dests = load(b, keys)
        assert all(r.ok for r in results)
        for src, dest in zip(sources, dests, strict=True):
            assert [bytes(d) for d in dest] == [bytes(s) for s in src], "a load is not bit-exact"
        # engine B stores the same blocks: nothing copied, nothing added
        assert all(r.ok for r in store(b, keys, [payloads(1) for _ in keys]))
        after = service.stats()
        assert after["blocks"] == before["blocks"] == 4, "a block two engines stored is not held once"
        assert after["used_slots"] == 4 * WIDTH and after["pinned_blocks"] == 0
        assert b.counts["duplicates"] == 4 and after["engines"]["engine-b"]["stored_blocks"] == 0
        # the pool still holds A's bytes (B's duplicate store wrote nothing)
        _, again = load(a, keys)
        assert [[bytes(d) for d in x] for x in again] == [[bytes(s) for s in x] for x in sources]
        # a block evicted or never stored is a NOT_FOUND read, not data
        results, _ = load(b, [keys[0], keys_of("never", 1)[0], keys[1]])
        assert [(r.ok, r.error) for r in sorted(results, key=lambda r: r.job_id)] == [
            (True, None), (False, IoError.NOT_FOUND), (True, None)]
    finally:
        a.close()
        b.close()


def test_the_service_killed_costs_misses_and_dropped_stores_then_the_tier_reattaches(tmp_path):
    node = NodeProcess(tmp_path / "node.sock", "4MiB").start()
    t = tier(node, "survivor")
    try:
        keys = keys_of("before", 2)
        assert all(r.ok for r in store(t, keys, [payloads(1) for _ in keys]))
        node.kill()
        # a load of a block the tier still believes in: fails (a miss), never hangs or raises
        results, _ = load(t, keys)
        assert not any(r.ok for r in results) and t.unavailable > 0
        assert t.write_room() is None  # stores are dropped (counted by the caller) while it is gone
        assert probe(t, keys_of("during", 2), group="r2") == [Presence.ABSENT] * 2
        node.start()
        time.sleep(0.3)  # past retry_interval_s
        fresh = keys_of("after", 2)
        assert probe(t, fresh, group="r3") == [Presence.ABSENT] * 2  # reattached: a new, empty pool
        assert t.write_room(), "the tier did not take writes again once the service answered"
        assert probe(t, keys, group="r4") == [Presence.ABSENT] * 2, "answers of the old pool survived"
        sources = [payloads(1) for _ in fresh]
        assert all(r.ok for r in store(t, fresh, sources))
        results, dests = load(t, fresh)
        assert all(r.ok for r in results)
        assert [[bytes(d) for d in x] for x in dests] == [[bytes(s) for s in x] for x in sources]
        assert node.stats()["blocks"] == 2 and node.stats()["pinned_blocks"] == 0
    finally:
        t.close()
        node.stop()


def test_a_service_that_is_not_running_is_misses_and_stores_are_dropped(tmp_path):
    t = NodeTier(NodeTierConfig(tmp_path / "none.sock", retry_interval_s=0.2), engine="e", payload_bytes=PAYLOAD,
                 width=WIDTH)
    try:
        assert probe(t, keys_of("k", 3)) == [Presence.ABSENT] * 3
        assert t.unavailable >= 1 and t.write_room() is None
    finally:
        t.close()


def test_bad_entries_are_refused_naming_the_key(tmp_path):
    where = "secondary_tiers[kvtier_node]"
    with pytest.raises(ConfigError, match=r"kvtier_node\]\.socket' is required"):
        parse_tier({}, TierType.NODE, where)
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['sock'\]"):
        parse_tier({"sock": "/x"}, TierType.NODE, where)
    with pytest.raises(ConfigError, match=r"socket' .* at most 107"):
        parse_tier({"socket": "/" + "s" * 200}, TierType.NODE, where)
    with pytest.raises(ConfigError, match=r"timeout_s' must be > 0"):
        parse_tier({"socket": "/x", "timeout_s": 0}, TierType.NODE, where)
    with pytest.raises(ConfigError, match=r"cap_bytes' must be an integer"):
        parse_tier({"socket": "/x", "cap_bytes": "1G"}, TierType.NODE, where)
    config = parse_tier({"socket": str(tmp_path / "n.sock"), "cap_bytes": 2**20}, TierType.NODE, where)
    assert config == NodeTierConfig(tmp_path / "n.sock", cap_bytes=2**20)


def test_a_service_of_another_block_size_stops_the_engine_naming_the_socket(tmp_path):
    """The native adapter's start-up hello (vLLM-free here: the method runs on its facts only)."""
    pytest.importorskip("vllm")
    from kvtier.vllm.native.node_tier import KVTierNodeTier

    node = NodeProcess(tmp_path / "node.sock", "4MiB").start()
    other = NodeTier(NodeTierConfig(node.sock), engine="other-model", payload_bytes=2 * PAYLOAD, width=1)
    facts = SimpleNamespace(tier_type="kvtier_node", engine="e", config=NodeTierConfig(node.sock),
                            run=SimpleNamespace(payload_bytes=PAYLOAD))
    try:
        assert all(r.ok for r in store(other, keys_of("o", 1), [[memoryview(bytearray(2 * PAYLOAD))]]))
        with pytest.raises(ConfigError, match=r"secondary_tiers\[kvtier_node\]\.socket.*slots of 16384 bytes"):
            KVTierNodeTier._check_service(facts)
        facts.run.payload_bytes = 2 * PAYLOAD
        KVTierNodeTier._check_service(facts)  # the right size: accepted
        facts.config = NodeTierConfig(Path(tmp_path / "absent.sock"))
        KVTierNodeTier._check_service(facts)  # not running: only logged, the tier starts with misses
    finally:
        other.close()
        node.stop()


def test_a_store_reserved_in_a_pool_that_dies_never_lands_in_the_next_one(tmp_path):
    """The service is SIGKILLed and restarted between a reservation and its commit: the copy goes
    to the old pool's mapping, the commit fails (the reservation died with its connection), the
    writes are reported dropped, and the new pool holds nothing of them."""
    node = NodeProcess(tmp_path / "node.sock", "4MiB").start()

    class RestartAfterReserve(NodeTier):
        def _call(self, name, *args, **kwargs):
            reply = super()._call(name, *args, **kwargs)
            if name == "reserve" and not restarted:
                restarted.append(True)
                node.kill()
                node.start()
            return reply

    restarted: list[bool] = []
    t = RestartAfterReserve(NodeTierConfig(node.sock, retry_interval_s=0.05), engine="e", payload_bytes=PAYLOAD,
                            width=WIDTH)
    try:
        keys = keys_of("torn", 3)
        results = store(t, keys, [payloads(1) for _ in keys])
        assert restarted and [(r.ok, r.error) for r in results] == [(False, IoError.DROPPED)] * 3
        time.sleep(0.1)
        assert node.stats()["blocks"] == 0, "a store reserved in the old pool was committed in the new one"
        assert probe(t, keys) == [Presence.ABSENT] * 3
    finally:
        t.close()
        node.stop()


def test_a_service_that_is_gone_reaches_vllms_metrics_as_dropped_stores_and_unavailable_calls(tmp_path):
    """Through the native adapter's ChunkStore and metrics, as kvtier_disk / kvtier_redis count theirs."""
    pytest.importorskip("vllm")
    import numpy as np

    from kvtier.runtime.chunks.rows import Rows
    from kvtier.runtime.chunks.store import ChunkStore
    from kvtier.vllm.native.metrics import STORES_DROPPED, UNAVAILABLE, TierMetrics

    region = np.zeros((4, WIDTH * PAYLOAD), dtype=np.uint8)
    t = NodeTier(NodeTierConfig(tmp_path / "none.sock"), engine="e", payload_bytes=PAYLOAD, width=WIDTH)
    store = ChunkStore(t, Rows(memoryview(region), WIDTH, PAYLOAD), namespace_digest=b"n" * 32, chunk_tokens=64)
    try:
        store.submit_store(1, [b"chunk-1", b"chunk-2"], [0, 1])
        deadline, outcomes = time.monotonic() + 30, []
        while not outcomes:
            assert time.monotonic() < deadline
            outcomes = store.poll()
            time.sleep(0.005)
        assert not outcomes[0].ok and store.counts["stores_dropped"] == 2
        values = TierMetrics("kvtier_node").take(store).data["data"]
        assert values[STORES_DROPPED] == {("kvtier_node",): 2} and values[UNAVAILABLE] == {("kvtier_node",): 1}, values
    finally:
        store.close()
