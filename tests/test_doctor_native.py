"""``kvtier doctor`` on lines that use vLLM's own offloading (OffloadingConnector), with and without
kvtier's tiers behind it: each finding with a line that raises it and one that does not."""

from __future__ import annotations

import json

import pytest

from kvtier.doctor.audit import audit

NATIVE = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
KVTIER_SPEC = {"spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier.vllm.native"}


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))


def line(tiers: list[dict], *flags: str, env: tuple[str, ...] = (), spec: dict | None = None, **extra) -> list[str]:
    config = {**NATIVE, "kv_connector_extra_config": {**(KVTIER_SPEC if spec is None else spec),
                                                       "cpu_bytes_to_use": 8 * 2**30, "secondary_tiers": tiers,
                                                       **extra}}
    return [*env, "vllm", "serve", "some/model", "--kv-transfer-config", json.dumps(config), *flags]


def codes(argv) -> dict[str, str]:
    return {f.code: f.severity for f in reversed(audit(argv))}


def disk(tmp_path, **more) -> dict:
    return {"type": "kvtier_disk", "root_dir": str(tmp_path / "kv"), "capacity_bytes": 64 * 2**30, **more}


def test_xxhash_without_pythonhashseed_with_a_persistent_tier_is_flagged(tmp_path):
    fs = {"type": "fs", "root_dir": str(tmp_path / "fs")}
    found = codes(line([fs], "--prefix-caching-hash-algo", "xxhash"))  # the issue's own example
    assert found["native-random-hash-seed"] == "error"
    (finding,) = [f for f in audit(line([fs], "--prefix-caching-hash-algo", "xxhash"))
                  if f.code == "native-random-hash-seed"]
    assert "PYTHONHASHSEED" in finding.fix and "restart" in finding.title
    assert "native-random-hash-seed" not in codes(line([fs], "--prefix-caching-hash-algo", "xxhash",
                                                       env=("PYTHONHASHSEED=7",)))
    assert "native-random-hash-seed" not in codes(line([disk(tmp_path)]))  # sha256: a fixed seed
    assert "native-random-hash-seed" not in codes(line([{"type": "example"}], "--prefix-caching-hash-algo",
                                                       "xxhash_cbor"))
    assert codes(line([disk(tmp_path)], "--prefix-caching-hash-algo", "xxhash_cbor"))["native-random-hash-seed"]


def test_vllms_fs_tier_is_flagged_with_kvtier_disk_as_the_fix(tmp_path):
    fs = {"type": "fs", "root_dir": str(tmp_path / "fs")}
    (finding,) = [f for f in audit(line([fs])) if f.code == "native-fs-unchecked"]
    assert finding.severity == "warning" and "flipped byte" in finding.why and "testing" in finding.why
    assert '"type": "kvtier_disk"' in finding.fix and str(tmp_path / "fs") in finding.fix
    assert "native-fs-unchecked" not in codes(line([disk(tmp_path)]))


def test_sizes_are_totals_over_the_ranks(tmp_path):
    found = codes(line([disk(tmp_path, capacity_bytes=2**30)], "-tp", "4"))
    assert found["native-size-total"] == "info" and found["native-disk-smaller-than-host"] == "warning"
    found = codes(line([disk(tmp_path)]))
    assert "native-size-total" not in found and "native-disk-smaller-than-host" not in found


def test_tier_types_and_specs_that_will_not_resolve(tmp_path, monkeypatch):
    assert "kvtier-tier-unresolved" not in codes(line([disk(tmp_path)]))  # kvtier's plugin is installed here
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")  # an allow-list without kvtier
    found = codes(line([disk(tmp_path)], spec={"spec_name": "KVTierOffloadingSpec"}))
    assert found["kvtier-tier-unresolved"] == "error" and found["kvtier-spec-unresolved"] == "error"
    assert "kvtier-tier-unresolved" not in codes(line([disk(tmp_path, module_path="kvtier.vllm.native")]))
    assert codes(line([disk(tmp_path, module_path="kvtier.tiers")]))["kvtier-tier-module"] == "error"
    bad = codes(line([{"type": "kvtier_redis", "url": "http://nope"}]))
    assert bad["kvtier-tier-config"] == "error"
    assert codes(line([{"type": "kvtier_node", "sockett": "/run/kvtier/node.sock"}]))["kvtier-tier-config"] == "error"
    assert "kvtier-tier-config" not in codes(line([{"type": "kvtier_node", "socket": "/run/kvtier/node.sock"}]))
    assert not (tmp_path / "kv").exists()  # doctor validated the disk tier without creating it


def test_vllms_own_specs_on_vllm_cpu_are_refused(tmp_path, monkeypatch):
    """A vllm serve line runs on vLLM-CPU when its own environment says so (docs/operators.md,
    Limits): the vLLM installed where doctor runs does not decide it, whatever it is."""
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    tiering = {"spec_name": "TieringOffloadingSpec"}
    for installed in (True, False):
        monkeypatch.setattr("kvtier.launch.command.vllm_runs_on_cpu", lambda environ=None, cpu=installed: cpu)
        for env in (("VLLM_TARGET_DEVICE=cpu",), ("VLLM_CPU_KVCACHE_SPACE=8",)):
            assert codes(line([disk(tmp_path)], env=env, spec=tiering))["native-offloading-on-cpu"] == "error"
            assert "native-offloading-on-cpu" not in codes(line([disk(tmp_path)], env=env))  # kvtier's spec
        for env in ((), ("VLLM_TARGET_DEVICE=cuda",), ("VLLM_TARGET_DEVICE=cuda", "VLLM_CPU_KVCACHE_SPACE=8")):
            assert "native-offloading-on-cpu" not in codes(line([disk(tmp_path)], env=env, spec=tiering))


def test_the_fix_for_vllms_spec_on_vllm_cpu_clears_it(tmp_path, monkeypatch):
    """From --kv-offloading-size there is no kv-transfer config to add kvtier's spec to, and the flag
    beside one would replace it: the fix is the whole --kv-transfer-config, and the fixed line is clean."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    base = ["VLLM_TARGET_DEVICE=cpu", "vllm", "serve", "some/model", "--max-model-len", "4096"]
    (finding,) = [f for f in audit([*base, "--kv-offloading-size", "8"]) if f.code == "native-offloading-on-cpu"]
    assert finding.fix.startswith("Drop --kv-offloading-size and give --kv-transfer-config '")
    fixed_config = finding.fix.split("'")[1]
    assert json.loads(fixed_config)["kv_connector_extra_config"]["cpu_bytes_to_use"] == 8 * 2**30
    errors = [f.code for f in audit([*base, "--kv-transfer-config", fixed_config]) if f.severity == "error"]
    assert errors == []


def test_tiers_kept_across_a_reset_are_said_with_what_an_in_place_weight_update_then_gets(tmp_path):
    found = codes(line([disk(tmp_path, keep_on_reset=True)]))
    assert found["kept-on-reset"] == "info" and "kvtier-tier-config" not in found
    (finding,) = [f for f in audit(line([disk(tmp_path, keep_on_reset=True)])) if f.code == "kept-on-reset"]
    assert "secondary_tiers[0].keep_on_reset" in finding.title and "old weights" in finding.why
    assert "kept-on-reset" not in codes(line([disk(tmp_path)]))
    connector = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.vllm", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"cpu_bytes_to_use": 2**30, "keep_tiers_on_reset": True}}
    argv = ["vllm", "serve", "some/model", "--kv-transfer-config", json.dumps(connector)]
    assert codes(argv)["kept-on-reset"] == "info"
