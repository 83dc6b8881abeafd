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
from support.seaweed import REGION, s3, seaweed  # noqa: F401  (pytest fixtures)

from kvtier.cachetools.objects import ObjectTarget, inspect_objects, verify_objects
from kvtier.cachetools.purge import PurgeSelection
from kvtier.cachetools.remote import RemoteTarget, inspect_remote, purge_remote, verify_remote
from kvtier.cachetools.scan import discover
from kvtier.cli.main import main
from kvtier.core.keys import Namespace
from kvtier.core.tier_config import RedisTierConfig
from kvtier.doctor.audit import audit
from kvtier.doctor.remote import Reach, probe_remote
from kvtier.tiers.blockfile import HEADER_LEN, encode_header
from kvtier.tiers.disk.layout import DiskLayout
from kvtier.tiers.redis import RedisTier
from kvtier.tiers.redis.codec import KeySpace
from kvtier.tiers.s3.keys import ObjectKeys
from kvtier.tiers.value import encode_value

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


# ---------------------------------------------------------------------- a config judged wrong, a bounded read


BOMB = b"[" * 100_000  # under the 1 MiB bound; json.loads raises RecursionError on it


def config_key(name: str) -> str:
    return f"kvtier:{NAMESPACES[name].digest.hex()[:16]}:config"


def test_a_config_key_of_another_namespace_is_reported_and_its_values_left_in_place(server) -> None:
    raw = server.client()
    raw.set(config_key("smol"), NAMESPACES["qwen"].config_json(MODEL_NAMES["qwen"]))  # planted, or stale
    names = block_names(server, "smol")
    report = verify_remote(RemoteTarget(server.url()), delete=True)
    assert all(raw.exists(n) for n in names)  # before: all 6 deleted as "namespace ... is not this rank's"
    (problem,) = report.problems
    assert "does not match its key name" in problem.reason and problem.action == "reported"
    assert report.files_ok == BLOCKS["qwen"]
    by_digest = {ns.digest16: ns for ns in inspect_remote(RemoteTarget(server.url())).namespaces}
    assert "does not match" in by_digest[NAMESPACES["smol"].digest.hex()[:16]].config_problem


def test_verify_reads_no_value_beyond_the_namespace_block_size(server) -> None:
    raw = server.client()
    ns = NAMESPACES["smol"]
    payload = 8 << 20  # far more than the 737,280 payload bytes a rank of its config can hold
    planted = KeySpace.of("kvtier", ns.digest).block(key_of("planted", 0))
    header = encode_header(namespace=ns.rank_digests()[0], key=key_of("planted", 0), parent=ns.digest,
                           num_tokens=16, payload_len=payload, checksum=0)
    raw.set(planted, header)
    raw.setrange(planted, WORLD * (HEADER_LEN + payload) - 1, b"x")  # the size its header announces
    report = verify_remote(RemoteTarget(server.url()), delete=True)
    assert report.bytes_checked < 1 << 20  # before: the 16 MiB value was read whole
    (problem,) = report.problems
    assert problem.path == planted.decode() and "more than the 737280" in problem.reason
    assert not raw.exists(planted) and report.files_ok == sum(BLOCKS.values())


def test_a_config_that_does_not_parse_is_reported_never_a_traceback(server, tmp_path) -> None:
    raw = server.client()
    raw.set(config_key("smol"), BOMB)
    code, out = run("inspect", server.url(), "--json")
    assert code == 0, out  # before: RecursionError
    problems = [ns["config_problem"] for ns in json.loads(out)["namespaces"]]
    assert set(problems) == {"config key unreadable: nested too deeply", None}
    report = verify_remote(RemoteTarget(server.url()))
    assert [p.reason.split(":")[0] for p in report.problems] == ["config key unreadable"]
    assert len(block_names(server, "smol")) == BLOCKS["smol"]
    root = tmp_path / "root"  # a disk root: the same parse
    prefix = DiskLayout(root, "m", bytes(8), 1, 0).prefix
    (root / prefix).mkdir(parents=True)
    (root / prefix / "config.json").write_bytes(BOMB)
    (found,) = discover(root).namespaces
    assert found.config is None and found.config_problem == "config.json unreadable: nested too deeply"
    code, out = run("inspect", root, "--json")
    assert code == 0 and json.loads(out)["namespaces"][0]["config_problem"] == found.config_problem


# S3: objects put as the tier puts them (the object is the value, tests/test_s3_tier.py)
S3_NS = toy_namespace(weights="blake3:" + "5" * 64)  # 512 payload bytes a block at most: 648-byte objects
S3_PAYLOAD = 512


def s3_fill(s3, prefix: str, count: int, config: str | bytes | None = None) -> tuple[ObjectKeys, list[str]]:  # noqa: F811
    import obstore

    keys = ObjectKeys.of(prefix, "m", S3_NS.engine_digest)
    store = s3.store()
    obstore.put(store, keys.config, config if config is not None else S3_NS.config_json("m").encode(),
                use_multipart=False)
    paths = []
    for i in range(count):
        key = key_of("s3", i)
        value = b"".join(encode_value(S3_NS.rank_digests(), key, S3_NS.digest, 4, [memoryview(os.urandom(S3_PAYLOAD))]))
        obstore.put(store, keys.block(key), value, use_multipart=False)
        paths.append(keys.block(key))
    return keys, paths


def s3_target(s3, prefix: str) -> ObjectTarget:  # noqa: F811
    return ObjectTarget.of(f"s3://{s3.bucket}/{prefix}", endpoint=s3.endpoint, region=REGION)


def test_s3_verify_judges_by_the_config_never_by_the_most_common_size(s3) -> None:  # noqa: F811
    import obstore

    prefix = f"bound-{os.urandom(4).hex()}"
    keys, valid = s3_fill(s3, prefix, 3)
    planted = [keys.block(key_of("planted", i)) for i in range(4)]
    for path in planted:  # outnumber the valid blocks
        obstore.put(s3.store(), path, os.urandom(64 << 10), use_multipart=False)
    report = verify_objects(s3_target(s3, prefix), delete=True)
    left = s3.objects(prefix + "/")
    assert all(path in left for path in valid)  # before: the 3 valid blocks deleted as "of another size"
    assert report.files_ok == 3 and report.bytes_checked == 3 * (HEADER_LEN + S3_PAYLOAD)  # before: 256 KiB read
    assert {p.path for p in report.problems} == set(planted) and not any(path in left for path in planted)
    assert all("more than the 648 bytes" in p.reason for p in report.problems)


def test_s3_config_of_another_namespace_or_unparsable_leaves_the_objects(s3) -> None:  # noqa: F811
    other = toy_namespace(weights="blake3:" + "6" * 64)
    for config, why in ((other.config_json("m").encode(), "does not match its folder name"), (BOMB, "nested too deeply")):
        prefix = f"cfg-{os.urandom(4).hex()}"
        _, valid = s3_fill(s3, prefix, 3, config)
        report = verify_objects(s3_target(s3, prefix), delete=True)  # before: deleted / RecursionError
        (problem,) = report.problems
        assert why in problem.reason and problem.action == "reported"
        assert all(path in s3.objects(prefix + "/") for path in valid)
        (space,) = inspect_objects(s3_target(s3, prefix)).namespaces
        assert why in space.config_problem
        code, out = run("inspect", f"s3://{s3.bucket}/{prefix}", "--endpoint", s3.endpoint, "--region", REGION)
        assert code == 0, out


@pytest.mark.parametrize("url", [
    "redis://:S3cr3tPW/x@127.0.0.1:1/0", "redis://:S3cr3tPW#x@127.0.0.1:1/0", "redis://:S3cr3tPW?x@127.0.0.1:1/0",
    "redis://:123/S3cr3tPW@127.0.0.1:1/0", "redis://user:S3cr3tPW@127.0.0.1:notaport/0", "redis://:S3cr3tPW@[::1/0",
])
def test_a_url_the_tools_cannot_use_is_a_usage_error_that_never_shows_the_password(url) -> None:
    code, out = run("inspect", url)  # before: a traceback quoting the password (or a bare ValueError)
    assert code == 2 and "S3cr3tPW" not in out and "***@" in out, out


@pytest.mark.parametrize("mode", ["scan", "ping"])
def test_the_tools_and_doctor_end_by_their_deadlines_against_a_trickling_server(mode) -> None:
    """A server that answers one byte every 50 ms never lets an idle timeout fire: ``kvtier inspect``
    (its first SCAN, or the PING before it) and ``kvtier doctor``'s probe fail by the exchange's
    deadline, as a connection failure the commands report, instead of holding the operator forever."""
    import redis

    from support.fake_redis import TricklingRedis

    with TricklingRedis(mode, drip_s=0.05) as fake:
        start = time.monotonic()
        if mode == "scan":
            with pytest.raises(redis.TimeoutError, match="deadline"):
                inspect_remote(RemoteTarget(fake.url(), connect_timeout_s=0.2, timeout_s=0.3))
        else:
            probe = probe_remote(RedisTierConfig(url=fake.url()), timeout_s=0.3)
            assert probe.reach is Reach.UNREACHABLE and "deadline" in probe.detail
        assert time.monotonic() - start < 5  # 0.2 + 0.3 s and a 1 MiB reply's share (0.25 s) per call
