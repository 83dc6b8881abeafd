"""``kvtier inspect / verify / purge`` and ``kvtier doctor`` on a Redis remote tier: a real
redis-server (tests/support/redis_server.py) filled through RedisTier, as the connector fills it."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner
from support.namespaces import toy_namespace
from support.redis_server import redis_factory, valkey_server  # noqa: F401  (pytest fixtures)
from support.seaweed import REGION, s3, seaweed  # noqa: F401  (pytest fixtures)

from kvtier.cachetools import remote
from kvtier.cachetools.objects import ObjectTarget, inspect_objects, verify_objects
from kvtier.cachetools.purge import PurgeSelection
from kvtier.cachetools.remote import MEMORY_NOTE, RemoteTarget, inspect_remote, purge_remote, verify_remote
from kvtier.cachetools.scan import discover
from kvtier.cli.main import main
from kvtier.core.keys import Namespace
from kvtier.core.tier_config import RedisTierConfig
from kvtier.doctor.audit import audit
from kvtier.doctor.remote import Reach, probe_remote
from kvtier.tiers.blockfile import HEADER_LEN, encode_header
from kvtier.tiers.disk.layout import DiskLayout
from kvtier.tiers.base import Presence
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
            deadline = time.monotonic() + 30
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
    assert inventory.notes == [MEMORY_NOTE]  # redis-server 7.0: no CLIENT NO-TOUCH, so MEMORY USAGE, said so
    for name, count in BLOCKS.items():
        ns = by_model[MODEL_NAMES[name]]
        assert ns.complete_blocks == count and not ns.older_spec
        names = block_names(server, name)
        assert ns.block_bytes == sum(server.client().memory_usage(n) for n in names)
        assert ns.block_bytes > count * len(server.client().get(names[0]))  # the values, and the keys' and allocator's share
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
    assert "does not match its key name" in problem.reason and problem.action == "left in place"
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
        assert why in problem.reason and problem.action == "left in place"
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


# ---------------------------------------------------------------------- looking is not using (LRU / LFU)


def idle_times(client, names: list[bytes]) -> list[int]:
    """``OBJECT IDLETIME`` of each key (which never counts as a use of it)."""
    return [client.object("idletime", name) for name in names]


def all_blocks(client) -> list[bytes]:
    return sorted(n for n in client.scan_iter(match=b"kvtier:*") if not n.endswith(b":config"))


def test_inspect_and_dry_runs_leave_the_ages_purge_goes_by_on_a_server_without_no_touch(server) -> None:
    """redis-server 7.0 refuses CLIENT NO-TOUCH and counts STRLEN and GETRANGE as uses of a key:
    inspect and purge --dry-run read no value there (ages first, sizes by MEMORY USAGE), so two dry
    runs find the same old blocks and the purge then removes them, with the values' exact lengths
    (STRLEN in the pipeline that unlinks them). The tier's own presence probes (EXISTS) and
    memory monitor (INFO) are no uses either."""
    raw = server.client()
    names = all_blocks(raw)
    lengths = sum(len(raw.get(name)) for name in names)  # a plain client's GET: a use, before the clock starts
    time.sleep(2.2)  # OBJECT IDLETIME counts whole seconds
    ns = NAMESPACES["smol"]
    tier = RedisTier(RedisTierConfig(url=server.url()), engine_digest=ns.digest, rank_digests=ns.rank_digests(),
                     namespace_json=ns.config_json(MODEL_NAMES["smol"]), payload_bytes=PAYLOAD, usage_interval=0.05)
    try:
        keys = [key_of("smol", i) for i in range(BLOCKS["smol"])]
        tier.probe(keys)
        deadline = time.monotonic() + 30
        while not all(tier.presence(k) is Presence.PRESENT for k in keys):
            tier.poll()
            assert time.monotonic() < deadline, "the tier's probes did not answer"
            time.sleep(0.01)
        time.sleep(0.2)  # a few INFO rounds of its monitor
    finally:
        tier.close()
    for _ in range(2):
        code, inspected = run("inspect", server.url())
        assert code == 0
        code, out = run("purge", server.url(), "--older-than", "1s", "--dry-run", "--json")
        assert code == 0 and json.loads(out)["files"] == len(names), out  # before: 0 the second time
    assert min(idle_times(raw, names)) >= 2  # before: 0 (inspect's STRLEN)
    assert "MEMORY USAGE" in inspected and "refuses CLIENT NO-TOUCH" in inspected  # how it measured, said
    code, out = run("purge", server.url(), "--older-than", "1s", "--json")
    data = json.loads(out)
    assert code == 0 and (data["files"], data["bytes"]) == (len(names), lengths) and all_blocks(raw) == []


def test_on_a_server_with_client_no_touch_nothing_the_tools_read_is_a_use(valkey_server) -> None:  # noqa: F811
    """Valkey 9 accepts CLIENT NO-TOUCH: inspect (STRLEN: exact sizes), verify (every value read)
    and purge --dry-run leave every block's idle time as it was."""
    fill(valkey_server.url)
    raw = valkey_server.client()
    names = all_blocks(raw)
    lengths = sum(len(raw.get(name)) for name in names)
    time.sleep(2.2)
    code, inspected = run("inspect", valkey_server.url, "--json")
    assert code == 0
    code, verified = run("verify", valkey_server.url, "--json")
    assert code == 0 and json.loads(verified)["files_ok"] == len(names)
    code, out = run("purge", valkey_server.url, "--older-than", "1s", "--dry-run", "--json")
    assert code == 0 and (json.loads(out)["files"], json.loads(out)["bytes"]) == (len(names), lengths)
    assert min(idle_times(raw, names)) >= 2  # before: 0 (verify's GETRANGE and STRLEN)
    inventory = json.loads(inspected)  # exact sizes (STRLEN), nothing to note
    assert sum(ns["block_bytes"] for ns in inventory["namespaces"]) == lengths and inventory["notes"] == []
    assert json.loads(verified)["notes"] == [] and not RemoteTarget(valkey_server.url).client().reads_touch()
    code, out = run("purge", valkey_server.url, "--older-than", "1s", "--json")
    assert code == 0 and json.loads(out)["files"] == len(names) and all_blocks(raw) == []


# ---------------------------------------------------------------------- purge --older-than: the age read again at the unlink


def used_at_the_unlink(monkeypatch, raw, also=None) -> list[bytes]:
    """Make ``purge_remote`` meet engines between its age read and its unlink, deterministically: at
    its first unlink of a namespace's selected blocks, the first is read (GET) and the second
    rewritten (SET), as an engine would, by a plain client whose reads count as uses; ``also(raw)``
    runs there after them. Returns the names it used."""
    real = remote._unlink_counted
    used: list[bytes] = []

    def meanwhile(client, names, result, *rest):
        if len(names) >= 2 and not used:
            raw.get(names[0])
            raw.set(names[1], raw.get(names[1]))
            used.extend(names[:2])
            if also is not None:
                also(raw)
        return real(client, names, result, *rest)

    monkeypatch.setattr(remote, "_unlink_counted", meanwhile)
    return used


def full(raw) -> None:
    """The server at its ``maxmemory`` from now (noeviction): a write is refused."""
    raw.config_set("maxmemory", raw.info("memory")["used_memory"] // 2)
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        raw.set("kvtier-test:probe", b"x")


@pytest.mark.parametrize("kind", ["redis-7.0", "valkey-9"])
def test_purge_older_than_keeps_blocks_used_between_their_age_read_and_their_unlink(kind, request,
                                                                                     monkeypatch) -> None:
    """The age is read again in the script that unlinks (atomic on the server): a block read or
    rewritten since it was selected is kept and counted as the disk purge counts one (``skipped``:
    "kept N used meanwhile"). Before: both went."""
    if kind == "valkey-9":
        url = request.getfixturevalue("valkey_server").url
        fill(url)
        raw = request.getfixturevalue("valkey_server").client()
    else:
        url, raw = request.getfixturevalue("server").url(), request.getfixturevalue("server").client()
    names = all_blocks(raw)
    time.sleep(2.2)  # OBJECT IDLETIME counts whole seconds
    used = used_at_the_unlink(monkeypatch, raw, full)  # the server full when purge unlinks: the script still may
    code, out = run("purge", url, "--older-than", "1s", "--json")
    data = json.loads(out)
    assert code == 0 and all_blocks(raw) == sorted(used) and len(used) == 2
    assert data["files"] == len(names) - 2 and sum(ns["skipped"] for ns in data["namespaces"]) == 2
    assert data["notes"] == []
    time.sleep(2.2)
    code, out = run("purge", url, "--older-than", "1s")  # the seam used blocks once: unused since, they go now
    assert code == 0 and all_blocks(raw) == [] and "used meanwhile" not in out


REFUSALS = {
    "no @scripting": (["-@scripting"], None, "no permissions"),  # SCRIPT EXISTS refused before the pipeline
    "no EVALSHA": (["-evalsha"], None, "no permissions"),  # each EVALSHA refused in the pipeline
    "LFU meanwhile": ([], lambda raw: raw.config_set("maxmemory-policy", "allkeys-lfu"), "LFU"),  # OBJECT IDLETIME
}


@pytest.mark.parametrize("refusal", REFUSALS)
def test_purge_older_than_on_a_server_that_refuses_the_script_unlinks_as_before_and_says_so(
        refusal, redis_factory, monkeypatch) -> None:  # noqa: F811
    """A server that refuses the re-check's script still purges (STRLEN + UNLINK, as before the
    re-check: a block used meanwhile goes too), and the report says the re-check was not possible
    and why, once."""
    rules, also, why = REFUSALS[refusal]
    secured = redis_factory(users=[["kv", "on", f">{PASSWORD}", "~kvtier:*", "+@all", *rules]])
    fill(secured.url())
    raw = secured.client()
    names, kept = block_names(secured, "smol"), block_names(secured, "qwen")
    lengths = sum(len(raw.get(name)) for name in names)
    time.sleep(2.2)
    used = used_at_the_unlink(monkeypatch, raw, also)
    code, out = run("purge", secured.url(), "--username", "kv", "--password-env", "KV_PASS", "--older-than", "1s",
                    "--model", MODEL_NAMES["smol"], "--json", env={"KV_PASS": PASSWORD})
    data = json.loads(out)
    assert code == 0 and len(used) == 2 and set(used) <= set(names) and all_blocks(raw) == kept
    assert (data["files"], data["bytes"]) == (len(names), lengths)
    assert sum(ns["skipped"] for ns in data["namespaces"]) == 0
    [note] = data["notes"]
    assert note.startswith("--older-than: blocks were unlinked without their idle time being read again") and why in note
    assert PASSWORD not in out


# ---------------------------------------------------------------------- what the operator typed, in the store's words


@pytest.mark.parametrize("prefix", ["a b*", "", "*", "x" * 65])
def test_a_key_prefix_the_tier_would_refuse_is_a_usage_error(server, prefix) -> None:
    for command in (["inspect"], ["verify"], ["purge", "--all"]):
        code, out = run(*command, server.url(), "--key-prefix", prefix)
        assert code == 2 and "--key-prefix" in out, out  # before: an empty report, exit 0
        assert "1-64 characters of [A-Za-z0-9._:-]" in out or "must be a non-empty string" in out
    assert len(all_blocks(server.client())) == sum(BLOCKS.values())


def test_redis_reports_speak_of_values_keys_and_config_keys(server) -> None:
    raw = server.client()
    smol = block_names(server, "smol")
    value = bytearray(raw.get(smol[0]))
    value[HEADER_LEN + 3] ^= 0xFF
    raw.set(smol[0], bytes(value))  # a payload byte flipped: read, and deleted
    qwen_stray = config_key("qwen").removesuffix("config") + "notes"
    raw.set(qwen_stray, b"someone's")  # in qwen's namespace: keeps its config key
    raw.set("kvtier:junk", b"x")
    raw.set("kvtier:a", b"x")  # printed as its name, never as an emoji code (":a:" before ": not a kvtier key")
    code, out = run("inspect", server.url())
    assert code == 0 and out.startswith(f"kvtier Redis tier {server.url()}")  # before: "kvtier disk cache"
    assert not any(word in out for word in ("quarantine", "temp", "files", "disk"))
    assert "3 unexpected keys" in out and "kvtier:junk" in out and qwen_stray in out and "kvtier:a:" in out
    raw.delete("kvtier:a")
    code, out = run("verify", server.url())
    assert code == 1 and f"checked {sum(BLOCKS.values())} block values" in out and "(deleted)" in out
    assert "1 problem(s), 1 deleted" in out and "quarantine" not in out  # before: "block files", "0 quarantined"
    raw.delete(config_key("smol"))
    code, out = run("verify", server.url(), "--namespace", MODEL_NAMES["qwen"], "--namespace", smol[0].decode()[7:23])
    assert code == 1 and "config key missing: its 5 values cannot be checked (left in place)" in out
    assert "(reported)" not in out
    raw.set(config_key("smol"), NAMESPACES["smol"].config_json(MODEL_NAMES["smol"]))
    for args in (["--quarantine"], ["--model", MODEL_NAMES["qwen"], "--quarantine"]):
        code, out = run("purge", server.url(), *args)
        assert code == 2 and "Redis tier has no quarantine" in out  # before: "quarantine: removed 0 files"
    code, out = run("purge", server.url(), "--model", MODEL_NAMES["smol"])
    assert code == 0 and "removed 5 blocks" in out and "config key removed" in out and "files" not in out
    assert "removed 5 values" in out and not raw.exists(config_key("smol"))
    code, out = run("purge", server.url(), "--model", MODEL_NAMES["qwen"])
    assert code == 0 and "removed 4 blocks" in out and "config key" not in out
    assert raw.exists(config_key("qwen")) and raw.exists(qwen_stray)  # something of the namespace is left
    raw.delete(qwen_stray)
    code, out = run("purge", server.url(), "--model", MODEL_NAMES["qwen"])
    assert code == 0 and "config key removed" in out and not raw.exists(config_key("qwen"))
    assert [n for n in raw.scan_iter()] == [b"kvtier:junk"]


def test_a_digest_prefix_under_four_digits_says_the_minimum(server) -> None:
    digest = NAMESPACES["smol"].digest.hex()
    for command in (["purge", "--namespace", digest[:3]], ["verify", "--namespace", digest[:3]]):
        code, out = run(command[0], server.url(), *command[1:])
        assert code == 2 and "a digest prefix needs at least 4 hex digits" in out, out
    code, out = run("purge", server.url(), "--namespace", digest[:4], "--dry-run")
    assert code == 0 and "would remove 6 blocks" in out


def test_a_redis_url_to_another_server_or_a_redis_socket_given_as_a_path(redis_factory, tmp_path) -> None:  # noqa: F811
    """A Redis URL at an HTTP server names the URL and says it is not a Redis server; a Redis
    server's socket given as a path (inspect takes node sockets) is named as one at once, with the
    unix:// URL to give."""
    import socket
    import threading

    def answer_as_http(listener: socket.socket) -> None:
        """Answer each connection's first bytes as an HTTP server does a request it cannot parse, and
        keep it open until the client closes it (no reset that could swallow the answer)."""
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                while conn.recv(65536):
                    pass

    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=answer_as_http, args=(listener,), daemon=True).start()
    try:
        url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
        code, out = run("inspect", url)
        assert code == 1 and f"{url} is not a Redis server" in out and "Traceback" not in out, out
    finally:
        listener.close()
    made = redis_factory(unixsocket=True)
    run("inspect", made.socket_path)  # the command's modules imported: the second call is timed alone
    start = time.monotonic()
    code, out = run("inspect", made.socket_path)
    assert code == 2 and "is the socket of a Redis server (redis-server" in out and f"unix://{made.socket_path}" in out
    assert time.monotonic() - start < 4  # before: the node client's 5 s timeout, then "timed out"


# ---------------------------------------------------------------------- S3: one line per failure, the operator's words

FAKE_KEYS = {"AWS_ACCESS_KEY_ID": "kvtier-nobody", "AWS_SECRET_ACCESS_KEY": "kvtier-nothing-secret"}


@pytest.mark.parametrize("command", [["inspect"], ["verify"], ["purge", "--all"]])
def test_an_s3_store_that_does_not_answer_is_one_line(command) -> None:
    code, out = run(command[0], "s3://kvtier-test/p", *command[1:], "--endpoint", "http://127.0.0.1:1", env=FAKE_KEYS)
    assert code == 1 and len(out.strip().splitlines()) == 1, out  # before: the client's 38-line Debug dump
    assert "s3://kvtier-test/p at http://127.0.0.1:1 does not answer: Connection refused" in out
    assert "check --endpoint" in out and "Debug" not in out and "GenericError" not in out


def test_s3_messages_name_what_the_operator_typed(s3, tmp_path) -> None:  # noqa: F811
    code, out = run("inspect", "s3://my_bucket/x")
    assert code == 2 and "DIR_OR_URL names the bucket 'my_bucket'" in out, out  # before: "'--url' ... 'my-bucket'"
    code, out = run("inspect", "s3://kvtier-test/a//b")
    assert code == 2 and "'/'-separated names of [A-Za-z0-9._-]" in out  # before: "[A-Za-z0-9.--]"
    not_pem = tmp_path / "hostname"
    not_pem.write_text("myhost\n")
    code, out = run("inspect", f"s3://{s3.bucket}/p", "--endpoint", s3.endpoint, "--ca-bundle", not_pem)
    assert code == 1 and f"--ca-bundle '{not_pem}' holds no PEM certificate" in out, out
    assert "AWS_ACCESS_KEY_ID" not in out and "credentials" not in out  # before: "Fix: set AWS_ACCESS_KEY_ID ..."
    nowhere = {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none")}
    code, out = run("inspect", f"s3://{s3.bucket}/p", "--endpoint", s3.endpoint, "--profile", "nope", env=nowhere)
    assert code == 1 and "--profile names the AWS profile 'nope'" in out and "or remove --profile" in out, out
    code, out = run("inspect", "s3://no-such-bucket-kvtier/p", "--endpoint", s3.endpoint, "--region", REGION)
    assert code == 1 and "fix the bucket in DIR_OR_URL (and --endpoint, --region)" in out, out
    assert not any(quoted in out for quoted in ("'target", "'options", "kv_connector_extra_config"))


def test_s3_reports_speak_of_objects_list_strays_and_keep_a_config_while_anything_is_left(s3) -> None:  # noqa: F811
    import obstore

    prefix = f"words-{os.urandom(4).hex()}"
    keys, valid = s3_fill(s3, prefix, 3)
    store = s3.store()
    notes, elsewhere = f"{prefix}/{keys.folder}/notes.txt", f"{prefix}/elsewhere.txt"
    obstore.put(store, notes, b"someone's", use_multipart=False)
    obstore.put(store, elsewhere, b"someone else's", use_multipart=False)
    value = bytearray(obstore.get(store, valid[0]).bytes().to_bytes())
    value[HEADER_LEN + 3] ^= 0xFF  # a payload byte flipped: read, and deleted
    obstore.put(store, valid[0], bytes(value), use_multipart=False)
    url, where = f"s3://{s3.bucket}/{prefix}", ("--endpoint", s3.endpoint, "--region", REGION)
    code, out = run("inspect", url, *where)
    assert code == 0 and out.startswith(f"kvtier S3 tier {url} at {s3.endpoint}"), out  # before: "kvtier disk cache"
    assert not any(word in out for word in ("quarantine", "temp", "files"))
    assert "2 unexpected objects" in out and notes in out and elsewhere in out  # before: not listed
    data = json.loads(run("inspect", url, *where, "--json")[1])
    assert data["store"] == "s3" and {s["path"] for s in data["strays"]} == {notes, elsewhere}
    code, out = run("verify", url, *where)
    assert code == 1 and "checked 3 block objects" in out and "1 problem(s), 1 deleted" in out, out
    code, out = run("purge", url, *where, "--quarantine")
    assert code == 2 and "S3 tier has no quarantine" in out


def test_s3_purge_keeps_a_namespace_config_while_anything_of_it_is_left(s3) -> None:  # noqa: F811
    """As on disk: a whole-namespace purge leaves config.json while an object of the folder that
    is no block remains (it goes once nothing else is left)."""
    import obstore

    prefix = f"keep-{os.urandom(4).hex()}"
    keys, valid = s3_fill(s3, prefix, 3)
    notes = f"{prefix}/{keys.folder}/notes.txt"
    obstore.put(s3.store(), notes, b"someone's", use_multipart=False)
    url, where = f"s3://{s3.bucket}/{prefix}", ("--endpoint", s3.endpoint, "--region", REGION)
    code, out = run("purge", url, *where, "--namespace", keys.folder, "--json")
    assert code == 0 and json.loads(out)["files"] == 3 and not json.loads(out)["namespaces"][0]["config_removed"]
    assert set(s3.objects(prefix + "/")) == {keys.config, notes}  # before: config.json deleted beside notes.txt
    obstore.delete(s3.store(), notes)
    code, out = run("purge", url, *where, "--namespace", keys.folder)
    assert code == 0 and "config.json removed" in out and s3.objects(prefix + "/") == {}
