"""A disk tier on a full filesystem: writes are dropped (counted, logged without a line per block),
nothing partial stays, the usage ledger gives the charge back, and writes succeed again by
themselves once there is space.

Two real ways to run out: a 2 MiB tmpfs (needs root or CAP_SYS_ADMIN to mount; skipped otherwise)
and, without privileges, a writer process under ``RLIMIT_FSIZE`` (``EFBIG``).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.disk_writer import PARENT, WriterPlan, key_for, layout_at, open_tier, payload_of, run_writer

from kvtier.tiers.base import IoError
from kvtier.tiers.blockfile import HEADER_LEN
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk.layout import DiskLayout
from kvtier.tiers.disk.ledger import decode, ledger_path
from kvtier.tiers.disk.writer import NoSpaceLog

WORLD = 2


def ledger_bytes(layout: DiskLayout) -> int:
    with open(ledger_path(layout), "rb") as f:
        return decode(f.read())[1]


def block_files(layout: DiskLayout) -> dict[str, int]:
    return {str(p): p.stat().st_size for rank_dir in layout.rank_dirs for p in Path(rank_dir).rglob("*.bin")}


def temp_files(layout: DiskLayout) -> list[Path]:
    return [p for rank_dir in layout.rank_dirs for p in Path(rank_dir).rglob("*.tmp")]


def write_all(tier: DiskTier, keys: list[bytes], payload: int) -> list:
    """Write ``keys`` one at a time (each result before the next submit)."""
    results = []
    for job, key in enumerate(keys):
        sources = [memoryview(payload_of(key, rank, payload)) for rank in range(WORLD)]
        assert tier.submit_write(job, key, PARENT, 16, sources)
        deadline = time.monotonic() + 30
        got: list = []
        while not got:
            got = tier.poll()
            assert time.monotonic() < deadline
            time.sleep(0.001)
        results += got
    return results


@pytest.fixture
def small_fs(tmp_path):
    """A real 2 MiB filesystem (tmpfs), unmounted afterwards."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mount_point)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_full_filesystem_drops_writes_and_recovers(small_fs, caplog):
    payload = 60 * 1024
    tier = open_tier(small_fs, world=WORLD, payload=payload, capacity_blocks=100, max_pending_writes=64)
    layout = layout_at(small_fs, WORLD)
    file_bytes = HEADER_LEN + payload
    try:
        free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
        filler = small_fs / "filler"
        filler.write_bytes(b"\0" * (free - 5 * file_bytes - file_bytes // 2))  # room for 5.5 files: 2 blocks
        caplog.set_level(logging.WARNING, logger="kvtier")
        results = write_all(tier, [key_for(9, i) for i in range(12)], payload)

        ok = [r for r in results if r.ok]
        dropped = [r for r in results if not r.ok]
        assert len(ok) == 2 and len(dropped) == 10 and {r.error for r in dropped} == {IoError.DROPPED}
        stats = tier.stats
        assert stats.writes_no_space == 10 == stats.writes_dropped and stats.io_errors == 0
        # Nothing partial: only the 2 complete blocks' files, no temp file; the ledger charges exactly them.
        assert sorted(block_files(layout).values()) == [file_bytes] * 4 and temp_files(layout) == []
        assert ledger_bytes(layout) == 4 * file_bytes
        no_space = [r.getMessage() for r in caplog.records if "no space" in r.getMessage()]
        assert len(no_space) == 1, no_space  # one warning, not one per block
        assert str(small_fs) in no_space[0] and "No space left on device" in no_space[0]
        assert "dropping stores" in no_space[0]

        filler.unlink()  # space returns
        results = write_all(tier, [key_for(9, i) for i in range(12, 16)], payload)
        assert all(r.ok for r in results)
        assert tier.stats.writes_no_space == 10 and tier.stats.io_errors == 0
        assert any("succeed again (10 stores were dropped" in r.getMessage() for r in caplog.records)
        assert ledger_bytes(layout) == 12 * file_bytes == sum(block_files(layout).values())
        for key in (key_for(9, 0), key_for(9, 13)):
            dests = [bytearray(payload) for _ in range(WORLD)]
            tier.submit_read(99, key, [memoryview(d) for d in dests])
            deadline = time.monotonic() + 30
            got: list = []
            while not got:
                got = tier.poll()
                assert time.monotonic() < deadline
            assert got[0].ok and [bytes(d) for d in dests] == [payload_of(key, r, payload) for r in range(WORLD)]
    finally:
        tier.close()


@pytest.mark.timeout(300)
def test_a_file_size_limit_drops_writes_and_recovers(tmp_path):
    """EFBIG without privileges: a writer process under RLIMIT_FSIZE smaller than a block file, lifted
    halfway (space returns)."""
    plan = WriterPlan(str(tmp_path), writer=0, keys=10, payload=4096, capacity_blocks=50, read_every=10**6,
                      peers=1, file_size_limit=1000)
    ctx = multiprocessing.get_context("spawn")
    start, reports = ctx.Barrier(2), ctx.Queue()
    proc = ctx.Process(target=run_writer, args=(plan, start, reports))
    proc.start()
    start.wait(120)
    report = reports.get(timeout=120)
    proc.join(30)
    assert report.error == ""
    assert report.results == {"write_dropped": 5, "write_ok": 5}
    assert report.stats["writes_no_space"] == 5  # (writes_dropped also counts submits refused: queue full)
    assert report.stats["io_errors"] == 0
    layout = layout_at(tmp_path, WORLD)
    file_bytes = HEADER_LEN + 4096
    assert sorted(block_files(layout).values()) == [file_bytes] * 10 and temp_files(layout) == []
    assert ledger_bytes(layout) == 10 * file_bytes


def test_no_space_log_is_rate_limited(caplog, monkeypatch):
    from kvtier.tiers.disk import writer

    now = [1000.0]  # the log's clock, moved by the test (a loaded machine may stall between two calls)
    monkeypatch.setattr(writer, "time", SimpleNamespace(monotonic=lambda: now[0]))
    caplog.set_level(logging.INFO, logger="kvtier")
    log = NoSpaceLog("/somewhere", interval=0.3)
    error = OSError(28, "No space left on device")
    for _ in range(50):
        log.dropped(error)
        now[0] += 0.001
    now[0] += 0.3
    log.dropped(error)  # a summary: the 50 since the warning
    for _ in range(5):
        log.dropped(error)  # within the interval again: no line
    log.written()
    log.written()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "no space to write under /somewhere (No space left on device): dropping stores" in lines[0]
    assert "50 more stores dropped" in lines[1]
    assert "succeed again (56 stores were dropped" in lines[2]
    log.dropped(error)  # a new episode warns again
    assert "dropping stores" in caplog.records[-1].getMessage()
