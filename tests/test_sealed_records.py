"""Records authenticated with a fleet key (and encrypted per record) on the disk tier and on a real
redis-server: forged, re-signed, copied and replayed records are never served, and are counted.

The forger knows everything public: the model (so the namespace digests of every rank), the
tokens (so the block keys) and the record format. It writes the store directly, as a node holding
the store's credentials (or a user with write access to the root) can.
"""

from __future__ import annotations

import os
import random
import struct
import time
from pathlib import Path

import pytest
import redis
from support.redis_server import redis_factory  # noqa: F401  (pytest fixture)

from kvtier.core.fleet_key import AuthConfig, FleetKey, parse_auth
from kvtier.core.tier_config import RedisTierConfig, parse_secondary_tiers, parse_tier, TierType
from kvtier.core.values import ConfigError
from kvtier.tiers.base import IoError, IoKind, IoResult
from kvtier.tiers.blockfile import HEADER_LEN, CorruptBlockError, decode_header, sealed_header_sum
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.redis import KeySpace, RedisTier
from kvtier.tiers.sealing import PLAIN, KeyState, Sealer, UnauthenticatedRecord

PAYLOAD = 4096
ENGINE = bytes(range(32))
PARENT = b"\x00" * 32
NS_JSON = '{"model_name":"test","tp_size":2}'
K1 = FleetKey(bytes(range(100, 132)), "test K1")
K2 = FleetKey(bytes(range(200, 232)), "test K2")
ATTACKER = FleetKey(bytes(range(1, 33)), "attacker")


def rank_digests(world: int) -> list[bytes]:
    return [bytes([0xA0 + rank]) * 32 for rank in range(world)]


def key_of(n: int) -> bytes:
    return bytes([n % 251]) + n.to_bytes(4, "little") + b"\x5a" * 27


def payload_of(key: bytes, rank: int) -> bytes:
    return random.Random(key + bytes([rank])).randbytes(PAYLOAD)


def auth(write: FleetKey = K1, *, read: tuple[FleetKey, ...] = (), encrypt: bool = False) -> AuthConfig:
    return AuthConfig(write=write, read=read, encrypt=encrypt)


def wait_results(tier, n: int, timeout: float = 30.0) -> list[IoResult]:
    results: list[IoResult] = []
    deadline = time.monotonic() + timeout
    while len(results) < n:
        results += tier.poll()
        assert time.monotonic() < deadline, f"only {len(results)} of {n} completions after {timeout}s"
        time.sleep(0.001)
    return results


def write(tier, key: bytes, world: int = 1) -> None:
    assert tier.submit_write(1, key, PARENT, 64, [memoryview(payload_of(key, r)) for r in range(world)])
    (result,) = wait_results(tier, 1)
    assert result.ok, result


def read(tier, key: bytes, world: int = 1) -> tuple[IoResult, list[bytes]]:
    dests = [bytearray(PAYLOAD) for _ in range(world)]
    tier.submit_read(2, key, [memoryview(d) for d in dests])
    while True:
        (result,) = [r for r in wait_results(tier, 1) if r.kind is IoKind.READ] or [None]
        if result is not None:
            return result, [bytes(d) for d in dests]


def served(result: IoResult, data: list[bytes], key: bytes) -> bool:
    return result.ok and data == [payload_of(key, r) for r in range(len(data))]


def record(sealer: Sealer, key: bytes, rank: int, *, namespace: bytes | None = None, payload: bytes | None = None,
           world: int = 1) -> bytes:
    """One rank's record of ``key`` as ``sealer`` writes it (the forger's tool: the public format)."""
    namespace = namespace if namespace is not None else rank_digests(world)[rank]
    header, body = sealer.seal(namespace=namespace, key=key, parent=PARENT, num_tokens=64,
                               source=memoryview(payload if payload is not None else payload_of(key, rank)))
    return header + bytes(body)


def forgeries(key: bytes, rank: int = 0, world: int = 1) -> dict[str, bytes]:
    """What an attacker with write access plants for ``key``: a payload of its choosing (here: zeros)
    with right magic, namespace, key and checksums and no MAC; the same signed under its own key."""
    evil = bytes(PAYLOAD)
    return {
        "no MAC": record(PLAIN, key, rank, payload=evil, world=world),
        "MAC under another key": record(Sealer(auth(ATTACKER)), key, rank, payload=evil, world=world),
        "encrypted under another key": record(Sealer(auth(ATTACKER, encrypt=True)), key, rank, payload=evil,
                                              world=world),
    }


def retarget(raw: bytes, *, key: bytes | None = None, namespace: bytes | None = None) -> bytes:
    """``raw`` with its header's key / namespace rewritten (a copy made to look native: its public
    header sum recomputed, as a forger can)."""
    out = bytearray(raw)
    if namespace is not None:
        out[8:40] = namespace
    if key is not None:
        out[40:72] = key
    return resum(out)


def resum(raw: bytes | bytearray) -> bytes:
    """A sealed header's (public) header sum recomputed after an edit."""
    out = bytearray(raw)
    if decode_alg(out) in (2, 3):
        struct.pack_into("<Q", out, 92, sealed_header_sum(out))
    return bytes(out)


def decode_alg(raw: bytes | bytearray) -> int:
    return struct.unpack_from("<H", raw, 108)[0]


# ---------------------------------------------------------------- configuration


def test_fleet_key_config_errors_name_the_key(tmp_path, monkeypatch):
    good = "ab" * 4 + bytes(range(28)).hex()
    monkeypatch.setenv("KV_FLEET", good)
    monkeypatch.setenv("KV_BAD", "not-a-key")
    where = "secondary_tiers[0]"
    cases = [
        ({"auth_key_env": "KV_MISSING"}, "'secondary_tiers[0].auth_key_env' names the environment variable"),
        ({"auth_key_env": "KV_BAD"}, "'secondary_tiers[0].auth_key_env' (KV_BAD) does not hold a valid fleet key"),
        ({"auth_key_env": good}, "'secondary_tiers[0].auth_key_env' must be the NAME"),
        ({"auth_key_file": str(tmp_path / "nope")}, "'secondary_tiers[0].auth_key_file' = "),
        ({"auth_key_env": "KV_FLEET", "auth_key_file": "/x"}, "are both set"),
        ({"encrypt": True}, "'secondary_tiers[0].encrypt' needs a fleet key"),
        ({"auth_read_key_envs": ["KV_FLEET"]}, "'secondary_tiers[0].auth_read_key_envs' needs a fleet key"),
        ({"auth_key_env": "KV_FLEET", "auth_read_key_envs": ["KV_FLEET"]}, "listed twice"),
        ({"auth_key_env": "KV_FLEET", "auth_read_key_envs": "KV_FLEET"}, "must be a list"),
    ]
    for raw, message in cases:
        with pytest.raises(ConfigError) as caught:
            parse_auth(raw, where)
        assert message in str(caught.value), (raw, str(caught.value))
        assert good not in str(caught.value)
    assert parse_auth({}, where) is None


def test_fleet_key_loaded_from_env_or_file_and_never_printed(tmp_path, monkeypatch):
    secret, old = bytes(range(50, 82)), bytes(range(150, 182))
    monkeypatch.setenv("KV_FLEET", secret.hex())
    (tmp_path / "old.key").write_text(old.hex().upper() + "\n")
    fs = {"type": "fs", "root_dir": str(tmp_path / "root"), "capacity_bytes": 10**6, "auth_key_env": "KV_FLEET",
          "auth_read_key_files": [str(tmp_path / "old.key")], "encrypt": True}
    rd = {"type": "redis", "url": "redis://h:6379/0", "auth_key_file": str(tmp_path / "old.key")}
    disk, remote = parse_secondary_tiers([fs, rd])
    assert disk.auth.write.secret == secret and [k.secret for k in disk.auth.read] == [old] and disk.auth.encrypt
    assert remote.auth.write.secret == old and not remote.auth.encrypt
    native = parse_tier({k: v for k, v in fs.items() if k != "type"}, TierType.FS, "kvtier_disk")
    assert native.auth.write.secret == secret
    for text in (repr(disk), repr(remote), repr(disk.auth), str(native)):
        assert secret.hex() not in text.lower() and old.hex() not in text.lower()
        assert "env KV_FLEET" in text or "old.key" in text


# ---------------------------------------------------------------- the sealer


@pytest.mark.parametrize("size", [1, 15, 16, 17, 4096, (1 << 20) + 7])
@pytest.mark.parametrize("encrypt", [False, True])
def test_sealed_round_trip_rotation_and_tamper(size, encrypt):
    key, ns = key_of(1), rank_digests(1)[0]
    data = os.urandom(size)
    writer = Sealer(auth(K1, encrypt=encrypt))
    header, body = writer.seal(namespace=ns, key=key, parent=PARENT, num_tokens=3, source=memoryview(data))
    assert len(header) == HEADER_LEN and (bytes(body) != data) is encrypt
    decoded = decode_header(header)
    for reader in (writer, Sealer(auth(K2, read=(K1,)))):  # the write key, or a retired key still listed
        dest = memoryview(bytearray(size))
        opener = reader.opener(decoded, header)
        opener.land(memoryview(bytes(body)), dest)
        opener.finish()
        assert bytes(dest) == data
    assert Sealer(auth(K2, read=(K1,))).key_state(decoded) is KeyState.RETIRED
    assert writer.key_state(decoded) is KeyState.CURRENT
    for refusing in (Sealer(auth(K2)), PLAIN):
        with pytest.raises(UnauthenticatedRecord):
            refusing.opener(decoded, header)
    for flip in (20, 60, 84, 101, 104, 112):  # namespace, key, nonce, zero, tokens, length: under the tag
        bad = bytearray(header)
        bad[flip] ^= 1
        with pytest.raises(CorruptBlockError, match="header checksum mismatch"):  # damage: corrupt
            decode_header(bytes(bad))
        bad = resum(bad)  # made on purpose (the header sum is public): unauthenticated
        opener = writer.opener(decode_header(bytes(bad)), bytes(bad))
        opener.land(memoryview(bytes(body)), memoryview(bytearray(size)))
        with pytest.raises(UnauthenticatedRecord):
            opener.finish()
    tampered = bytearray(body)
    tampered[size // 2] ^= 0x80
    opener = writer.opener(decoded, header)
    opener.land_in_place(memoryview(tampered))
    with pytest.raises(UnauthenticatedRecord):
        opener.finish()


def test_damage_is_corrupt_and_forgery_unauthenticated():
    """A plain record whose checksum_alg is flipped to a sealed one is damage (its header sum
    fails), not a record of another kind; a sealed header damaged anywhere is too."""
    plain = bytearray(record(PLAIN, key_of(3), 0))
    for alg in (2, 3):
        struct.pack_into("<H", plain, 108, alg)
        with pytest.raises(CorruptBlockError) as caught:
            decode_header(bytes(plain))
        assert not isinstance(caught.value, UnauthenticatedRecord)
    sealed = bytearray(record(Sealer(auth(K1)), key_of(3), 0))
    sealed[95] ^= 4  # the header sum itself
    with pytest.raises(CorruptBlockError, match="header checksum mismatch"):
        decode_header(bytes(sealed))


def test_keyed_reader_refuses_plain_records_and_keyless_reader_refuses_sealed():
    key, ns = key_of(2), rank_digests(1)[0]
    plain = record(PLAIN, key, 0)
    with pytest.raises(UnauthenticatedRecord, match="carries no MAC"):
        Sealer(auth(K1)).opener(decode_header(plain), plain)
    sealed = record(Sealer(auth(K1)), key, 0)
    with pytest.raises(UnauthenticatedRecord, match="has none to check it"):
        PLAIN.opener(decode_header(sealed), sealed)
    del ns


# ---------------------------------------------------------------- disk tier


@pytest.fixture
def disk(tmp_path):
    made: list[DiskTier] = []

    def make(sealer: Sealer = PLAIN, *, world: int = 1, root: Path | None = None) -> DiskTier:
        tier = DiskTier(root_dir=root or tmp_path / "root", model_name="test/model", engine_digest=ENGINE,
                        rank_digests=rank_digests(world), namespace_json=NS_JSON, payload_bytes=PAYLOAD,
                        capacity_bytes=64 * world * (HEADER_LEN + PAYLOAD), n_read_threads=2, n_write_threads=2,
                        max_pending_writes=16, sealer=sealer)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def plant(tier: DiskTier, key: bytes, rank: int, raw: bytes) -> None:
    path = tier.block_path(key, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(raw)


@pytest.mark.parametrize("encrypt", [False, True])
def test_disk_forged_records_are_never_served(disk, encrypt):
    tier = disk(Sealer(auth(K1, encrypt=encrypt)))
    for n, what in enumerate(forgeries(key_of(0))):
        key = key_of(10 + n)
        plant(tier, key, 0, forgeries(key)[what])
        result, data = read(tier, key)
        assert not result.ok and result.error is IoError.UNAUTHENTICATED, (what, result)
        assert not tier.block_path(key, 0).exists(), what  # quarantined
    assert tier.stats.unauthenticated == 3 and tier.stats.reads_ok == 0


@pytest.mark.parametrize("encrypt", [False, True])
def test_disk_valid_record_copied_under_another_key_or_rank_fails(disk, encrypt):
    sealer = Sealer(auth(K1, encrypt=encrypt))
    tier = disk(sealer, world=2)
    a, b, c = key_of(20), key_of(21), key_of(22)
    write(tier, a, world=2)
    result, data = read(tier, a, world=2)
    assert served(result, data, a)
    rank0, rank1 = (tier.block_path(a, r).read_bytes() for r in range(2))
    # Under another key, as copied, and with the header's key rewritten to match.
    plant(tier, b, 0, rank0)
    plant(tier, b, 1, rank1)
    plant(tier, c, 0, retarget(rank0, key=c))
    plant(tier, c, 1, retarget(rank1, key=c))
    # Rank 1's record in rank 0's place of a's block, as copied and with the namespace rewritten.
    d, e = key_of(23), key_of(24)
    write(tier, d, world=2)
    write(tier, e, world=2)
    d1, e1 = tier.block_path(d, 1).read_bytes(), tier.block_path(e, 1).read_bytes()
    plant(tier, d, 0, d1)
    plant(tier, e, 0, retarget(e1, namespace=rank_digests(2)[0]))
    outcomes = {k: read(tier, k, world=2) for k in (b, c, d, e)}
    for k, (result, data) in outcomes.items():
        assert not result.ok, k.hex()[:8]
    # As copied, the header names another key / rank: a failed check. Made to look native: the tag fails.
    assert outcomes[b][0].error is IoError.CORRUPT and outcomes[d][0].error is IoError.CORRUPT
    assert outcomes[c][0].error is IoError.UNAUTHENTICATED and outcomes[e][0].error is IoError.UNAUTHENTICATED
    assert tier.stats.unauthenticated == 2


def test_disk_tenant_record_replayed_under_another_tenants_key_fails(disk):
    """Tenants differ by cache_salt, which is chained into every block key: tenant B's key for the
    same tokens is another key, so A's record (encrypted under a key derived from A's block key)
    replayed under B's key fails, whether the header is left or rewritten."""
    from kvtier.core.keys import BlockExtras, chain_block_keys

    tokens = list(range(64))
    (key_a,) = chain_block_keys(ENGINE, tokens, 64, BlockExtras(cache_salt="tenant-a"))
    (key_b,) = chain_block_keys(ENGINE, tokens, 64, BlockExtras(cache_salt="tenant-b"))
    assert key_a != key_b
    tier = disk(Sealer(auth(K1, encrypt=True)))
    write(tier, key_a)
    raw = tier.block_path(key_a, 0).read_bytes()
    assert payload_of(key_a, 0)[:64] not in raw  # encrypted at rest
    plant(tier, key_b, 0, retarget(raw, key=key_b))
    result, _ = read(tier, key_b)
    assert not result.ok and result.error is IoError.UNAUTHENTICATED
    assert served(*read(tier, key_a), key_a)


def test_disk_mixed_fleet_fails_safe_and_rotation(disk, tmp_path):
    root = tmp_path / "shared"
    keyless = disk(PLAIN, root=root)
    keyed = disk(Sealer(auth(K1)), root=root)
    p, s = key_of(30), key_of(31)
    write(keyless, p)
    write(keyed, s)
    for tier, key in ((keyed, p), (keyless, s)):  # each refuses the other's records
        result, _ = read(tier, key)
        assert not result.ok and result.error is IoError.UNAUTHENTICATED, (tier, result)
    # Rotation: records under K1 are read while K1 is listed for reading, missed once it is not.
    r1 = key_of(32)
    write(keyed, r1)
    rotated = disk(Sealer(auth(K2, read=(K1,))), root=root)
    assert served(*read(rotated, r1), r1)
    dropped = disk(Sealer(auth(K2)), root=root)
    result, _ = read(dropped, r1)
    assert not result.ok and result.error is IoError.UNAUTHENTICATED


# ---------------------------------------------------------------- Redis tier (a real redis-server)


@pytest.fixture
def remote(redis_factory):  # noqa: F811
    server = redis_factory()
    made: list[RedisTier] = []

    def make(sealer_auth: AuthConfig | None = None, *, world: int = 1, **kw) -> RedisTier:
        config = RedisTierConfig(url=server.url(), timeout_s=2.0, connect_timeout_s=2.0, auth=sealer_auth)
        tier = RedisTier(config, engine_digest=ENGINE, rank_digests=rank_digests(world), namespace_json=NS_JSON,
                         payload_bytes=PAYLOAD, **kw)
        made.append(tier)
        return tier

    make.client = redis.Redis.from_url(server.url())
    yield make
    for tier in made:
        tier.close()
    make.client.close()


def name_of(key: bytes) -> bytes:
    return KeySpace.of("kvtier", ENGINE).block(key)


@pytest.mark.parametrize("encrypt, piece_bytes", [(False, None), (True, None), (True, 1000), (False, 1000)])
def test_redis_forged_values_are_never_served(remote, encrypt, piece_bytes):
    tier = remote(auth(K1, encrypt=encrypt), **({"piece_bytes": piece_bytes} if piece_bytes else {}))
    for n, what in enumerate(forgeries(key_of(0))):
        key = key_of(40 + n)
        remote.client.set(name_of(key), forgeries(key)[what])
        result, data = read(tier, key)
        assert not result.ok and result.error is IoError.UNAUTHENTICATED, (what, result)
        assert remote.client.exists(name_of(key)) == 0, what  # deleted
    assert tier.stats.unauthenticated == 3 and tier.stats.reads_ok == 0
    good = key_of(49)
    write(tier, good)
    assert served(*read(tier, good), good)


@pytest.mark.parametrize("encrypt", [False, True])
def test_redis_value_copied_under_another_key_rank_or_tenant_fails(remote, encrypt):
    tier = remote(auth(K1, encrypt=encrypt), world=2)
    a, b, c = key_of(50), key_of(51), key_of(52)
    write(tier, a, world=2)
    value = remote.client.get(name_of(a))
    rec = HEADER_LEN + PAYLOAD
    r0, r1 = value[:rec], value[rec:]
    remote.client.set(name_of(b), value)  # as copied
    remote.client.set(name_of(c), retarget(r0, key=c) + retarget(r1, key=c))  # made to look native
    d = key_of(53)
    remote.client.set(name_of(d), retarget(r1, key=d, namespace=rank_digests(2)[0])
                      + retarget(r0, key=d, namespace=rank_digests(2)[1]))  # ranks swapped
    errors = {}
    for k in (b, c, d):
        result, _ = read(tier, k, world=2)
        assert not result.ok
        errors[k] = result.error
    assert errors == {b: IoError.CORRUPT, c: IoError.UNAUTHENTICATED, d: IoError.UNAUTHENTICATED}
    assert served(*read(tier, a, world=2), a)


def test_redis_mixed_fleet_and_rotation(remote):
    keyless, keyed = remote(None), remote(auth(K1))
    p, s = key_of(60), key_of(61)
    write(keyless, p)
    write(keyed, s)
    result, _ = read(keyed, p)
    assert result.error is IoError.UNAUTHENTICATED
    result, _ = read(keyless, s)
    assert result.error is IoError.UNAUTHENTICATED
    r = key_of(62)
    write(keyed, r)
    assert served(*read(remote(auth(K2, read=(K1,))), r), r)
    result, _ = read(remote(auth(K2)), r)
    assert result.error is IoError.UNAUTHENTICATED
    assert remote.client.get(name_of(r)) is None  # removed by the reader that cannot accept it


def test_redis_encrypted_values_hold_no_plaintext(remote):
    tier = remote(auth(K1, encrypt=True), world=2)
    key = key_of(70)
    write(tier, key, world=2)
    value = remote.client.get(name_of(key))
    assert len(value) == 2 * (HEADER_LEN + PAYLOAD)
    for rank in range(2):
        assert payload_of(key, rank)[:32] not in value
    assert served(*read(tier, key, world=2), key)


# ---------------------------------------------------------------- kvtier verify / purge with fleet keys


def _cli(*args: str, env: dict[str, str]) -> tuple[int, str]:
    from click.testing import CliRunner

    from kvtier.cli.main import main

    result = CliRunner().invoke(main, [str(a) for a in args], env=env)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, result.output


def _toy(world: int = 2):
    from support.namespaces import toy_namespace

    return toy_namespace(layers=2, kv_heads=2, head_size=64, block_tokens=16, kv_dtype="bfloat16", tp_size=world)


KEYS_ENV = {"KV_K1": K1.secret.hex(), "KV_K2": K2.secret.hex()}


def _fill(tier, keys, world: int = 2) -> None:
    for i, key in enumerate(keys):
        assert tier.submit_write(i, key, PARENT, 16, [memoryview(os.urandom(PAYLOAD)) for _ in range(world)])
    assert all(r.ok for r in wait_results(tier, len(keys)))


def test_verify_names_records_under_retired_keys_and_purge_removes_them_on_disk(tmp_path):
    ns = _toy()
    root = tmp_path / "root"

    def tier(sealer: Sealer) -> DiskTier:
        return DiskTier(root_dir=root, model_name="toy", engine_digest=ns.digest, rank_digests=ns.rank_digests(),
                        namespace_json=ns.config_json("toy"), payload_bytes=PAYLOAD, capacity_bytes=1 << 22,
                        n_read_threads=1, n_write_threads=1, max_pending_writes=16, sealer=sealer)

    old, new = tier(Sealer(auth(K1))), tier(Sealer(auth(K2, read=(K1,))))
    _fill(old, [key_of(i) for i in range(3)])
    _fill(new, [key_of(i) for i in range(3, 5)])
    old.close(), new.close()
    files = sorted(p for p in root.rglob("*.bin") if "quarantine" not in p.parts)
    assert len(files) == 10
    code, out = _cli("verify", root, "--json", env=KEYS_ENV)  # no key: sealed records are left alone
    assert code == 0 and json_of(out)["sealed_unchecked"] == 10 and json_of(out)["quarantined"] == 0
    code, out = _cli("verify", root, "--auth-key-env", "KV_K2", "--read-key-env", "KV_K1", env=KEYS_ENV)
    assert code == 0 and f"6 records under retired key {K1.key_id.hex()}" in out, out
    assert K1.secret.hex() not in out and K2.secret.hex() not in out
    code, out = _cli("verify", root, "--auth-key-env", "KV_K2", "--json", env=KEYS_ENV)  # K1 no longer listed
    assert code == 1 and json_of(out)["quarantined"] == 6 and json_of(out)["files_ok"] == 4
    _fill(tier(Sealer(auth(K1))), [key_of(i) for i in range(3)])  # written again under K1
    code, out = _cli("purge", root, "--retired", "--auth-key-env", "KV_K2", "--json", env=KEYS_ENV)
    assert code == 0 and json_of(out)["files"] == 6, out
    code, out = _cli("verify", root, "--auth-key-env", "KV_K2", "--json", env=KEYS_ENV)
    assert code == 0 and json_of(out)["files_ok"] == 4
    code, out = _cli("purge", root, "--retired", env=KEYS_ENV)
    assert code == 2 and "--retired needs the current fleet key" in out


def test_verify_and_purge_with_fleet_keys_on_redis(redis_factory):  # noqa: F811
    from kvtier.cachetools.remote import RemoteTarget, verify_remote

    server = redis_factory()
    ns = _toy()

    def tier(a: AuthConfig) -> RedisTier:
        return RedisTier(RedisTierConfig(url=server.url(), auth=a), engine_digest=ns.digest,
                         rank_digests=ns.rank_digests(), namespace_json=ns.config_json("toy"), payload_bytes=PAYLOAD)

    for a, keys in ((auth(K1), range(3)), (auth(K2, encrypt=True), range(3, 5))):
        t = tier(a)
        _fill(t, [key_of(i) for i in keys])
        t.close()
    report = verify_remote(RemoteTarget(server.url()), delete=True)
    assert report.ok and report.sealed_unchecked == 5
    report = verify_remote(RemoteTarget(server.url()), auth=auth(K2, read=(K1,)))
    assert report.ok and report.retired == {K1.key_id.hex(): 3} and report.files_ok == 5
    code, out = _cli("purge", server.url(), "--retired", "--auth-key-env", "KV_K2", "--json", env=KEYS_ENV)
    assert code == 0 and json_of(out)["files"] == 3, out
    report = verify_remote(RemoteTarget(server.url()), auth=auth(K2))
    assert report.ok and report.files_ok == 2


def json_of(out: str) -> dict:
    import json

    return json.loads(out)


# ---------------------------------------------------------------- kvtier doctor


def _doctor(tiers: list[dict]) -> dict[str, list]:
    import json

    from kvtier.doctor.audit import audit

    tc = json.dumps({"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.vllm",
                     "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": 2**30,
                                                                         "secondary_tiers": tiers}})
    found: dict[str, list] = {}
    for f in audit(["vllm", "serve", "M", "--max-model-len", "4096", "--kv-transfer-config", tc]):
        found.setdefault(f.code, []).append(f)
    return found


def test_doctor_flags_shared_stores_without_a_key_and_explains_a_mixed_fleet(tmp_path, monkeypatch,
                                                                            redis_factory):  # noqa: F811
    monkeypatch.setenv("KV_K1", K1.secret.hex())
    monkeypatch.setenv("KV_K2", K2.secret.hex())
    server = redis_factory()
    root = tmp_path / "root"
    root.mkdir()
    own = {"type": "fs", "root_dir": str(root), "capacity_bytes": 2**30}
    assert "fleet-key-missing" not in _doctor([own])  # an owner-only root: no one else writes there
    root.chmod(0o2770)
    (finding,) = _doctor([own])["fleet-key-missing"]
    assert finding.severity == "warning" and "secondary_tiers[0]" in finding.fix
    keyed_redis = {"type": "redis", "url": server.url(), "auth_key_env": "KV_K1"}
    found = _doctor([{**own, "auth_key_env": "KV_K1"}, {"type": "redis", "url": server.url()}])
    assert [f.title for f in found["fleet-key-missing"]] == [f"Redis tier {server.url()} has no fleet key"]
    assert "fleet-key-missing" not in _doctor([{**own, "auth_key_env": "KV_K1"}, keyed_redis])
    # A mixed fleet: records without a MAC and under K1 in both stores.
    disk_tier = DiskTier(root_dir=root, model_name="m", engine_digest=ENGINE, rank_digests=rank_digests(1),
                         namespace_json=NS_JSON, payload_bytes=PAYLOAD, capacity_bytes=1 << 22, n_read_threads=1,
                         n_write_threads=1, max_pending_writes=8)
    _fill(disk_tier, [key_of(1), key_of(2)], world=1)
    disk_tier.close()
    redis_tier = RedisTier(RedisTierConfig(url=server.url(), auth=auth(K1)), engine_digest=ENGINE,
                           rank_digests=rank_digests(1), namespace_json=NS_JSON, payload_bytes=PAYLOAD)
    _fill(redis_tier, [key_of(3)], world=1)
    redis_tier.close()
    found = _doctor([{**own, "auth_key_env": "KV_K2"}, {"type": "redis", "url": server.url(), "auth_key_env": "KV_K2"}])
    disk_mixed, redis_mixed = found["fleet-mixed"]
    assert "2 carry no MAC" in disk_mixed.why and K2.key_id.hex() in disk_mixed.why
    assert f"under key ids {K1.key_id.hex()}" in redis_mixed.why
    rotating = _doctor([{**own, "auth_key_env": "KV_K2"}, {
        "type": "redis", "url": server.url(), "auth_key_env": "KV_K2", "auth_read_key_envs": ["KV_K1"]}])
    assert [f.title.startswith(str(root)) for f in rotating["fleet-mixed"]] == [True]  # K1 listed: Redis agrees
    (keyless,) = [f for f in _doctor([{"type": "redis", "url": server.url()}])["fleet-mixed"]]
    from kvtier.doctor.fleet_checks import record_kind  # its own reading of the header, against the tiers'

    for sealer, expected in ((PLAIN, "plain"), (Sealer(auth(K1)), K1.key_id.hex()),
                             (Sealer(auth(K2, encrypt=True)), K2.key_id.hex())):
        raw = record(sealer, key_of(5), 0)
        assert record_kind(raw[:HEADER_LEN]) == expected == (decode_header(raw).key_id.hex() or "plain")
    assert record_kind(b"KVTB" + bytes(200)) is None and record_kind(b"junk") is None
    assert "has none" in keyless.title
    for findings in found.values():
        for f in findings:
            assert K1.secret.hex() not in f.why + f.fix and K2.secret.hex() not in f.why + f.fix
    monkeypatch.delenv("KV_K2")
    assert "fleet-key-unloadable" in _doctor([{**own, "auth_key_env": "KV_K2"}])


def test_kvtier_serve_flags_put_the_fleet_key_on_every_tier(tmp_path, monkeypatch):
    from kvtier.launch.command import ServeConfigError, ServeOptions, build_extra_config

    monkeypatch.setenv("KV_K1", K1.secret.hex())
    extra = build_extra_config(ServeOptions(disk_dir=str(tmp_path / "kv"), redis_url="redis://h:6379/0",
                                            fleet_key_env="KV_K1", encrypt=True))
    disk, remote = parse_secondary_tiers(extra["secondary_tiers"])
    assert disk.auth.write.secret == K1.secret and disk.auth.encrypt and remote.auth.write.secret == K1.secret
    with pytest.raises(ServeConfigError, match="--encrypt needs a fleet key"):
        build_extra_config(ServeOptions(disk_dir=str(tmp_path / "kv"), encrypt=True))
    # kvtier doctor reads the same flags from a kvtier serve line
    from kvtier.doctor.audit import audit

    line = ["kvtier", "serve", "--disk-dir", str(tmp_path / "kv"), "--redis-url", "redis://127.0.0.1:1/0",
            "--max-model-len", "4096"]
    assert any(f.code == "fleet-key-missing" and "Redis" in f.title for f in audit(line))
    keyed = line[:2] + ["--fleet-key-env", "KV_K1", "--encrypt"] + line[2:]
    assert not any(f.code in ("fleet-key-missing", "kvtier-config") for f in audit(keyed))
