"""The S3 tier in every way in, without an engine, against the session's real SeaweedFS
(tests/support/seaweed.py): below the disk tier of an embedded orchestrator (an S3 hit promoted into
the host tier and kept on the local disk, the tier's counters under ``s3``); as ``kvtier_s3``
behind vLLM's own TieringOffloadingManager (tests/support/native_rig.py: a second engine served
what the first stored); in the node service (an S3 hit kept on the node's disk; ``kvtier node
--s3-url`` refused credentials stop it naming the flag); and ``kvtier inspect / verify / purge`` and
``kvtier doctor`` on the tier's prefix. Real engines: tests/e2e/test_s3_e2e.py."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import obstore
from click.testing import CliRunner
from support.native_rig import NativeRig, native_env  # noqa: F401  (pytest fixture)
from support.node_service import NodeThread
from support.redis_server import free_port
from support.seaweed import REGION, SECRET_KEY, s3, seaweed  # noqa: F401  (pytest fixtures)
from test_node_service import ENV, stop
from test_node_tiers import disk, engine, load, payload, store, tier_counts, tiers_open, wait_for
from test_orchestrator import NS, SLOT, keys, settle
from test_orchestrator import store as store_blocks

from kvtier.cli.main import main
from kvtier.core.tier_config import S3TierConfig, TierType, parse_tier
from kvtier.doctor.audit import audit
from kvtier.policy.admission import StoreAdmission
from kvtier.runtime.orchestrator import AcquireStatus, BlockInfo, HostBytes, Orchestrator
from kvtier.tiers.base import Medium
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostIndex
from kvtier.tiers.s3 import S3Tier


def s3_config(server, prefix: str, **more) -> S3TierConfig:
    raw = {k: v for k, v in server.tier(prefix, list_interval_s=0.5, **more).items() if k != "type"}
    config = parse_tier(raw, TierType.S3, "secondary_tiers[1]")
    assert isinstance(config, S3TierConfig)
    return config


def embedded(tmp_path: Path, config: S3TierConfig, num_slots: int = 4) -> tuple[Orchestrator, list[bytearray]]:
    buffers = [bytearray(SLOT * num_slots)]
    disk_tier = DiskTier(root_dir=tmp_path, model_name="toy", engine_digest=NS.digest,
                         rank_digests=NS.rank_digests(), namespace_json=NS.config_json("toy"), payload_bytes=SLOT,
                         capacity_bytes=10**8, n_read_threads=2, n_write_threads=2, max_pending_writes=64)
    s3_tier = S3Tier(config, model_name="toy", engine_digest=NS.digest, rank_digests=NS.rank_digests(),
                     namespace_json=NS.config_json("toy"), payload_bytes=SLOT)
    orch = Orchestrator(HostIndex(num_slots), HostBytes([memoryview(b) for b in buffers], SLOT), [disk_tier, s3_tier],
                        StoreAdmission(0, 100))
    return orch, buffers


def test_embedded_s3_below_disk_serves_a_fresh_engine_and_keeps_its_hits_on_disk(s3, tmp_path):
    prefix = f"embedded-{os.urandom(4).hex()}"
    first, buffers = embedded(tmp_path / "a", s3_config(s3, prefix))
    blocks = keys(3, seed=5)
    store_blocks(first, buffers, blocks)
    settle(first)
    written = first.take_stats()
    assert written.host_to_s3.jobs == 3 and written.host_to_disk.jobs == 3 and written.s3_writes_dropped == 0
    expected = [bytes(buffers[0][s * SLOT:(s + 1) * SLOT]) for s in range(3)]
    first.close()
    # A fresh engine with an empty disk: the blocks come from S3 (after one "ask again"), bit-exact,
    # and are written to its disk on the way (a remote hit kept on the local disk).
    second, buffers = embedded(tmp_path / "b", s3_config(s3, prefix))
    deadline = time.monotonic() + 60
    while (got := second.acquire("r", blocks, NS.digest, 4)).status is not AcquireStatus.READY:  # the chain: kept
        assert time.monotonic() < deadline, "the promotion never finished"
        time.sleep(0.005)
    assert got.num_blocks == 3 and got.promoted == {Medium.S3: 3}
    assert [bytes(buffers[0][s * SLOT:(s + 1) * SLOT]) for s in second.slots_of(blocks)] == expected
    second.release("r")
    settle(second)
    stats = second.take_stats()
    assert stats.s3_to_host.jobs == 3 and stats.host_to_disk.jobs == 3
    assert stats.s3_used_bytes is not None and stats.s3_capacity_bytes == 0
    assert second.media_of(blocks[0]) == [Medium.HOST, Medium.DISK, Medium.S3]
    second.close()


def test_tails_stay_off_s3_and_a_reset_deletes_nothing(s3, tmp_path):
    """A tail (partial block) goes to the local disk, never to the shared store (a lookup there would
    probe every tail length); one engine's reset empties its host tier and deletes nothing from the
    secondary tiers (the engine moves to a new key epoch instead), the fleet's S3 prefix least of all."""
    prefix = f"tails-{os.urandom(4).hex()}"
    orch, buffers = embedded(tmp_path, s3_config(s3, prefix))
    block, tail = keys(2, seed=8)
    assert orch.begin_store(block, BlockInfo(NS.digest, 4)) is not None
    assert orch.begin_store(tail, BlockInfo(block, 2, tail=True)) is not None
    orch.finish_store([block, tail], ok=True)
    settle(orch)
    stats = orch.take_stats()
    assert stats.host_to_disk.jobs == 2 and stats.host_to_s3.jobs == 1
    stored = {p for p in s3.objects(prefix + "/") if p.endswith(".bin")}
    assert len(stored) == 1
    orch.clear()  # vLLM's reset_prefix_cache(reset_connector=True)
    settle(orch)
    assert orch.host.used_slots == 0 and orch.disk.contains(block) and orch.disk.contains(tail)
    orch.close()
    assert {p for p in s3.objects(prefix + "/") if p.endswith(".bin")} == stored


def test_kvtier_s3_behind_vllms_offloading_serves_a_second_engine(native_env, s3):  # noqa: F811
    entry = {"type": "kvtier_s3", **{k: v for k, v in s3.tier(f"native-{os.urandom(4).hex()}",
                                                             list_interval_s=0.5).items() if k != "type"}}
    first = NativeRig(native_env, [entry])
    keys_, rows = first.store_prompt(1, 3)
    first.close()
    second = NativeRig(native_env, [entry])
    assert second.fetch(keys_) == second.stored_part(rows)
    store = second.tiers[0]._store
    assert store.tier.stats.reads_ok == 3 and store.tier.medium is Medium.S3
    second.close()
    prefix = entry["url"].split("/", 3)[3]
    runner = CliRunner()
    common = ["--endpoint", s3.endpoint, "--region", REGION]
    inspected = runner.invoke(main, ["inspect", entry["url"], "--json", *common])
    assert inspected.exit_code == 0, inspected.output
    (space,) = json.loads(inspected.output)["namespaces"]
    assert space["model_name"] == str(native_env) and space["complete_blocks"] == 3
    # a damaged object: verify finds and deletes it, and only it
    objects = sorted(p for p in s3.objects(prefix + "/") if p.endswith(".bin"))
    obstore.put(s3.store(), objects[0], b"not a block", use_multipart=False)
    verified = runner.invoke(main, ["verify", entry["url"], "--json", *common])
    assert verified.exit_code == 1, verified.output
    report = json.loads(verified.output)
    assert report["files_ok"] == 2 and [p["path"] for p in report["problems"]] == [objects[0]]
    assert objects[0] not in s3.objects(prefix + "/")
    dry = runner.invoke(main, ["purge", entry["url"], "--all", "--dry-run", *common])
    assert dry.exit_code == 0 and "would remove 2 blocks" in dry.output, dry.output
    purged = runner.invoke(main, ["purge", entry["url"], "--all", *common])
    assert purged.exit_code == 0, purged.output
    assert s3.objects(prefix + "/") == {}


def test_the_node_service_keeps_an_s3_hit_on_its_disk(s3, tmp_path):
    """As with Redis (tests/test_node_tiers.py): the service restarted with an emptied disk root serves
    from S3 and writes what it promoted to its disk."""
    sock, root = tmp_path / "n.sock", tmp_path / "disk"
    tiers = (disk(root), s3_config(s3, f"node-{os.urandom(4).hex()}"))

    def service() -> NodeThread:
        return NodeThread(sock, pool_bytes=8 * 4096, slot_bytes=4096, tiers=tiers)

    svc = service()
    a = engine(sock)
    wait_for(lambda: tiers_open(a))
    store(a, [1, 2, 3])
    wait_for(lambda: tier_counts(a).get("written_s3", 0) == 3, what="3 S3 writes")
    a.close()
    svc.stop()
    shutil.rmtree(root)
    svc = service()
    try:
        a = engine(sock)
        wait_for(lambda: tiers_open(a))
        assert load(a, [1, 2, 3])[1:] == (3, [payload(i) for i in (1, 2, 3)])
        counts = tier_counts(a)
        assert counts["promoted_s3"] == 3 and counts["promoted_disk"] == 0
        wait_for(lambda: tier_counts(a)["written_disk"] == 3, what="the 3 S3 hits written to the node's disk")
        a.close()
    finally:
        svc.stop()


def test_kvtier_node_starts_with_s3_flags_and_refuses_credentials_naming_the_flag(s3, tmp_path):
    flags = ("--pool-bytes", "1M", "--s3-url", f"s3://{s3.bucket}/node-flags", "--s3-endpoint", s3.endpoint,
             "--s3-region", REGION, "--s3-size", "1")
    env = {**ENV, "AWS_ACCESS_KEY_ID": os.environ["AWS_ACCESS_KEY_ID"], "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    proc = start_node_with(tmp_path / "ok.sock", env, *flags)
    try:
        wait_for(lambda: (tmp_path / "ok.sock").exists() or proc.poll() is not None, what="the service's socket")
        assert proc.poll() is None, proc.communicate()[1]
    finally:
        stop(proc)
    proc = start_node_with(tmp_path / "n.sock", {**env, "AWS_SECRET_ACCESS_KEY": "wrong-secret"}, *flags)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "--s3-url" in err and "AWS_ACCESS_KEY_ID" in err and "wrong-secret" not in err + out, err
    bad_size = start_node_with(tmp_path / "s.sock", env, *flags[:-1], "0")
    assert bad_size.wait(60) != 0 and "--s3-size" in bad_size.communicate()[1]


def start_node_with(sock: Path, env: dict, *args: str):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "kvtier.cli.main", "node", "--socket", str(sock), *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def doctor_codes(tmp_path: Path, entry: dict, monkeypatch) -> dict[str, str]:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    model = str(Path(__file__).parent / "fixtures" / "model_configs" / "llama-3.1-70b.json")
    transfer = json.dumps({"kv_connector": "KVTierConnector", "kv_role": "kv_both",
                           "kv_connector_module_path": "kvtier.vllm",
                           "kv_connector_extra_config": {"cpu_bytes_to_use": 2**30, "secondary_tiers": [entry]}})
    line = ["vllm", "serve", model, "-tp", "4", "--max-model-len", "32768", "--kv-transfer-config", transfer]
    return {f.code: f.severity for f in audit(line)}


def test_doctor_probes_reach_credentials_permissions_and_latency(s3, tmp_path, monkeypatch):
    entry = s3.tier("doctor", timeout_s=2.0)
    found = doctor_codes(tmp_path, entry, monkeypatch)
    assert found["s3-ok"] == "info" and found["s3-unbounded"] == "warning"
    assert not {c for c in found if c.startswith("s3-")} - {"s3-ok", "s3-unbounded", "s3-slow"}
    assert "s3-unbounded" not in doctor_codes(tmp_path, {**entry, "capacity_bytes": 10**9}, monkeypatch)
    assert not [p for p in s3.objects("doctor/")], "the probe object was left behind"
    # a read-only identity: put and delete refused
    s3.add_identity("doctor-reader", "READONLYKEY0000001", "read-only-secret-1", "Read,List")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "READONLYKEY0000001")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "read-only-secret-1")
    assert doctor_codes(tmp_path, entry, monkeypatch)["s3-permissions"] == "error"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    assert doctor_codes(tmp_path, entry, monkeypatch)["s3-refused"] == "error"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    unreachable = {**entry, "endpoint": f"http://127.0.0.1:{free_port()}", "timeout_s": 0.5, "connect_timeout_s": 0.2}
    assert doctor_codes(tmp_path, unreachable, monkeypatch)["s3-unreachable"] == "warning"



def test_kv_events_announce_s3_blocks_as_storage_remote_beside_the_local_disk(s3, tmp_path):
    """KV events of kvtier's connector: a block in S3 is announced as vLLM announces its own object
    store's (medium STORAGE, locality REMOTE), apart from the disk tier's (STORAGE, LOCAL); a block
    deleted from S3 is announced removed from there only."""
    from test_kv_events import BLOCK, SLOT as EVENT_SLOT, make_request, translator
    from test_kv_events import NS as EVENT_NS
    from test_kv_events import store_blocks as store_event_blocks
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from kvtier.core.keys import chain_block_keys

    disk_tier = DiskTier(root_dir=tmp_path, model_name="toy", engine_digest=EVENT_NS.digest,
                         rank_digests=[EVENT_NS.for_rank(0).digest], namespace_json=EVENT_NS.config_json("toy"),
                         payload_bytes=EVENT_SLOT, capacity_bytes=10**7, n_read_threads=1, n_write_threads=1,
                         max_pending_writes=16)
    s3_tier = S3Tier(s3_config(s3, f"events-{os.urandom(4).hex()}"), model_name="toy",
                     engine_digest=EVENT_NS.digest, rank_digests=[EVENT_NS.for_rank(0).digest],
                     namespace_json=EVENT_NS.config_json("toy"), payload_bytes=EVENT_SLOT)
    orch = Orchestrator(HostIndex(8), HostBytes([memoryview(bytearray(EVENT_SLOT * 8))], EVENT_SLOT),
                        [disk_tier, s3_tier], StoreAdmission(0, 10))
    events = translator(orch, self_describing=False)
    tokens = list(range(300, 300 + 2 * BLOCK + 1))
    request = make_request("s3", tokens)
    blocks = chain_block_keys(EVENT_NS.digest, tokens[: 2 * BLOCK], BLOCK)
    store_event_blocks(orch, blocks)
    events.learn(request, enumerate(blocks))
    settle(orch)
    got = events.take_events()
    where = sorted({(e.medium, e.locality) for e in got})
    assert where == [("CPU", "LOCAL"), ("STORAGE", "LOCAL"), ("STORAGE", "REMOTE")], where
    assert all(isinstance(e, BlockStored) for e in got) and len(got) == 6
    assert s3_tier.delete([blocks[0]]) == 1
    removed = events.take_events()
    assert [(type(e), e.medium, e.locality) for e in removed] == [(BlockRemoved, "STORAGE", "REMOTE")]
    orch.close()
