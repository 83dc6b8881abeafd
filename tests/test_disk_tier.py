"""DiskTier and the block file format, against real files in a temporary directory (no mocks)."""

from __future__ import annotations

import os
import random
import shutil
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.store_files import settle_scan

from kvtier.tiers.base import IoError, IoKind, IoResult, Medium
from kvtier.tiers.blockfile import (
    HEADER_LEN,
    MAGIC,
    BlockHeader,
    CorruptBlockError,
    decode_header,
    encode_header,
    payload_checksum,
)
from kvtier.tiers.disk import DiskTier, sanitize_model_name

PAYLOAD = 512
ENGINE = bytes(range(32))
PARENT = b"\x00" * 32
NS_JSON = '{"model_name":"test","tp_size":2}'
PREFIX = f"HuggingFaceTB_SmolLM2-135M_{ENGINE.hex()[:16]}"  # <model>_<digest16>
SMALL_HEADER = dict(
    namespace=b"n" * 32, key=b"k" * 32, parent=b"p" * 32, num_tokens=1, payload_len=8, checksum=7
)


def rank_digests(world: int) -> list[bytes]:
    return [bytes([0xA0 + rank]) * 32 for rank in range(world)]


def make_tier(root: Path, *, world: int = 1, blocks: int = 8, **overrides) -> DiskTier:
    payload = overrides.pop("payload_bytes", PAYLOAD)
    args = dict(
        root_dir=root,
        model_name="HuggingFaceTB/SmolLM2-135M",
        engine_digest=ENGINE,
        rank_digests=rank_digests(world),
        namespace_json=NS_JSON,
        payload_bytes=payload,
        capacity_bytes=blocks * world * (HEADER_LEN + payload),
        n_read_threads=2,
        n_write_threads=2,
        max_pending_writes=64,
    )
    args.update(overrides)
    return DiskTier(**args)


def key_of(n: int) -> bytes:
    return bytes([n % 251]) + n.to_bytes(4, "little") + b"\x5a" * 27


def payload_of(key: bytes, rank: int, size: int = PAYLOAD) -> bytes:
    """Content addressing: the payload is a function of the key (and rank)."""
    return random.Random(key + bytes([rank])).randbytes(size)


def sources_of(key: bytes, world: int = 1) -> list[memoryview]:
    return [memoryview(payload_of(key, rank)) for rank in range(world)]


def wait_results(tier: DiskTier, n: int, timeout: float = 30.0) -> list[IoResult]:
    """Poll until ``n`` results came out (fails after ``timeout`` seconds)."""
    results: list[IoResult] = []
    deadline = time.monotonic() + timeout
    while len(results) < n:
        results += tier.poll()
        if len(results) >= n:
            break
        assert time.monotonic() < deadline, f"only {len(results)} of {n} completions after {timeout}s"
        time.sleep(0.0005)
    return results


def write(tier: DiskTier, key: bytes, world: int = 1, job_id: int = 1) -> IoResult:
    sources = [memoryview(payload_of(key, rank)) for rank in range(world)]
    assert tier.submit_write(job_id, key, PARENT, 128, sources)
    (result,) = wait_results(tier, 1)
    assert result.kind is IoKind.WRITE and result.key == key
    return result


def read(tier: DiskTier, key: bytes, world: int = 1, job_id: int = 2) -> tuple[IoResult, list[bytes]]:
    dests = [bytearray(PAYLOAD) for _ in range(world)]
    tier.submit_read(job_id, key, [memoryview(d) for d in dests])
    (result,) = wait_results(tier, 1)
    assert result.kind is IoKind.READ and result.key == key and result.job_id == job_id
    return result, [bytes(d) for d in dests]


def assert_reads_back(tier: DiskTier, key: bytes, world: int = 1) -> None:
    result, data = read(tier, key, world)
    assert result.ok, result
    assert data == [payload_of(key, rank) for rank in range(world)]


@pytest.fixture
def tiers():
    """Closes every tier a test made, even when it fails."""
    made: list[DiskTier] = []

    def factory(root: Path, **kwargs) -> DiskTier:
        tier = make_tier(root, **kwargs)
        made.append(tier)
        return tier

    yield factory
    for tier in made:
        tier.close()


# ---------------------------------------------------------------- block file format


def test_header_round_trip_and_layout():
    payload = os.urandom(1000)
    header = encode_header(
        namespace=b"n" * 32, key=b"k" * 32, parent=b"p" * 32, num_tokens=16, payload_len=1000,
        checksum=payload_checksum(payload),
    )
    assert len(header) == HEADER_LEN == 136
    assert header[:4] == MAGIC and struct.unpack_from("<HH", header, 4) == (1, 136)
    decoded = decode_header(header + payload)
    assert decoded == BlockHeader(
        namespace=b"n" * 32, key=b"k" * 32, parent=b"p" * 32, num_tokens=16, payload_len=1000,
        checksum=payload_checksum(payload),
    )
    assert decode_header(memoryview(bytearray(header))) == decoded


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda h: b"XXXX" + h[4:], "bad magic"),
        (lambda h: h[:4] + struct.pack("<H", 2) + h[6:], "unsupported format version 2"),
        (lambda h: h[:6] + struct.pack("<H", 64) + h[8:], "bad header length 64"),
        (lambda h: h[:50] + bytes([h[50] ^ 1]) + h[51:], "header checksum mismatch"),
        (lambda h: h[:130] + bytes([h[130] ^ 1]) + h[131:], "header checksum mismatch"),
        (lambda h: h[:100], "short header"),
        (lambda h: h[:3], "short header"),
    ],
)
def test_decode_header_names_the_problem(mutate, message):
    header = encode_header(**SMALL_HEADER)
    with pytest.raises(CorruptBlockError, match=message):
        decode_header(mutate(header))


def test_every_header_bit_flip_is_caught():
    header = encode_header(**SMALL_HEADER)
    for offset in range(HEADER_LEN):
        broken = bytearray(header)
        broken[offset] ^= 0x10
        with pytest.raises(CorruptBlockError):
            decode_header(bytes(broken))


def test_sanitize_model_name():
    assert sanitize_model_name("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB_SmolLM2-135M"
    assert sanitize_model_name("/models/llama 3/") == "llama_3"
    assert sanitize_model_name("./ckpt/My Model:v1") == "My_Model_v1"
    assert sanitize_model_name("a\\b") == "a_b"
    assert sanitize_model_name("..") == "__"
    assert sanitize_model_name("") == "model"
    long = sanitize_model_name("org/" + "m" * 300)  # every file name built on it fits 255 bytes
    assert long == ("org_" + "m" * 300)[:128] and sanitize_model_name("m" * 128) == "m" * 128


def test_a_model_name_longer_than_a_directory_name_may_be_is_stored_and_read_back(tmp_path, tiers):
    tier = tiers(tmp_path, model_name="org/" + "m" * 300)
    assert write(tier, key_of(1)).ok
    assert_reads_back(tier, key_of(1))


# ---------------------------------------------------------------- basics


@pytest.mark.parametrize("world", [1, 2])
def test_round_trip_random_payloads(tmp_path, tiers, world):
    tier = tiers(tmp_path, world=world, blocks=64)
    assert tier.medium is Medium.DISK
    rng = random.Random(world)
    stored: dict[bytes, list[bytes]] = {}
    for job in range(40):
        key = rng.randbytes(32)
        stored[key] = [rng.randbytes(PAYLOAD) for _ in range(world)]
        assert tier.submit_write(job, key, PARENT, 128, [memoryview(p) for p in stored[key]])
    results = wait_results(tier, 40)
    assert all(r.ok and r.num_bytes == tier.block_bytes for r in results)
    assert tier.leading_run(list(stored)) == 40
    dests = {key: [bytearray(PAYLOAD) for _ in range(world)] for key in stored}
    for job, key in enumerate(stored):
        tier.submit_read(job, key, [memoryview(d) for d in dests[key]])
    results = wait_results(tier, 40)
    assert all(r.ok and r.num_bytes == world * PAYLOAD for r in results)
    assert {key: [bytes(d) for d in bufs] for key, bufs in dests.items()} == stored
    stats = tier.stats
    assert (stats.writes_ok, stats.reads_ok, stats.bytes_read) == (40, 40, 40 * world * PAYLOAD)
    usage = tier.usage()
    assert usage.num_blocks == 40 and usage.used_bytes == 40 * world * (HEADER_LEN + PAYLOAD)
    # Layout: <root>/<model>_<digest16>_r<rank>/<hhh>/<hh>_g0/<hex>.bin and config.json.
    key = next(iter(stored))
    for rank in range(world):
        path = tmp_path / f"{PREFIX}_r{rank}" / key.hex()[:3] / (
            key.hex()[3:5] + "_g0"
        ) / f"{key.hex()}.bin"
        assert path == tier.block_path(key, rank) and path.stat().st_size == HEADER_LEN + PAYLOAD
        header = decode_header(path.read_bytes()[:HEADER_LEN])
        assert (header.namespace, header.key, header.parent, header.num_tokens) == (
            rank_digests(world)[rank], key, PARENT, 128,
        )
    assert (tmp_path / PREFIX / "config.json").read_text() == NS_JSON


def test_non_byte_buffers_and_bad_buffers(tmp_path, tiers):
    import array

    tier = tiers(tmp_path)
    key = key_of(1)
    src = array.array("I", payload_of(key, 0))  # 4-byte items: the tier views it as bytes
    assert tier.submit_write(1, key, PARENT, 1, [memoryview(src)])
    assert wait_results(tier, 1)[0].ok
    dest = array.array("I", bytes(PAYLOAD))
    tier.submit_read(2, key, [memoryview(dest)])
    assert wait_results(tier, 1)[0].ok and dest.tobytes() == payload_of(key, 0)
    with pytest.raises(ValueError, match="payload_bytes"):
        tier.submit_read(3, key, [memoryview(bytearray(PAYLOAD - 1))])
    with pytest.raises(ValueError, match="writable"):
        tier.submit_read(3, key, [memoryview(bytes(PAYLOAD))])
    with pytest.raises(ValueError, match="one per rank"):
        tier.submit_write(3, key, PARENT, 1, [])
    with pytest.raises(ValueError, match="C-contiguous"):
        tier.submit_read(3, key, [memoryview(bytearray(2 * PAYLOAD))[::2]])
    with pytest.raises(ValueError, match="32 bytes"):
        tier.submit_write(3, key, b"short", 1, sources_of(key))


def test_dedup(tmp_path, tiers):
    tier = tiers(tmp_path, world=2)
    key = key_of(7)
    assert write(tier, key, world=2).num_bytes == tier.block_bytes
    mtime = tier.block_path(key, 0).stat().st_mtime_ns
    again = write(tier, key, world=2, job_id=9)
    assert again.ok and again.job_id == 9 and again.num_bytes == 0
    # Two submits of one key in flight at once: one write job.
    other = key_of(8)
    assert tier.submit_write(10, other, PARENT, 1, sources_of(other, 2))
    assert tier.submit_write(11, other, PARENT, 1, sources_of(other, 2))
    assert all(r.ok for r in wait_results(tier, 2))
    assert tier.stats.writes_ok == 2 and tier.usage().num_blocks == 2
    assert tier.block_path(key, 0).stat().st_mtime_ns == mtime
    assert_reads_back(tier, other, world=2)


def test_capacity_and_lru_order(tmp_path, tiers):
    tier = tiers(tmp_path, world=2, blocks=3)
    capacity = tier.usage().capacity_bytes
    a, b, c, d, e = (key_of(i) for i in range(5))
    for key in (a, b, c):
        assert write(tier, key, world=2).ok
        assert tier.usage().used_bytes <= capacity
    assert tier.lru_keys() == [a, b, c]
    tier.touch([a])  # now b is the least recently used
    assert write(tier, d, world=2).ok
    assert tier.usage().used_bytes <= capacity and tier.usage().num_blocks == 3
    assert not tier.contains(b) and tier.contains(a)
    assert tier.lru_keys() == [c, a, d]
    assert_reads_back(tier, c, world=2)  # a read hit counts as a use
    assert write(tier, e, world=2).ok
    assert tier.lru_keys() == [d, c, e] and tier.stats.evictions == 2
    assert tier.usage().used_bytes == capacity
    tier.close()  # let the unlink jobs finish
    for gone in (a, b):
        assert not tier.block_path(gone, 0).exists() and not tier.block_path(gone, 1).exists()
        assert not tier.block_path(gone, 0).parent.exists()  # its emptied leaf directory too
    assert all(tier.block_path(k, r).exists() for k in (c, d, e) for r in range(2))


def test_key_being_read_is_not_evicted(tmp_path, tiers):
    tier = tiers(tmp_path, blocks=2)
    a, b, c = key_of(1), key_of(2), key_of(3)
    write(tier, a)
    write(tier, b)
    dest = bytearray(PAYLOAD)
    tier.submit_read(5, a, [memoryview(dest)])  # pinned until its completion is polled
    sources = [memoryview(payload_of(c, 0))]
    assert tier.submit_write(6, c, PARENT, 1, sources)
    assert tier.contains(a) and not tier.contains(b)
    results = {r.job_id: r for r in wait_results(tier, 2)}
    assert results[5].ok and bytes(dest) == payload_of(a, 0) and results[6].ok


def test_block_larger_than_capacity_is_dropped(tmp_path, tiers):
    tier = tiers(tmp_path, capacity_bytes=HEADER_LEN + PAYLOAD - 1)
    result = write(tier, key_of(1))
    assert not result.ok and result.error is IoError.DROPPED
    assert tier.usage().used_bytes == 0 and tier.stats.writes_dropped == 1
    assert not tier.block_path(key_of(1), 0).exists()


def test_no_evictable_space_is_dropped(tmp_path, tiers):
    tier = tiers(tmp_path, blocks=1)
    write(tier, key_of(1))
    tier.submit_read(1, key_of(1), [memoryview(bytearray(PAYLOAD))])  # pins the only block
    assert tier.submit_write(2, key_of(2), PARENT, 1, [memoryview(payload_of(key_of(2), 0))])
    results = {r.job_id: r for r in wait_results(tier, 2)}
    assert results[1].ok and results[2].error is IoError.DROPPED and tier.contains(key_of(1))


def test_bounded_write_queue(tmp_path, tiers):
    tier = tiers(tmp_path, n_write_threads=1, max_pending_writes=3)
    keys = [key_of(i) for i in range(6)]
    accepted = [tier.submit_write(i, k, PARENT, 1, sources_of(k)) for i, k in enumerate(keys)]
    assert accepted == [True, True, True, False, False, False]
    assert tier.stats.writes_dropped == 3
    assert all(r.ok for r in wait_results(tier, 3))
    assert tier.submit_write(9, keys[3], PARENT, 1, [memoryview(payload_of(keys[3], 0))])
    assert wait_results(tier, 1)[0].ok and tier.usage().num_blocks == 4


def drop_snapshot(root: Path) -> None:
    """Remove the index snapshot close() wrote: the next start-up scans the files (as after a
    crash before the first snapshot)."""
    (root / PREFIX / "index_g0.snapshot").unlink()


def test_restart_rebuilds_index_in_mtime_order(tmp_path, tiers):
    tier = tiers(tmp_path, world=2)
    keys = [key_of(i) for i in range(5)]
    for key in keys:
        write(tier, key, world=2)
    tier.close()
    drop_snapshot(tmp_path)
    # Give the files distinct mtimes in a known order (ranks may differ: the newest counts).
    order = [keys[3], keys[0], keys[4], keys[1], keys[2]]
    base = time.time_ns() - 10**9 * 100
    for position, key in enumerate(order):
        os.utime(tier.block_path(key, 0), ns=(base, base + position * 10**9))
        os.utime(tier.block_path(key, 1), ns=(base, base + position * 10**9 - 5))
    again = tiers(tmp_path, world=2)
    assert again.lru_keys() == order
    assert again.usage().used_bytes == tier.usage().used_bytes
    # Read hits refresh mtime, so the order of those reads survives the next restart.
    for key in keys:
        assert_reads_back(again, key, world=2)
        time.sleep(0.02)  # more than one tick of the filesystem's timestamp clock
    assert again.lru_keys() == keys
    again.close()
    drop_snapshot(tmp_path)
    assert tiers(tmp_path, world=2).lru_keys() == keys
    again.close()
    assert tiers(tmp_path, world=2).lru_keys() == keys


def test_restart_evicts_down_to_a_smaller_capacity(tmp_path, tiers):
    tier = tiers(tmp_path, blocks=6)
    keys = [key_of(i) for i in range(6)]
    for position, key in enumerate(keys):
        write(tier, key)
        os.utime(tier.block_path(key, 0), ns=(0, 10**18 + position))
    tier.close()
    small = tiers(tmp_path, blocks=2)
    assert small.lru_keys() == keys[4:]
    small.close()
    assert [tier.block_path(k, 0).exists() for k in keys] == [False] * 4 + [True] * 2


# ---------------------------------------------------------------- corruption and faults


def _quarantined(tmp_path: Path) -> list[str]:
    qdir = tmp_path / "quarantine"
    return sorted(p.name for p in qdir.iterdir()) if qdir.exists() else []


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ 0xFF]))


@pytest.mark.parametrize(
    "damage",
    ["payload_byte", "header_byte", "truncated", "truncated_header", "wrong_key", "wrong_namespace"],
)
@pytest.mark.parametrize("rank", [0, 1])
def test_corrupt_file_is_a_counted_quarantined_miss(tmp_path, tiers, damage, rank):
    tier = tiers(tmp_path, world=2)
    key, good = key_of(1), key_of(2)
    write(tier, key, world=2)
    write(tier, good, world=2)
    path = tier.block_path(key, rank)
    if damage == "payload_byte":
        _flip(path, HEADER_LEN + PAYLOAD // 2)
    elif damage == "header_byte":
        _flip(path, 45)
    elif damage == "truncated":
        os.truncate(path, HEADER_LEN + PAYLOAD - 10)
    elif damage == "truncated_header":
        os.truncate(path, 20)
    else:  # a valid file of another block or namespace under this name
        other_ns = rank_digests(2)[1 - rank] if damage == "wrong_namespace" else rank_digests(2)[rank]
        other_key = key if damage == "wrong_namespace" else good
        data = payload_of(key, rank)
        header = encode_header(
            namespace=other_ns, key=other_key, parent=PARENT, num_tokens=1, payload_len=PAYLOAD,
            checksum=payload_checksum(data),
        )
        path.write_bytes(header + data)
    result, _ = read(tier, key, world=2)
    assert not result.ok and result.error is IoError.CORRUPT
    assert tier.stats.corrupt_quarantined == 1 and not tier.contains(key)
    assert _quarantined(tmp_path) == [f"{PREFIX}_r{rank}__{key.hex()}.bin"]
    assert not path.exists()
    result, _ = read(tier, key, world=2, job_id=3)  # never ok afterwards
    assert not result.ok and result.error is IoError.NOT_FOUND
    assert_reads_back(tier, good, world=2)
    tier.close()
    assert not tier.block_path(key, 1 - rank).exists()  # the other rank's file went too


def test_wrong_size_file_is_quarantined_at_startup(tmp_path, tiers):
    tier = tiers(tmp_path)
    key, good = key_of(1), key_of(2)
    write(tier, key)
    write(tier, good)
    tier.close()
    with open(tier.block_path(key, 0), "ab") as fh:
        fh.write(b"junk")
    drop_snapshot(tmp_path)
    again = tiers(tmp_path)
    assert not again.contains(key) and again.contains(good)
    assert again.stats.corrupt_quarantined == 1
    assert _quarantined(tmp_path) == [f"{PREFIX}_r0__{key.hex()}.bin"]
    result, _ = read(again, key)
    assert not result.ok
    assert again.usage().num_blocks == 1


def test_file_deleted_behind_the_tiers_back_is_not_found(tmp_path, tiers):
    tier = tiers(tmp_path, world=2)
    key = key_of(1)
    write(tier, key, world=2)
    tier.block_path(key, 1).unlink()
    result, _ = read(tier, key, world=2)
    assert result.error is IoError.NOT_FOUND and not tier.contains(key)
    assert tier.stats.read_misses == 1 and tier.usage().used_bytes == 0
    assert _quarantined(tmp_path) == []


def test_a_block_stored_again_after_a_read_io_error_replaces_its_files(tmp_path, tiers, monkeypatch):
    """A read that fails with EIO (a bad sector under the file) leaves the file alone and makes the
    block a miss; storing it again replaces the file, so the block is served again (not the old
    file adopted again, failing every read)."""
    import errno

    from kvtier.tiers.disk import files

    tier = tiers(tmp_path)
    key = key_of(1)
    write(tier, key)
    held = open(tier.block_path(key, 0), "rb")  # noqa: SIM115 - keeps its inode number from being reused
    bad_inode = os.fstat(held.fileno()).st_ino
    real = files._read_file

    def bad_sector(fs, path, *args, **kwargs):
        if os.stat(os.path.join(fs.root, path)).st_ino == bad_inode:
            raise OSError(errno.EIO, "Input/output error (injected)")
        return real(fs, path, *args, **kwargs)

    monkeypatch.setattr(files, "_read_file", bad_sector)
    result, _ = read(tier, key)
    assert result.error is IoError.IO and not tier.contains(key) and tier.stats.io_errors == 1
    assert write(tier, key, job_id=3).ok and tier.contains(key)
    assert tier.block_path(key, 0).stat().st_ino != bad_inode
    assert_reads_back(tier, key)
    assert tier.stats.io_errors == 1
    held.close()


def test_write_io_error_leaves_no_files(tmp_path, tiers):
    tier = tiers(tmp_path, world=2)
    key = key_of(1)
    blocker = tier.block_path(key, 1).parent.parent  # <hhh> of rank 1 is a file: rank 1 cannot be written
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_bytes(b"")
    result = write(tier, key, world=2)
    assert not result.ok and result.error is IoError.IO
    assert tier.stats.io_errors == 1 and not tier.contains(key) and tier.usage().used_bytes == 0
    assert list(tier.block_path(key, 0).parent.iterdir()) == []  # rank 0 published then removed; no temp


def test_config_mismatch_names_the_directory(tmp_path, tiers):
    tiers(tmp_path).close()
    with pytest.raises(ValueError, match=f"SmolLM2-135M_{ENGINE.hex()[:16]}"):
        make_tier(tmp_path, namespace_json='{"model_name":"test","tp_size":3}')
    # Same JSON, other formatting: accepted; so is another display name (not part of the identity).
    tiers(tmp_path, namespace_json='{"model_name": "test", "tp_size": 2}').close()
    tiers(tmp_path, namespace_json='{"model_name": "renamed", "tp_size": 2}').close()


def test_stale_temp_files(tmp_path, tiers):
    tier = tiers(tmp_path)
    key = key_of(1)
    write(tier, key)
    tier.close()
    leaf = tier.block_path(key, 0).parent
    dead_pid = 2**22 + 12345  # above pid_max's default: never alive
    dead = leaf / f"{key.hex()}.bin.{dead_pid}.abcd1234.tmp"
    live = leaf / f"{key.hex()}.bin.{os.getpid()}.abcd1234.tmp"
    old_live = leaf / f"{key.hex()}.bin.{os.getpid()}.ffff0000.tmp"
    for path in (dead, live, old_live):
        path.write_bytes(b"partial")
    os.utime(old_live, (time.time() - 7200, time.time() - 7200))
    again = tiers(tmp_path)
    settle_scan(again)  # started from the snapshot: the rescan in the background cleans up
    assert not dead.exists() and live.exists() and not old_live.exists()
    assert again.contains(key)


def test_delete_clear_close(tmp_path, tiers):
    tier = tiers(tmp_path, world=2)
    keys = [key_of(i) for i in range(4)]
    for key in keys:
        write(tier, key, world=2)
    assert tier.delete([keys[0], key_of(99)]) == 1
    assert not tier.contains(keys[0])
    # An orphan rank file and a block written by "another process" are cleared too.
    other = make_tier(tmp_path, world=2)
    write(other, key_of(50), world=2)
    other.close()
    assert tier.clear() == 3
    assert tier.usage().used_bytes == 0 and tier.usage().num_blocks == 0
    tier.close()
    tier.close()
    assert not any(p.suffix == ".bin" for p in tmp_path.rglob("*.bin"))
    assert tier.submit_write(1, keys[0], PARENT, 1, sources_of(keys[0], 2)) is False
    tier.submit_read(2, keys[0], [memoryview(bytearray(PAYLOAD)) for _ in range(2)])
    (result,) = tier.poll()
    assert not result.ok and result.error is IoError.IO


def test_write_right_after_clear_survives_the_sweep(tmp_path, tiers):
    tier = tiers(tmp_path, blocks=64)
    old = [key_of(i) for i in range(40)]
    for job, key in enumerate(old):
        assert tier.submit_write(job, key, PARENT, 1, sources_of(key))
    wait_results(tier, 40)
    assert tier.clear() == 40 and tier.usage().num_blocks == 0
    new = key_of(1000)
    assert write(tier, new).ok and tier.contains(new)
    assert_reads_back(tier, new)
    tier.close()
    assert [p.name for p in tmp_path.rglob("*.bin")] == [f"{new.hex()}.bin"]


def test_delete_during_write_wins(tmp_path, tiers):
    tier = tiers(tmp_path)
    key = key_of(1)
    assert tier.submit_write(1, key, PARENT, 1, [memoryview(payload_of(key, 0))])
    assert tier.delete([key]) == 0
    wait_results(tier, 1)
    assert not tier.contains(key)
    tier.close()
    assert not tier.block_path(key, 0).exists()


# ---------------------------------------------------------------- sharing a root


def test_two_tiers_share_a_root_concurrently(tmp_path):
    world = 2
    a = make_tier(tmp_path, world=world, blocks=200)
    b = make_tier(tmp_path, world=world, blocks=200)
    keys_a = [key_of(i) for i in range(0, 120)]
    keys_b = [key_of(i) for i in range(60, 180)]  # 60 keys overlap
    errors: list[BaseException] = []

    def writer(tier: DiskTier, keys: list[bytes]) -> None:
        try:
            random.Random(len(keys)).shuffle(keys)
            for job, key in enumerate(keys):
                while not tier.submit_write(job, key, PARENT, 1, sources_of(key, world)):
                    tier.poll()
                    time.sleep(0.0005)
                tier.poll()
            deadline = time.monotonic() + 60  # (then the checks below fail: writes still in flight)
            while tier.usage().num_blocks < len(keys) and time.monotonic() < deadline:
                tier.poll()
                time.sleep(0.001)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t, list(k))) for t, k in ((a, keys_a), (b, keys_b))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert not errors, errors
        assert a.stats.io_errors == 0 and b.stats.io_errors == 0
        for tier in (a, b):
            tier.rescan(wait=True)
            assert tier.leading_run(sorted(set(keys_a) | set(keys_b))) == 180
            for key in set(keys_a) | set(keys_b):
                assert_reads_back(tier, key, world=world)
        # Deleted by the other process: a miss, then gone; a rescan forgets what vanished.
        a.delete([keys_a[0], keys_a[1]])
        a.close()
        assert read(b, keys_a[0], world=world)[0].error is IoError.NOT_FOUND
        b.rescan()  # in the background; merged by poll
        deadline = time.monotonic() + 30
        while b.contains(keys_a[1]):
            b.poll()
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert b.usage().num_blocks == 178
    finally:
        a.close()
        b.close()
    # After close (its threads joined): b's rescan may queue an index snapshot whose temp file
    # exists while it is written, so temp files are only checked once nothing writes.
    assert not list(tmp_path.rglob("*.tmp"))


def test_read_adopts_a_block_written_by_another_process(tmp_path, tiers):
    a = tiers(tmp_path)
    b = tiers(tmp_path)
    key = key_of(3)
    write(a, key)
    assert not b.contains(key)
    assert_reads_back(b, key)
    assert b.contains(key)


def test_startup_scan_indexes_without_opening_a_block_file(tmp_path, tiers):
    """5,000 blocks x 2 ranks in fresh leaf directories; a restart indexes them without opening any
    block file (the scan lists directories only). How fast that is, is measured by
    benchmarks/bench_restart.py, not asserted here: a loaded machine must not fail a test."""
    world, n = 2, 5000
    for rank, digest in enumerate(rank_digests(world)):
        data = payload_of(b"x", rank)
        header_for = {}
        for i in range(n):
            key = key_of(i)
            hex_key = key.hex()
            path = tmp_path / f"{PREFIX}_r{rank}" / hex_key[:3] / (
                hex_key[3:5] + "_g0"
            )
            path.mkdir(parents=True, exist_ok=True)
            header_for[i] = encode_header(
                namespace=digest, key=key, parent=PARENT, num_tokens=1, payload_len=PAYLOAD,
                checksum=payload_checksum(data),
            )
            (path / f"{hex_key}.bin").write_bytes(header_for[i] + data)
    opened: list[str] = []
    watching = [True]

    def audit(event: str, args: tuple) -> None:  # (audit hooks cannot be removed: switched off below)
        if watching[0] and event == "open" and str(args[0]).endswith(".bin"):
            opened.append(str(args[0]))

    sys.addaudithook(audit)
    try:
        tier = tiers(tmp_path, world=world, blocks=n)
    finally:
        watching[0] = False
    assert tier.usage().num_blocks == n
    assert opened == [], f"the start-up scan opened {len(opened)} block files, e.g. {opened[:2]}"


# ---------------------------------------------------------------- properties


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=4096), min_size=1, max_size=6),
    world=st.integers(min_value=1, max_value=3),
)
def test_round_trip_any_payload_size(tmp_path_factory, sizes, world):
    root = tmp_path_factory.mktemp("rt")
    for size in sizes:
        tier = make_tier(root, world=world, payload_bytes=size, blocks=4)
        try:
            key = os.urandom(32)
            data = [os.urandom(size) for _ in range(world)]
            assert tier.submit_write(1, key, PARENT, 3, [memoryview(d) for d in data])
            assert wait_results(tier, 1)[0].ok
            dests = [bytearray(size) for _ in range(world)]
            tier.submit_read(2, key, [memoryview(d) for d in dests])
            assert wait_results(tier, 1)[0].ok and [bytes(d) for d in dests] == data
        finally:
            tier.close()
        shutil.rmtree(root)
        root.mkdir()


class _Model:
    """Drives one DiskTier with a random operation sequence and checks it against the model.

    Content addressing means the payload of a key is fixed, so every successful read must
    return exactly ``payload_of(key)`` of a key that was submitted for writing; the used bytes
    never exceed the capacity; ``contains``/``delete``/``touch`` agree with the index.
    """

    WORLD = 2
    BLOCKS = 4
    KEYS = [key_of(i) for i in range(6)]

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tier = self._open()
        self.next_job = 0
        self.reads: dict[int, tuple[bytes, list[bytearray]]] = {}
        self.submitted: set[bytes] = set()
        self.outcomes: set[str] = set()

    def _open(self) -> DiskTier:
        return make_tier(self.root, world=self.WORLD, blocks=self.BLOCKS, max_pending_writes=3)

    def absorb(self, results: list[IoResult]) -> None:
        for result in results:
            self.outcomes.add(f"{result.kind.value} {'ok' if result.ok else result.error.value}")
            if result.kind is IoKind.READ:
                key, dests = self.reads.pop(result.job_id)
                if result.ok:
                    assert [bytes(d) for d in dests] == [payload_of(key, r) for r in range(self.WORLD)]
                    assert key in self.submitted
                else:  # no corruption is injected here: a failed read is a plain miss
                    assert result.error is IoError.NOT_FOUND, result

    def wait_for(self, job: int) -> None:
        deadline = time.monotonic() + 30
        while True:
            results = self.tier.poll()
            self.absorb(results)
            if any(r.job_id == job for r in results):
                return
            assert time.monotonic() < deadline, f"job {job} never completed"
            time.sleep(0.0002)

    def step(self, op: str, index: int, flag: bool) -> None:
        tier, key = self.tier, self.KEYS[index]
        self.next_job += 1
        job = self.next_job
        if op == "write":
            self.submitted.add(key)
            accepted = tier.submit_write(job, key, PARENT, 1, sources_of(key, self.WORLD))
            if accepted and flag:
                self.wait_for(job)
        elif op == "read":
            dests = [bytearray(PAYLOAD) for _ in range(self.WORLD)]
            self.reads[job] = (key, dests)
            tier.submit_read(job, key, [memoryview(d) for d in dests])
            if flag:
                self.wait_for(job)
        elif op == "delete":
            keys = [key, self.KEYS[(index + 1) % len(self.KEYS)]] if flag else [key]
            present = sum(tier.contains(k) for k in set(keys))
            assert tier.delete(keys) == present
            assert not any(tier.contains(k) for k in keys)
        elif op == "touch":
            tier.touch([key])
            if tier.contains(key):
                assert tier.lru_keys()[-1] == key
        elif op == "poll":
            self.absorb(tier.poll())
        elif op == "clear":
            indexed = tier.usage().num_blocks
            assert tier.clear() == indexed and tier.usage().num_blocks == 0
        elif op == "restart":
            tier.close()
            self.absorb(tier.poll())
            assert not self.reads  # close() finished every read
            before = set(tier.lru_keys())
            self.tier = self._open()
            assert set(self.tier.lru_keys()) == before
        usage = self.tier.usage()
        assert usage.used_bytes <= usage.capacity_bytes
        assert usage.num_blocks * self.tier.block_bytes <= usage.used_bytes
        assert all(self.tier.contains(k) for k in self.tier.lru_keys())


_OPS = st.tuples(
    st.sampled_from(["write"] * 4 + ["read"] * 4 + ["delete", "touch", "poll", "poll", "restart", "clear"]),
    st.integers(0, len(_Model.KEYS) - 1),
    st.booleans(),
)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(_OPS, min_size=10, max_size=60))
def test_random_operation_sequences(ops):
    root = Path(tempfile.mkdtemp(prefix="kvtier-disk-prop-"))
    model = _Model(root)
    try:
        for op in ops:
            model.step(*op)
        model.tier.close()
        model.absorb(model.tier.poll())
        assert not model.reads
        for outcome in model.outcomes:
            event(outcome)
    finally:
        model.tier.close()
        shutil.rmtree(root, ignore_errors=True)
