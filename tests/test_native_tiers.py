"""kvtier_disk behind vLLM's own TieringOffloadingManager (vLLM 0.32's real manager, CPU tier and
tier factory; real files), without an engine: see tests/support/native_rig.py.

What a native tier must do (vLLM's tiering/base.py): answer lookups from memory, store and load
rows on its own threads, report each job once, fail a chunk rather than serve wrong bytes, keep the
namespace (model, layout, hash seed) apart, stay within capacity_bytes with several engines on one
root, and leave records kvtier's operator tools read.
"""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
from click.testing import CliRunner
from support.native_rig import NativeRig, make_model, native_env, payload_of, prompt  # noqa: F401 (fixture)
from support.store_files import record_files

from kvtier.cli.main import main
from kvtier.core.keys import Namespace
from kvtier.core.tier_config import TierType
from kvtier.core.values import ConfigError
from kvtier.runtime.chunks.store import chunk_key


@pytest.fixture
def model(native_env):  # noqa: F811
    return native_env


def disk(root, **more) -> dict:
    return {"type": "kvtier_disk", "root_dir": str(root), "capacity_bytes": 10**8, **more}


def test_a_fresh_engine_reads_what_another_stored_and_the_records_are_kvtiers(tmp_path, model):
    root = tmp_path / "root"
    first = NativeRig(model, [disk(root)])
    keys, rows = first.store_prompt(1, 4)
    first.close()
    assert len(record_files(root)) == 4  # one record per chunk (one rank)

    second = NativeRig(model, [disk(root)])  # a restart: a new process, vLLM's CPU tier empty
    assert second.fetch(keys) == second.stored_part(rows)
    assert second.tiers[0]._store.counts == {}
    second.close()

    # kvtier's own namespace: config.json parses, every record's header carries its rank digest.
    (ns_dir,) = [p for p in root.iterdir() if (p / "config.json").exists()]
    config = json.loads((ns_dir / "config.json").read_text())
    ns = Namespace.from_dict(config)
    assert config["vllm_offloading"]["algorithm"] == "sha256" and config["vllm_offloading"]["seed"] == "fixed"
    assert ns_dir.name.endswith(ns.engine_digest.hex()[:16])
    pages = json.loads(ns.page.pages)
    assert pages["hash"]["seed_digest"] == config["vllm_offloading"]["seed_digest"]
    assert "vllm-none-hash" not in (ns_dir / "config.json").read_text()  # never the seed itself
    key = chunk_key(ns.engine_digest, keys[0])
    assert (ns_dir.parent / f"{ns_dir.name}_r0" / key.hex()[:3] / f"{key.hex()[3:5]}_g0" / f"{key.hex()}.bin").exists()


def test_a_running_engine_finds_what_another_stored_since_at_the_cores_refresh(tmp_path, model, monkeypatch):
    """Two engines on one root at once: what the second stores after the first opened is found by
    the first at its next refresh, every REFRESH_INTERVAL_S: the core's one period
    (kvtier.tiers.stack.RefreshClock), which kvtier's connector and the node service follow too."""
    from kvtier.tiers import stack

    monkeypatch.setattr(stack, "REFRESH_INTERVAL_S", 0.2)
    root = tmp_path / "root"
    first, second = NativeRig(model, [disk(root)]), NativeRig(model, [disk(root)])
    keys, rows = second.store_prompt(7, 2)
    deadline = time.monotonic() + 30
    while (found := first.fetch(keys)) == [None, None]:  # each fetch ends with steps (polls: refreshes)
        assert time.monotonic() < deadline, "the first engine never found the second's records"
        time.sleep(0.05)
    assert found == first.stored_part(rows)
    first.close()
    second.close()


def test_operator_tools_work_on_a_root_the_native_tier_wrote(tmp_path, model):
    root = tmp_path / "root"
    rig = NativeRig(model, [disk(root)])
    rig.store_prompt(2, 3)
    rig.close()
    runner = CliRunner()
    inspected = runner.invoke(main, ["inspect", str(root), "--json"])
    assert inspected.exit_code == 0, inspected.output
    (space,) = json.loads(inspected.output)["namespaces"]
    assert space["complete_blocks"] == 3 and space["model_name"] == str(model)
    assert space["layout"]["block_tokens"] == 32 and space["layout"]["backends"] == ["cpu", "auto"]
    verified = runner.invoke(main, ["verify", str(root)])
    assert verified.exit_code == 0 and "3" in verified.output, verified.output
    bad = record_files(root)[0]
    bad.write_bytes(bad.read_bytes()[:-1] + b"\x00")
    verified = runner.invoke(main, ["verify", str(root)])
    assert verified.exit_code != 0 and "1" in verified.output, verified.output
    line = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 2**30, "secondary_tiers": [disk(root)]}})
    doctor = runner.invoke(main, ["doctor", "--json", "--", "vllm", "serve", str(model), "--kv-transfer-config", line])
    (shared,) = [f for f in json.loads(doctor.output)["findings"] if f["code"] == "shared-root"]
    assert "32-token blocks" in shared["why"] and str(model) in shared["why"]
    purged = runner.invoke(main, ["purge", str(root), "--all"])
    assert purged.exit_code == 0, purged.output
    assert record_files(root) == []


def corrupt(path, how: str) -> None:
    data = path.read_bytes()
    if how == "flip":
        path.write_bytes(data[:-100] + bytes([data[-100] ^ 0x01]) + data[-99:])
    elif how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        path.write_bytes(b"")


def test_bad_records_are_counted_misses_never_bytes(tmp_path, model):
    root = tmp_path / "root"
    rig = NativeRig(model, [disk(root)])
    requests = [rig.keys(prompt(10 + i, 1)) for i in range(6)]  # six one-chunk requests
    rows = [payload_of(rig, i) for i in range(6)]
    for keys, row in zip(requests, rows):
        rig.store(keys, [row])
    store = rig.tiers[0]._store
    tier = store.tier
    for index, how in zip((0, 2, 4), ("flip", "truncate", "empty")):
        corrupt(tier.block_path(store.key_of(requests[index][0]), 0), how)
    rig.forget_cpu_tier()  # vLLM's CPU tier forgets: every chunk must come from disk
    for index, keys in enumerate(requests):
        found = rig.fetch(keys)
        if index in (0, 2, 4):
            assert found == [None], f"request {index}: a bad record was served"
        else:
            assert found == rig.stored_part([rows[index]])
    assert store.counts["rejected"] == 3
    assert len(list((root / "quarantine").glob("*.bin"))) == 3
    for index in (0, 2, 4):  # a failed chunk is not offered again
        assert rig.fetch(requests[index]) == [None]
    assert store.counts["rejected"] == 3
    rig.close()


def test_other_models_layouts_and_seeds_never_share_a_record(tmp_path, model):
    root = tmp_path / "root"
    base = NativeRig(model, [disk(root)])
    keys, _ = base.store_prompt(3, 2)
    base.close()

    twin = make_model(tmp_path / "runs" / "model", weights=b"weights-1")  # same config.json, other weights
    engines = {
        "fine-tuned twin": NativeRig(twin, [disk(root)]),
        "other engine block size": NativeRig(model, [disk(root)], worker_bytes_per_block=2048),
        "other KV bytes per block": NativeRig(model, [disk(root)], worker_bytes_per_block=8192),
        "two ranks": NativeRig(model, [disk(root)], world_size=2),
        "operator-named weights": NativeRig(model, [disk(root, model_identity="release-7")]),
    }
    try:
        for what, rig in engines.items():
            assert rig.fetch(keys) == [None, None], f"{what} loaded the base engine's records"
    finally:
        for rig in engines.values():
            rig.close()
    os.environ["PYTHONHASHSEED"] = "17"
    try:
        seeded = NativeRig(model, [disk(root)])
        assert seeded.fetch(keys) == [None, None], "an engine with another hash seed loaded the records"
        assert seeded.tiers[0].seed.kind.value == "pythonhashseed"
        seeded.close()
    finally:
        del os.environ["PYTHONHASHSEED"]
    configs = [json.loads(p.read_text()) for p in root.glob("*/config.json")]
    assert len(configs) == 7  # base, twin, 2048 and 8192 bytes, two ranks, operator-named, PYTHONHASHSEED
    assert len({c["vllm_offloading"]["seed_digest"] for c in configs}) == 2


def test_a_record_of_another_namespace_copied_in_is_rejected(tmp_path, model):
    root = tmp_path / "root"
    rig = NativeRig(model, [disk(root)])
    other = NativeRig(model, [disk(root, model_identity="other")])
    keys = rig.keys(prompt(4, 1))
    rig.store(keys, [payload_of(rig, 0)])
    other.store(keys, [payload_of(rig, 1)])
    mine = rig.tiers[0]._store
    theirs = other.tiers[0]._store
    # a valid record of the other namespace, under this namespace's file name
    mine.tier.block_path(mine.key_of(keys[0]), 0).write_bytes(
        theirs.tier.block_path(theirs.key_of(keys[0]), 0).read_bytes())
    rig.forget_cpu_tier()
    assert rig.fetch(keys) == [None]
    assert mine.counts["rejected"] == 1
    rig.close()
    other.close()


def test_capacity_holds_with_two_engines_writing_one_root(tmp_path, model):
    root = tmp_path / "root"
    probe = NativeRig(model, [disk(root)])
    record = probe.tiers[0].run.payload_bytes + 136
    probe.close()
    capacity = 10 * record
    engines = [NativeRig(model, [disk(root, capacity_bytes=capacity)]) for _ in range(2)]
    for round_ in range(4):
        for index, rig in enumerate(engines):
            rig.store_prompt(100 + 10 * round_ + index, 4)
            files = record_files(root)
            assert sum(p.stat().st_size for p in files) <= capacity, f"round {round_}: {len(files)} records"
    assert len(record_files(root)) >= 6  # the root is used, not emptied
    assert sum(rig.tiers[0]._store.tier.evictions for rig in engines) > 0
    for rig in engines:
        rig.close()


def test_a_random_hash_seed_is_said_at_start_up_and_leaves_nothing_behind(tmp_path, model, caplog):
    root = tmp_path / "root"
    with caplog.at_level(logging.WARNING, logger="kvtier.vllm.native.tiers"):
        rig = NativeRig(model, [disk(root)], hash_algo="xxhash")
    assert "cannot outlive this process or be shared" in caplog.text
    assert "PYTHONHASHSEED" in caplog.text
    keys, rows = rig.store_prompt(5, 2)
    rig.forget_cpu_tier()
    assert rig.fetch(keys) == rig.stored_part(rows)  # serves this process
    (config,) = [json.loads(p.read_text()) for p in root.glob("*/config.json")]
    assert config["vllm_offloading"]["seed"] == "random"
    rig.close()
    assert list(root.rglob("*.bin")) == [] and list(root.glob("*/config.json")) == []


def test_bad_tier_keys_stop_start_up_with_the_key_named(tmp_path, model):
    with pytest.raises(ConfigError, match="capacity_bytes"):
        NativeRig(model, [disk(tmp_path / "root", capacity_bytes="lots")])
    with pytest.raises(ConfigError, match="unknown key"):
        NativeRig(model, [disk(tmp_path / "root", rootdir="typo")])
    with pytest.raises(ConfigError, match="model_identity"):  # weights that cannot be read
        NativeRig(tmp_path / "no-such-model", [disk(tmp_path / "root")])
    assert TierType.FS.value == "fs"


def test_events_and_metrics_go_through_vllms_definitions(tmp_path, model):
    from vllm.v1.kv_offload.base import Medium

    from kvtier.vllm.native import metrics

    rig = NativeRig(model, [disk(tmp_path / "root")], kv_events=True)
    tier = rig.tiers[0]
    keys, _ = rig.store_prompt(6, 3)
    stored = [e for e in rig.manager.take_events() if e.ownership == "kvtier_disk"]
    assert [(e.medium, e.removed, sorted(e.keys)) for e in stored] == [(Medium.STORAGE, False, sorted(keys))]
    corrupt(tier._store.tier.block_path(tier._store.key_of(keys[1]), 0), "flip")
    rig.forget_cpu_tier()
    assert rig.fetch(keys)[1:] == [None, None]
    stats = tier.get_stats().reduce()
    assert stats[f"{metrics.FAILED_READS}:('kvtier_disk', 'rejected')"] == 1
    assert stats[f"{metrics.CAPACITY_BYTES}:('kvtier_disk',)"] == 10**8
    removed = [e for e in rig.manager.take_events() if e.ownership == "kvtier_disk"]
    assert [(e.removed, e.keys) for e in removed] == [(True, [keys[1]])]  # the quarantined record left
    assert set(metrics.definitions()) == set(type(tier).build_metric_definitions({}))
    rig.close()


def test_tier_types_resolve_by_plugin_and_by_module_path():
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    import kvtier.vllm.native as native
    from kvtier.vllm.native.plugin import register
    from kvtier.vllm.native.tiers import KVTierDiskTier, KVTierRedisTier

    register()
    register()  # loaded twice in one process: no error
    assert SecondaryTierFactory.get_tier_class({"type": "kvtier_disk"}) is KVTierDiskTier
    assert SecondaryTierFactory.get_tier_class({"type": "KVTierRedisTier",
                                                "module_path": "kvtier.vllm.native"}) is KVTierRedisTier
    assert native.kvtier_disk is KVTierDiskTier and native.kvtier_redis is KVTierRedisTier


def test_a_reset_of_vllms_cache_moves_the_tier_to_a_new_key_epoch(tmp_path, model):
    """vLLM's reset_cache (``pause_generation`` before a weight update or a sleep; it drains every
    secondary tier): nothing the tier held before is offered to the engine again (the weights may
    have changed in place) and nothing is deleted; what it stores after is served; an engine of the
    old weights still reads the old records; ``keep_on_reset`` keeps offering them."""
    root = tmp_path / "root"
    rig = NativeRig(model, [disk(root)])
    keys, rows = rig.store_prompt(1, 2)
    rig.reset()
    assert rig.fetch(keys) == [None, None]
    assert len(record_files(root)) == 2
    new_rows = [payload_of(rig, 5), payload_of(rig, 6)]
    rig.store(keys, new_rows)  # what the engine computes after the reset, under the same vLLM keys
    assert len(record_files(root)) == 4
    rig.forget_cpu_tier()
    assert rig.fetch(keys) == rig.stored_part(new_rows)
    old_weights = NativeRig(model, [disk(root)])  # another engine, in the epoch of start-up
    assert old_weights.fetch(keys) == old_weights.stored_part(rows)
    kept = NativeRig(model, [disk(root, keep_on_reset=True)])
    kept.reset()
    assert kept.fetch(keys) == kept.stored_part(rows)
    for each in (rig, old_weights, kept):
        each.close()
    with pytest.raises(ConfigError, match="keep_on_reset"):
        NativeRig(model, [disk(root, keep_on_reset="yes")])
