"""Engines sharing one disk root: the usage ledger keeps the namespace's block files within
``capacity_bytes`` across processes, counts every file once, and is repaired when it drifts.

Real files and real processes (spawned interpreters, as two engines are); no mocks. The negative
control (the same run with the ledger switched off) shows the check can fail.
"""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import threading
import time
from pathlib import Path

import pytest
from support.disk_writer import (
    PARENT,
    WriterPlan,
    WriterReport,
    key_for,
    layout_at,
    open_tier,
    payload_of,
    run_writer,
)

from kvtier.tiers.base import IoError, IoKind
from kvtier.tiers.blockfile import HEADER_LEN
from kvtier.tiers.disk import DiskTier, writer
from kvtier.tiers.disk import refused
from kvtier.tiers.disk.layout import DiskLayout
from kvtier.tiers.disk.ledger import Ledger, Sharing, decode, encode, ledger_path
from kvtier.tiers.disk.writer import WriteOutcome

WORLD, PAYLOAD = 2, 4096
BLOCK = WORLD * (HEADER_LEN + PAYLOAD)


def layout_of(tier: DiskTier) -> DiskLayout:
    return tier._layout  # noqa: SLF001


def bin_bytes(layout: DiskLayout) -> int:
    """Bytes of the namespace's block files on disk (every ``.bin`` under its rank directories)."""
    total = 0
    for rank_dir in layout.rank_dirs:
        for top in _scandir(rank_dir):
            for leaf in _scandir(top.path):
                total += sum(_size(e) for e in _scandir(leaf.path) if e.name.endswith(".bin"))
    return total


def _size(entry: os.DirEntry) -> int:
    try:
        return entry.stat().st_size
    except FileNotFoundError:  # removed since the directory was listed
        return 0


def _scandir(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def ledger_bytes(layout: DiskLayout) -> int:
    with open(ledger_path(layout), "rb") as f:
        return decode(f.read())[1]


def temp_files(layout: DiskLayout) -> list[str]:
    return [str(p) for rank_dir in layout.rank_dirs for p in Path(rank_dir).rglob("*.tmp")]


def wait_results(tier: DiskTier, n: int, timeout: float = 30.0) -> list:
    results: list = []
    deadline = time.monotonic() + timeout
    while len(results) < n:
        results += tier.poll()
        assert time.monotonic() < deadline, f"{len(results)} of {n} results"
        time.sleep(0.001)
    return results


def write(tier: DiskTier, key: bytes, job: int = 1):
    sources = [memoryview(payload_of(key, rank, PAYLOAD)) for rank in range(WORLD)]
    assert tier.submit_write(job, key, PARENT, 16, sources)
    (result,) = wait_results(tier, 1)
    return result


# ---------------------------------------------------------------- two processes, one root


def run_writers(root: Path, plans: list[WriterPlan]) -> tuple[list[WriterReport], list[int]]:
    """Run one process per plan, all starting at once; while they run, measure the namespace's
    block bytes on disk holding the ledger's lock (no file is charged or removed meanwhile, so
    each measure is a consistent snapshot). Returns the reports and the measures."""
    ctx = multiprocessing.get_context("spawn")
    start, reports = ctx.Barrier(len(plans) + 1), ctx.Queue()
    procs = [ctx.Process(target=run_writer, args=(plan, start, reports)) for plan in plans]
    for proc in procs:
        proc.start()
    layout = layout_at(root, WORLD)
    observer = Ledger.for_tool(layout)
    start.wait(120)
    measures: list[int] = []
    got: list[WriterReport] = []
    deadline = time.monotonic() + 120
    while len(got) < len(procs):
        with observer.locked():
            measures.append(bin_bytes(layout))
        while not reports.empty():
            got.append(reports.get())
        assert time.monotonic() < deadline, "writers did not finish"
        time.sleep(0.002)
    for proc in procs:
        proc.join(30)
    assert not [r.error for r in got if r.error], [r.error for r in got]
    measures.append(bin_bytes(layout))  # at the end, quiescent
    return sorted(got, key=lambda r: r.writer), measures


@pytest.mark.timeout(300)
def test_two_processes_stay_within_the_capacity_and_keep_turning_over(tmp_path, record_property):
    capacity_blocks = 20
    plans = [WriterPlan(str(tmp_path), writer, keys=400, capacity_blocks=capacity_blocks) for writer in (0, 1)]
    reports, measures = run_writers(tmp_path, plans)
    capacity = capacity_blocks * BLOCK
    record_property("max_bytes_on_disk", max(measures))
    record_property("capacity_bytes", capacity)
    print(f"\nwith the ledger: max {max(measures)} B ({max(measures) / BLOCK:.1f} blocks) over "
          f"{len(measures)} measures, capacity {capacity} B ({capacity_blocks} blocks)")
    assert len(measures) > 20
    assert max(measures) <= capacity
    for report in reports:
        print(f"writer {report.writer}: {report.results}, no_room drops {report.stats['writes_no_room']}, "
              f"retries {report.stats['no_room_retries']}, evictions {report.stats['evictions']}")
        assert report.sharing == Sharing.LEDGER.value
        assert report.wrong_bytes == 0  # never wrong bytes
        assert report.stats["writes_ok"] > 3 * capacity_blocks  # the namespace keeps turning over
        assert report.stats["io_errors"] == 0 and report.stats["corrupt_quarantined"] == 0
        assert set(report.results) <= {"write_ok", "write_dropped", "read_ok", "read_not_found"}
        assert report.results.get("read_not_found", 0) > 0  # blocks the other process evicted: misses
        assert report.results["read_ok"] > 0
    assert sum(r.stats["no_room_retries"] + r.stats["writes_no_room"] for r in reports) > 0  # the bound refused
    layout = layout_at(tmp_path, WORLD)
    assert temp_files(layout) == [] and bin_bytes(layout) == measures[-1]
    # The rescans' reconciles may have counted temp files created but not yet charged (at most one
    # block per write thread): more than is there, never less. A quiet rescan makes it exact.
    assert 0 <= ledger_bytes(layout) - measures[-1] <= 2 * 2 * BLOCK
    quiet = open_tier(tmp_path, world=WORLD, payload=PAYLOAD, capacity_blocks=capacity_blocks)
    quiet.close()
    assert ledger_bytes(layout) == bin_bytes(layout) == measures[-1]


@pytest.mark.timeout(300)
def test_negative_control_without_the_ledger_the_capacity_is_exceeded(tmp_path):
    """The same run with the ledger switched off in both writers (as on a root that cannot lock):
    each bounds only its own index, and the measure above sees it (so that test can fail)."""
    capacity_blocks = 20
    plans = [WriterPlan(str(tmp_path), writer, keys=400, capacity_blocks=capacity_blocks, ledger=False)
             for writer in (0, 1)]
    reports, measures = run_writers(tmp_path, plans)
    print(f"\nwithout the ledger: max {max(measures)} B ({max(measures) / BLOCK:.1f} blocks) over "
          f"{len(measures)} measures, capacity {capacity_blocks * BLOCK} B ({capacity_blocks} blocks)")
    assert all(r.sharing == Sharing.PER_PROCESS.value for r in reports)
    assert max(measures) > capacity_blocks * BLOCK


@pytest.mark.timeout(300)
def test_the_same_keys_written_by_two_processes_at_once_are_counted_once(tmp_path):
    # No rescans: nothing reconciles the ledger, so it shows exactly what the writers charged.
    plans = [WriterPlan(str(tmp_path), 0, keys=80, capacity_blocks=200, read_every=10**6, peers=1,
                        rescan_every=10**6) for _ in range(2)]
    reports, _ = run_writers(tmp_path, plans)
    for report in reports:
        assert report.results == {"write_ok": 80} and report.stats["writes_no_room"] == 0
    layout = layout_at(tmp_path, WORLD)
    assert bin_bytes(layout) == 80 * BLOCK
    assert ledger_bytes(layout) == 80 * BLOCK
    assert temp_files(layout) == []


@pytest.fixture(params=["noreplace", "link"])
def publishing(request, tmp_path, monkeypatch):
    """How block files are published under tmp_path: ``renameat2(RENAME_NOREPLACE)`` (where this
    system has it, as kvtier prefers) or ``link`` + ``unlink`` (filesystems without the flag)."""
    if request.param == "link":
        monkeypatch.setattr(writer, "_LINK_ROOTS", {str(tmp_path)})
    else:
        try:
            writer.rename_noreplace("missing", "missing-too", src_dir_fd=-100, dst_dir_fd=-100)  # AT_FDCWD
        except FileNotFoundError:
            pass
        except OSError as exc:
            pytest.skip(f"no renameat2(RENAME_NOREPLACE) here: {exc}")
        monkeypatch.setattr(os, "link", _no_link)
    return request.param


def _no_link(*args, **kwargs):
    raise AssertionError("published by link although renameat2(RENAME_NOREPLACE) works here")


def test_a_file_another_process_published_is_not_charged_again(tmp_path, publishing):
    """Deterministic EEXIST: tier b does not know the block tier a wrote and writes it too."""
    a = open_tier(tmp_path, world=WORLD, payload=PAYLOAD, capacity_blocks=10)
    b = open_tier(tmp_path, world=WORLD, payload=PAYLOAD, capacity_blocks=10)
    try:
        key = key_for(7, 7)
        assert write(a, key).ok
        inodes = [os.stat(a.block_path(key, rank)).st_ino for rank in range(WORLD)]
        assert not b.contains(key) and write(b, key).ok and b.contains(key)
        assert [os.stat(a.block_path(key, rank)).st_ino for rank in range(WORLD)] == inodes  # not replaced
        assert ledger_bytes(layout_of(a)) == BLOCK == bin_bytes(layout_of(a))
        assert temp_files(layout_of(a)) == []
        b.delete([key])  # b removes the files: given back once; a's later unlink finds nothing
        poll_until(b, lambda: not os.path.exists(a.block_path(key, 0)))
        a.delete([key])
        a.close()
        assert ledger_bytes(layout_of(a)) == 0 == bin_bytes(layout_of(a))
    finally:
        a.close()
        b.close()


def test_publish_by_rename_where_there_are_no_hard_links(tmp_path):
    """The fallback for filesystems without ``link`` (selected here as the first EPERM would): the
    final name is checked first, so a file another process published is still not charged again."""
    a = open_tier(tmp_path, world=WORLD, payload=PAYLOAD, capacity_blocks=10)
    b = open_tier(tmp_path, world=WORLD, payload=PAYLOAD, capacity_blocks=10)
    writer._LINK_ROOTS.add(str(tmp_path))  # noqa: SLF001
    writer._RENAME_ROOTS.add(str(tmp_path))  # noqa: SLF001
    try:
        key = key_for(8, 8)
        assert write(a, key).ok and write(b, key).ok and write(b, key_for(8, 9)).ok
        assert ledger_bytes(layout_of(a)) == 2 * BLOCK == bin_bytes(layout_of(a))
        assert temp_files(layout_of(a)) == []
    finally:
        writer._LINK_ROOTS.discard(str(tmp_path))  # noqa: SLF001
        writer._RENAME_ROOTS.discard(str(tmp_path))  # noqa: SLF001
        a.close()
        b.close()


def test_a_filesystem_without_renameat2_publishes_by_link(tmp_path, monkeypatch, caplog):
    """``EINVAL`` from renameat2 (a filesystem without the flag, as NFS answers): that root is
    published by link from then on (logged once), and the write succeeds."""
    calls = []

    def refused(*args, **kwargs):
        calls.append(args)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(writer, "rename_noreplace", refused)
    monkeypatch.setattr(writer, "_LINK_ROOTS", set())
    a = open_tier(tmp_path, world=WORLD, payload=PAYLOAD, capacity_blocks=10)
    try:
        with caplog.at_level(logging.INFO, logger="kvtier.tiers.disk.writer"):
            assert write(a, key_for(9, 1)).ok and write(a, key_for(9, 2)).ok
        assert len(calls) == 1 and writer._LINK_ROOTS == {str(tmp_path)}  # noqa: SLF001
        assert sum("publishing block files by link" in r.getMessage() for r in caplog.records) == 1
        assert ledger_bytes(layout_of(a)) == 2 * BLOCK == bin_bytes(layout_of(a)) and temp_files(layout_of(a)) == []
    finally:
        a.close()


def test_a_write_creates_nothing_before_it_is_charged(tmp_path):
    """A write charges and creates its temp files in one hold of the ledger's lock: while another
    holds the lock, the waiting write has created nothing, so a scan cannot count a write that is
    not charged yet and then have the ledger charged for it again (a drift of a block per write
    in flight, which once left a small root shared by two engines refusing writes with half of it
    free)."""
    a = open_tier(tmp_path, world=WORLD, payload=PAYLOAD, capacity_blocks=10)
    layout = layout_of(a)
    key = key_for(10, 1)
    try:
        with Ledger.for_tool(layout).locked():
            assert a.submit_write(1, key, PARENT, 16, [memoryview(payload_of(key, r, PAYLOAD)) for r in range(WORLD)])
            time.sleep(0.3)  # the write job runs now and waits for the lock
            assert a.poll() == [] and temp_files(layout) == [] and layout.count_units() == 0
        (result,) = wait_results(a, 1)
        assert result.ok and ledger_bytes(layout) == BLOCK == bin_bytes(layout) and layout.count_units() == WORLD
    finally:
        a.close()


def poll_until(tier: DiskTier, condition, timeout: float = 30.0) -> None:
    """Poll ``tier`` (applying its finished jobs) until ``condition()`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        tier.poll()
        if condition():
            return
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.002)


def test_no_room_in_the_ledger_gives_way_and_retries(tmp_path):
    """Another process filled the namespace: the refused write evicts this process's LRU block and is retried."""
    mine = open_tier(tmp_path, world=WORLD, payload=PAYLOAD, capacity_blocks=4)
    other = open_tier(tmp_path, world=WORLD, payload=PAYLOAD, capacity_blocks=4)
    try:
        for i in range(2):
            assert write(mine, key_for(1, i)).ok
        for i in range(2):
            assert write(other, key_for(2, i)).ok
        assert write(mine, key_for(1, 2)).ok  # mine knows 2 blocks of 4, but the ledger holds 4
        stats = mine.stats
        assert stats.no_room_retries == 1 and stats.writes_dropped == 0 and stats.evictions == 1
        assert not mine.contains(key_for(1, 0)) and mine.contains(key_for(1, 1)) and mine.contains(key_for(1, 2))
        assert ledger_bytes(layout_of(mine)) == 4 * BLOCK == bin_bytes(layout_of(mine))
    finally:
        mine.close()
        other.close()


def test_no_room_and_nothing_to_evict_drops_the_write(tmp_path):
    mine = open_tier(tmp_path, world=WORLD, payload=PAYLOAD, capacity_blocks=4)  # indexes nothing
    other = open_tier(tmp_path, world=WORLD, payload=PAYLOAD, capacity_blocks=4)
    try:
        for i in range(4):
            assert write(other, key_for(2, i)).ok
        result = write(mine, key_for(1, 0))
        assert not result.ok and result.error is IoError.DROPPED
        stats = mine.stats
        assert stats.writes_no_room == 1 == stats.writes_dropped and stats.no_room_retries == 0
        assert stats.starved_rescans == 0  # paced: its start-up scan ended moments ago
        assert stats.io_errors == 0 and not mine.contains(key_for(1, 0))
        assert temp_files(layout_of(mine)) == [] and not os.path.exists(mine.block_path(key_for(1, 0), 0))
        mine.rescan(wait=True)  # now it knows the other's blocks: its next write evicts the LRU one first
        assert write(mine, key_for(1, 0)).ok and mine.stats.writes_no_room == 1
        assert not os.path.exists(other.block_path(key_for(2, 0), 0))
        assert ledger_bytes(layout_of(mine)) == 4 * BLOCK == bin_bytes(layout_of(mine))
    finally:
        mine.close()
        other.close()


def test_a_write_with_nothing_to_evict_waits_for_an_early_rescan_then_gives_way(tmp_path):
    """Another engine filled the namespace since this one's last scan: the refused write starts a
    rescan at once (not at the next 30 s refresh) and waits for it, its space reserved; the rescan
    indexes the other's blocks, evicting the least recently used so the reservation fits, and the
    write then succeeds in its place."""
    mine = open_tier(tmp_path, world=WORLD, payload=PAYLOAD, capacity_blocks=4)  # indexes nothing
    other = open_tier(tmp_path, world=WORLD, payload=PAYLOAD, capacity_blocks=4)
    try:
        for i in range(4):
            assert write(other, key_for(2, i)).ok
        time.sleep(refused.STARVED_RESCAN_S + 0.05)  # the start-up scan is that old
        result = write(mine, key_for(1, 0))
        assert result.ok and result.num_bytes == BLOCK
        stats = mine.stats
        assert stats.starved_rescans == 1 and stats.no_room_retries == 1 and stats.writes_dropped == 0
        assert stats.evictions == 1 and not os.path.exists(other.block_path(key_for(2, 0), 0))
        assert mine.lru_keys() == [key_for(2, i) for i in (1, 2, 3)] + [key_for(1, 0)]
        assert ledger_bytes(layout_of(mine)) == 4 * BLOCK == bin_bytes(layout_of(mine))
    finally:
        mine.close()
        other.close()


def test_a_write_whose_block_the_rescan_finds_on_disk_completes_without_writing(tmp_path):
    """Both engines store the same block; the other published it and filled the namespace: the
    refused write waits for the rescan, which finds that very block, so it is stored (indexed,
    reported ok, 0 bytes written) and nothing of the other's is evicted for it."""
    mine = open_tier(tmp_path, world=WORLD, payload=PAYLOAD, capacity_blocks=4)
    other = open_tier(tmp_path, world=WORLD, payload=PAYLOAD, capacity_blocks=4)
    try:
        for i in range(4):
            assert write(other, key_for(2, i)).ok
        inode = os.stat(other.block_path(key_for(2, 1), 0)).st_ino
        time.sleep(refused.STARVED_RESCAN_S + 0.05)
        result = write(mine, key_for(2, 1))
        assert result.ok and result.num_bytes == 0
        stats = mine.stats
        assert stats.starved_rescans == 1 and stats.evictions == 0 and stats.writes_dropped == 0
        assert mine.contains(key_for(2, 1)) and os.stat(mine.block_path(key_for(2, 1), 0)).st_ino == inode
        assert sorted(mine.lru_keys()) == sorted(key_for(2, i) for i in range(4))
        assert ledger_bytes(layout_of(mine)) == 4 * BLOCK == bin_bytes(layout_of(mine))
    finally:
        mine.close()
        other.close()


def test_a_write_waiting_for_a_rescan_is_dropped_by_close(tmp_path):
    """Closing while a refused write waits for a rescan completes it DROPPED (nothing waits forever,
    nothing is left on disk for it)."""
    mine = open_tier(tmp_path, world=WORLD, payload=PAYLOAD, capacity_blocks=4)
    other = open_tier(tmp_path, world=WORLD, payload=PAYLOAD, capacity_blocks=4)
    try:
        for i in range(4):
            assert write(other, key_for(2, i)).ok
        time.sleep(refused.STARVED_RESCAN_S + 0.05)
        busy = threading.Event()
        mine._scan_pool.submit(busy.wait, 10)  # noqa: SLF001 - the rescan queues behind this
        sources = [memoryview(payload_of(key_for(1, 0), rank, PAYLOAD)) for rank in range(WORLD)]
        assert mine.submit_write(1, key_for(1, 0), PARENT, 16, sources)
        poll_until(mine, lambda: mine.stats.starved_rescans == 1)  # refused: waits for the rescan
        assert mine.poll() == []
        threading.Timer(0.2, busy.set).start()
        mine.close()  # cancels the queued rescan, which then never reports
        (result,) = mine.poll()
        assert result.error is IoError.DROPPED and mine.stats.writes_no_room == 1
        assert temp_files(layout_of(mine)) == [] and not os.path.exists(mine.block_path(key_for(1, 0), 0))
        assert ledger_bytes(layout_of(mine)) == bin_bytes(layout_of(mine))
    finally:
        mine.close()
        other.close()


def test_write_room_leaves_out_writes_that_cannot_fit_beside_those_in_flight(tmp_path):
    """A root of 4 blocks, 64 writes allowed in flight: with 4 in flight, no fifth is invited (it
    could evict nothing: the space is reserved, not indexed); room comes back as they complete. A
    caller's backlog then waits instead of having the fifth refused."""
    tier = open_tier(tmp_path, world=WORLD, payload=PAYLOAD, capacity_blocks=4, max_pending_writes=64)
    try:
        assert tier.write_room() == 4
        for i in range(3):
            sources = [memoryview(payload_of(key_for(1, i), rank, PAYLOAD)) for rank in range(WORLD)]
            assert tier.submit_write(i, key_for(1, i), PARENT, 16, sources)
        assert tier.write_room() == 1  # results not polled yet: all three still reserve their space
        assert all(r.ok for r in wait_results(tier, 3))
        assert tier.write_room() == 4  # indexed blocks can be evicted for new writes
    finally:
        tier.close()
    tiny = open_tier(tmp_path / "tiny", world=WORLD, payload=PAYLOAD, capacity_blocks=0, max_pending_writes=8)
    try:  # no block ever fits: writes are refused at submit, never held back for ever
        assert tiny.write_room() == 8
    finally:
        tiny.close()


# ---------------------------------------------------------------- drift


@pytest.fixture
def tier(tmp_path):
    made = open_tier(tmp_path, world=WORLD, payload=PAYLOAD, capacity_blocks=20, max_pending_writes=64)
    yield made
    made.close()


def fill(tier: DiskTier, n: int) -> list[bytes]:
    keys = [key_for(3, i) for i in range(n)]
    for job, key in enumerate(keys):
        assert tier.submit_write(job, key, PARENT, 16, [memoryview(payload_of(key, r, PAYLOAD)) for r in range(WORLD)])
    assert all(r.ok for r in wait_results(tier, n))
    return keys


def test_a_ledger_locked_by_another_process_for_long_is_given_up_not_waited_on(tier, monkeypatch, caplog):
    """Another process (hung, or a writer of the root doing it on purpose: a read-only open is
    enough) holds a lock on the ledger: writes, removals and the operator's tools wait at most
    LOCK_WAIT_S, then go on without it (capacity bounded per process, as on a root that cannot lock)."""
    import fcntl

    from kvtier.tiers.disk import ledger as ledger_module

    keys = fill(tier, 2)
    layout = layout_of(tier)
    monkeypatch.setattr(ledger_module, "LOCK_WAIT_S", 0.3)
    holder = os.open(ledger_path(layout), os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_SH)
    try:
        began = time.monotonic()
        with caplog.at_level(logging.WARNING):
            assert write(tier, key_for(3, 50), job=50).ok and tier.contains(key_for(3, 50))
            assert tier.sharing is Sharing.PER_PROCESS
            assert "held by another process" in caplog.text
            tool = Ledger.for_tool(layout)
            paths = [str(tier.block_path(keys[0], rank)) for rank in range(WORLD)]
            assert [o.removed for o in tool.remove(paths)] == [True] * WORLD
        assert time.monotonic() - began < 5.0
    finally:
        os.close(holder)


def test_files_deleted_by_hand_are_given_back_by_a_rescan(tier):
    keys = fill(tier, 10)
    layout = layout_of(tier)
    for key in keys[:3]:
        for rank in range(WORLD):
            tier.block_path(key, rank).unlink()
    assert ledger_bytes(layout) == 10 * BLOCK  # drift: counts more than is there
    tier.rescan(wait=True)
    assert ledger_bytes(layout) == 7 * BLOCK == bin_bytes(layout)


@pytest.mark.parametrize("damage", ["garbage", "removed", "truncated", "too_long", "too_low"])
def test_a_damaged_ledger_is_rebuilt_from_the_files(tier, damage):
    fill(tier, 6)
    layout = layout_of(tier)
    path = Path(ledger_path(layout))
    if damage == "garbage":
        path.write_bytes(os.urandom(40))
    elif damage == "removed":
        path.unlink()
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:17])
    elif damage == "too_long":
        path.write_bytes(path.read_bytes() + b"\n")
    else:  # a valid record that counts less than is there (edited by hand)
        path.write_bytes(encode(HEADER_LEN + PAYLOAD, 0, 12345))
    tier.rescan(wait=True)
    assert ledger_bytes(layout) == 6 * BLOCK == bin_bytes(layout) and path.stat().st_size == 40
    assert write(tier, key_for(4, 0)).ok
    assert ledger_bytes(layout) == 7 * BLOCK == bin_bytes(layout)


def test_a_damaged_ledger_is_rebuilt_by_the_next_write(tier):
    fill(tier, 5)
    layout = layout_of(tier)
    Path(ledger_path(layout)).write_bytes(b"not a ledger")
    assert write(tier, key_for(4, 1)).ok
    # The write's charge rebuilt the ledger from the 5 blocks' files, then charged its own block
    # (its temp files are created after the count, in the same hold of the lock): exact.
    assert ledger_bytes(layout) == 6 * BLOCK == bin_bytes(layout)
    tier.rescan(wait=True)
    assert ledger_bytes(layout) == 6 * BLOCK


def test_a_writer_killed_after_charging_is_repaired_by_a_rescan(tier):
    """A dead writer left a charge and its temp files: the scan removes the temps and reconciles."""
    fill(tier, 3)
    layout = layout_of(tier)
    dead_pid = 2**22 + 4321
    key = key_for(5, 0).hex()
    for rank in range(WORLD):
        Path(layout.path(key, rank)).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{layout.path(key, rank)}.{dead_pid}.0000abcd.tmp").write_bytes(b"partial")
    assert Ledger.for_engine(layout, HEADER_LEN + PAYLOAD, 20 * BLOCK).charge(BLOCK)
    assert ledger_bytes(layout) == 4 * BLOCK
    tier.rescan(wait=True)
    assert temp_files(layout) == [] and ledger_bytes(layout) == 3 * BLOCK == bin_bytes(layout)


def test_the_startup_from_a_snapshot_reconciles_in_the_background(tmp_path):
    tier = open_tier(tmp_path, world=WORLD, payload=PAYLOAD, capacity_blocks=20, max_pending_writes=64)
    keys = fill(tier, 8)
    tier.close()  # writes the index snapshot
    layout = layout_of(tier)
    for rank in range(WORLD):
        tier.block_path(keys[0], rank).unlink()
    again = open_tier(tmp_path, world=WORLD, payload=PAYLOAD, capacity_blocks=20)
    try:
        assert again.contains(keys[0])  # served from the snapshot; the rescan runs in the background
        poll_until(again, lambda: not again._state.scan_running)  # noqa: SLF001
        assert ledger_bytes(layout) == 7 * BLOCK == bin_bytes(layout)
    finally:
        again.close()


def test_a_walk_during_which_the_ledger_changed_does_not_overwrite_it(tier):
    """The reconcile needs a quiet walk: a charge made during the walk must not be lost."""
    fill(tier, 4)
    layout = layout_of(tier)
    ledger = Ledger.for_engine(layout, HEADER_LEN + PAYLOAD, 20 * BLOCK)
    since = ledger.version()
    units = layout.count_units()  # the walk
    assert ledger.charge(BLOCK)  # a writer charges while the walk runs (its files come later)
    done = ledger.reconcile(since, units)
    assert done.before is None and ledger_bytes(layout) == 5 * BLOCK  # kept
    done = ledger.reconcile(ledger.version(), units)  # a quiet walk sets it
    assert done.before == 5 * BLOCK and done.after == 4 * BLOCK == ledger_bytes(layout)


def test_corrupt_block_quarantined_by_a_read_is_given_back(tier):
    keys = fill(tier, 3)
    layout = layout_of(tier)
    path = tier.block_path(keys[1], 1)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    dests = [memoryview(bytearray(PAYLOAD)) for _ in range(WORLD)]
    tier.submit_read(9, keys[1], dests)
    (result,) = wait_results(tier, 1)
    assert result.kind is IoKind.READ and result.error is IoError.CORRUPT
    poll_until(tier, lambda: not os.path.exists(tier.block_path(keys[1], 0)))
    assert ledger_bytes(layout) == 2 * BLOCK == bin_bytes(layout)


def test_write_outcomes_map_to_results():
    assert WriteOutcome.WRITTEN.error is None
    assert WriteOutcome.NO_ROOM.error is IoError.DROPPED and WriteOutcome.NO_SPACE.error is IoError.DROPPED
    assert WriteOutcome.FAILED.error is IoError.IO


def test_ledger_record_round_trip_and_damage():
    assert decode(encode(4200, 123, 7)) == (4200, 123, 7)
    good = encode(4200, 123, 7)
    for bad in (good[:-1], good + b"x", b"X" + good[1:], good[:20] + bytes([good[20] ^ 1]) + good[21:]):
        with pytest.raises(ValueError):
            decode(bad)
