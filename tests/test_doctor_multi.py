"""``kvtier doctor`` on vLLM MultiConnector lines: each child audited as a standalone connector, and
the combinations only a MultiConnector can get wrong (docs/multiconnector.md), each with a positive and
a negative command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.doctor.audit import audit

FIXTURES = Path(__file__).parent / "fixtures" / "model_configs"
L8 = str(FIXTURES / "llama-3.1-8b.json")
RECOMPUTE = {"kv_load_failure_policy": "recompute"}


@pytest.fixture(autouse=True)
def gpu_semantics(monkeypatch):
    monkeypatch.setattr("kvtier.launch.command.vllm_runs_on_cpu", lambda environ=None: False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)


def kvtier(extra: dict | None = None, **top) -> dict:
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.vllm", "kv_role": "kv_both",
            "kv_connector_extra_config": extra if extra is not None else {"cpu_bytes_to_use": 2**36}, **top}


def native(tiers: list[dict]) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 2**36, "secondary_tiers": tiers}}


def example(path: str = "/tmp/kvtier-doctor-example") -> dict:
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": path}}


NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def line(transfer: dict) -> list[str]:
    return ["vllm", "serve", L8, "--max-model-len", "8192", "--kv-transfer-config", json.dumps(transfer)]


def multi(*children, **top) -> list[str]:
    return line({"kv_connector": "MultiConnector", "kv_role": "kv_both", **top,
                 "kv_connector_extra_config": {"connectors": list(children)}})


def found(argv) -> list[tuple[str, str, str]]:
    return [(f.code, f.severity, f.title) for f in audit(argv)]


def codes(argv) -> set[str]:
    return {f.code for f in audit(argv)}


@pytest.mark.parametrize("extra", [
    {"cpu_bytes_to_use": 2**36, "secondary_tiers": [{"type": "fs", "capacity_bytes": 2**30}]},  # no root_dir
    {"cpu_bytes_to_use": -5},
])
@pytest.mark.parametrize("position", [0, 1])
def test_a_kvtier_child_is_audited_as_a_standalone_kvtier(extra, position):
    alone = [f for f in found(line(kvtier(extra))) if f[1] == "error"]
    assert [f[0] for f in alone] == ["kvtier-config"]
    children = [example(), NIXL]
    children.insert(position, kvtier(extra))
    errors = [f for f in found(multi(*children, **RECOMPUTE)) if f[1] == "error"]
    assert [(code, title) for code, _, title in errors] == [
        ("kvtier-config", f"connectors[{position}] (KVTierConnector): {alone[0][2]}")]
    assert not [f for f in found(multi(example(), kvtier(), **RECOMPUTE)) if f[1] == "error"]


def test_a_native_child_is_audited_as_a_standalone_offloading_connector():
    bad_tiers = [{"type": "kvtier_disk", "capacity_bytes": 2**40}, {"type": "fs", "root_dir": "/var/cache/vllm"}]
    alone = {code: severity for code, severity, _ in found(line(native(bad_tiers)))}
    assert alone["kvtier-tier-config"] == "error" and alone["native-fs-unchecked"] == "warning"
    titles = [title for code, _, title in found(multi(example(), native(bad_tiers)))
              if code in ("kvtier-tier-config", "native-fs-unchecked")]
    assert len(titles) == 2 and all(t.startswith("connectors[1] (OffloadingConnector): ") for t in titles)


def test_a_childs_own_kv_transfer_config():
    no_path = {k: v for k, v in kvtier().items() if k != "kv_connector_module_path"}
    assert "kvtier-module-path" in codes(multi(no_path))
    assert "kvtier-module-path" not in codes(multi(kvtier()))
    assert "kv-role" in codes(multi(kvtier(kv_role="kv_producer")))
    assert "kv-role" in codes(multi({"kv_connector": "NixlConnector"}, kvtier()))  # no role at all
    assert "kv-role" not in codes(multi({**NIXL, "kv_role": "kv_consumer"}, kvtier()))  # a transfer child's role


def test_children_missing_or_malformed():
    assert "multi-connectors" in codes(line({"kv_connector": "MultiConnector", "kv_role": "kv_both"}))
    assert "multi-connectors" in codes(multi())
    bad = [f for f in audit(multi(kvtier(), "KVTierConnector", {"kv_role": "kv_both"})) if f.code == "multi-connectors"]
    assert [f.title for f in bad] == ["connectors[1] names no connector", "connectors[2] names no connector"]
    assert "multi-connectors" not in codes(multi(kvtier(), example()))


def test_two_kvtier_children_on_one_engine_id():
    assert "multi-kvtier-twice" in codes(multi(kvtier(), kvtier()))
    assert "multi-kvtier-twice" in codes(multi(kvtier(engine_id="a"), kvtier(engine_id="a")))
    assert "multi-kvtier-twice" not in codes(multi(kvtier(engine_id="a"), kvtier(engine_id="b")))
    assert "multi-kvtier-twice" not in codes(multi(kvtier()))


def test_two_children_writing_one_root_or_server(tmp_path):
    root = str(tmp_path / "kv")
    disk = {"cpu_bytes_to_use": 2**36, "secondary_tiers": [{"type": "fs", "root_dir": root, "capacity_bytes": 2**40}]}
    same = multi(kvtier(disk), native([{"type": "kvtier_disk", "root_dir": root + "/", "capacity_bytes": 2**40}]))
    (finding,) = [f for f in audit(same) if f.code == "multi-double-store"]
    assert finding.severity == "warning" and root in finding.title
    other = multi(kvtier(disk), native([{"type": "kvtier_disk", "root_dir": root + "2", "capacity_bytes": 2**40}]))
    assert "multi-double-store" not in codes(other)
    redis = {"cpu_bytes_to_use": 2**36, "secondary_tiers": [{"type": "redis", "url": "redis://127.0.0.1:1/0"}]}
    assert "multi-double-store" in codes(multi(kvtier(redis), native([{"type": "kvtier_redis",
                                                                       "url": "redis://127.0.0.1:1/0"}])))
    assert "multi-double-store" in codes(multi(example(root), kvtier(disk)))


def test_orders_that_shadow_kvtier_or_take_requests_from_a_transfer_child():
    assert "multi-kvtier-shadowed" in codes(multi(example(), kvtier()))
    assert "multi-kvtier-shadowed" in codes(multi(kvtier(), native([{"type": "kvtier_disk", "root_dir": "/d"}])))
    first = codes(multi(kvtier(), example()))
    assert "multi-kvtier-shadowed" not in first and "multi-two-caches" in first
    assert "multi-kvtier-before-transfer" in codes(multi(kvtier(), NIXL))
    recipe = codes(multi(NIXL, kvtier(), **RECOMPUTE))
    assert not recipe & {"multi-kvtier-shadowed", "multi-kvtier-before-transfer", "multi-two-caches"}


def test_the_multiconnectors_load_failure_policy():
    assert "multi-load-failure-policy" in codes(multi(NIXL, kvtier()))
    assert "multi-load-failure-policy" in codes(multi(NIXL, kvtier(), kv_load_failure_policy="fail"))
    assert "multi-load-failure-policy" not in codes(multi(NIXL, kvtier(), **RECOMPUTE))
    assert "multi-load-failure-policy" not in codes(multi(NIXL, example()))  # no kvtier child
