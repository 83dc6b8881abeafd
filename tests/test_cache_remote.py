"""``kvtier inspect / verify / purge`` and ``kvtier doctor`` on a Redis remote tier: a real
redis-server (tests/support/redis_server.py) filled through RedisTier, as the connector fills it."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.namespaces import toy_namespace
from support.redis_server import redis_factory  # noqa: F401  (pytest fixture)

from kvtier.cachetools.purge import PurgeSelection
from kvtier.cachetools.remote import RemoteTarget, inspect_remote, purge_remote, verify_remote
from kvtier.cli.main import main
from kvtier.core.keys import Namespace
from kvtier.core.tier_config import RedisTierConfig
from kvtier.doctor.audit import audit
from kvtier.doctor.remote import Reach, probe_remote
from kvtier.tiers.redis import RedisTier

PAYLOAD = 256
WORLD = 2
BLOCKS = {"smol": 6, "qwen": 4}
MODEL_NAMES = {"smol": "SmolLM2-135M-Instruct", "qwen": "Qwen3-0.6B"}
PASSWORD = "s3cret-pass"


def make_namespace(layers: int) -> Namespace:
    return toy_namespace(
        layers=layers, kv_heads=3, head_size=64, block_tokens=16, kv_dtype="bfloat16", tp_size=WORLD
    )


NAMESPACES = {"smol": make_namespace(30), "qwen": make_namespace(28)}


def key_of(name: str, i: int) -> bytes:
    return hashlib.sha256(f"{name}/{i}".encode()).digest()


def fill(url: str, **config) -> None:
    """Write BLOCKS through RedisTier (one tier per namespace, as each engine would)."""
    for name, count in BLOCKS.items():
        ns = NAMESPACES[name]
        tier = RedisTier(
            RedisTierConfig(url=url, **config),
            engine_digest=ns.digest,
            rank_digests=ns.rank_digests(),
            namespace_json=ns.config_json(MODEL_NAMES[name]),
            payload_bytes=PAYLOAD,
        )
        try:
            for i in range(count):
                sources = [memoryview(os.urandom(PAYLOAD)) for _ in range(WORLD)]
                assert tier.submit_write(i, key_of(name, i), ns.digest, 16, sources)
            done = 0
            deadline = time.monotonic() + 10
            while done < count:
                results = tier.poll()
                assert all(r.ok for r in results), results
                done += len(results)
                assert time.monotonic() < deadline, "writes did not complete"
                time.sleep(0.002)
        finally:
            tier.close()


def block_names(server, name: str) -> list[bytes]:
    digest16 = NAMESPACES[name].digest.hex()[:16]
    return sorted(
        n
        for n in server.client().scan_iter(match=f"kvtier:{digest16}:*".encode())
        if not n.endswith(b":config")
    )


@pytest.fixture
def server(redis_factory):  # noqa: F811
    made = redis_factory()
    fill(made.url())
    return made


def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args], env=env)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, result.output


def test_inspect_lists_each_namespace_with_its_model_blocks_and_bytes(server) -> None:
    inventory = inspect_remote(RemoteTarget(server.url()))
    by_model = {ns.model_name: ns for ns in inventory.namespaces}
    assert set(by_model) == set(MODEL_NAMES.values())
    for name, count in BLOCKS.items():
        ns = by_model[MODEL_NAMES[name]]
        assert ns.complete_blocks == count and not ns.older_spec
        assert ns.block_bytes == count * len(server.client().get(block_names(server, name)[0]))
        assert ns.digest16 == NAMESPACES[name].digest.hex()[:16]
    code, out = run("inspect", server.url(), "--json")
    assert code == 0 and {ns["model_name"] for ns in json.loads(out)["namespaces"]} == set(
        MODEL_NAMES.values()
    )


def test_verify_finds_and_deletes_damaged_values_only(server) -> None:
    raw = server.client()
    names = block_names(server, "smol")
    truncated, garbage, swapped = names[0], names[1], names[2]
    raw.set(truncated, raw.get(truncated)[:-7])
    raw.set(garbage, os.urandom(len(raw.get(garbage))))
    raw.set(swapped, raw.get(names[3]))  # a sound value under another block's name
    report = verify_remote(RemoteTarget(server.url()), delete=False)
    assert not report.ok and {p.path for p in report.problems} == {
        n.decode() for n in (truncated, garbage, swapped)
    }
    assert all(raw.exists(n) for n in names)
    code, out = run("verify", server.url(), "--json")
    assert code == 1 and len(json.loads(out)["problems"]) == 3
    assert [n for n in names if not raw.exists(n)] == [truncated, garbage, swapped]
    assert verify_remote(RemoteTarget(server.url())).ok


def test_purge_by_model_and_all_and_dry_run(server) -> None:
    raw = server.client()
    before = raw.dbsize()
    code, out = run("purge", server.url(), "--model", MODEL_NAMES["qwen"], "--dry-run", "--json")
    assert code == 0 and raw.dbsize() == before
    report = purge_remote(RemoteTarget(server.url()), PurgeSelection(models=(MODEL_NAMES["qwen"],)))
    assert report.namespaces[0].blocks == BLOCKS["qwen"] and block_names(server, "qwen") == []
    assert len(block_names(server, "smol")) == BLOCKS["smol"]
    code, _ = run("purge", server.url(), "--all")
    assert code == 0 and raw.dbsize() == 0
    code, out = run("purge", server.url(), "--model", "nope")
    assert code == 2 and "nope" in out


def test_purge_older_than_uses_idle_time(server) -> None:
    time.sleep(3.5)  # OBJECT IDLETIME counts whole seconds
    raw = server.client()
    fresh = block_names(server, "smol")[0]
    raw.get(fresh)  # touched: idle 0 s
    report = purge_remote(RemoteTarget(server.url()), PurgeSelection(older_than=2.0))
    assert sum(ns.blocks for ns in report.namespaces) == sum(BLOCKS.values()) - 1
    assert raw.exists(fresh)


def test_password_from_env_never_printed_and_wrong_one_refused(redis_factory) -> None:  # noqa: F811
    secured = redis_factory(users=[["kv", "on", f">{PASSWORD}", "~kvtier:*", "+@all"]])
    os.environ["KVTIER_TEST_PASS"] = PASSWORD
    try:
        fill(secured.url(), username="kv", password_env="KVTIER_TEST_PASS")
    finally:
        del os.environ["KVTIER_TEST_PASS"]
    args = ("inspect", secured.url(), "--username", "kv", "--password-env", "KV_PASS")
    code, out = run(*args, env={"KV_PASS": PASSWORD})
    assert code == 0 and PASSWORD not in out and MODEL_NAMES["smol"] in out
    code, out = run(*args, env={"KV_PASS": "wrong"})
    assert code == 1 and "wrong" not in out.replace("WRONGPASS", "") and PASSWORD not in out
    code, out = run("inspect", secured.url(), "--password-env", "UNSET_VAR_X")
    assert code == 2 and "UNSET_VAR_X" in out
    url_with_password = secured.url(user="kv", password=PASSWORD)
    code, out = run("inspect", url_with_password)
    assert code == 0 and PASSWORD not in out


def test_doctor_probe_reports_reach_policy_and_foreign_keys(redis_factory) -> None:  # noqa: F811
    plain = redis_factory()
    found = probe_remote(RedisTierConfig(url=plain.url()))
    assert found.reach is Reach.OK and found.maxmemory == 0 and found.policy == "noeviction"
    lru = redis_factory(maxmemory="64mb", policy="allkeys-lru")
    lru.client().set("session:42", "someone else's data")
    found = probe_remote(RedisTierConfig(url=lru.url()))
    assert found.policy == "allkeys-lru" and found.foreign_keys == ["session:42"]
    secured = redis_factory(users=[["kv", "on", f">{PASSWORD}", "~kvtier:*", "+@all"]])
    os.environ["KVTIER_TEST_WRONG"] = "not-it"
    try:
        found = probe_remote(
            RedisTierConfig(url=secured.url(), username="kv", password_env="KVTIER_TEST_WRONG")
        )
    finally:
        del os.environ["KVTIER_TEST_WRONG"]
    assert found.reach is Reach.REFUSED and "not-it" not in found.detail
    port = plain.port
    plain.kill()
    found = probe_remote(RedisTierConfig(url=f"redis://127.0.0.1:{port}/0"), timeout_s=0.5)
    assert found.reach is Reach.UNREACHABLE


def test_doctor_audit_flags_an_unsafe_redis_and_a_refusing_one(redis_factory, tmp_path, monkeypatch) -> None:  # noqa: F811
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    model = str(Path(__file__).parent / "fixtures" / "model_configs" / "llama-3.1-70b.json")

    def codes_for(entry: dict) -> dict[str, str]:
        transfer = json.dumps(
            {
                "kv_connector": "KVTierConnector",
                "kv_role": "kv_both",
                "kv_connector_module_path": "kvtier.vllm",
                "kv_connector_extra_config": {"cpu_bytes_to_use": 2**30, "secondary_tiers": [entry]},
            }
        )
        line = [
            "vllm",
            "serve",
            model,
            "-tp",
            "4",
            "--max-model-len",
            "32768",
            "--kv-transfer-config",
            transfer,
        ]
        return {f.code: f.severity for f in audit(line)}

    lru = redis_factory(maxmemory="64mb", policy="allkeys-lru")
    lru.client().set("session:42", "x")
    found = codes_for({"type": "redis", "url": lru.url()})
    assert found["remote-ok"] == "info" and found["remote-evicts-other-data"] == "warning"
    plain = redis_factory()
    found = codes_for({"type": "redis", "url": plain.url()})
    assert found["remote-no-maxmemory"] == "warning" and found["remote-noeviction"] == "warning"
    dedicated = redis_factory(maxmemory="64mb", policy="allkeys-lru")
    found = codes_for({"type": "redis", "url": dedicated.url()})
    assert not {c for c in found if c.startswith("remote-")} - {"remote-ok"}
    secured = redis_factory(users=[["kv", "on", f">{PASSWORD}", "~kvtier:*", "+@all"]])
    monkeypatch.setenv("KV_WRONG", "not-it")
    found = codes_for({"type": "redis", "url": secured.url(), "username": "kv", "password_env": "KV_WRONG"})
    assert found["remote-auth"] == "error"
    port = plain.port
    plain.kill()
    assert (
        codes_for({"type": "redis", "url": f"redis://127.0.0.1:{port}/0"})["remote-unreachable"] == "warning"
    )
