"""An engine's scheduler attached to a node service (kvtier.runtime.node_host), against the real
service (kvtier.node.server, its loop on a thread) over its real Unix socket: batched lookups and
reservations, blocks shared between engines and held once, per-rank slots, failure as a miss,
holds of a dead service's session never sent to its successor, no service at start-up only misses
until one answers, and the ``node`` config key."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from support.node_service import NodeThread

from kvtier.core.config import ConfigError, KVTierConfig
from kvtier.core.residency import Medium
from kvtier.node import NodeClient, Role
from kvtier.policy.admission import StoreAdmission
from kvtier.runtime.node_host import NodeHost, connect_node
from kvtier.runtime.host_side import Acquired, AcquireStatus
from kvtier.tiers.stack import BlockInfo

SLOT = 4096


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


INFO = BlockInfo(key(0), 16)


def Service(sock: Path) -> NodeThread:  # noqa: N802 (reads as the class it returns)
    return NodeThread(sock, pool_bytes=64 * SLOT, slot_bytes=SLOT)


@pytest.fixture
def service(tmp_path):
    svc = Service(tmp_path / "node.sock")
    yield svc
    svc.stop()


def host(sock: Path, engine: str, width: int = 1, cap: int | None = None) -> NodeHost:
    client = connect_node(str(sock), engine=engine, role=Role.SCHEDULER, slot_bytes=SLOT, cap_bytes=cap)
    client.retry_interval_s = 0.0
    return NodeHost(client, width, StoreAdmission(0, 1000))


def test_a_block_one_engine_stores_is_a_hit_for_another_and_is_held_once(service):
    sock = service.server.options.socket_path
    a, b = host(sock, "A"), host(sock, "B")
    keys = [key(i) for i in range(1, 5)]
    slots = a.begin_stores([(k, INFO) for k in keys])
    assert all(s is not None and len(s) == 1 for s in slots) and len({s for s in slots}) == 4
    assert b.leading_run(keys) == 0  # WRITING: no one's hit yet
    a.finish_store(keys[:3], ok=True)
    a.finish_store(keys[3:], ok=False)
    got = b.acquire("req-1", keys + [key(99)])
    assert got.status is AcquireStatus.READY and got.num_blocks == 3
    assert b.held("req-1") == keys[:3] and b.held_slots("req-1") == slots[:3]
    assert b.held_pool("req-1") == b.pool_id == service.stats()["pool_id"]
    assert b.locate(keys[0]) is Medium.HOST and b.locate(keys[3]) is None
    assert service.stats()["pinned_blocks"] == 3
    b.trim_hold("req-1", 2)
    assert b.held("req-1") == keys[:2]
    b.release("req-1")
    b.release("req-1")  # idempotent
    assert service.stats()["pinned_blocks"] == 0
    # B stores the same blocks: nothing to copy, the pool keeps one copy.
    assert b.begin_stores([(k, INFO) for k in keys[:3]]) == [None] * 3
    stats = service.stats()
    assert stats["blocks"] == 3 and stats["engines"]["B"]["duplicate_blocks"] == 3
    assert b.take_stats().stores_submitted == 0 and a.take_stats().stores_submitted == 4
    a.close(), b.close()


def test_blocks_of_a_tensor_parallel_engine_have_one_slot_per_rank(service):
    sock = service.server.options.socket_path
    tp = host(sock, "TP2", width=2)
    [slots] = tp.begin_stores([(key(1), INFO)])
    assert slots is not None and len(slots) == 2 and slots[0] != slots[1]
    tp.finish_store([key(1)], ok=True)
    assert tp.acquire("r", [key(1)]).num_blocks == 1 and tp.held_slots("r") == [slots]
    assert host(sock, "TP1", width=1).leading_run([key(1)]) == 0  # another width: another namespace anyway
    tp.close()


def test_a_dead_service_is_a_miss_and_its_successor_never_sees_the_old_session_s_holds(tmp_path):
    sock = tmp_path / "node.sock"
    first = Service(sock)
    a = host(sock, "A")
    a.begin_stores([(key(1), INFO)]), a.finish_store([key(1)], ok=True)
    assert a.acquire("held-over", [key(1)]).num_blocks == 1
    [pending] = a.begin_stores([(key(2), INFO)])  # reserved, then the service dies before the commit
    assert pending is not None
    old_pool = a.pool_id
    first.stop()
    assert a.held_pool("held-over") == old_pool  # its load job names the dead pool: never read from another

    assert a.acquire("req", [key(1)]).num_blocks == 0  # a miss, not an error
    assert a.begin_stores([(key(3), INFO)]) == [None]
    stats = a.take_stats()
    assert stats.node_unavailable >= 2 and stats.stores_dropped == 1

    second = Service(sock)
    try:
        [fresh] = a.begin_stores([(key(2), INFO)])  # reattached by itself: a new pool
        assert fresh is not None and a.pool_id != old_pool
        a.finish_store([key(2)], ok=True)
        b = host(sock, "B")
        assert b.acquire("other", [key(2)]).num_blocks == 1  # pin handle 1 of B's session
        a.release("held-over")  # a handle of the dead session: never sent to the new service
        assert second.stats()["pinned_blocks"] == 1
        b.release("other")
        assert second.stats()["pinned_blocks"] == 0
        a.close(), b.close()
    finally:
        second.stop()


def test_a_store_reserved_in_a_dead_pool_is_never_committed_in_the_new_one(tmp_path):
    sock = tmp_path / "node.sock"
    first = Service(sock)
    a = host(sock, "A")
    [old] = a.begin_stores([(key(7), INFO)])
    assert old is not None
    first.stop()
    second = Service(sock)
    try:
        assert a.leading_run([key(7)]) == 0  # reattaches
        a.finish_store([key(7)], ok=True)  # copied into the old pool: must not become a hit here
        assert second.stats()["blocks"] == 0
        assert a.take_stats().stores_dropped == 1  # and it is a dropped store
        a.close()
    finally:
        second.stop()


def test_stores_lost_with_the_service_are_counted_dropped_as_refused_ones_are(tmp_path):
    """A block copied into its slots whose commit cannot reach the service (gone before or during
    it) never became a hit: a dropped store, as one the pool refused at reserve (and as kvtier_node
    counts it behind vLLM's offloading); a copy that failed is aborted, not dropped (as an embedded
    engine's)."""
    sock = tmp_path / "node.sock"
    first = Service(sock)
    a = host(sock, "A")
    assert None not in a.begin_stores([(key(1), INFO), (key(2), INFO)])
    first.stop()
    a.finish_store([key(1)], ok=True)  # the commit finds the service gone
    a.finish_store([key(2)], ok=True)  # the client knows it is gone by now
    second = Service(sock)
    try:
        assert None not in a.begin_stores([(key(4), INFO)])  # attached again: a new pool
        a.finish_store([key(4)], ok=False)  # the workers' copy failed: aborted
        stats = a.take_stats()
        assert (stats.stores_submitted, stats.stores_dropped) == (3, 2)
        assert second.stats()["blocks"] == 0
        a.close()
    finally:
        second.stop()


def test_an_engine_s_cap_is_its_share_of_the_pool(service):
    sock = service.server.options.socket_path
    small = host(sock, "small", cap=2 * SLOT)
    for i in range(4):
        [slots] = small.begin_stores([(key(10 + i), INFO)])
        assert slots is not None
        small.finish_store([key(10 + i)], ok=True)
    assert service.stats()["engines"]["small"]["held_slots"] == 2  # it evicted its own oldest
    usage = small.take_stats()
    assert usage.host_used_bytes == 2 * SLOT and usage.host_capacity_bytes == 2 * SLOT
    small.close()


def test_no_service_at_start_up_is_only_misses_until_one_answers_then_it_attaches_by_itself(tmp_path):
    sock = tmp_path / "node.sock"
    client = connect_node(str(sock), engine="e", role=Role.SCHEDULER, slot_bytes=SLOT)  # no error: it starts
    assert not client.connected and client.retry_interval_s == 1.0
    early = NodeHost(client, 1, StoreAdmission(0, 1000))
    assert early.acquire("r", [key(1)]) == Acquired(AcquireStatus.READY, 0)
    assert early.begin_stores([(key(1), INFO)]) == [None]
    assert early.stats.node_unavailable == 2 and early.stats.stores_dropped == 1  # both misses, counted
    svc = Service(sock)
    try:
        started = time.monotonic()
        while early.begin_stores([(key(1), INFO)]) == [None]:  # attaches at the first call past the interval
            assert time.monotonic() - started < 1.0 + 2.0, "not attached within retry_interval_s"
            time.sleep(0.05)
        early.finish_store([key(1)], ok=True)
        assert early.pool_id == svc.stats()["pool_id"]
        assert host(sock, "other").acquire("r", [key(1)]).num_blocks == 1
    finally:
        early.close()
        svc.stop()


def test_another_block_size_is_refused_with_the_key_named(service):
    sock = service.server.options.socket_path
    keep = host(sock, "A")
    with pytest.raises(ConfigError, match=r"'node' = .*refused this engine.*slots of 4096 bytes"):
        connect_node(str(sock), engine="e", role=Role.WORKER, slot_bytes=3 * SLOT)
    keep.close()


def test_the_node_key():
    base = {"cpu_bytes_to_use": 10**9}
    assert KVTierConfig.from_extra_config(base).node is None
    assert KVTierConfig.from_extra_config({**base, "node": " /run/kvtier/node.sock "}).node == "/run/kvtier/node.sock"
    with pytest.raises(ConfigError, match="'node' must be a non-empty string"):
        KVTierConfig.from_extra_config({**base, "node": ""})
    with pytest.raises(ConfigError, match="'node' and 'secondary_tiers' are both set"):
        KVTierConfig.from_extra_config({**base, "node": "/x.sock", "secondary_tiers": [
            {"type": "fs", "root_dir": "/tmp/x", "capacity_bytes": 10**9}]})


def test_observers_do_not_count_as_engines(service):
    with NodeClient(service.server.options.socket_path, engine="probe", role=Role.OBSERVER) as probe:
        probe.connect()
        assert probe.stats()["attached_engines"] == 0
