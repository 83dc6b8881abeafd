"""RedisTier against real redis-server processes (tests/support/redis_server.py; no mocks of Redis),
plus its pure parts (value codec, circuit breaker, presence cache) on their own and its redis-py
client (pipelines, error replies as exceptions, the Python packer) against a real server."""

from __future__ import annotations

import logging
import os
import random
import sys
import threading
import time

import pytest
import redis
from support.redis_server import redis_factory  # noqa: F401  (pytest fixture)

from kvtier.core.residency import ChangeKind, ResidencyLog
from kvtier.core.tier_config import RedisTierConfig
from kvtier.core.values import ConfigError
from kvtier.tiers.base import IoError, IoKind, IoResult, Medium, Presence
from kvtier.tiers.blockfile import HEADER_LEN, CorruptBlockError, encode_header, payload_checksum
from kvtier.tiers.redis import KeySpace, RedisTier, decode_value, encode_value
from kvtier.tiers.breaker import BreakerState, CircuitBreaker
import kvtier.tiers.redis.client as redis_client_module
from kvtier.tiers.redis.client import (
    COMMAND_PACKER,
    READER_SLACK,
    RedisClient,
    error_code,
    is_connection_failure,
    safe_text,
)
from kvtier.tiers.presence import PresenceCache
from kvtier.tiers.redis.jobs import PIECE_BYTES
from kvtier.tiers.redis.codec import PieceLander

PAYLOAD = 4096
ENGINE = bytes(range(32))
OTHER_ENGINE = bytes(range(1, 33))
PARENT = b"\x00" * 32
NS_JSON = '{"model_name":"test","tp_size":2}'
TIMEOUT = 0.5  # timeout_s and connect_timeout_s of the tiers under test


def rank_digests(world: int, engine: bytes = ENGINE) -> list[bytes]:
    return [bytes([engine[0] ^ 0xA0 ^ rank]) * 32 for rank in range(world)]


def key_of(n: int) -> bytes:
    return n.to_bytes(4, "little") + b"\x5a" * 28


def payload_of(key: bytes, rank: int, size: int = PAYLOAD) -> bytes:
    return random.Random(key + bytes([rank])).randbytes(size)


def config_for(server, **overrides) -> RedisTierConfig:
    args = {"url": server.url(), "timeout_s": TIMEOUT, "connect_timeout_s": TIMEOUT, **overrides}
    return RedisTierConfig(**args)


@pytest.fixture
def tiers():
    """``make(config, world=1, engine=ENGINE, payload=PAYLOAD, **kw)``; closes every tier a test made."""
    made: list[RedisTier] = []

    def make(
        config: RedisTierConfig, *, world: int = 1, engine: bytes = ENGINE, payload: int = PAYLOAD, **kw
    ):
        tier = RedisTier(
            config,
            engine_digest=engine,
            rank_digests=rank_digests(world, engine),
            namespace_json=NS_JSON,
            payload_bytes=payload,
            **kw,
        )
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


@pytest.fixture
def server(redis_factory):  # noqa: F811
    return redis_factory()


def wait_results(tier: RedisTier, n: int, timeout: float = 30.0) -> list[IoResult]:
    results: list[IoResult] = []
    deadline = time.monotonic() + timeout
    while len(results) < n:
        results += tier.poll()
        if len(results) >= n:
            break
        assert time.monotonic() < deadline, f"only {len(results)} of {n} completions after {timeout}s"
        time.sleep(0.001)
    return results


def wait_for(tier: RedisTier, condition, timeout: float = 30.0, what: str = "condition") -> float:
    """Poll the tier until ``condition()``; returns the seconds it took."""
    start = time.monotonic()
    while not condition():
        tier.poll()
        assert time.monotonic() - start < timeout, f"{what} not reached after {timeout}s"
        time.sleep(0.005)
    return time.monotonic() - start


def write_all(tier: RedisTier, keys, world: int = 1, payload: int = PAYLOAD) -> list[IoResult]:
    for job, key in enumerate(keys):
        sources = [memoryview(payload_of(key, rank, payload)) for rank in range(world)]
        assert tier.submit_write(job, key, PARENT, 128, sources)
    return wait_results(tier, len(keys))


def read_one(tier: RedisTier, key: bytes, world: int = 1, fill: int = 0xEE) -> tuple[IoResult, list[bytes]]:
    dests = [bytearray([fill]) * PAYLOAD for _ in range(world)]
    tier.submit_read(7, key, [memoryview(d) for d in dests])
    deadline = time.monotonic() + 30.0  # (a hang detector: a loaded machine may take seconds)
    while True:  # completions of jobs an earlier step left in flight are not this read's
        mine = [r for r in tier.poll() if r.kind is IoKind.READ and r.job_id == 7]
        if mine:
            break
        assert time.monotonic() < deadline, "the read did not complete in 30 s"
        time.sleep(0.001)
    (result,) = mine
    assert result.key == key
    return result, [bytes(d) for d in dests]


def probe_now(tier: RedisTier, keys) -> None:
    tier.probe(keys)
    wait_for(tier, lambda: all(tier.presence(k) is not Presence.UNKNOWN for k in keys), what="probe answers")


# ---------------------------------------------------------------- pure parts


def test_value_is_the_disk_block_file_bytes_rank_by_rank_and_every_check_bites():
    key, digests = key_of(1), rank_digests(2)
    payloads = [os.urandom(PAYLOAD), os.urandom(PAYLOAD)]
    parts = encode_value(digests, key, PARENT, 128, [memoryview(p) for p in payloads])
    value = b"".join(bytes(p) for p in parts)
    files = [
        encode_header(
            namespace=digests[r],
            key=key,
            parent=PARENT,
            num_tokens=128,
            payload_len=PAYLOAD,
            checksum=payload_checksum(payloads[r]),
        )
        + payloads[r]
        for r in range(2)
    ]
    assert value == files[0] + files[1] and len(value) == 2 * (HEADER_LEN + PAYLOAD)
    dests = [bytearray(PAYLOAD), bytearray(PAYLOAD)]
    decode_value(value, [memoryview(d) for d in dests], rank_digests=digests, key=key)
    assert [bytes(d) for d in dests] == payloads

    def broken(mutated: bytes, message: str, *, digests=digests, key=key) -> None:
        dests = [bytearray(b"\xee" * PAYLOAD) for _ in range(2)]
        with pytest.raises(CorruptBlockError, match=message):
            decode_value(mutated, [memoryview(d) for d in dests], rank_digests=digests, key=key)
        if "payload checksum" not in message:  # lengths and headers are checked before any copy
            assert dests == [bytearray(b"\xee" * PAYLOAD)] * 2

    broken(value[:-1], "value is")
    broken(value + b"x", "value is")
    broken(files[1] + files[0], "rank 0: namespace")  # ranks swapped
    broken(value, "header key", key=key_of(2))
    broken(value, "namespace", digests=rank_digests(2, OTHER_ENGINE))
    flipped = bytearray(value)
    flipped[-5] ^= 1
    broken(bytes(flipped), "rank 1: payload checksum")
    flipped = bytearray(value)
    flipped[20] ^= 1
    broken(bytes(flipped), "header checksum")

    space = KeySpace.of("kvtier", ENGINE)
    assert space.block(key) == b"kvtier:" + ENGINE.hex()[:16].encode() + b":" + key.hex().encode()
    assert space.config == b"kvtier:0001020304050607:config"
    assert space.block_key_of(space.block(key)) == key and space.block_key_of(space.config) is None


def test_breaker_opens_after_consecutive_failures_and_backs_off_exponentially():
    now = [0.0]
    opened = []
    breaker = CircuitBreaker(
        threshold=3,
        base_backoff=1.0,
        max_backoff=30.0,
        clock=lambda: now[0],
        on_open=lambda: opened.append(now[0]),
    )
    assert not breaker.failure() and not breaker.failure()
    breaker.success()  # consecutive only
    assert not breaker.failure() and not breaker.failure() and breaker.failure()
    assert not breaker.closed and breaker.opens == 1 and opened == [0.0]
    assert not breaker.begin_trial()  # back-off not over
    backoffs = []
    for _ in range(7):
        now[0] = breaker.retry_at()
        assert breaker.begin_trial() and breaker.state is BreakerState.HALF_OPEN
        breaker.end_trial(False)
        backoffs.append(breaker.backoff)
    assert backoffs == [2, 4, 8, 16, 30, 30, 30]
    assert not breaker.failure()  # failures while open change nothing
    now[0] = breaker.retry_at()
    assert breaker.begin_trial()
    breaker.end_trial(True)
    assert breaker.closed and breaker.backoff == 1.0 and breaker.opens == 1


def test_presence_cache_ttls_lru_bound_and_residency():
    now = [100.0]
    log = ResidencyLog(Medium.REMOTE)
    log.enable()
    cache = PresenceCache(log, present_ttl=30, absent_ttl=1, max_entries=2, clock=lambda: now[0])
    a, b, c = key_of(1), key_of(2), key_of(3)
    assert cache.get(a) is Presence.UNKNOWN
    assert cache.to_probe([a, a, b]) == [a, b] and cache.to_probe([a]) == []  # in flight: once
    cache.probed([a, b], [True, False])
    assert cache.get(a) is Presence.PRESENT and cache.get(b) is Presence.ABSENT
    now[0] += 1.5
    assert cache.get(b) is Presence.UNKNOWN and cache.get(a) is Presence.PRESENT
    cache.found(c)  # evicts the least recently updated (a): it was reported, so REMOVED
    assert cache.get(a) is Presence.UNKNOWN and len(cache) == 2
    cache.invalidate()
    assert cache.get(c) is Presence.UNKNOWN
    assert [(ch.kind, ch.key) for ch in log.take()] == [
        (ChangeKind.STORED, a),
        (ChangeKind.STORED, c),
        (ChangeKind.REMOVED, a),
    ]


def test_a_probe_in_flight_when_its_key_is_removed_is_not_taken():
    """The probe may have found the block before the DELETE reached the server: a delete's ABSENT
    stands, a clear's forgetting stands, and a later probe is taken again."""
    cache = PresenceCache(ResidencyLog(Medium.REMOTE), present_ttl=30, absent_ttl=1, clock=lambda: 100.0)
    a, b, c = key_of(1), key_of(2), key_of(3)
    assert cache.to_probe([a, b]) == [a, b]
    cache.missing(a)  # deleted while probed
    cache.probed([a, b], [True, True])
    assert cache.get(a) is Presence.ABSENT and cache.get(b) is Presence.PRESENT
    assert cache.to_probe([c]) == [c]
    cache.forget_all()  # cleared while probed
    cache.probed([c], [True])
    assert cache.get(c) is Presence.UNKNOWN
    assert cache.to_probe([c]) == [c]
    cache.probed([c], [True])
    assert cache.get(c) is Presence.PRESENT


# ---------------------------------------------------------------- redis-py client


def test_client_runs_one_pipeline_per_batch_with_error_replies_in_place(server, monkeypatch):
    client = RedisClient(config_for(server))
    client.connect()
    writes: list[bytes] = []
    send = redis.connection.AbstractConnection.send_packed_command

    def counting_send(self, command, check_health=True):
        chunks = [command] if isinstance(command, (bytes, str)) else list(command)
        writes.append(b"".join(bytes(chunk) for chunk in chunks))
        return send(self, chunks, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting_send)
    admin = server.client()
    admin.rpush(b"kvtier:list", b"x")
    value = os.urandom(70000)
    writes.clear()  # the admin client's own traffic
    try:
        replies = client.run(
            [
                (b"SET", b"kvtier:a", value),
                (b"GET", b"kvtier:a"),
                (b"GET", b"kvtier:missing"),
                (b"GET", b"kvtier:list"),
                (b"EXISTS", b"kvtier:a"),
                (b"EXPIRE", b"kvtier:a", 100),
                (b"UNLINK", b"kvtier:missing"),
            ]
        )
        # one write carrying all seven commands (the first's start, the last's end), one round trip
        assert len(writes) == 1 and replies.round_trips == 1
        assert writes[0].startswith(b"*3\r\n$3\r\nSET\r\n$8\r\nkvtier:a\r\n$70000\r\n")
        assert writes[0].endswith(b"*2\r\n$6\r\nUNLINK\r\n$14\r\nkvtier:missing\r\n")
        ok, got, missing, wrongtype, exists, expire, unlinked = replies
        assert ok == b"OK" and got == value and missing is None and exists == 1 and expire and unlinked == 0
        assert isinstance(wrongtype, redis.exceptions.ResponseError) and error_code(wrongtype) == "WRONGTYPE"
        assert not is_connection_failure(wrongtype)
        # The value went out as its own buffer (redis-py's Python packer does not copy it).
        pool = client.node_clients()[0].connection_pool
        conn = pool.get_connection()
        try:
            assert conn._command_packer is COMMAND_PACKER
            assert type(conn).__name__ == "GuardedConnection"  # exchanges have deadlines (deadline.py)
            assert any(chunk is value for chunk in conn.pack_commands([(b"SET", b"kvtier:a", value)]))
        finally:
            pool.release(conn)
        # A server that is gone: every command's reply is the connection failure, nothing raises.
        server.kill()
        replies = client.run([(b"GET", b"kvtier:a"), (b"EXISTS", b"kvtier:b")])
        assert all(
            isinstance(r, redis.exceptions.ConnectionError) and is_connection_failure(r) for r in replies
        )
    finally:
        client.close()


def test_logged_error_texts_never_carry_arguments():
    quoted = "Command # 1 (SET kvtier:ab \x01secret) of pipeline) of pipeline caused error: OOM no room"
    assert safe_text(quoted) == "Command # 1 of pipeline caused error: OOM no room"
    echoed = "ERR unknown command 'FOO', with args beginning with: 'secret'"
    assert "secret" not in safe_text(echoed)
    assert safe_text("bad magic b'\\x00KV' here") == "bad magic <bytes> here"
    # A hostile server's message: one log line, no terminal command (OSC 52 writes the clipboard).
    assert safe_text("ERR \x1b]52;c;Zm9v\x07 no\nkvtier redis: forged") == (
        "ERR \\x1b]52;c;Zm9v\\x07 no kvtier redis: forged")
    assert error_code(redis.exceptions.OutOfMemoryError("no room", status_code="OOM")) == "OOM"


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    "world, piece_bytes",
    [(1, PIECE_BYTES), (2, PIECE_BYTES), (1, 1000), (1, 100)],  # 100: the header spans two pieces
)
def test_round_trip_bit_exact_into_caller_buffers(server, tiers, world, piece_bytes):
    tier = tiers(config_for(server), world=world, piece_bytes=piece_bytes)
    assert tier._path.piecewise is (world == 1 and 2 * piece_bytes <= HEADER_LEN + PAYLOAD)
    assert tier.medium is Medium.REMOTE and tier.breaker.closed
    tier.residency.enable()
    keys = [key_of(n) for n in range(6)]
    results = write_all(tier, keys, world)
    assert all(r.ok and r.num_bytes == tier.value_bytes == world * (HEADER_LEN + PAYLOAD) for r in results)
    assert all(tier.presence(k) is Presence.PRESENT for k in keys) and tier.leading_run(keys) == 6
    admin = server.client()
    stored = admin.get(tier.keys.block(keys[0]))
    expected = b"".join(
        encode_header(
            namespace=rank_digests(world)[r],
            key=keys[0],
            parent=PARENT,
            num_tokens=128,
            payload_len=PAYLOAD,
            checksum=payload_checksum(payload_of(keys[0], r)),
        )
        + payload_of(keys[0], r)
        for r in range(world)
    )
    assert stored == expected  # exactly the disk tier's block files, rank by rank
    assert admin.ttl(tier.keys.block(keys[0])) == -1  # no ttl_seconds: no TTL
    assert admin.get(tier.keys.config) == NS_JSON.encode() and admin.ttl(tier.keys.config) == -1
    for key in keys:
        result, data = read_one(tier, key, world)
        assert result.ok and result.num_bytes == world * PAYLOAD
        assert data == [payload_of(key, rank) for rank in range(world)]
    stats = tier.stats
    assert (stats.writes_ok, stats.reads_ok, stats.corrupt, stats.io_errors) == (6, 6, 0, 0)
    assert stats.bytes_read == 6 * world * PAYLOAD and stats.bytes_written == 6 * tier.value_bytes
    assert [c.kind for c in tier.residency.take()] == [ChangeKind.STORED] * 6
    # A missing block is a NOT_FOUND miss; the buffer is not touched.
    result, data = read_one(tier, key_of(99), world)
    assert result.error is IoError.NOT_FOUND and data == [bytes([0xEE]) * PAYLOAD] * world
    assert tier.presence(key_of(99)) is Presence.ABSENT
    # Storing a block known present completes at once without a write.
    assert tier.submit_write(
        50, keys[0], PARENT, 128, [memoryview(payload_of(keys[0], r)) for r in range(world)]
    )
    (result,) = wait_results(tier, 1)
    assert result.ok and tier.stats.writes_deduped == 1 and tier.stats.writes_ok == 6
    u = tier.usage()
    assert u.medium is Medium.REMOTE and u.num_blocks is None and tier.evictions == 0
    # delete(): gone from the server and from what the tier answers; REMOVED recorded.
    tier.residency.take()
    assert tier.delete([keys[1], key_of(98)]) == 1
    assert tier.presence(keys[1]) is Presence.ABSENT
    assert [(c.kind, c.key) for c in tier.residency.take()] == [(ChangeKind.REMOVED, keys[1])]
    wait_for(tier, lambda: admin.exists(tier.keys.block(keys[1])) == 0, what="UNLINK")


def test_one_round_trip_per_batch_bounded_by_bytes(server, tiers, monkeypatch):
    tier = tiers(config_for(server))
    calls: list[int] = []
    run = tier._client.run

    def counting_run(commands, **options):
        calls.append(len(commands))
        return run(commands, **options)

    tier._client.run = counting_run
    executes: list[int] = []  # exchanges run (one round trip each), and their commands
    exchange = redis_client_module._pipeline
    monkeypatch.setattr(
        redis_client_module,
        "_pipeline",
        lambda node, commands, indexes, on_reply=None, **kw: (
            executes.append(len(indexes)),
            exchange(node, commands, indexes, on_reply, **kw),
        )[1],
    )
    keys = [key_of(n) for n in range(8)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(
        1.0
    )  # the caller's run of submissions is not interrupted (as in one scheduler step)
    try:
        for job, key in enumerate(keys):
            assert tier.submit_write(job, key, PARENT, 1, [memoryview(payload_of(key, 0))])
        wait_results(tier, 8)
        assert calls == [8] and executes[-1:] == [8]
        before = server.client().info("commandstats").get("cmdstat_getrange", {}).get("calls", 0)
        dests = [bytearray(PAYLOAD) for _ in keys]
        for job, key in enumerate(keys):
            tier.submit_read(job, key, [memoryview(dests[job])])
        assert all(r.ok for r in wait_results(tier, 8))
        assert calls == [8, 8] and tier.stats.read_batches == 1 and tier.stats.write_batches == 1
        assert executes[-2:] == [8, 8]  # one pipeline each: the writes, then the reads
        after = server.client().info("commandstats")["cmdstat_getrange"]["calls"]
        assert after - before == 8 and dests == [bytearray(payload_of(k, 0)) for k in keys]
    finally:
        sys.setswitchinterval(interval)

    small = tiers(config_for(server), batch_bytes=3 * tier.value_bytes)  # at most 3 values per batch
    calls.clear()
    small_run = small._client.run
    small._client.run = lambda commands, **options: (
        calls.append(len(commands)),
        small_run(commands, **options),
    )[1]
    executes.clear()
    sys.setswitchinterval(1.0)
    try:
        for job, key in enumerate(keys):
            small.submit_read(job, key, [memoryview(bytearray(PAYLOAD))])
        assert all(r.ok for r in wait_results(small, 8))
    finally:
        sys.setswitchinterval(interval)
    assert sorted(calls) == [2, 3, 3] and small.stats.read_batches == 3 and sorted(executes) == [2, 3, 3]


def test_presence_unknown_then_probe_then_present_or_absent(server, tiers):
    writer = tiers(config_for(server))
    reader = tiers(config_for(server), absent_ttl=1.0)  # (shorter: a stalled test saw ABSENT expire)
    reader.residency.enable()
    stored, missing = key_of(1), key_of(2)
    write_all(writer, [stored])
    assert reader.presence(stored) is Presence.UNKNOWN and not reader.contains(stored)
    reader.probe([stored, missing])
    reader.probe([stored, missing])  # in flight already: not probed twice
    probe_now(reader, [stored, missing])
    assert reader.presence(stored) is Presence.PRESENT and reader.contains(stored)
    assert reader.presence(missing) is Presence.ABSENT
    assert reader.stats.probes == 2 and reader.stats.probe_batches == 1
    reader.probe([stored])  # known: nothing to do
    assert reader.stats.probes == 2
    time.sleep(1.05)
    assert reader.presence(missing) is Presence.UNKNOWN  # ABSENT answers expire quickly
    assert [(c.kind, c.key) for c in reader.residency.take()] == [(ChangeKind.STORED, stored)]
    result, data = read_one(reader, stored)
    assert result.ok and data == [payload_of(stored, 0)]


# ---------------------------------------------------------------- verification


def _garbage(value: bytes, other: bytes) -> bytes:
    return os.urandom(len(value))


def _truncated(value: bytes, other: bytes) -> bytes:
    return value[:-100]


def _bit_flip(value: bytes, other: bytes) -> bytes:
    flipped = bytearray(value)
    flipped[HEADER_LEN + 17] ^= 0x01
    return bytes(flipped)


def _other_key(value: bytes, other: bytes) -> bytes:
    return other  # a valid value of another block, copied over this one


def _longer(value: bytes, other: bytes) -> bytes:
    return value + b"\x00"


@pytest.mark.parametrize("piece_bytes", [PIECE_BYTES, 1000])
@pytest.mark.parametrize(
    "mutate", [_garbage, _truncated, _longer, _bit_flip, _other_key, "other_namespace", "list"]
)
def test_corrupt_values_are_never_served_counted_and_deleted(server, tiers, mutate, piece_bytes, caplog):
    tier = tiers(config_for(server), piece_bytes=piece_bytes)
    tier.residency.enable()
    key, other = key_of(1), key_of(2)
    write_all(tier, [key, other])
    admin = server.client()
    name = tier.keys.block(key)
    if mutate == "other_namespace":  # the same block key stored by an engine of another namespace
        foreign = tiers(config_for(server), engine=OTHER_ENGINE)
        write_all(foreign, [key])
        admin.set(name, admin.get(foreign.keys.block(key)))
    elif mutate == "list":
        admin.delete(name)
        admin.rpush(name, b"x")
    else:
        admin.set(name, mutate(admin.get(name), admin.get(tier.keys.block(other))))
    tier.residency.take()
    with caplog.at_level(logging.WARNING):
        result, data = read_one(tier, key, fill=0xEE)
    assert "corrupt value for block" in caplog.text and "\\x" not in caplog.text  # no value bytes
    assert not result.ok and result.error is IoError.CORRUPT
    if mutate is not _bit_flip and not tier._path.piecewise:  # a whole value's length and headers
        assert data == [bytes([0xEE]) * PAYLOAD]  # are checked before anything is copied
    # (a payload is checked as it is copied: the read is not ok, so the caller discards its buffer)
    assert tier.stats.corrupt == 1 and tier.presence(key) is Presence.ABSENT
    assert [(c.kind, c.key) for c in tier.residency.take()] == [(ChangeKind.REMOVED, key)]
    wait_for(tier, lambda: admin.exists(name) == 0, what="corrupt value deleted")
    wait_for(tier, lambda: tier.stats.removed == 1, what="removal counted")
    result, _ = read_one(tier, other)
    assert result.ok  # the rest is untouched


@pytest.mark.parametrize("piece_bytes", [PIECE_BYTES, 1000])
def test_an_empty_value_is_corrupt_counted_and_deleted_not_a_miss_found_again_forever(
    server, tiers, piece_bytes, monkeypatch, caplog
):
    """GETRANGE answers "" for an empty value as for a missing key. An empty reply is asked again as
    EXISTS then GETRANGE in one pipeline: EXISTS 1 then "" is CORRUPT (counted, UNLINKed: EXISTS
    no longer answers 1 for it, so it is not found present again by every probe); EXISTS 0 is a
    miss that removes nothing; a valid value another engine wrote meanwhile is served, never removed."""
    tier = tiers(config_for(server), piece_bytes=piece_bytes)
    tier.residency.enable()
    key, other, late = key_of(1), key_of(2), key_of(3)
    write_all(tier, [key, other, late])
    admin = server.client()
    name = tier.keys.block(key)
    admin.set(name, b"")
    tier.residency.take()
    batches = tier.stats.read_batches
    with caplog.at_level(logging.WARNING):
        result, data = read_one(tier, key)
    assert not result.ok and result.error is IoError.CORRUPT and "empty value" in caplog.text
    assert tier.stats.read_batches - batches == 2  # the read, then EXISTS + GETRANGE
    assert tier.stats.corrupt == 1 and tier.stats.read_misses == 0 and tier.presence(key) is Presence.ABSENT
    assert [(c.kind, c.key) for c in tier.residency.take()] == [(ChangeKind.REMOVED, key)]
    wait_for(tier, lambda: admin.exists(name) == 0, what="empty value deleted")
    wait_for(tier, lambda: tier.stats.removed == 1, what="removal counted")
    fresh = tiers(config_for(server))
    probe_now(fresh, [key])
    assert fresh.presence(key) is Presence.ABSENT
    # A missing key: EXISTS 0, a miss; nothing is removed, nothing counted corrupt.
    result, _ = read_one(tier, key_of(99))
    assert result.error is IoError.NOT_FOUND and tier.stats.corrupt == 1 and tier.stats.removed == 1
    # Missing at the first read, written by another engine before the second: served, kept.
    late_name, value = tier.keys.block(late), admin.get(tier.keys.block(late))
    admin.delete(late_name)
    client, run = tier._path.client, tier._path.client.run

    def write_between(commands, **kwargs):
        replies = run(commands, **kwargs)
        if commands[0][0] == b"GETRANGE" and commands[0][1] == late_name and not admin.exists(late_name):
            admin.set(late_name, value)
        return replies

    monkeypatch.setattr(client, "run", write_between)
    result, data = read_one(tier, late)
    assert result.ok and data == [payload_of(late, 0)] and admin.get(late_name) == value
    assert tier.stats.corrupt == 1
    result, _ = read_one(tier, other)
    assert result.ok  # the rest is untouched


def test_pieces_that_fail_a_check_are_read_again_whole_before_anything_is_called_corrupt(
    server, tiers, monkeypatch
):
    """A value read in GETRANGE pieces may change between two of them (another engine rewrote
    it): such a read fails its checksum, and only the whole-value GET that follows may call the
    value corrupt. Here the first landing of every read fails; the re-read serves the block."""
    tier = tiers(config_for(server), piece_bytes=1000)
    keys = [key_of(n) for n in range(3)]
    write_all(tier, keys)
    finish = PieceLander.finish
    failures: list[bytes] = []

    def racing_finish(self):
        if self.key not in failures:
            failures.append(self.key)
            raise CorruptBlockError("rank 0: payload checksum mismatch")
        finish(self)

    monkeypatch.setattr(PieceLander, "finish", racing_finish)
    batches = tier.stats.read_batches
    dests = [bytearray(PAYLOAD) for _ in keys]
    for job, key in enumerate(keys):
        tier.submit_read(job, key, [memoryview(dests[job])])
    assert all(r.ok for r in wait_results(tier, 3)) and failures == keys
    assert dests == [bytearray(payload_of(k, 0)) for k in keys] and tier.stats.corrupt == 0
    assert tier.stats.read_batches - batches == 2  # the pieces, then one GET per failed read
    assert all(server.client().exists(tier.keys.block(k)) for k in keys)
    monkeypatch.setattr(PieceLander, "finish", finish)
    # A missing key: GETRANGE answers "" (as for an empty value), EXISTS says 0: NOT_FOUND.
    result, data = read_one(tier, key_of(99))
    assert result.error is IoError.NOT_FOUND and tier.stats.corrupt == 0


def test_ttl_is_applied_and_touch_refreshes_it(server, tiers):
    tier = tiers(config_for(server, ttl_seconds=100))
    key = key_of(1)
    write_all(tier, [key])
    admin = server.client()
    name = tier.keys.block(key)
    assert 95 <= admin.ttl(name) <= 100
    assert admin.ttl(tier.keys.config) == -1  # the namespace key never expires
    admin.expire(name, 5)
    tier.touch([key])
    wait_for(tier, lambda: admin.ttl(name) > 50, what="TTL refreshed")


def test_namespaces_never_see_each_others_blocks(server, tiers):
    a = tiers(config_for(server))
    b = tiers(config_for(server), engine=OTHER_ENGINE)
    shared, only_a = key_of(1), key_of(2)
    write_all(a, [shared, only_a])
    probe_now(b, [shared, only_a])
    assert b.presence(shared) is Presence.ABSENT and b.presence(only_a) is Presence.ABSENT
    result, _ = read_one(b, shared)
    assert result.error is IoError.NOT_FOUND
    write_all(b, [shared])
    admin = server.client()
    assert admin.exists(a.keys.block(shared), b.keys.block(shared)) == 2  # two keys, one per namespace
    a.residency.enable()
    assert a.clear() == 2
    assert {c.kind for c in a.residency.take()} == {ChangeKind.REMOVED}
    wait_for(a, lambda: a.stats.removed == 2, what="clear sweep")
    assert admin.exists(a.keys.block(shared), a.keys.block(only_a)) == 0
    assert (
        admin.exists(b.keys.block(shared), a.keys.config, b.keys.config) == 3
    )  # b's block and the config keys stay
    assert a.delete([shared]) == 0
    result, data = read_one(b, shared)
    assert result.ok and data == [payload_of(shared, 0)]


# ---------------------------------------------------------------- credentials


def test_acl_user_with_the_right_password_works(redis_factory, tiers, monkeypatch):  # noqa: F811
    server = redis_factory(password="adminpw", users=[["kv", "on", ">kvpass", "~kvtier:*", "+@all"]])
    monkeypatch.setenv("KV_REDIS_PW", "kvpass")
    for config in (
        config_for(server, url=server.url("kv", "kvpass")),
        config_for(server, username="kv", password_env="KV_REDIS_PW"),
    ):
        tier = tiers(config)
        write_all(tier, [key_of(1)])
        result, data = read_one(tier, key_of(1))
        assert result.ok and data == [payload_of(key_of(1), 0)]


def test_wrong_credentials_are_a_config_error_without_the_password(
    redis_factory,  # noqa: F811
    tiers,
    monkeypatch,
    caplog,
):
    server = redis_factory(password="adminpw", users=[["kv", "on", ">kvpass", "~kvtier:*", "+@all"]])
    monkeypatch.setenv("KV_REDIS_PW", "s3cr3t-wrong")
    cases = [
        config_for(server, url=server.url("kv", "s3cr3t-wrong")),
        config_for(server, username="kv", password_env="KV_REDIS_PW"),
        config_for(server, url=server.url("nobody", "s3cr3t-wrong")),
        config_for(server),  # no password at all
    ]
    for config in cases:
        with caplog.at_level(logging.DEBUG), pytest.raises(ConfigError) as info:
            tiers(config)
        message = str(info.value)
        assert "s3cr3t-wrong" not in message and "kvpass" not in message
        assert f"127.0.0.1:{server.port}" in message and "Fix:" in message and "refused the login" in message
    assert "s3cr3t-wrong" not in caplog.text
    # A user whose ACL does not cover the key prefix: named, with the fix.
    with pytest.raises(ConfigError, match=r"ACL refused.*~other:\*"):
        tiers(config_for(server, url=server.url("kv", "kvpass"), key_prefix="other"))


# ---------------------------------------------------------------- failures


def _submit_everything(tier: RedisTier, keys) -> float:
    """Reads, writes and probes against a sick server; returns the slowest caller-side call."""
    slowest = 0.0
    zeros = memoryview(bytes(PAYLOAD))
    for job, key in enumerate(keys):
        calls = (
            (tier.submit_read, job, key, [memoryview(bytearray(PAYLOAD))]),
            (tier.submit_write, 100 + job, key_of(1000 + job), PARENT, 1, [zeros]),
            (tier.probe, [key_of(2000 + job)]),
            (tier.presence, key),
            (tier.poll,),
        )
        for call, *args in calls:
            start = time.monotonic()
            call(*args)
            slowest = max(slowest, time.monotonic() - start)
    return slowest


def test_an_embedded_engine_counts_a_server_gone_as_unavailable_since_the_last_take(server, tiers):
    """The orchestrator reports RemoteTier.unavailable as kvtier_tier_unavailable{tier="remote"}
    (what kvtier_redis reports as kvtier_offload_unavailable): a block cascaded to a killed server."""
    from kvtier.policy.admission import StoreAdmission
    from kvtier.runtime.orchestrator import BlockInfo, HostBytes, Orchestrator
    from kvtier.tiers.host import HostIndex

    tier = tiers(config_for(server))
    buffer = bytearray(PAYLOAD * 4)
    orch = Orchestrator(HostIndex(4), HostBytes([memoryview(buffer)], PAYLOAD), [tier], StoreAdmission(0, 100))
    server.kill()
    slot = orch.begin_store(key_of(1), BlockInfo(PARENT, 16))
    assert slot is not None
    orch.finish_store([key_of(1)], ok=True)  # cascaded to the tier: the write finds the server gone
    deadline = time.monotonic() + 30
    while tier.unavailable == 0:
        orch.poll()
        assert time.monotonic() < deadline, "the write was not counted unavailable"
        time.sleep(0.01)
    stats = orch.take_stats()
    assert stats.remote_unavailable == tier.unavailable >= 1 and stats.s3_unavailable == 0
    assert orch.take_stats().remote_unavailable == 0  # since the last take


def test_server_killed_fails_fast_opens_breaker_and_recovers_after_restart(server, tiers):
    tier = tiers(config_for(server))
    keys = [key_of(n) for n in range(4)]
    write_all(tier, keys)
    server.kill()
    # Before the breaker opens: a write and a read that found the server gone are counted unavailable
    # (kvtier_offload_unavailable, RemoteTier's accounting, as for the S3 tier).
    assert tier.submit_write(50, key_of(50), PARENT, 1, [memoryview(bytes(PAYLOAD))])
    (written,) = wait_results(tier, 1)
    assert written.error is IoError.IO and tier.stats.unreachable == 1 == tier.unavailable
    result, _ = read_one(tier, keys[0])
    assert result.error is IoError.IO and tier.stats.unreachable == 2 == tier.unavailable
    deadline = time.monotonic() + 30
    slowest = 0.0
    while tier.breaker.closed:
        slowest = max(slowest, _submit_everything(tier, keys[:1]))
        tier.poll()
        assert time.monotonic() < deadline, "breaker never opened"
        time.sleep(0.01)
    assert slowest < TIMEOUT / 2, f"a caller-side call took {slowest:.3f}s"  # (a wait costs >= TIMEOUT)
    wait_for(tier, lambda: tier.stats.io_errors > 0, what="failures counted")
    assert tier.stats.breaker_opens == 1
    assert all(tier.presence(k) is Presence.ABSENT for k in keys) and not tier.contains(keys[0])
    dropped = tier.stats.writes_dropped
    assert not tier.submit_write(1, key_of(77), PARENT, 1, [memoryview(bytes(PAYLOAD))])
    assert tier.stats.writes_dropped == dropped + 1
    result, _ = read_one(tier, keys[0])
    assert result.error is IoError.IO and tier.stats.breaker_rejects >= 1
    assert tier.unavailable == tier.stats.unreachable + tier.stats.breaker_rejects
    server.start()  # same port, empty (no persistence)
    took = wait_for(tier, lambda: tier.breaker.closed, timeout=10, what="recovery")
    assert took < 8
    assert tier.presence(keys[0]) is Presence.UNKNOWN  # pre-outage answers are stale
    write_all(tier, [key_of(5)])
    result, data = read_one(tier, key_of(5))
    assert result.ok and data == [payload_of(key_of(5), 0)]
    assert server.client().get(tier.keys.config) == NS_JSON.encode()  # stored again after the restart


def test_paused_server_costs_at_most_a_timeout_per_call_then_recovers(server, tiers):
    tier = tiers(config_for(server))
    key = key_of(1)
    write_all(tier, [key])
    server.pause()
    try:
        start = time.monotonic()
        slowest = _submit_everything(tier, [key, key_of(2), key_of(3)])
        done_at: dict[tuple, float] = {}
        while len(done_at) < 6 or tier.stats.probes < 3:  # 3 reads, 3 writes, 3 probed keys
            now = time.monotonic()
            done_at.update({(r.kind, r.job_id): now - start for r in tier.poll()})
            assert now - start < 10, f"jobs still running after 10 s: {done_at}"
            time.sleep(0.002)
        probes_done = time.monotonic() - start
        assert slowest < TIMEOUT / 2, f"a caller-side call took {slowest:.3f}s"  # (a wait costs >= TIMEOUT)
        assert max(done_at.values()) < 3 * TIMEOUT, f"a job took longer than 3 x timeout_s: {done_at}"
        assert probes_done < 3 * TIMEOUT + 0.1, f"probes took {probes_done:.2f}s"
        assert tier.stats.reads_ok == 0 and tier.stats.writes_ok == 1  # the one before the pause
        wait_for(tier, lambda: not tier.breaker.closed, timeout=3 * TIMEOUT, what="breaker open")
        assert tier.presence(key) is Presence.ABSENT
    finally:
        server.resume()
    wait_for(tier, lambda: tier.breaker.closed, timeout=30, what="recovery")
    result, data = read_one(tier, key)
    assert result.ok and data == [payload_of(key, 0)]


def test_full_server_drops_writes_as_oom_and_keeps_serving_reads(redis_factory, tiers, caplog):  # noqa: F811
    server = redis_factory(maxmemory="3mb")
    payload = 256 << 10
    tier = tiers(config_for(server), payload=payload, usage_interval=0.1)
    keys = [key_of(n) for n in range(16)]
    with caplog.at_level(logging.DEBUG):
        for job, key in enumerate(keys):
            assert tier.submit_write(job, key, PARENT, 1, [memoryview(payload_of(key, 0, payload))])
            wait_results(tier, 1)
    stats = tier.stats
    assert stats.writes_oom > 0 and stats.writes_ok > 0 and stats.writes_ok + stats.writes_oom == 16
    assert stats.writes_dropped == stats.writes_oom and stats.breaker_opens == 0 and tier.breaker.closed
    stored = [k for k in keys if tier.presence(k) is Presence.PRESENT]
    assert len(stored) == stats.writes_ok
    dests = [bytearray(payload)]
    tier.submit_read(1, stored[0], [memoryview(dests[0])])
    (result,) = wait_results(tier, 1)
    assert result.ok and bytes(dests[0]) == payload_of(stored[0], 0, payload)
    assert "OOM" in caplog.text or "full" in caplog.text
    sample = payload_of(keys[-1], 0, payload)[:16]
    assert repr(sample)[2:-1] not in caplog.text and sample.hex() not in caplog.text
    wait_for(tier, lambda: tier.usage().used_bytes > 2 << 20, what="usage refreshed")
    assert tier.usage().capacity_bytes == 3 << 20


def test_unreachable_at_startup_is_not_an_error_and_connects_later(tiers, tmp_path, caplog):
    from support.redis_server import RedisServer, free_port

    port = free_port()
    config = RedisTierConfig(url=f"redis://127.0.0.1:{port}/0", timeout_s=TIMEOUT, connect_timeout_s=TIMEOUT)
    with caplog.at_level(logging.WARNING):
        tier = tiers(config)
    assert "not reachable at start-up" in caplog.text
    assert not tier.breaker.closed and tier.presence(key_of(1)) is Presence.ABSENT
    assert not tier.submit_write(1, key_of(1), PARENT, 1, [memoryview(bytes(PAYLOAD))])
    server = RedisServer(tmp_path / "late", port=port)
    try:
        wait_for(tier, lambda: tier.breaker.closed, timeout=30, what="connected")
        write_all(tier, [key_of(1)])
        assert server.client().get(tier.keys.config) == NS_JSON.encode()
    finally:
        server.kill()


def test_reconnect_max_s_caps_the_wait_between_tries(tiers, tmp_path):
    """With ``reconnect_max_s`` 0.2 a server that is down is tried again every 0.2 s, not after a
    back-off doubling to 30 s: a server started 3 s later is used within a second."""
    from support.redis_server import RedisServer, free_port

    port = free_port()
    config = RedisTierConfig(url=f"redis://127.0.0.1:{port}/0", timeout_s=TIMEOUT, connect_timeout_s=0.1,
                             reconnect_max_s=0.2)
    tier = tiers(config)
    time.sleep(3.0)  # about 10 failed tries; with the default the back-off would be 2-4 s by now
    assert not tier.breaker.closed and tier.breaker.backoff == 0.2
    server = RedisServer(tmp_path / "late", port=port)
    try:
        assert wait_for(tier, lambda: tier.breaker.closed, timeout=10, what="connected") < 1.5
    finally:
        server.kill()


def test_reconnect_max_s_must_be_positive():
    from kvtier.core.tier_config import parse_secondary_tiers

    with pytest.raises(ConfigError, match="reconnect_max_s"):
        parse_secondary_tiers([{"type": "redis", "url": "redis://127.0.0.1:6379/0", "reconnect_max_s": 0}])
    (parsed,) = parse_secondary_tiers([{"type": "redis", "url": "redis://h:1/0", "reconnect_max_s": 5}])
    assert parsed.reconnect_max_s == 5.0


def test_queue_bound_and_close(server, tiers):
    tier = tiers(config_for(server, max_pending_writes=2))
    sources = [memoryview(bytes(PAYLOAD))]
    assert tier.submit_write(1, key_of(1), PARENT, 1, sources)
    assert tier.submit_write(2, key_of(2), PARENT, 1, sources)
    assert not tier.submit_write(3, key_of(3), PARENT, 1, sources)  # nothing queued
    assert tier.stats.writes_dropped == 1
    assert {r.job_id for r in wait_results(tier, 2)} == {1, 2}
    tier.close()
    tier.close()
    assert tier.presence(key_of(1)) is Presence.ABSENT
    tier.submit_read(9, key_of(1), [memoryview(bytearray(PAYLOAD))])
    (result,) = wait_results(tier, 1)
    assert result.error is IoError.IO
    assert not any(
        t.is_alive() for pool in (tier._read_pool, tier._write_pool, tier._probe_pool) for t in pool._threads
    )


# ---------------------------------------------------------------- deadlines
# A server that answers one byte at a time, faster than redis-py's socket_timeout (an idle
# timeout): only the deadline of a whole exchange (kvtier/tiers/redis/deadline.py) ends a read.
# Before it, each of these hung: the read stayed pending, close() and start-up never returned.

QUICK = {"timeout_s": 0.3, "connect_timeout_s": 0.2}  # an exchange's deadline: 0.5 s (+ bytes at 4 MiB/s)


@pytest.fixture
def trickling():
    """``start(mode)``: a :class:`support.fake_redis.TricklingRedis` (one byte every 0.1 s), stopped
    at teardown before the tiers are closed (request it after ``tiers``), so a test of code that
    hangs fails instead of hanging its teardown."""
    from support.fake_redis import TricklingRedis

    servers = []

    def start(mode: str) -> TricklingRedis:
        servers.append(TricklingRedis(mode, drip_s=0.1))
        return servers[-1]

    yield start
    for fake in servers:
        fake.stop()


def _in_thread(call) -> tuple[threading.Event, list]:
    """Run ``call()`` on a daemon thread: (done, [its result or exception])."""
    done, out = threading.Event(), []

    def run():
        try:
            out.append(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done, out


@pytest.mark.timeout(30)
def test_a_trickled_reply_fails_the_read_by_its_deadline_and_counts_for_the_breaker(tiers, trickling):
    fake = trickling("getrange")
    tier = tiers(RedisTierConfig(url=fake.url(), **QUICK))
    assert tier.breaker.closed
    for n in range(3):  # three failed batches in a row open the breaker
        start = time.monotonic()
        result, _ = read_one(tier, key_of(n))
        took = time.monotonic() - start
        assert result.error is IoError.IO and took < 2.0, f"read {n}: {result.error} after {took:.2f} s"
        assert tier.stats.unreachable == n + 1  # a connection failure, as an unanswered read
    wait_for(tier, lambda: not tier.breaker.closed, timeout=10.0, what="breaker open")
    assert tier.stats.breaker_opens == 1 and fake.seen[b"GETRANGE"] == 3


@pytest.mark.timeout(30)
def test_close_returns_while_a_read_is_stuck_in_a_trickle(tiers, trickling):
    fake = trickling("getrange")
    tier = tiers(RedisTierConfig(url=fake.url(), **QUICK))
    tier.submit_read(1, key_of(1), [memoryview(bytearray(PAYLOAD))])
    wait_for(tier, lambda: fake.seen.get(b"GETRANGE"), timeout=10.0, what="the read sent")
    start = time.monotonic()
    done, _ = _in_thread(tier.close)
    assert done.wait(3.0), "close() did not return within 3 s"
    assert time.monotonic() - start < 1.5


@pytest.mark.timeout(30)
def test_close_is_bounded_even_when_a_worker_never_finishes(tiers, trickling, monkeypatch, caplog):
    from kvtier.tiers.redis.jobs import DataPath

    release, entered = threading.Event(), threading.Event()

    def stuck(self, jobs):  # stuck, not in I/O
        entered.set()
        release.wait()

    monkeypatch.setattr(DataPath, "read_batch", stuck)
    fake = trickling("none")
    tier = tiers(RedisTierConfig(url=fake.url(), **QUICK), batch_bytes=1 << 20)
    try:
        tier.submit_read(1, key_of(1), [memoryview(bytearray(PAYLOAD))])
        assert entered.wait(10.0), "the read never reached a worker"  # (a sleep raced a slow worker)
        # It waits a pool wait plus a full batch's deadline (0.3 + 0.5 + 1 MiB at 4 MiB/s), then goes on.
        with caplog.at_level(logging.WARNING):
            start = time.monotonic()
            done, _ = _in_thread(tier.close)
            assert done.wait(3.0), "close() waited for a stuck worker"
        assert 0.9 < time.monotonic() - start < 2.0
        assert "threads of kvtier-redis-read still busy" in caplog.text  # only the stuck pool
    finally:
        release.set()


@pytest.mark.timeout(30)
def test_start_up_against_a_ping_that_never_ends_returns_by_the_deadline(tiers, trickling, caplog):
    from kvtier.tiers.factory import check_tier

    fake = trickling("ping")
    config = RedisTierConfig(url=fake.url(), **QUICK)
    with caplog.at_level(logging.WARNING):
        start = time.monotonic()
        done, out = _in_thread(lambda: check_tier(config, where="secondary_tiers[redis]"))
        assert done.wait(3.0), "check_tier did not return within 3 s"
        assert out == [False] and time.monotonic() - start < 1.5  # unreachable: only logged (and said)
        assert "not reachable at start-up" in caplog.text and "deadline" in caplog.text
        start = time.monotonic()
        done, out = _in_thread(lambda: tiers(config))
        assert done.wait(3.0), "the tier's constructor did not return within 3 s"
    (tier,) = out
    assert isinstance(tier, RedisTier) and not tier.breaker.closed and time.monotonic() - start < 1.5


def test_rediss_to_a_plaintext_server_is_a_config_error_at_start_up(server, tiers):
    from kvtier.tiers.factory import check_tier

    config = config_for(server, url=f"rediss://127.0.0.1:{server.port}/0")
    with pytest.raises(ConfigError, match="speaks plain RESP, not TLS.*Fix: use 'redis://'"):
        check_tier(config, where="secondary_tiers[redis]")
    with pytest.raises(ConfigError, match="speaks plain RESP"):
        tiers(config)


def test_an_exchange_past_its_deadline_wakes_a_blocked_send_and_a_trickled_recv():
    """The watchdog itself: ``shutdown`` of the armed connection's socket ends a ``sendall`` that
    no timeout bounds (the peer never reads) and a ``recv`` of a peer that trickles."""
    import socket

    from kvtier.tiers.redis.deadline import ExchangeTimeout, exchange, guarded

    class Plain:  # a connection: ``connect()`` is what a pool calls at check-out
        _sock = None

        def connect(self):
            pass

    conn = guarded(Plain)()
    ours, peer = socket.socketpair()
    try:
        conn._sock = ours
        start = time.monotonic()
        with pytest.raises(ExchangeTimeout), exchange(0.3):
            conn.connect()  # armed: 0.3 s from here
            ours.sendall(bytes(16 << 20))  # blocks: the peer never reads, and there is no timeout
        assert 0.25 < time.monotonic() - start < 1.5
    finally:
        ours.close()
        peer.close()
    ours, peer = socket.socketpair()
    stop = threading.Event()

    def trickle():
        while not stop.wait(0.05):
            try:
                peer.send(b"x")
            except OSError:
                return

    threading.Thread(target=trickle, daemon=True).start()
    try:
        conn._sock = ours
        ours.settimeout(0.2)  # an idle timeout, as redis-py's: never fires on this trickle
        start = time.monotonic()
        with pytest.raises(ExchangeTimeout), exchange(0.3):
            conn.connect()
            while ours.recv(1):
                pass
            raise ConnectionError("closed")  # what redis-py raises on an empty recv
        assert time.monotonic() - start < 1.5
    finally:
        stop.set()
        ours.close()
        peer.close()
    ours, peer = socket.socketpair()
    try:
        conn._sock = ours
        with exchange(0.2):  # an exchange that ends in time: its connection is left alone
            conn.connect()
        time.sleep(0.4)
        ours.sendall(b"y")
        assert peer.recv(1) == b"y"
    finally:
        ours.close()
        peer.close()


# ---------------------------------------------------------------- cluster


def test_cluster_round_trip_across_slots_and_nodes(redis_factory, tiers):  # noqa: F811
    cluster = redis_factory(cluster=True)
    config = RedisTierConfig(
        url=f"redis://{cluster.node_urls[0]}/0",
        nodes=tuple(cluster.node_urls),
        cluster=True,
        timeout_s=TIMEOUT,
        connect_timeout_s=TIMEOUT,
    )
    tier = tiers(config, world=2)
    keys = [key_of(n) for n in range(12)]
    assert all(r.ok for r in write_all(tier, keys, world=2))
    nodes = tier._client.node_clients()
    assert len(nodes) == 3  # every node's pool has the tier's wire hooks (kvtier/tiers/redis/wire.py)
    for node in nodes:
        conn = node.connection_pool.get_connection()
        try:
            value = bytes(7000)
            assert any(chunk is value for chunk in conn.pack_commands([(b"SET", b"k", value)]))
            assert conn._parser._reader.getmaxbuf() == tier.value_bytes + READER_SLACK
            assert type(conn).__name__ == "GuardedConnection"  # exchanges have deadlines (deadline.py)
        finally:
            node.connection_pool.release(conn)
    per_node = [node.client().dbsize() for node in cluster.nodes]
    assert sum(per_node) == 13 and sum(1 for n in per_node if n) >= 2  # 12 blocks + the config key, spread
    batches = tier.stats.read_batches
    dests = {k: [bytearray(PAYLOAD), bytearray(PAYLOAD)] for k in keys}
    for job, key in enumerate(keys):
        tier.submit_read(job, key, [memoryview(d) for d in dests[key]])
    assert all(r.ok for r in wait_results(tier, 12))
    assert all([bytes(d) for d in dests[k]] == [payload_of(k, 0), payload_of(k, 1)] for k in keys)
    assert tier.stats.read_batches - batches <= 3 * 2  # one round trip per node and batch
    other = tiers(config, world=2)
    probe_now(other, keys + [key_of(99)])
    assert (
        all(other.presence(k) is Presence.PRESENT for k in keys)
        and other.presence(key_of(99)) is Presence.ABSENT
    )
    # An empty value: EXISTS and GETRANGE of its key go to its node in one pipeline: CORRUPT, deleted.
    empty = tier.keys.block(keys[0])
    assert list(tier._client.run([(b"SET", empty, b"")])) == [b"OK"]
    result, _ = read_one(tier, keys[0], world=2)
    assert result.error is IoError.CORRUPT and tier.stats.corrupt == 1
    wait_for(tier, lambda: list(tier._client.run([(b"EXISTS", empty)])) == [0], what="empty value deleted")
    tier.clear()
    wait_for(tier, lambda: tier.stats.removed == 12, what="cluster clear")
    assert sum(node.client().dbsize() for node in cluster.nodes) == 1
