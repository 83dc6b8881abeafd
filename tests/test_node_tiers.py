"""The node service owns the node's disk and Redis tiers (kvtier.node.tiers): a real service (in
this process on a thread, or ``kvtier node`` as a process), a real disk root and a real
redis-server, engines as NodeHosts writing and reading the pool through their own mapping.

Shown: commits cascade below the pool; a block evicted from the pool is promoted back, bit-exact,
after one RETRY answer (from disk, and from Redis); a Redis hit is kept on the node's disk, as an
embedded engine keeps it; a record another writer puts into the disk root is found after a
refresh; a service SIGKILLed and restarted on the same disk dir serves its first lookups from
disk; a corrupt record is a counted miss; the loop answers while a read is stuck; an engine
attached with ``node`` still refuses its own secondary tiers."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from support.namespaces import toy_namespace
from support.node_service import NodeThread
from support.redis_server import free_port, redis_factory  # noqa: F401  (pytest fixture)
from test_node_service import ENV, start_node, stop

from kvtier.core.config import ConfigError, KVTierConfig
from kvtier.core.fleet_key import AuthConfig, FleetKey
from kvtier.core.tier_config import DiskTierConfig, RedisTierConfig
from kvtier.node import NodeUnavailable, Role
from kvtier.node import tiers as tiers_module
from kvtier.node.metrics import registry_for
from kvtier.core.residency import Medium
from kvtier.tiers import factory
from kvtier.tiers import stack as stack_module
from kvtier.policy.admission import StoreAdmission
from kvtier.runtime.node_host import NodeHost, connect_node
from kvtier.runtime.orchestrator import AcquireStatus, BlockInfo
from kvtier.tiers.blockfile import HEADER_LEN, decode_header
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.factory import open_tier
from kvtier.tiers.sealing import PLAIN, Sealer

SLOT = 4096
NS = toy_namespace()
NAMESPACE = NS.config_json("toy")


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def payload(i: int) -> bytes:
    return bytes([(i * 37 + n) % 251 for n in range(256)]) * (SLOT // 256)


def disk(root: Path) -> DiskTierConfig:
    return DiskTierConfig(root_dir=root, capacity_bytes=64 * 2**20, n_read_threads=2, n_write_threads=2)


def engine(sock: Path, name: str = "A") -> NodeHost:
    client = connect_node(str(sock), engine=name, role=Role.SCHEDULER, slot_bytes=SLOT, map_pool=True,
                          namespace=NAMESPACE)
    client.retry_interval_s = 0.0
    return NodeHost(client, 1, StoreAdmission(0, 1000))


def wait_for(predicate, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what or predicate}"
        time.sleep(0.01)


def tier_counts(host: NodeHost) -> dict:
    return host.client.stats()["tiers"]


def attached(host: NodeHost) -> bool:
    try:
        host.client.stats()
        return True
    except NodeUnavailable:
        return False


def tiers_open(host: NodeHost) -> bool:
    try:
        namespaces = tier_counts(host)["namespaces"]
    except NodeUnavailable:  # a restarted service: the next call reattaches
        return False
    return bool(namespaces) and all(ns["open"] for ns in namespaces.values())


def store(host: NodeHost, ids: list[int]) -> None:
    """Store blocks ``ids`` as an engine does: reserve, copy into the slots, commit."""
    blocks = [(key(i), BlockInfo(key(i - 1), 16)) for i in ids]
    slots = host.begin_stores(blocks)
    assert all(s is not None for s in slots), slots
    for i, got in zip(ids, slots):
        host.client.pool.slot(got[0])[:] = payload(i)
    host.finish_store([key(i) for i in ids], True)


def answers_of(host: NodeHost) -> list:
    """Every answer ``host.acquire`` gives from now on, appended as it gives it."""
    answers, acquire = [], host.acquire
    host.acquire = lambda *args, **kwargs: answers.append(acquire(*args, **kwargs)) or answers[-1]
    return answers


def load(host: NodeHost, ids: list[int], owner: str = "req") -> tuple[int, int, list[bytes]]:
    """Acquire ``ids`` until the answer is READY: (RETRY answers seen, hits, the bytes read)."""
    retries = 0
    deadline = time.monotonic() + 30
    while True:  # the chain names the blocks as an engine's lookup does (key i's parent: key i - 1)
        got = host.acquire(owner, [key(i) for i in ids], key(ids[0] - 1), 16)
        if got.status is AcquireStatus.READY:
            break
        retries += 1
        assert time.monotonic() < deadline, "still RETRY after 30 s"
        time.sleep(0.005)
    data = [bytes(host.client.pool.slot(s[0])) for s in host.held_slots(owner)]
    host.release(owner)
    return retries, got.num_blocks, data


def test_a_block_evicted_from_the_pool_is_promoted_back_from_disk_bit_exact(tmp_path):
    svc = NodeThread(tmp_path / "n.sock", pool_bytes=8 * SLOT, slot_bytes=SLOT, tiers=(disk(tmp_path / "disk"),))
    try:
        a = engine(svc.sock)
        wait_for(lambda: tiers_open(a), what="the namespace's tiers to open")
        store(a, [1, 2, 3, 4])
        wait_for(lambda: tier_counts(a).get("written_disk", 0) == 4, what="4 disk writes")
        for batch in ([5, 6, 7, 8], [9, 10, 11, 12]):  # the pool holds 8: blocks 1-4 are evicted
            store(a, batch)
            wait_for(lambda: not tier_counts(a)["writes_in_flight"])
        assert a.leading_run([key(i) for i in (1, 2, 3, 4)]) == 4  # the pool has none, the disk all
        assert a.client.lookup([key(1)]).hits == 0
        answers = answers_of(a)
        retries, hits, data = load(a, [1, 2, 3, 4])
        assert retries >= 1 and hits == 4
        assert data == [payload(i) for i in (1, 2, 3, 4)]
        assert answers[-1].promoted == {Medium.DISK: 4}  # the engine counts these hits as disk's, not the pool's
        counts = tier_counts(a)
        assert counts["promoted_disk"] == 4 and counts.get("promotion_failures", 0) == 0
        assert svc.stats()["pinned_blocks"] == 0  # parked promotions were let go
        a.close()
    finally:
        svc.stop()


def test_a_block_evicted_from_the_pool_is_promoted_back_from_redis(tmp_path, redis_factory):  # noqa: F811
    redis = redis_factory()
    svc = NodeThread(tmp_path / "n.sock", pool_bytes=4 * SLOT, slot_bytes=SLOT,
                     tiers=(RedisTierConfig(url=redis.url()),))
    try:
        a = engine(svc.sock)
        wait_for(lambda: tiers_open(a), what="the namespace's tiers to open")
        store(a, [1, 2])
        wait_for(lambda: tier_counts(a).get("written_remote", 0) == 2, what="2 Redis writes")
        store(a, [3, 4, 5, 6])  # evicts 1 and 2 from the pool
        wait_for(lambda: not tier_counts(a)["writes_in_flight"])
        answers = answers_of(a)
        retries, hits, data = load(a, [1, 2])
        assert retries >= 1 and hits == 2 and data == [payload(1), payload(2)]
        assert tier_counts(a)["promoted_remote"] == 2 and answers[-1].promoted == {Medium.REMOTE: 2}
        assert load(a, [1, 2])[:2] == (0, 2) and answers[-1].promoted == {}  # in the pool now
        a.close()
    finally:
        svc.stop()


def test_a_redis_server_gone_is_counted_unavailable_by_the_node_as_by_an_embedded_engine(tmp_path, redis_factory):  # noqa: F811
    """Writes that find the service's Redis gone are counted in kvtier_node_tier_unavailable, as
    an embedded engine's kvtier_tier_unavailable and kvtier_redis's kvtier_offload_unavailable
    count them (RemoteTier.unavailable), besides the writes dropped."""
    redis = redis_factory()
    svc = NodeThread(tmp_path / "n.sock", pool_bytes=8 * SLOT, slot_bytes=SLOT,
                     tiers=(RedisTierConfig(url=redis.url(), timeout_s=0.5, connect_timeout_s=0.5),))
    try:
        a = engine(svc.sock)
        wait_for(lambda: tiers_open(a), what="the namespace's tiers to open")
        redis.kill()
        store(a, [1, 2])
        wait_for(lambda: tier_counts(a)["unavailable_remote"] >= 1, what="an unreachable call counted")
        counts = tier_counts(a)
        assert counts["unavailable_disk"] == 0 and counts["writes_dropped_remote"] >= 1
        metrics = generate_latest(registry_for(svc.server)).decode()
        assert f'kvtier_node_tier_unavailable_total{{tier="remote"}} {float(counts["unavailable_remote"])}' in metrics
        a.close()
    finally:
        svc.stop()


def test_a_redis_hit_is_kept_on_the_nodes_disk_and_serves_once_redis_is_gone(tmp_path, redis_factory):  # noqa: F811
    """As an embedded engine keeps a remote hit on its local disk: the service restarted with an
    emptied disk root serves from Redis, and writes what it promoted to its disk; restarted again
    with Redis stopped, it serves the same blocks from its disk, bit-exact."""
    redis, sock, root = redis_factory(), tmp_path / "n.sock", tmp_path / "disk"
    tiers = (disk(root), RedisTierConfig(url=redis.url()))

    def service() -> NodeThread:
        return NodeThread(sock, pool_bytes=8 * SLOT, slot_bytes=SLOT, tiers=tiers)

    svc = service()
    a = engine(sock)
    wait_for(lambda: tiers_open(a))
    store(a, [1, 2, 3])
    wait_for(lambda: tier_counts(a).get("written_remote", 0) == 3, what="3 Redis writes")
    a.close()
    svc.stop()
    shutil.rmtree(root)
    svc = service()
    a = engine(sock)
    wait_for(lambda: tiers_open(a))
    assert load(a, [1, 2, 3])[1:] == (3, [payload(i) for i in (1, 2, 3)])
    counts = tier_counts(a)
    assert counts["promoted_remote"] == 3 and counts["promoted_disk"] == 0
    wait_for(lambda: tier_counts(a)["written_disk"] == 3, what="the 3 Redis hits written to the node's disk")
    a.close()
    svc.stop()
    redis.stop()
    svc = service()
    try:
        a = engine(sock)
        wait_for(lambda: tiers_open(a))
        assert load(a, [1, 2, 3])[1:] == (3, [payload(i) for i in (1, 2, 3)])
        assert tier_counts(a)["promoted_disk"] == 3
        a.close()
    finally:
        svc.stop()


def test_a_record_another_writer_puts_into_the_disk_root_is_found_after_a_refresh(tmp_path, monkeypatch):
    """The service's tiers are refreshed as an embedded engine's are (every REFRESH_INTERVAL_S):
    a record another process wrote into the root after the namespace opened becomes a hit."""
    monkeypatch.setattr(stack_module, "REFRESH_INTERVAL_S", 0.2)
    sock, root = tmp_path / "n.sock", tmp_path / "disk"
    svc = NodeThread(sock, pool_bytes=8 * SLOT, slot_bytes=SLOT, tiers=(disk(root),))
    try:
        a = engine(sock)
        wait_for(lambda: tiers_open(a))
        assert a.leading_run([key(7)]) == 0
        other = open_tier(disk(root), model_name="toy", namespace=NS, namespace_json=NAMESPACE, payload_bytes=SLOT)
        assert other.submit_write(1, key(7), key(6), 16, [memoryview(payload(7))])
        wait_for(lambda: [r.ok for r in other.poll()] == [True], what="the other writer's record")
        other.close()
        wait_for(lambda: a.leading_run([key(7)]) == 1, what="the service to find the record (a refresh)")
        assert load(a, [7])[1:] == (1, [payload(7)])
        a.close()
    finally:
        svc.stop()


def test_a_commit_larger_than_the_node_disk_turns_it_over_and_counts_its_evictions(tmp_path):
    """8 blocks committed at once to a service whose disk tier holds 4: the tier takes what fits
    beside its writes in flight and the rest wait in the pool, so all 8 are written, 4 evicted,
    none dropped; the evictions show in the stats and on /metrics, as an embedded engine's do."""
    small = replace(disk(tmp_path / "disk"), capacity_bytes=4 * (HEADER_LEN + SLOT))
    svc = NodeThread(tmp_path / "n.sock", pool_bytes=16 * SLOT, slot_bytes=SLOT, tiers=(small,))
    try:
        a = engine(svc.sock)
        wait_for(lambda: tiers_open(a), what="the namespace's tiers to open")
        store(a, list(range(1, 9)))
        wait_for(lambda: tier_counts(a).get("written_disk", 0) == 8, what="8 disk writes")
        counts = tier_counts(a)
        assert counts["writes_dropped_disk"] == 0 and counts["evicted_disk"] == 4
        metrics = generate_latest(registry_for(svc.server)).decode()
        assert 'kvtier_node_tier_evicted_blocks_total{tier="disk"} 4.0' in metrics
        a.close()
    finally:
        svc.stop()


def test_a_block_committed_again_that_the_disk_holds_is_touched_there_not_evicted_first(tmp_path):
    """The disk (6 blocks) holds block 1, which the pool (4 slots) evicted; an engine commits block 1
    again: the cascade finds it on disk and touches it there, as an embedded engine touches a tier
    that holds a block it stores, so the disk's next eviction takes block 2, its least recently used."""
    # one writer thread: the disk's recency is the order its writes land in, the order of the commits
    small = replace(disk(tmp_path / "disk"), capacity_bytes=6 * (HEADER_LEN + SLOT), n_write_threads=1)
    svc = NodeThread(tmp_path / "n.sock", pool_bytes=4 * SLOT, slot_bytes=SLOT, tiers=(small,))
    try:
        a = engine(svc.sock)
        wait_for(lambda: tiers_open(a), what="the namespace's tiers to open")
        for ids, written in (([1, 2, 3, 4], 4), ([5, 6], 6), ([1], 6), ([7], 7)):
            store(a, ids)  # the pool evicts its least recently used blocks; the disk keeps 6
            wait_for(lambda n=written: tier_counts(a).get("written_disk", 0) == n, what=f"{written} disk writes")
        on_disk = {p.name.removesuffix(".bin") for p in (tmp_path / "disk").rglob("*.bin")}
        assert key(1).hex() in on_disk and key(2).hex() not in on_disk, sorted(on_disk)
        a.close()
    finally:
        svc.stop()


def test_after_a_sigkill_and_restart_on_the_same_disk_dir_lookups_are_disk_hits(tmp_path):
    sock, root = tmp_path / "n.sock", tmp_path / "disk"
    args = ("--pool-bytes", str(16 * SLOT), "--slot-bytes", str(SLOT), "--no-prefault", "--disk-dir", str(root),
            "--disk-size", "0.1")
    proc = start_node(sock, *args)
    try:
        a = engine(sock)
        wait_for(lambda: tiers_open(a))
        store(a, [1, 2, 3])
        wait_for(lambda: tier_counts(a).get("written_disk", 0) == 3, what="3 disk writes")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        port = free_port()
        proc = start_node(sock, *args, "--metrics-port", str(port))
        wait_for(lambda: attached(a), what="the engine to reattach")  # its tiers may still be opening:
        assert a.client.stats()["blocks"] == 0  # a new, empty pool              # lookups then ask again
        retries, hits, data = load(a, [1, 2, 3])
        assert retries >= 1 and hits == 3 and data == [payload(i) for i in (1, 2, 3)]
        assert tier_counts(a)["promoted_disk"] == 3
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'kvtier_node_promoted_blocks_total{tier="disk"} 3.0' in metrics
        text = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "inspect", str(sock)], env=ENV,
                              capture_output=True, text=True, timeout=60).stdout
        assert "promoted_disk 3" in text, text
        a.close()
    finally:
        stop(proc)


def test_a_corrupt_record_is_a_counted_miss(tmp_path):
    sock, root = tmp_path / "n.sock", tmp_path / "disk"
    svc = NodeThread(sock, pool_bytes=8 * SLOT, slot_bytes=SLOT, tiers=(disk(root),))
    a = engine(sock)
    wait_for(lambda: tiers_open(a))
    store(a, [1, 2])
    wait_for(lambda: tier_counts(a).get("written_disk", 0) == 2)
    a.close()
    svc.stop()
    files = [p for p in root.rglob("*") if p.is_file() and key(2).hex() in p.name]
    assert len(files) == 1
    raw = bytearray(files[0].read_bytes())
    raw[-100] ^= 0xFF  # a flipped payload byte: the checksum no longer matches
    files[0].write_bytes(bytes(raw))
    svc = NodeThread(sock, pool_bytes=8 * SLOT, slot_bytes=SLOT, tiers=(disk(root),))
    try:
        a = engine(sock)
        wait_for(lambda: tiers_open(a))
        retries, hits, data = load(a, [1, 2])
        assert hits == 1 and data == [payload(1)]  # block 2 is a miss, never wrong bytes
        counts = tier_counts(a)
        assert counts["checksum_failures"] == 1 and counts["promotion_failures"] == 1
        assert load(a, [1, 2])[1] == 1 and a.leading_run([key(1), key(2)]) == 1  # quarantined: gone below
        a.close()
    finally:
        svc.stop()


def test_with_a_fleet_key_records_are_sealed_and_others_are_counted_misses(tmp_path):
    """The service's tiers under a fleet key: what it writes is signed (encrypted here); a record
    re-signed with an attacker's key, or rewritten as a plain record, is an unauthenticated miss."""
    sock, root = tmp_path / "n.sock", tmp_path / "disk"
    fleet = AuthConfig(FleetKey(bytes(range(32)), "fleet"), encrypt=True)
    sealed = replace(disk(root), auth=fleet)
    svc = NodeThread(sock, pool_bytes=8 * SLOT, slot_bytes=SLOT, tiers=(sealed,))
    a = engine(sock)
    wait_for(lambda: tiers_open(a))
    store(a, [1, 2, 3])
    wait_for(lambda: tier_counts(a).get("written_disk", 0) == 3)
    a.close()
    svc.stop()
    files = {i: next(p for p in root.rglob("*.bin") if key(i).hex() in p.name) for i in (1, 2, 3)}
    raws = {i: f.read_bytes() for i, f in files.items()}
    assert all(payload(i) not in raws[i] for i in raws), "encrypted at rest: the payload is not in the record"
    header = decode_header(raws[1])
    attacker, plain = Sealer(AuthConfig(FleetKey(bytes(range(7, 39)), "attacker"))), PLAIN
    for i, sealer in ((2, attacker), (3, plain)):  # valid checksums, the right namespace and key
        head, body = sealer.seal(namespace=header.namespace, key=key(i), parent=key(i - 1), num_tokens=16,
                                 source=memoryview(payload(9)))
        files[i].write_bytes(head + bytes(body))
    svc = NodeThread(sock, pool_bytes=8 * SLOT, slot_bytes=SLOT, tiers=(sealed,))
    try:
        a = engine(sock)
        wait_for(lambda: tiers_open(a))
        assert load(a, [1])[1:] == (1, [payload(1)])  # its own record: read, decrypted, bit-exact
        assert load(a, [2])[1] == 0 and load(a, [3])[1] == 0
        assert tier_counts(a)["auth_failures"] == 2
        a.close()
    finally:
        svc.stop()


@pytest.mark.parametrize(("flags", "message"), [
    (["--encrypt"], "needs a fleet key"),
    (["--fleet-key-env", "KVTIER_TEST_UNSET_KEY", "--disk-dir", "D", "--disk-size", "1"], "--fleet-key-env"),
    (["--fleet-key-env", "KVTIER_TEST_NODE_KEY"], "--disk-dir"),
    (["--fleet-key-file", "D/missing", "--disk-dir", "D", "--disk-size", "1"], "'--fleet-key-file' = "),
    (["--fleet-key-env", "KVTIER_TEST_NODE_KEY", "--fleet-key-file", "D/k", "--disk-dir", "D", "--disk-size", "1"],
     "keep one"),
])
def test_fleet_key_flags_are_checked_at_start_up(tmp_path, flags, message):
    flags = [f.replace("D", str(tmp_path / "d"), 1) if f.startswith("D") else f for f in flags]
    done = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "node", "--socket", str(tmp_path / "n.sock"),
                           "--pool-bytes", "1MiB", *flags], capture_output=True, text=True, timeout=60,
                          env={**ENV, "KVTIER_TEST_NODE_KEY": bytes(range(32)).hex()})
    assert done.returncode != 0 and message in done.stderr and "kv_connector_extra_config" not in done.stderr, \
        done.stderr
    assert not (tmp_path / "n.sock").exists()


def test_commits_made_while_the_tiers_open_are_cascaded_once_they_are_open(tmp_path, monkeypatch):
    gate = threading.Event()
    real_open = tiers_module.open_tier

    def slow_open(config, **kwargs):  # a disk scan that takes a while
        assert gate.wait(60.0), "the test never opened the gate"
        return real_open(config, **kwargs)

    monkeypatch.setattr(tiers_module, "open_tier", slow_open)
    svc = NodeThread(tmp_path / "n.sock", pool_bytes=8 * SLOT, slot_bytes=SLOT, tiers=(disk(tmp_path / "disk"),))
    try:
        a = engine(svc.sock)
        store(a, [1, 2])
        assert not tiers_open(a) and tier_counts(a).get("written_disk", 0) == 0
        gate.set()
        wait_for(lambda: tier_counts(a).get("written_disk", 0) == 2, what="the 2 early commits written to disk")
        assert a.client.stats()["pinned_blocks"] == 0
        a.close()
    finally:
        gate.set()
        svc.stop()


def test_a_tier_that_cannot_open_leaves_the_others_serving(tmp_path, monkeypatch):
    """A namespace's Redis tier fails to open (here: a user whose ACL refuses the namespace's keys);
    its disk tier opens and serves, as each of vLLM's offloading tiers opens on its own."""
    real_open = tiers_module.open_tier

    def redis_refuses(config, **kwargs):
        if isinstance(config, RedisTierConfig):
            raise ConfigError("NOPERM this user has no permissions to access one of the keys")
        return real_open(config, **kwargs)

    monkeypatch.setattr(tiers_module, "open_tier", redis_refuses)
    redis = RedisTierConfig(url=f"redis://127.0.0.1:{free_port()}")
    svc = NodeThread(tmp_path / "n.sock", pool_bytes=8 * SLOT, slot_bytes=SLOT, tiers=(disk(tmp_path / "disk"), redis))
    try:
        a = engine(svc.sock)
        wait_for(lambda: tiers_open(a), what="the namespace's tiers to open")
        counts = tier_counts(a)
        assert counts["tiers_failed"] == 1 and list(next(iter(counts["namespaces"].values()))["tiers"]) == ["disk"]
        store(a, [1, 2])
        wait_for(lambda: tier_counts(a).get("written_disk", 0) == 2, what="the 2 commits written to disk")
        a.close()
    finally:
        svc.stop()


@pytest.mark.parametrize(("wait_s", "answer"), [(30.0, AcquireStatus.RETRY), (0.0, AcquireStatus.READY)])
def test_lookups_ask_again_while_the_tiers_open_for_open_wait_s_at_most(tmp_path, redis_factory, monkeypatch,  # noqa: F811
                                                                       wait_s, answer):
    """While a namespace's tiers open (here: a Redis server that does not answer, asked by the tier's
    constructor), a lookup that misses in the pool is told to ask again for OPEN_WAIT_S at most: the
    one rule of kvtier.tiers.factory, which vLLM's offloading follows too
    (tests/test_native_shapes.py); then it is a miss (READY, nothing held)."""
    monkeypatch.setattr(factory, "OPEN_WAIT_S", wait_s)
    server = redis_factory()
    redis = RedisTierConfig(url=server.url(), connect_timeout_s=3.0, timeout_s=3.0)
    server.pause()
    svc = NodeThread(tmp_path / "n.sock", pool_bytes=8 * SLOT, slot_bytes=SLOT, tiers=(redis,))
    try:
        a = engine(svc.sock)
        got = a.acquire("r", [key(1)], key(0), 16)
        assert not tiers_open(a)  # still opening when it answered
        assert got.status is answer and got.num_blocks == 0
        a.release("r")
        server.resume()
        wait_for(lambda: tiers_open(a), what="the namespace's tiers to open")
        a.close()
    finally:
        server.resume()
        svc.stop()


class _GatedDisk(DiskTier):
    """A real disk tier whose reads wait for a gate (a stuck device)."""

    gate = threading.Event()

    def _read_job(self, job_id, key, gen, views):
        assert self.gate.wait(60.0), "the test never opened the gate"
        return super()._read_job(job_id, key, gen, views)


def test_the_loop_answers_while_a_read_is_stuck(tmp_path, monkeypatch):
    def gated_open(config, *, model_name, namespace, namespace_json, payload_bytes):
        return _GatedDisk(root_dir=config.root_dir, model_name=model_name, engine_digest=namespace.engine_digest,
                          rank_digests=namespace.rank_digests(), namespace_json=namespace_json,
                          payload_bytes=payload_bytes, capacity_bytes=config.capacity_bytes, n_read_threads=1,
                          n_write_threads=1, max_pending_writes=8)

    monkeypatch.setattr(tiers_module, "open_tier", gated_open)
    _GatedDisk.gate = threading.Event()
    svc = NodeThread(tmp_path / "n.sock", pool_bytes=4 * SLOT, slot_bytes=SLOT, tiers=(disk(tmp_path / "d"),))
    try:
        a, b = engine(svc.sock, "A"), engine(svc.sock, "B")
        wait_for(lambda: tiers_open(a))
        store(a, [1])
        wait_for(lambda: tier_counts(a).get("written_disk", 0) == 1)
        store(a, [2, 3, 4, 5])  # evicts 1
        wait_for(lambda: not tier_counts(a)["writes_in_flight"])
        assert a.acquire("r", [key(1)]).status is AcquireStatus.RETRY  # its read is stuck
        started = time.monotonic()
        assert b.client.lookup([key(5)]).hits == 1  # another engine is answered meanwhile
        assert a.acquire("r", [key(1)]).status is AcquireStatus.RETRY
        assert time.monotonic() - started < 1.0
        assert tier_counts(b)["promotions_in_flight"] == 1
        _GatedDisk.gate.set()
        retries, hits, data = load(a, [1])
        assert hits == 1 and data == [payload(1)]
        a.close()
        b.close()
    finally:
        _GatedDisk.gate.set()
        svc.stop()


def test_an_attached_engine_still_refuses_its_own_secondary_tiers_and_says_where_they_go(tmp_path):
    with pytest.raises(ConfigError, match="kvtier node .*--disk-dir"):
        KVTierConfig.from_extra_config({"node": str(tmp_path / "n.sock"), "cpu_bytes_to_use": 10**9,
                                 "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "d"),
                                                      "capacity_bytes": 10**9}]})


def test_a_hello_with_a_malformed_namespace_is_refused_naming_the_field(tmp_path):
    svc = NodeThread(tmp_path / "n.sock", pool_bytes=4 * SLOT, slot_bytes=SLOT, tiers=(disk(tmp_path / "d"),))
    try:
        bad = json.dumps({**json.loads(NAMESPACE), "ranks": ["short"]})
        with pytest.raises(ConfigError, match="'namespace' is not a namespace description"):
            connect_node(str(svc.sock), engine="A", role=Role.SCHEDULER, slot_bytes=SLOT, namespace=bad)
    finally:
        svc.stop()
