"""The disk index snapshot (kvtier.tiers.disk.snapshot): a restart serves from it at once, a
rescan in the background reconciles it with the files, and an unusable snapshot is ignored
(the tier scans the files instead). Real files in a temp directory."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_disk_tier import PREFIX, assert_reads_back, key_of, make_tier, read, settle_scan, write

from kvtier.tiers.base import IoError
from kvtier.tiers.disk import tier as tier_module
from kvtier.tiers.disk.snapshot import HEADER_BYTES, decode, encode

FILE_BYTES = 136 + 512


def snapshot_file(root: Path) -> Path:
    return root / PREFIX / "index_g0.snapshot"


@pytest.fixture
def closing():
    made = []
    yield made.append
    for tier in made:
        tier.close()


def test_restart_serves_from_the_snapshot_then_reconciles_with_the_files(tmp_path, closing):
    tier = make_tier(tmp_path, world=2, blocks=16)
    keys = [key_of(i) for i in range(6)]
    for key in keys:
        write(tier, key, world=2)
    tier.touch([keys[0]])  # LRU order: 1..5, 0
    other = make_tier(tmp_path, world=2, blocks=16)  # another process on the same namespace
    write(other, key_of(50), world=2)
    other.close()
    tier.close()  # the last snapshot written wins: it does not know key 50
    assert snapshot_file(tmp_path).stat().st_mode & 0o777 == 0o600
    for rank in range(2):  # and a block removed behind the tiers' backs
        tier.block_path(keys[2], rank).unlink()

    again = make_tier(tmp_path, world=2, blocks=16)
    closing(again)
    assert again.lru_keys() == [*keys[1:], keys[0]]  # from the snapshot, in its order, no scan
    assert again.contains(keys[2])  # a hint only: the read finds it gone
    result, _ = read(again, keys[2], world=2)
    assert result.error is IoError.NOT_FOUND and not again.contains(keys[2])
    assert_reads_back(again, keys[3], world=2)
    settle_scan(again)
    assert again.contains(key_of(50))  # found by the background rescan
    assert sorted(again.lru_keys()) == sorted([k for k in keys if k != keys[2]] + [key_of(50)])
    assert again.usage().used_bytes == len(again.lru_keys()) * 2 * FILE_BYTES


def test_a_corrupt_block_named_by_the_snapshot_is_a_miss(tmp_path, closing):
    tier = make_tier(tmp_path)
    write(tier, key_of(1))
    tier.close()
    with open(tier.block_path(key_of(1), 0), "r+b") as f:
        f.seek(200)
        f.write(b"\xff\xfe")
    again = make_tier(tmp_path)
    closing(again)
    result, _ = read(again, key_of(1))
    assert result.error is IoError.CORRUPT and not again.contains(key_of(1))
    assert again.stats.corrupt_quarantined == 1


@pytest.mark.parametrize("damage", ["truncated", "flipped", "empty", "other-world", "garbage"])
def test_an_unusable_snapshot_is_ignored_and_the_files_are_scanned(tmp_path, closing, caplog, damage):
    tier = make_tier(tmp_path)
    keys = [key_of(i) for i in range(3)]
    for key in keys:
        write(tier, key)
    tier.close()
    path = snapshot_file(tmp_path)
    data = path.read_bytes()
    path.write_bytes({
        "truncated": data[:-7],
        "flipped": data[:60] + bytes([data[60] ^ 1]) + data[61:],
        "empty": b"",
        "other-world": encode(b"".join(keys[:1]), world=2, file_bytes=FILE_BYTES),
        "garbage": os.urandom(len(data)),
    }[damage])
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        again = make_tier(tmp_path)
    closing(again)
    assert "index snapshot" in caplog.text and "scanning the files" in caplog.text
    assert sorted(again.lru_keys()) == sorted(keys)  # the synchronous scan's view


def test_a_periodic_snapshot_survives_a_crash(tmp_path, closing, monkeypatch):
    monkeypatch.setattr(tier_module, "SNAPSHOT_INTERVAL_S", 0.0)
    tier = make_tier(tmp_path, blocks=16)
    closing(tier)
    keys = [key_of(i) for i in range(4)]
    for key in keys:
        write(tier, key)
    tier.rescan()
    settle_scan(tier)  # merged: the snapshot is queued on the scan thread
    tier._scan_pool.submit(lambda: None).result()  # noqa: SLF001 (the snapshot write ran)
    # The process dies here (no close()): the next start-up uses the periodic snapshot.
    assert decode(snapshot_file(tmp_path).read_bytes(), 1, FILE_BYTES) == keys
    again = make_tier(tmp_path, blocks=16)
    closing(again)
    assert again.lru_keys() == keys


def test_a_snapshot_larger_than_the_capacity_is_evicted_down(tmp_path, closing):
    tier = make_tier(tmp_path, blocks=8)
    keys = [key_of(i) for i in range(8)]
    for key in keys:
        write(tier, key)
    tier.close()
    smaller = make_tier(tmp_path, blocks=3)
    closing(smaller)
    assert smaller.lru_keys() == keys[-3:]  # the most recently used stay
    settle_scan(smaller)
    assert smaller.lru_keys() == keys[-3:]


def test_purge_removes_the_snapshot(tmp_path):
    from kvtier.cachetools.purge import PurgeSelection, purge_cache

    tier = make_tier(tmp_path)
    write(tier, key_of(1))
    tier.close()
    assert snapshot_file(tmp_path).exists()
    purge_cache(tmp_path, PurgeSelection(all=True))
    assert not snapshot_file(tmp_path).exists()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=HEADER_BYTES + 3 * 32 + 8), st.integers(0, 3), st.integers(0, 2**16))
def test_decode_never_raises_anything_but_value_error(data, world, file_bytes):
    try:
        keys = decode(data, world, file_bytes)
    except ValueError:
        return
    assert all(len(k) == 32 for k in keys) and encode(b"".join(keys), world, file_bytes) == data


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(min_size=32, max_size=32), max_size=20), st.integers(1, 8), st.integers(1, 2**20))
def test_encode_decode_round_trip(keys, world, file_bytes):
    assert decode(encode(b"".join(keys), world, file_bytes), world, file_bytes) == keys


def test_inspect_reports_the_snapshot(tmp_path):
    from kvtier.cachetools.inventory import inspect_cache

    tier = make_tier(tmp_path)
    for i in range(3):
        write(tier, key_of(i))
    tier.close()
    (ns,) = inspect_cache(tmp_path).namespaces
    assert ns.snapshot_blocks == 3 and ns.snapshot_written is not None
    data = snapshot_file(tmp_path).read_bytes()
    snapshot_file(tmp_path).write_bytes(data[:10] + b"x" + data[11:])  # header damaged: unusable
    (ns,) = inspect_cache(tmp_path).namespaces
    assert ns.snapshot_blocks is None


def test_temp_files_of_dead_snapshot_writers_are_removed_at_start_up(tmp_path, closing):
    tier = make_tier(tmp_path)
    write(tier, key_of(1))
    tier.close()
    dead_pid = 2**22 + 12345  # above pid_max's default: never alive
    dead = snapshot_file(tmp_path).with_name(f"index_g0.snapshot.{dead_pid}.abcd1234.tmp")
    live = snapshot_file(tmp_path).with_name(f"index_g0.snapshot.{os.getpid()}.abcd1234.tmp")
    for path in (dead, live):
        path.write_bytes(b"partial")
    again = make_tier(tmp_path)
    closing(again)
    assert not dead.exists() and live.exists() and again.contains(key_of(1))
