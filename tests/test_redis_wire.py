"""The Redis tier's redis-py hooks (kvtier/tiers/redis/wire.py: values sent as uncopied parts, a
reply parser keeping its buffer), its one-pass copy-and-checksum of a reply, and
``RedisTier.wait``, against a real redis-server."""

from __future__ import annotations

import os
import time

import pytest
import redis
from redis.connection import Encoder, PythonRespSerializer
from support.redis_server import redis_factory  # noqa: F401  (pytest fixture)

from kvtier.core.tier_config import RedisTierConfig
from kvtier.tiers.base import IoKind
from kvtier.tiers.blockfile import COPY_CHUNK, copy_with_checksum, payload_checksum
from kvtier.tiers.redis import RedisTier
from kvtier.tiers.redis.client import READER_SLACK, RedisClient
from kvtier.tiers.redis.codec import HEADER_LEN
from kvtier.tiers.redis.jobs import read_reply_bytes
from kvtier.tiers.redis.wire import (
    BUFFER_CUTOFF,
    COMMAND_PACKER,
    READER_DEFAULT_MAXBUF,
    ValueParts,
    reply_parser,
)

REDIS_PY_PACKER = PythonRespSerializer(BUFFER_CUTOFF, Encoder("utf-8", "strict", False).encode)


@pytest.fixture
def server(redis_factory):  # noqa: F811
    return redis_factory()


def packed(chunks) -> bytes:
    return b"".join(bytes(chunk) for chunk in chunks)


def test_value_parts_are_framed_as_one_bulk_string_without_copying_big_parts():
    header, small = os.urandom(136), os.urandom(100)
    big = bytearray(os.urandom(3 * BUFFER_CUTOFF))
    tail = memoryview(big)[: BUFFER_CUTOFF + 1]
    parts = ValueParts([header, memoryview(big), small, tail])
    joined = header + bytes(big) + small + bytes(tail)
    assert len(parts) == parts.nbytes == len(joined)
    assert str(parts) == repr(parts) == f"<value of {len(joined)} bytes>"  # never the bytes
    command = (b"SET", b"kvtier:k", parts, b"EX", 100)
    chunks = COMMAND_PACKER.pack(*command)
    # Byte for byte what redis-py sends for the joined value...
    assert packed(chunks) == packed(REDIS_PY_PACKER.pack(b"SET", b"kvtier:k", joined, b"EX", 100))
    # ...with the big parts handed over as the caller's memory, not copies.
    uncopied = [chunk for chunk in chunks if isinstance(chunk, memoryview) and chunk.obj is big]
    assert [chunk.nbytes for chunk in uncopied] == [len(big), len(tail)]
    assert all(len(chunk) <= 2 * BUFFER_CUTOFF for chunk in chunks if isinstance(chunk, bytes))
    # Commands without parts are packed exactly as redis-py packs them.
    for plain in [(b"GET", b"kvtier:k"), (b"SET", b"kvtier:k", bytes(big)), ("CONFIG GET", "maxmemory")]:
        assert packed(COMMAND_PACKER.pack(*plain)) == packed(REDIS_PY_PACKER.pack(*plain))
    with pytest.raises(TypeError, match="command name"):
        COMMAND_PACKER.pack(parts, b"x")


def test_value_parts_round_trip_through_a_pipeline_and_errors_never_quote_them(server):
    pool = redis.ConnectionPool(host="127.0.0.1", port=server.port, command_packer=COMMAND_PACKER)
    client = redis.Redis(connection_pool=pool)
    try:
        values = {}
        pipe = client.pipeline(transaction=False)
        for n, sizes in enumerate([(136, 70_000), (136, 4096, 136, 4096), (5, BUFFER_CUTOFF + 1, 7)]):
            parts = [os.urandom(size) for size in sizes]
            values[b"kvtier:%d" % n] = b"".join(parts)
            pipe.execute_command(b"SET", b"kvtier:%d" % n, ValueParts(parts), b"EX", 1000)
        secret = b"\x00secret" * 1000
        pipe.execute_command(b"SET", b"kvtier:bad", ValueParts([secret]), b"EX", -5)  # an error reply
        for name in values:
            pipe.execute_command(b"GET", name)
        replies = pipe.execute(raise_on_error=False)
        assert replies[:3] == [b"OK"] * 3 and replies[4:] == list(values.values())
        error = replies[3]
        assert isinstance(error, redis.exceptions.ResponseError) and "expire" in str(error)
        assert "secret" not in str(error)  # redis-py quotes the command: the value is its length only
        assert all(0 < client.ttl(name) <= 1000 for name in values)
    finally:
        client.close()


def test_reply_parser_keeps_a_value_sized_reader_buffer(server):
    assert reply_parser(10).keep_bytes == READER_DEFAULT_MAXBUF  # never below hiredis's default
    pool = redis.ConnectionPool(host="127.0.0.1", port=server.port, parser_class=reply_parser(5 << 20))
    client = redis.Redis(connection_pool=pool)
    try:
        values = [os.urandom(3 << 20), os.urandom(1 << 20), os.urandom(9 << 20), b"small"]
        for value in values:  # replies bigger than the buffer kept still parse
            client.set(b"kvtier:k", value)
            assert client.get(b"kvtier:k") == value
        conn = pool.get_connection()
        try:
            assert conn._parser._reader.getmaxbuf() == 5 << 20
        finally:
            pool.release(conn)
    finally:
        client.close()


@pytest.mark.parametrize("size", [0, 1, COPY_CHUNK - 1, COPY_CHUNK, 3 * COPY_CHUNK + 5])
def test_copy_with_checksum_copies_and_hashes_in_one_pass(size):
    source = memoryview(os.urandom(size))
    dest = memoryview(bytearray(b"\xee" * size))
    assert copy_with_checksum(source, dest) == payload_checksum(source)
    assert bytes(dest) == bytes(source)
    with pytest.raises(ValueError, match="into a buffer of"):
        copy_with_checksum(source, memoryview(bytearray(size + 1)))


def completions(tier: RedisTier, timeout: float = 30.0) -> list:
    """wait() + poll() until a job completes (a worker also posts batch counts and probe answers)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tier.wait(deadline - time.monotonic())
        results = tier.poll()
        if results:
            return results
    raise AssertionError(f"no job completed in {timeout} s")


def test_wait_blocks_until_a_job_is_done_and_poll_returns_it(server):
    payload = 70_000
    config = RedisTierConfig(url=server.url(), timeout_s=2.0, connect_timeout_s=2.0)
    tier = RedisTier(
        config,
        engine_digest=bytes(range(32)),
        rank_digests=[b"\x11" * 32],
        namespace_json="{}",
        payload_bytes=payload,
        usage_interval=3600.0,
    )
    try:
        (node,) = tier._client.node_clients()  # the tier's connections keep one value's buffer
        assert (
            node.connection_pool.connection_kwargs["parser_class"].keep_bytes
            == tier.value_bytes + READER_SLACK
        )
        deadline = time.monotonic() + 30
        while tier.usage().used_bytes == 0:  # the monitor's first usage report (INFO memory): it may come
            assert time.monotonic() < deadline, "no usage report"  # later than a first quiet 0.2 s
            tier.wait(0.2)
            tier.poll()
        while tier.wait(0.2):  # anything else posted at start-up
            tier.poll()
        start = time.monotonic()
        assert tier.wait(0.05) is False and time.monotonic() - start >= 0.04  # nothing in flight
        source = os.urandom(payload)
        assert tier.submit_write(1, b"\x22" * 32, b"\x00" * 32, 16, [memoryview(source)])
        assert tier.wait(5.0) is True
        assert tier.wait(0.0) is True  # the outcome waits for poll(); waiting again takes nothing
        (result,) = completions(tier)
        assert result.kind is IoKind.WRITE and result.ok and result.job_id == 1
        dest = bytearray(payload)
        tier.submit_read(2, b"\x22" * 32, [memoryview(dest)])
        assert [(r.job_id, r.ok) for r in completions(tier)] == [(2, True)] and bytes(dest) == source
        assert tier.poll() == []
    finally:
        tier.close()


def test_run_hands_each_reply_to_on_reply_before_reading_the_next(server, monkeypatch):
    """The read path copies a value while the server sends the next one: ``on_reply`` sees reply
    i before reply i+1 is read, with its command's index, and its return value replaces it."""
    client = RedisClient(RedisTierConfig(url=server.url(), timeout_s=5.0, connect_timeout_s=5.0))
    client.connect()
    values = [os.urandom(size) for size in (70_000, 10, 300_000)]
    events: list[str] = []
    read = redis.connection.AbstractConnection.read_response

    def recording_read(self, *args, **kwargs):
        events.append("read")
        return read(self, *args, **kwargs)

    def on_reply(index, reply):
        events.append(f"reply {index}")
        return ("seen", index, reply)

    try:
        assert client.run([(b"SET", b"kvtier:%d" % n, v) for n, v in enumerate(values)]) == [b"OK"] * 3
        monkeypatch.setattr(redis.connection.AbstractConnection, "read_response", recording_read)
        commands = [(b"GET", b"kvtier:%d" % n) for n in range(3)] + [(b"GET", b"kvtier:none")]
        replies = client.run(commands, on_reply=on_reply)
        assert events == ["read", "reply 0", "read", "reply 1", "read", "reply 2", "read", "reply 3"]
        assert replies == [("seen", n, v) for n, v in enumerate(values)] + [("seen", 3, None)]
    finally:
        client.close()


def test_read_reply_bytes_is_a_value_or_one_even_piece():
    """What each connection's reader keeps: a whole value, unless reads go in pieces (one rank,
    a value of at least two pieces), then one of the value // PIECE_BYTES even pieces."""
    assert read_reply_bytes(1, 4096) == HEADER_LEN + 4096
    assert read_reply_bytes(1, (1 << 20) - HEADER_LEN + 5) == (1 << 20) + 5  # under two pieces: whole
    assert read_reply_bytes(1, 5898240) == -(-(HEADER_LEN + 5898240) // 5)  # 5 pieces of ~1.18 MB
    assert read_reply_bytes(2, 5898240) == 2 * (HEADER_LEN + 5898240)  # several ranks: whole
    assert read_reply_bytes(1, 4096, piece_bytes=1000) == -(-(HEADER_LEN + 4096) // 4)
