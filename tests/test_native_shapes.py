"""kvtier_disk and kvtier_redis behind vLLM 0.32's real TieringOffloadingManager at the shapes GPUs
run (tests/support/native_rig.py; real files, a real redis-server): a step that cascades hundreds of
chunks at once is kept whole, a record that cannot be read costs one miss and is not offered again,
a prefix that stays hot in vLLM's CPU tier stays recent in kvtier's tiers, and start-up neither
waits on a tier nor starts with a configuration that can never work.

On GPUs vLLM's block is 16 tokens and the README's example sets no offload block_size, so one chunk
is one block: an 8k-token prefill step hands a tier ~512 chunks, a 100k-token context ~6,250.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from support.native_rig import NativeRig, native_env, prompt  # noqa: F401  (pytest fixture)
from support.redis_server import redis_factory  # noqa: F401  (pytest fixture)
from support.store_files import record_files
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from kvtier.core.values import ConfigError
from kvtier.tiers.disk.owners import OWNER_FILE, Owner, mark_owned, orphans, reclaim_orphans

LONG = 600  # chunks in one store job: more than either tier's bound on writes in flight (8 here)


@pytest.fixture
def model(native_env):  # noqa: F811
    return native_env


def disk(root, **more) -> dict:
    return {"type": "kvtier_disk", "root_dir": str(root), "capacity_bytes": 10**9, "max_pending_writes": 8, **more}


def redis(server, **more) -> dict:
    return {"type": "kvtier_redis", "url": server.url(), "timeout_s": 2, "connect_timeout_s": 0.5,
            "max_pending_writes": 8, **more}


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_a_long_prompt_is_kept_whole(tmp_path, model, redis_factory, kind):  # noqa: F811
    """One cascade of 600 chunks (a 9.6k-token prefill in 16-token chunks) against a tier that
    takes 8 writes at a time: every chunk is stored, the job succeeds (so vLLM's backpressure
    detector sees its real duration), and a fresh engine is served all of them."""
    tier = disk(tmp_path / "root") if kind == "disk" else redis(redis_factory())
    first = NativeRig(model, [tier], num_chunks=LONG + 16)
    keys, rows = first.store_prompt(1, LONG)
    store = first.tiers[0]._store
    assert store.counts["stores_dropped"] == 0 and store.counts["store_errors"] == 0
    assert first.manager._metrics is not None
    first.close()

    second = NativeRig(model, [tier], num_chunks=LONG + 16)  # a restart: vLLM's CPU tier empty
    assert second.fetch(keys) == second.stored_part(rows)
    second.close()


def test_a_job_whose_tier_takes_no_writes_fails_at_once(tmp_path, model, redis_factory):  # noqa: F811
    """Chunks waiting for room are not kept forever: a server that goes away fails them (a future
    miss each, counted), and the job is reported."""
    server = redis_factory()
    rig = NativeRig(model, [redis(server)], num_chunks=LONG + 16)
    server.kill()
    keys = rig.keys(prompt(2, 64))
    context = ReqContext(req_id="down")
    rig.manager.on_new_request(context)
    out = rig.manager.prepare_store(keys, context)
    rig.manager.complete_store(out.keys_to_store, context)
    rig.manager.on_request_finished(context)
    rig.settle(timeout=60)  # every job reported
    store = rig.tiers[0]._store
    assert store.counts["stores_dropped"] + store.counts["store_errors"] > 0
    assert not store.busy
    rig.close()


def test_records_that_cannot_be_read_cost_one_miss_each(tmp_path, model):
    """A record replaced by a symlink, a directory or a truncated file (the fresh engine's index comes
    from the snapshot, so it believes them): each is one counted miss, then no longer offered, so a
    request never waits on it for more than a few steps."""
    root = tmp_path / "root"
    first = NativeRig(model, [disk(root)])
    keys, rows = first.store_prompt(3, 6)
    names = [first.tiers[0]._store.key_of(k).hex() for k in keys]
    first.close()
    files = {p.stem: p for p in record_files(root)}
    path = [files[name] for name in names]
    path[1].unlink()
    path[1].symlink_to(path[5])  # a valid record of another key, through a link
    path[2].unlink()
    path[2].mkdir()
    path[3].write_bytes(path[3].read_bytes()[:100])

    second = NativeRig(model, [disk(root)])
    found = second.fetch(keys)  # (settles once the disk reads land: more steps on a loaded machine)
    assert found[0] == second.stored_part(rows)[0] and found[1:] == [None] * 5
    store = second.tiers[0]._store
    assert store.counts["rejected"] >= 1  # the symlink, read first; the rest of the prefix waits behind it
    for key in keys[1:4]:  # no longer offered: asked again, each is a miss at once
        context = ReqContext(req_id=f"again-{key.hex()[:6]}")
        second.manager.on_new_request(context)
        assert second.manager.lookup(key, context) in (LookupResult.MISS, LookupResult.HIT)
        second.manager.on_request_finished(context)
    for key in keys[1:4]:
        second.fetch([key], max_steps=20)  # each settles in a few steps, HIT or MISS, never RETRY
    assert store.counts["rejected"] == 3  # each bad record failed once, and only once
    assert not path[1].is_symlink() and not path[2].exists()  # quarantined
    second.close()


def test_a_prefix_hot_in_vllms_cpu_tier_outlives_one_off_prefixes(tmp_path, model, redis_factory):  # noqa: F811
    """vLLM 0.32's connector never calls a tier's touch. A hot prefix (a system prompt) sits in vLLM's
    CPU tier and is never read from kvtier; one-off prefixes stream through a disk tier at capacity.
    The hot prefix survives (its chunks are offered again with every request that uses it: the tier
    asks for request-level offloading), and its Redis TTL starts again."""
    root = tmp_path / "root"
    server = redis_factory()
    probe = NativeRig(model, [disk(root)])
    record_bytes = (probe.payload_bytes + 4096) * 1  # header + payload, rounded up by the ledger's unit
    probe.close()
    capacity = 10 * record_bytes  # room for about 10 chunks; the stream below writes 40
    tiers = [disk(root, capacity_bytes=capacity), redis(server, ttl_seconds=60)]
    rig = NativeRig(model, tiers, num_chunks=64)
    hot = prompt(100, 2)
    hot_keys = rig.keys(hot)
    client = server.client()
    for i in range(20):
        keys = rig.keys(hot + prompt(200 + i, 2))
        assert keys[:2] == hot_keys
        rig.store(keys, [bytes([i % 256]) * rig.payload_bytes] * len(keys))
        if i == 0:
            redis_names = [n for n in client.keys("*") if b"config" not in n]
            hot_name = max(redis_names, key=client.ttl)  # any value: each was written with ttl 60
            client.expire(hot_name, 5)  # as if written long ago
    disk_tier = rig.tiers[0]._store.tier
    assert disk_tier.evictions > 10  # the stream went through a full tier
    hot_kvtier = [rig.tiers[0]._store.key_of(k) for k in hot_keys]
    assert all(disk_tier.contains(k) for k in hot_kvtier)
    assert rig.tiers[0]._store.counts["stores_held"] >= 19 * 2
    # Every Redis value the hot prefix owns was touched: its TTL started again (60 s, not 5 s).
    hot_redis = [rig.tiers[1]._store.key_of(k) for k in hot_keys]
    names = {n for n in client.keys("*") if any(k.hex() in n.decode(errors="replace") for k in hot_redis)}
    assert names and all(client.ttl(n) > 30 for n in names)
    rig.close()
    fresh = NativeRig(model, [disk(root, capacity_bytes=capacity)])
    assert all(row is not None for row in fresh.fetch(hot_keys))
    fresh.close()


def test_start_up_stops_on_a_configuration_that_can_never_work(tmp_path, model, redis_factory):  # noqa: F811
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="root_dir"):
        NativeRig(model, [disk(blocker / "root")])
    server = redis_factory(password="right")
    with pytest.raises(ConfigError, match="refused the login"):
        NativeRig(model, [redis(server) | {"url": server.url(password="wrong")}])


def test_an_unreachable_server_starts_with_misses(tmp_path, model, redis_factory):  # noqa: F811
    server = redis_factory()
    url_tier = redis(server)
    server.kill()
    rig = NativeRig(model, [url_tier])
    keys = rig.keys(prompt(4, 2))
    assert rig.fetch(keys, max_steps=5) == [None, None]
    rig.close()


def test_start_up_waits_on_a_tier_that_is_not_open_for_a_few_seconds_at_most(tmp_path, model, monkeypatch):
    """vLLM builds its tiers before it sets the block-hash seed, and a tier opens only then (a disk
    root without a snapshot is scanned, a server connected). Meanwhile lookups answer "ask again"
    (a fresh engine's first requests can still be served from the tier), for OPEN_WAIT_S at most
    (kvtier.tiers.factory's, the node service's too): then misses, so a hung mount or server never
    keeps requests waiting."""
    from support.native_rig import chunk_keys, offloading_config
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from kvtier.tiers import factory

    (key,) = chunk_keys(prompt(5, 1))
    for wait_s, answer in ((30.0, LookupResult.RETRY), (0.0, LookupResult.MISS)):
        monkeypatch.setattr(factory, "OPEN_WAIT_S", wait_s)
        spec = TieringOffloadingSpec(offloading_config(model, [disk(tmp_path / "root")], engine_id=f"e{wait_s}"))
        manager = spec.get_manager()
        (tier,) = manager.secondary_tiers
        assert tier._store is None  # no seed set since the tier was made: not open
        context = ReqContext(req_id="early")
        manager.on_new_request(context)
        assert manager.lookup(key, context) is answer
        manager.on_request_finished(context)
        manager.shutdown()


def test_a_private_namespace_of_a_killed_process_is_reclaimed(tmp_path, model):
    """The namespace of an engine with a per-process hash seed names its owner; once that process is
    gone (SIGKILL: no shutdown, no exit hook) whoever opens the root next removes it."""
    root = tmp_path / "root"
    rig = NativeRig(model, [disk(root)], hash_algo="xxhash")
    rig.store_prompt(6, 2)
    (ns_dir,) = [p for p in root.iterdir() if (p / "config.json").exists()]
    assert (ns_dir / OWNER_FILE).exists()
    assert orphans(root) == []  # this process is alive
    rig.close()
    assert not ns_dir.exists()  # a clean shutdown removes it at once

    # A process that dies by SIGKILL after marking its namespace:
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead_ns = root / "model_0123456789abcdef"
    (dead_ns.parent / f"{dead_ns.name}_r0" / "abc").mkdir(parents=True)
    (dead_ns / "config.json").parent.mkdir(parents=True, exist_ok=True)
    (dead_ns / "config.json").write_text("{}")
    me = Owner.this_process()
    mark_owned(dead_ns, Owner(host=me.host, boot=me.boot, pid=victim.pid, started=_start_of(victim.pid)))
    assert orphans(root) == []
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert orphans(root) == [dead_ns]
    shared = NativeRig(model, [disk(root)])  # another engine opens the root
    assert not dead_ns.exists() and not (root / f"{dead_ns.name}_r0").exists()
    assert reclaim_orphans(root) == []
    shared.close()


def _start_of(pid: int) -> str:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]
        except OSError:
            time.sleep(0.01)
    raise AssertionError("no /proc entry")
