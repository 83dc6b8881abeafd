"""Bad input gives kvtier's own clear error or a miss, never another exception or a served block;
names cannot escape the disk root; what kvtier creates is owner-only by default.

Fuzzed (hypothesis): the connector config, the block-file header reader, whole block files on
disk, whole Redis values, model names that reach the filesystem, and ``kvtier serve``'s size and
path flags.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.cli import serve as serve_mod
from kvtier.cli.main import main
from kvtier.core.config import ConfigError, KVTierConfig
from kvtier.tiers.base import IoError
from kvtier.tiers.blockfile import (
    HEADER_LEN,
    CorruptBlockError,
    decode_header,
    encode_header,
    payload_checksum,
)
from kvtier.tiers.disk import DiskTier, sanitize_model_name
from kvtier.tiers.disk import files as disk_files
from kvtier.tiers.disk.layout import Access, DiskLayout
from kvtier.tiers.disk.ledger import Ledger

KEY = bytes(range(32))
NS = b"\xab" * 32
PAYLOAD = 64

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                      st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
TOP_KEYS = ["cpu_bytes_to_use", "block_size", "eviction_policy", "store_threshold", "max_tracker_size",
            "offload_prompt_only", "offload_partial_blocks", "spec_name", "secondary_tiers", "self_describing_kv_events",
            "model_identity"]
TIER_KEYS = ["type", "root_dir", "capacity_bytes", "n_read_threads", "n_write_threads", "max_pending_writes",
             "group_access", "url", "username", "password_env", "key_prefix", "ttl_seconds", "cluster", "nodes",
             "max_connections", "connect_timeout_s", "timeout_s"]


@st.composite
def extra_configs(draw, root: str):
    """Config objects near the real ones: known keys with arbitrary values, and unknown keys."""
    config = draw(st.dictionaries(st.sampled_from(TOP_KEYS) | st.text(max_size=8), json_value, max_size=6))
    if draw(st.booleans()):
        tier = draw(st.dictionaries(st.sampled_from(TIER_KEYS), json_value, max_size=6))
        if draw(st.booleans()):
            tier["type"] = draw(st.sampled_from(["fs", "redis"]))
        if tier.get("type") == "fs" or "root_dir" in tier:
            tier["root_dir"] = os.path.join(root, draw(st.text("abc", min_size=1, max_size=3)))
        config["secondary_tiers"] = draw(st.sampled_from([[tier], [tier, tier], tier]))
    return config


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_config_is_valid_or_a_config_error(tmp_path, data):
    config = data.draw(extra_configs(str(tmp_path)))
    try:
        KVTierConfig.from_extra_config(config)
    except ConfigError as exc:
        assert str(exc).startswith("kv_connector_extra_config")
        assert "s3cret" not in str(exc)


def test_a_password_never_appears_in_a_config_error():
    with pytest.raises(ConfigError) as exc:
        KVTierConfig.from_extra_config({"cpu_bytes_to_use": 1, "secondary_tiers": [
            {"type": "redis", "url": "http://user:s3cret@host:6379/0"}]})
    assert "s3cret" not in str(exc.value) and "***" in str(exc.value)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_any_header_bytes_decode_or_raise_corrupt(data):
    try:
        header = decode_header(data)
    except CorruptBlockError:
        return
    assert len(data) >= HEADER_LEN and header.header_len == HEADER_LEN


def valid_file() -> bytes:
    payload = bytes(range(PAYLOAD))
    header = encode_header(namespace=NS, key=KEY, parent=b"\0" * 32, num_tokens=4, payload_len=PAYLOAD,
                           checksum=payload_checksum(payload))
    return header + payload


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_damaged_block_file_is_never_served(tmp_path, data):
    """Any change to a valid file (flips, truncation, appended bytes, random content) is a miss."""
    layout = DiskLayout(tmp_path, "m", b"\x01" * 8, 1, 0)
    path = Path(layout.path(KEY.hex(), 0))
    path.parent.mkdir(parents=True, exist_ok=True)
    good = valid_file()
    bad = damaged(data, good)
    if bad == good:
        return
    path.write_bytes(bad)
    dest = memoryview(bytearray(PAYLOAD))
    error = disk_files.read_block(layout, Ledger.for_tool(layout), [NS], KEY, [dest])
    assert error in (IoError.CORRUPT, IoError.NOT_FOUND)


def damaged(data, good: bytes) -> bytes:
    """``good`` changed one way hypothesis picks: a byte flipped, cut short, bytes appended, or
    replaced by arbitrary bytes (possibly equal to ``good``)."""
    mode = data.draw(st.sampled_from(["flip", "truncate", "append", "random"]))
    if mode == "flip":
        at = data.draw(st.integers(0, len(good) - 1))
        return good[:at] + bytes([good[at] ^ data.draw(st.integers(1, 255))]) + good[at + 1:]
    if mode == "truncate":
        return good[: data.draw(st.integers(0, len(good) - 1))]
    if mode == "append":
        return good + data.draw(st.binary(min_size=1, max_size=8))
    return data.draw(st.binary(max_size=len(good) + 8))


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_damaged_redis_value_is_never_served(data):
    """The Redis tier's value reader: a value of two ranks, damaged any way, raises
    CorruptBlockError; only the intact value is read. Lengths and headers are checked before
    anything is copied (a damaged header leaves the buffers untouched); a payload is checked as it
    is copied, so after a payload checksum mismatch the buffers hold bytes the tier discards (its
    read is not ok: tests/test_redis_tier.py, a corrupt value is a miss)."""
    from kvtier.tiers.redis.codec import decode_value, encode_value

    digests = [NS, b"\xcd" * 32]
    payloads = [memoryview(bytes(range(PAYLOAD))), memoryview(bytes(reversed(range(PAYLOAD))))]
    good = b"".join(bytes(part) for part in encode_value(digests, KEY, b"\0" * 32, 4, payloads))
    value = damaged(data, good)
    dests = [memoryview(bytearray(b"\x77" * PAYLOAD)) for _ in digests]
    try:
        decode_value(value, dests, rank_digests=digests, key=KEY)
    except CorruptBlockError as exc:
        if "payload checksum" not in str(exc):
            assert all(bytes(d) == b"\x77" * PAYLOAD for d in dests), "copied before the header check"
        return
    assert value == good and [bytes(d) for d in dests] == [bytes(p) for p in payloads]


def test_a_valid_file_is_read(tmp_path):
    layout = DiskLayout(tmp_path, "m", b"\x01" * 8, 1, 0)
    path = Path(layout.path(KEY.hex(), 0))
    path.parent.mkdir(parents=True)
    path.write_bytes(valid_file())
    dest = bytearray(PAYLOAD)
    ledger = Ledger.for_tool(layout)  # no ledger file: reads need none
    assert disk_files.read_block(layout, ledger, [NS], KEY, [memoryview(dest)]) is None
    assert bytes(dest) == bytes(range(PAYLOAD))


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=40) | st.sampled_from(["..", ".", "../../etc", "/", "~", "a/../../b", "\\..\\x", "x/..", ""]))
def test_model_names_never_escape_the_root(name):
    safe = sanitize_model_name(name)
    assert safe and "/" not in safe and "\\" not in safe and safe not in (".", "..")
    root = "/srv/kv"
    prefix = DiskLayout(root, name, b"\x01" * 8, 1, 0).prefix
    assert os.path.dirname(os.path.normpath(os.path.join(root, prefix))) == root


def tier(root: Path, access: Access = Access.OWNER) -> DiskTier:
    return DiskTier(root_dir=root, model_name="m", engine_digest=b"\x02" * 32, rank_digests=[NS],
                    namespace_json='{"model_name": "m"}', payload_bytes=PAYLOAD, capacity_bytes=1 << 20,
                    n_read_threads=1, n_write_threads=1, max_pending_writes=8, access=access)


def write_and_wait(disk: DiskTier, key: bytes = KEY):
    import time

    assert disk.submit_write(1, key, b"\0" * 32, 4, [memoryview(bytes(PAYLOAD))])
    deadline = time.monotonic() + 30
    while True:
        results = disk.poll()
        if results:
            return results[0]
        assert time.monotonic() < deadline
        time.sleep(0.005)


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_directories_and_files_are_owner_only_by_default(tmp_path, umask):
    old = os.umask(umask)
    try:
        disk = tier(tmp_path)
        try:
            assert write_and_wait(disk).ok
        finally:
            disk.close()
    finally:
        os.umask(old)
    made = [p for p in tmp_path.rglob("*")]
    assert made
    for path in made:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))


def test_group_access_when_asked(tmp_path):
    old = os.umask(0o077)  # even under a strict umask
    try:
        disk = tier(tmp_path, Access.GROUP)
        try:
            assert write_and_wait(disk).ok
        finally:
            disk.close()
    finally:
        os.umask(old)
    for path in tmp_path.rglob("*"):
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o2770 if path.is_dir() else 0o660), (path, oct(mode))


def test_a_symlink_planted_in_a_shared_root_never_redirects_a_write(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    disk = tier(root)
    try:
        leaf = Path(disk.block_path(KEY, 0)).parent
        leaf.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(outside, leaf)  # <root>/<ns>_r0/<hhh>/<hh>_g0 -> outside
        result = write_and_wait(disk)
        assert not result.ok and result.error is IoError.IO
        assert list(outside.iterdir()) == []
        assert not disk.contains(KEY)
    finally:
        disk.close()


def test_a_symlinked_block_file_is_not_read(tmp_path):
    disk = tier(tmp_path / "root")
    try:
        target = tmp_path / "elsewhere.bin"
        target.write_bytes(valid_file())
        path = Path(disk.block_path(KEY, 0))
        path.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, path)
        layout, ledger = disk._layout, disk._ledger  # noqa: SLF001
        # a symlink where a record should be is no record of kvtier's: corrupt, quarantined, never followed
        assert disk_files.read_block(layout, ledger, [NS], KEY, [memoryview(bytearray(PAYLOAD))]) is IoError.CORRUPT
        assert not path.is_symlink() and target.read_bytes() == valid_file()
    finally:
        disk.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.text(max_size=8) | st.sampled_from(["nan", "inf", "-1", "0", "1e309", "0.0000000001", "4"]),
       disk_size=st.text(max_size=8) | st.sampled_from(["nan", "-inf", "0", "20"]),
       disk_dir=st.text(max_size=12))
def test_serve_size_and_path_flags_give_a_usage_error_or_a_command(tmp_path, monkeypatch, size, disk_size, disk_dir):
    """``kvtier serve``'s own flags: every value is accepted (then the command is built) or refused
    with a usage error naming the flag; never a traceback. vLLM is never started."""
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    launched = []
    monkeypatch.setattr(serve_mod, "launch", launched.append)
    args = ["serve", str(tmp_path / "model"), "--kv-offloading-size", size, "--disk-size", disk_size,
            "--disk-dir", str(tmp_path / "d" / disk_dir.replace("\x00", "")) if disk_dir else str(tmp_path / "d")]
    result = CliRunner().invoke(main, args)
    if result.exit_code == 0:
        assert len(launched) == 1
        assert json.loads(launched[0].argv[launched[0].argv.index("--kv-transfer-config") + 1])
    else:
        assert result.exit_code in (1, 2), result.output
        assert isinstance(result.exception, SystemExit), result.exception
        assert "Error" in result.output
