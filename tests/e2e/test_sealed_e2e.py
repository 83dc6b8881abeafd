"""Records authenticated with a fleet key, end to end on real vLLM-CPU engines (issue "Shared tiers
only the fleet can write"): forged and replayed records planted in the store are never served, are
counted, and every output equals vLLM alone's.

- kvtier's connector, a real redis-server, records encrypted under the fleet key: while the engine
  runs, three of tenant a's values are replaced by forgeries (another prompt's real KV as a plain
  record, the same signed and encrypted under an attacker's key), and every value of tenant b by one
  of tenant a's valid values re-addressed to b's key (a replay across cache_salts); a's prompts are
  then served 6 of 9 from Redis, b's none, with every refusal counted in kvtier_auth_failures.
- the other two pairings (kvtier's connector with a signed disk tier, vLLM's offloading with a
  signed kvtier_redis): the same three forgeries, 0 served, counted.
- vLLM's own offloading with kvtier_disk (records signed): the same forgeries on disk, counted in
  kvtier_offload_failed_reads{reason="unauthenticated"}; then key rotation: a fresh engine writing
  under a new key and still listing the old one is served every record, ``kvtier verify`` names
  them as records under the retired key, and a fresh engine without the old key misses them all.

- a hostile store without a key (issue 38): a root and a Redis server one engine filled, tampered
  several ways at once (FIFOs, symlinks, a leaf moved outside the root, a 256 MiB value): a fresh
  engine starts, serves what is intact, recomputes the rest; nothing outside the root changes.

Nine prompts of one 64-token block each, a tiny Qwen3-MoE (random weights), one process per engine,
ten engines in all (tests/support/offline_run.py).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.offline_run import cached, launch, tokens
from support.redis_server import RedisServer
from support.tiny_models import write_tiny_model

from kvtier.bench.text import long_prompts
from kvtier.core.fleet_key import AuthConfig, FleetKey
from kvtier.tiers.blockfile import HEADER_LEN, decode_header, sealed_header_sum
from kvtier.tiers.sealing import PLAIN, Sealer

pytestmark = pytest.mark.e2e

BLOCK = 64
PROMPTS = long_prompts(9, 50, seed=5)  # 77-87 tokens each: one full block per prompt
K1, K2 = FleetKey(bytes(range(60, 92)), "K1"), FleetKey(bytes(range(160, 192)), "K2")
ATTACKER = FleetKey(bytes(range(7, 39)), "attacker")
ENV = {"KVTIER_TEST_K1": K1.secret.hex(), "KVTIER_TEST_K2": K2.secret.hex()}
NATIVE = {"spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier.vllm.native"}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model("qwen3-moe", tmp_path_factory.mktemp("tiny"))


def spec(model: Path, tiers: list[dict] | None, rounds=({},), *, native: bool = False) -> dict:
    """Rounds after a reset of the connector's cache are served by the tiers (they keep offering what
    they hold: ``keep_on_reset`` / ``keep_tiers_on_reset``)."""
    if native and tiers is not None:
        tiers = [{**tier, "keep_on_reset": True} for tier in tiers]
    extra = None if tiers is None else {"cpu_bytes_to_use": 64 * 2**20, "block_size": BLOCK,
                                        "secondary_tiers": tiers, **(NATIVE if native else {"keep_tiers_on_reset": True})}
    return {"model": str(model), "prompts": PROMPTS, "rounds": list(rounds), "max_tokens": 8,
            "kv_cache_memory_bytes": 32 * 2**20, "max_model_len": 512, "block_size": BLOCK,
            "connector": "native" if native else "kvtier", "kv_connector_extra_config": extra}


def metric(result: dict, round_index: int, *parts: str) -> float:
    return sum(v for k, v in result["round_metrics"][round_index].items() if all(p in k for p in parts))


@pytest.fixture(scope="module")
def expected(model, tmp_path_factory) -> list[list[int]]:
    outputs = tokens(launch(spec(model, None), tmp_path_factory.mktemp("alone")))
    assert len(set(map(tuple, outputs))) == len(outputs), "the model does not tell the prompts apart"
    return outputs


def plaintext(record: bytes, keys: Sealer) -> bytes:
    """The KV a valid record holds (the test plays a forger who could compute it with the open model)."""
    header = decode_header(record)
    out = memoryview(bytearray(header.payload_len))
    opener = keys.opener(header, record[:HEADER_LEN])
    opener.land(memoryview(record)[HEADER_LEN:], out)
    opener.finish()
    return bytes(out)


def forge(sealer: Sealer, template: bytes, payload: bytes, key: bytes | None = None) -> bytes:
    """A record for ``template``'s namespace and key (or ``key``) holding ``payload``, sealed by ``sealer``."""
    header = decode_header(template)
    head, body = sealer.seal(namespace=header.namespace, key=key or header.key, parent=bytes(32),
                             num_tokens=header.num_tokens, source=memoryview(payload))
    return head + bytes(body)


def retarget(record: bytes, key: bytes) -> bytes:
    """``record`` re-addressed to ``key``, its public header sum recomputed (as a forger can)."""
    out = bytearray(record[:40] + key + record[72:])
    struct.pack_into("<Q", out, 92, sealed_header_sum(out))
    return bytes(out)


def test_connector_on_redis_serves_no_forged_or_replayed_record(model, expected, tmp_path):
    server = RedisServer(tmp_path / "redis")
    try:
        client = server.client()
        tiers = [{"type": "redis", "url": server.url(), "auth_key_env": "KVTIER_TEST_K1", "encrypt": True}]
        seen: dict[str, set[bytes]] = {}

        def values() -> set[bytes]:
            return {n for n in client.scan_iter(match=b"kvtier:*") if not n.endswith(b":config")}

        def settled(count: int) -> set[bytes]:
            """The values once at least ``count`` are in and none came for half a second."""
            deadline = time.monotonic() + 60
            last, since = values(), time.monotonic()
            while len(last) < count or time.monotonic() - since < 0.5:
                assert time.monotonic() < deadline, f"only {len(last)} of {count} values reached Redis"
                time.sleep(0.05)
                now = values()
                if now != last:
                    last, since = now, time.monotonic()
            return last

        def after_a() -> None:
            seen["a"] = settled(9)

        def plant() -> None:
            seen["b"] = settled(len(seen["a"]) + 9) - seen["a"]
            a_names = sorted(seen["a"])
            a_values = {n: client.get(n) for n in a_names}
            full = [n for n in a_names if decode_header(a_values[n]).num_tokens == BLOCK]
            assert len(full) >= 9, "expected a full block per prompt"
            reader = Sealer(AuthConfig(K1, encrypt=True))
            other = plaintext(a_values[full[3]], reader)  # real KV of another prompt
            for name, sealer in zip(full[:3], (PLAIN, Sealer(AuthConfig(ATTACKER)),
                                               Sealer(AuthConfig(ATTACKER, encrypt=True)))):
                client.set(name, forge(sealer, a_values[name], other))
            for name, source in zip(sorted(seen["b"]), full[3:] * 9):  # tenant a's valid values, as b's
                b_key = decode_header(client.get(name)).key
                client.set(name, retarget(a_values[source], b_key))

        reset = {"reset_prefix_cache": True, "reset_connector": True}
        result = launch(spec(model, tiers, rounds=(
            {"cache_salt": "a"}, {"pause": True, "cache_salt": "b"},
            {"pause": True, "cache_salt": "a", **reset}, {"cache_salt": "b", **reset})),
            tmp_path, env=ENV, before_round={1: after_a, 2: plant})
        for round_index in range(4):
            assert tokens(result, round_index) == expected, f"round {round_index} differs from vLLM alone"
        assert cached(result, 0) == [0] * 9 and cached(result, 1) == [0] * 9
        assert sorted(cached(result, 2)) == [0] * 3 + [BLOCK] * 6, cached(result, 2)
        assert cached(result, 3) == [0] * 9, "a record replayed from another tenant was served"
        assert metric(result, 2, "kvtier_auth_failures_total") == 3
        assert metric(result, 3, "kvtier_auth_failures_total") >= 3 + 9  # (running totals)
        print(f"tenant a after forgery: {cached(result, 2)}; tenant b after replay: {cached(result, 3)}")
    finally:
        server.kill()


def records(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.bin") if "quarantine" not in p.parts)


def disk(root: Path, **keys) -> dict:
    return {"type": "kvtier_disk", "root_dir": str(root), "capacity_bytes": 2**30, **keys}


def test_native_disk_forgeries_are_misses_and_keys_rotate(model, expected, tmp_path):
    root = tmp_path / "root"
    signed = disk(root, auth_key_env="KVTIER_TEST_K1")

    def plant() -> None:
        files = records(root)
        assert len(files) == 9, files
        raws = [f.read_bytes() for f in files]
        other = plaintext(raws[4], Sealer(AuthConfig(K1)))
        files[0].write_bytes(forge(PLAIN, raws[0], other))
        files[1].write_bytes(forge(Sealer(AuthConfig(ATTACKER)), raws[1], other))
        files[2].write_bytes(retarget(raws[5], decode_header(raws[2]).key))  # a valid record, re-addressed

    first = launch(spec(model, [signed], rounds=({}, {"pause": True, "reset_prefix_cache": True,
                                                      "reset_connector": True}), native=True),
                   tmp_path, env=ENV, before_round={1: plant})
    assert tokens(first, 0) == expected and tokens(first, 1) == expected
    assert sorted(cached(first, 1)) == [0] * 3 + [BLOCK] * 6, cached(first, 1)
    assert metric(first, 1, "kvtier_offload_failed_reads", "unauthenticated") == 3
    assert len(list((root / "quarantine").glob("*.bin"))) == 3

    # Rotation: K2 writes, K1 still accepted: every record (rewritten by the first engine) is served.
    deadline = time.monotonic() + 30
    while len(records(root)) < 9 and time.monotonic() < deadline:
        time.sleep(0.1)
    rotated = launch(spec(model, [disk(root, auth_key_env="KVTIER_TEST_K2",
                                       auth_read_key_envs=["KVTIER_TEST_K1"])], native=True), tmp_path, env=ENV)
    assert tokens(rotated) == expected and cached(rotated) == [BLOCK] * 9, cached(rotated)
    verify = subprocess.run([sys.executable, "-c", "from kvtier.cli.main import main; main()", "verify", str(root),
                             "--json",
                             "--auth-key-env", "KVTIER_TEST_K2", "--read-key-env", "KVTIER_TEST_K1"],
                            capture_output=True, text=True, env={**_env(), **ENV}, timeout=120)
    report = json.loads(verify.stdout)
    assert verify.returncode == 0 and report["retired"] == {K1.key_id.hex(): 9}, verify.stdout + verify.stderr
    # K1 removed: its records are misses, counted, and the outputs are still vLLM alone's.
    dropped = launch(spec(model, [disk(root, auth_key_env="KVTIER_TEST_K2")], native=True), tmp_path, env=ENV)
    assert tokens(dropped) == expected and cached(dropped) == [0] * 9, cached(dropped)
    assert metric(dropped, 0, "kvtier_offload_failed_reads", "unauthenticated") == 9


def plant_forgeries(raws: list[bytes], write, sealer_of_fleet: Sealer) -> None:
    """Replace records 0-2 of ``raws`` (in order) through ``write(i, record)``: another prompt's real
    KV as a plain record, the same signed under an attacker's key, and a valid record re-addressed."""
    other = plaintext(raws[4], sealer_of_fleet)
    write(0, forge(PLAIN, raws[0], other))
    write(1, forge(Sealer(AuthConfig(ATTACKER)), raws[1], other))
    write(2, retarget(raws[5], decode_header(raws[2]).key))


def test_connector_on_disk_and_native_on_redis_serve_no_forged_record(model, expected, tmp_path):
    """The two pairings the tests above leave: kvtier's connector with a signed disk tier (a fresh
    engine reads the root another wrote, three records forged meanwhile), and vLLM's offloading
    with a signed kvtier_redis (forgeries planted between rounds)."""
    root = tmp_path / "root"
    tiers = [{"type": "fs", "root_dir": str(root), "capacity_bytes": 2**30, "auth_key_env": "KVTIER_TEST_K1"}]
    whole_blocks = spec(model, tiers)
    whole_blocks["kv_connector_extra_config"]["offload_partial_blocks"] = False  # one record per prompt
    writer = launch(whole_blocks, tmp_path, env=ENV)
    assert tokens(writer) == expected
    files = records(root)  # (the engine drained its writes before it exited)
    assert len(files) == 9, files
    plant_forgeries([f.read_bytes() for f in files], lambda i, record: files[i].write_bytes(record),
                    Sealer(AuthConfig(K1)))
    reader = launch(whole_blocks, tmp_path, env=ENV)
    assert tokens(reader) == expected
    assert sorted(cached(reader)) == [0] * 3 + [BLOCK] * 6, cached(reader)
    assert metric(reader, 0, "kvtier_auth_failures_total") == 3

    server = RedisServer(tmp_path / "redis")
    try:
        client = server.client()
        signed = [{"type": "kvtier_redis", "url": server.url(), "auth_key_env": "KVTIER_TEST_K1"}]

        def plant() -> None:
            deadline = time.monotonic() + 30
            while True:
                names = sorted(n for n in client.scan_iter(match=b"kvtier:*") if not n.endswith(b":config"))
                if len(names) >= 9 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert len(names) == 9, names
            plant_forgeries([client.get(n) for n in names], lambda i, record: client.set(names[i], record),
                            Sealer(AuthConfig(K1)))

        native = launch(spec(model, signed, rounds=({}, {"pause": True, "reset_prefix_cache": True,
                                                         "reset_connector": True}), native=True),
                        tmp_path, env=ENV, before_round={1: plant})
        assert tokens(native, 0) == expected and tokens(native, 1) == expected
        assert sorted(cached(native, 1)) == [0] * 3 + [BLOCK] * 6, cached(native, 1)
        assert metric(native, 1, "kvtier_offload_failed_reads", "unauthenticated") == 3
    finally:
        server.kill()


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


def test_a_tampered_root_and_redis_cost_only_misses(model, expected, tmp_path):
    """Issue 38 (hostile store), several attacks at once on a shared root and a Redis server that a
    first engine filled (plain records, kvtier's connector, disk + Redis): the index snapshot is a
    FIFO; one prompt's record is a FIFO; another's a symlink to a valid copy outside the root, and its
    Redis value 256 MiB; a third's leaf directory moved outside and replaced by a symlink, beside
    a dead writer's temp file and a stray ``.bin`` there. A second engine starts (no hang: the FIFOs
    are ignored or quarantined, never opened for reading), serves the FIFO's and the moved leaf's
    prompts from Redis, recomputes the prompt whose record is a symlink and whose Redis value is
    huge, and serves the other six from disk; then its cache reset (``keep_tiers_on_reset``: the
    host tier emptied) and a round served from the tiers. Outputs equal vLLM alone's; nothing outside the root is touched."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    server = RedisServer(tmp_path / "redis")
    try:
        client = server.client()
        tiers = [{"type": "fs", "root_dir": str(root), "capacity_bytes": 2**30},
                 {"type": "redis", "url": server.url()}]
        def whole_blocks(rounds=({},)) -> dict:  # one record per prompt
            run = spec(model, tiers, rounds)
            run["kv_connector_extra_config"]["offload_partial_blocks"] = False
            return run

        writer = launch(whole_blocks(), tmp_path)
        assert tokens(writer) == expected
        files = records(root)
        names = sorted(n for n in client.scan_iter(match=b"kvtier:*") if not n.endswith(b":config"))
        assert len(files) == 9 and len(names) == 9, (files, names)

        (snapshot,) = root.glob("*/index_g*.snapshot")
        snapshot.unlink()
        os.mkfifo(snapshot)
        fifo_record, linked_record, moved_record = files[:3]  # (three prompts: which ones does not matter)
        fifo_record.unlink()
        os.mkfifo(fifo_record)
        copy = outside / "copy.bin"
        copy.write_bytes(linked_record.read_bytes())
        linked_record.unlink()
        os.symlink(copy, linked_record)
        huge = next(n for n in names if n.endswith(decode_header(copy.read_bytes()).key.hex().encode()))
        client.setrange(huge, (256 << 20) - 1, b"x")
        leaf = moved_record.parent
        os.rename(leaf, outside / "leaf")
        os.symlink(outside / "leaf", leaf)
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        (outside / "leaf" / f"{moved_record.name}.{dead.pid}.0a0b.tmp").write_bytes(b"a dead writer's")
        (outside / "leaf" / "stray.bin").write_bytes(b"not kvtier's")
        before = {p: (p.read_bytes(), p.lstat().st_mtime_ns) for p in outside.rglob("*") if p.is_file()}

        reader = launch(whole_blocks(({}, {"reset_prefix_cache": True, "reset_connector": True})), tmp_path,
                        timeout=300)
        assert tokens(reader, 0) == expected and tokens(reader, 1) == expected
        served = cached(reader, 0)
        assert sorted(served) == [0] + [BLOCK] * 8, served  # the symlinked record whose Redis value is huge: recomputed
        assert metric(reader, 0, "kvtier_hit_tokens", "disk") == 6 * BLOCK  # the untouched records
        assert metric(reader, 0, "kvtier_hit_tokens", "remote") == 2 * BLOCK  # the FIFO's and the moved leaf's
        assert cached(reader, 1) == [BLOCK] * 9, cached(reader, 1)  # after the reset: every prompt from Redis
        assert sorted(p.name for p in (root / "quarantine").iterdir()) == sorted(
            f"{fifo_record.parent.parent.parent.name}__{f.stem}.bin" for f in (fifo_record, linked_record))
        assert {p: (p.read_bytes(), p.lstat().st_mtime_ns) for p in outside.rglob("*") if p.is_file()} == before
        assert leaf.is_symlink()  # ignored by the scan and by clear(), left where it was planted
        print(f"served after tampering: {served}; after the reset: {cached(reader, 1)}")
    finally:
        server.kill()
