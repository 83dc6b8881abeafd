"""A hostile store costs only misses (issue 38, disk and Redis): whoever can write a shared disk root
or the Redis server plants objects; kvtier never acts outside the root, never waits forever, never
reads more than a record can be, and serves nothing that is not a record.

Each attack is one test, and each fails on the code before the fix (checked by running this file
with the older sources first on ``PYTHONPATH``):

- disk, a writer of a shared root: a leaf (and a ``<hhh>`` directory) planted as a symlink to a
  directory outside the root, then ``rescan()`` and ``clear()`` (before: stale ``*.tmp`` and every
  ``*.bin`` there deleted); a leaf swapped for a symlink after the tier wrote into it (before: the
  next write landed outside); a symlink in place of an indexed record, then ``touch()`` (before:
  the target's mtime changed); FIFOs in place of indexed records (before: 0 of 17 reads finished and
  ``close()`` blocked); a FIFO as the index snapshot (before: start-up hung) and as ``config.json``
  or its symlink target (before: start-up hung); ``config.json`` a symlink to ``/dev/zero`` or a
  planted ``/dev/zero`` device (before: read without bound); a sparse 512 MiB snapshot (before:
  read whole, +512 MiB);
- the cache tools on such a root: a ``quarantine`` symlinked to a directory outside (before:
  ``kvtier purge --quarantine`` deleted its files), FIFOs as a record, ledger, snapshot and
  ``config.json`` (before: ``kvtier inspect`` / ``verify`` hung); ``kvtier doctor``'s header sample
  over a FIFO record (before: hung);
- Redis, a writer of the server: a 256 MiB value under a block key (before: +514 MiB in the reader,
  whole-value reads and piecewise reads alike, and in ``kvtier verify``);
- ``encrypt: true``: a record signed but not encrypted under the tier's own key (before: served).

Every wait is bounded: a FIFO a reader might block on is opened for writing by the test until the
tier has closed, so a regression fails an assertion instead of hanging the suite; attacks that
could exhaust memory run in a child process with a limit. The disk attacks run twice: paths
resolved by ``openat2`` and by the one-directory-at-a-time walk (kernels without ``openat2``).
"""

from __future__ import annotations

import json
import os
import resource
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from support.redis_server import redis_factory  # noqa: F401 (a fixture)

from kvtier.core import rootfs
from kvtier.core.fleet_key import AuthConfig, FleetKey
from kvtier.tiers.base import IoError
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk.layout import PlantedEntryError
from kvtier.tiers.disk.snapshot import HEADER_BYTES, snapshot_path
from kvtier.tiers.sealing import Sealer

PAYLOAD = 4096
NS = b"\xab" * 32
PARENT = b"\0" * 32
DIGEST = b"\x02" * 32
OLD = time.time() - 3 * 86400  # three days ago


def key(prefix: str, n: int) -> bytes:
    """A block key whose hex starts with ``prefix`` (5 hex digits: one leaf directory)."""
    return bytes.fromhex(prefix + f"{n:0{64 - len(prefix)}x}")


def payload(k: bytes) -> bytes:
    return (k * (PAYLOAD // len(k) + 1))[:PAYLOAD]


@pytest.fixture(params=["openat2", "walk"])
def resolution(request, monkeypatch):
    """Paths below a root resolved by ``openat2`` (where the kernel has it) or one directory at a time."""
    if request.param == "openat2" and not rootfs.openat2_available():
        pytest.skip("this kernel (or its seccomp filter) has no openat2")
    monkeypatch.setattr(rootfs._OPENAT2, "usable", request.param == "openat2")
    return request.param


def make_tier(root: Path, *, capacity: int = 1 << 24, sealer: Sealer | None = None) -> DiskTier:
    return DiskTier(root_dir=root, model_name="m", engine_digest=DIGEST, rank_digests=[NS],
                    namespace_json='{"model_name": "m"}', payload_bytes=PAYLOAD, capacity_bytes=capacity,
                    n_read_threads=4, n_write_threads=1, max_pending_writes=64,
                    **({"sealer": sealer} if sealer is not None else {}))


def wait_results(disk: DiskTier, count: int, timeout: float = 30.0) -> list:
    """Up to ``count`` results, polled for at most ``timeout`` seconds (fewer: some never came)."""
    results: list = []
    deadline = time.monotonic() + timeout
    while len(results) < count and time.monotonic() < deadline:
        results += disk.poll()
        time.sleep(0.005)
    return results


def write(disk: DiskTier, keys: list[bytes]) -> list:
    for job, k in enumerate(keys):
        assert disk.submit_write(job, k, PARENT, 4, [memoryview(payload(k))])
    return wait_results(disk, len(keys))


def read(disk: DiskTier, keys: list[bytes], timeout: float = 30.0) -> list:
    dests = [bytearray(PAYLOAD) for _ in keys]
    for job, k in enumerate(keys):
        disk.submit_read(job, k, [memoryview(dests[job])])
    return wait_results(disk, len(keys), timeout)


def unblock(fifos) -> None:
    """Open every FIFO for writing and close it: a reader blocked opening one goes on (to EOF)."""
    for path in fifos:
        try:
            os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK))
        except OSError:
            pass


def bounded(fn, timeout: float, fifos=()) -> tuple[bool, object]:
    """Run ``fn`` in a thread: ``(finished within timeout, its result or exception)``. If it did not
    finish, ``fifos`` are unblocked until it does (at most 60 s more), so a regression fails the
    test rather than hanging the suite."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            box["value"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    in_time = not thread.is_alive()
    deadline = time.monotonic() + 60
    while thread.is_alive() and time.monotonic() < deadline:
        unblock(fifos)
        thread.join(0.05)
    assert not thread.is_alive(), "still blocked after its FIFOs were opened for writing"
    return in_time, box.get("value")


def child(code: str, *, timeout: float = 120, memory_limit: int | None = None) -> dict:
    """Run ``code`` in a fresh interpreter (same sources: this process's PYTHONPATH); returns the JSON
    of its last output line. ``memory_limit``: its address space, in bytes (RLIMIT_AS)."""
    def limit() -> None:
        if memory_limit is not None:
            resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))

    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "MALLOC_ARENA_MAX": "2",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), tests]))}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, preexec_fn=limit)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"child failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


def outside_tree(where: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``where``: (content, mtime_ns)."""
    return {str(p.relative_to(where)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(where.rglob("*")) if p.is_file()}


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---------------------------------------------------------------------- finding 1: outside the root


def test_rescan_and_clear_never_act_through_symlinked_directories(tmp_path, resolution):
    root, outside = tmp_path / "root", tmp_path / "outside"
    disk = make_tier(root)
    try:
        assert all(r.ok for r in write(disk, [key("abcde", 1), key("abcdf", 2)]))
        rank_dir = disk.rank_dir(0)
        stale = f"{key('00000', 1).hex()}.bin.{dead_pid()}.0a0b.tmp"  # a dead writer's temp name
        for victim in (outside / "leaf", outside / "top" / "de_g0"):
            victim.mkdir(parents=True)
            (victim / stale).write_bytes(b"keep me")
            os.utime(victim / stale, (OLD, OLD))
            (victim / "precious.bin").write_bytes(b"keep me too")
            (victim / f"{key('aaaaa', 3).hex()}.bin").write_bytes(b"and me")
        before = outside_tree(outside)
        os.symlink(outside / "leaf", rank_dir / "abc" / "ff_g0")  # a leaf
        os.symlink(outside / "top", rank_dir / "fff")  # a <hhh> directory
        disk.rescan(wait=True)
        assert outside_tree(outside) == before, "rescan acted through a symlink"
        disk.clear()
        assert not wait_results(disk, 1, timeout=0.5)  # (the sweep reports nothing; give it time)
    finally:
        disk.close()
    assert outside_tree(outside) == before, "clear() removed files outside the root"
    assert (rank_dir / "abc" / "ff_g0").is_symlink() and (rank_dir / "fff").is_symlink()  # ignored, left
    assert not any(os.path.lexists(disk.block_path(k, 0)) for k in (key("abcde", 1), key("abcdf", 2)))  # swept


def test_a_leaf_swapped_for_a_symlink_after_a_write_never_redirects_the_next(tmp_path, resolution):
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    disk = make_tier(root)
    try:
        first, second = key("abcde", 1), key("abcde", 2)  # one leaf directory
        assert all(r.ok for r in write(disk, [first]))
        leaf = Path(disk.block_path(first, 0)).parent
        os.rename(leaf, leaf.with_name("moved_aside"))
        os.symlink(outside, leaf)
        (result,) = write(disk, [second])
        assert not result.ok and result.error is IoError.IO
        assert list(outside.iterdir()) == [], "a write followed a leaf swapped for a symlink"
        assert not disk.contains(second) and disk.stats.io_errors == 1
    finally:
        disk.close()


def test_touch_and_reads_never_change_what_a_symlinked_record_points_to(tmp_path, resolution):
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    disk = make_tier(root)
    try:
        k = key("abcde", 1)
        assert all(r.ok for r in write(disk, [k]))
        path = Path(disk.block_path(k, 0))
        target = outside / "victim"
        target.write_bytes(path.read_bytes())  # even a valid record, copied out
        os.utime(target, (OLD, OLD))
        path.unlink()
        os.symlink(target, path)
        old_mtime = target.stat().st_mtime_ns
        disk.touch([k])
        in_time, _ = bounded(lambda: disk._write_pool.submit(lambda: None).result(), 60)  # noqa: SLF001
        assert in_time
        assert target.stat().st_mtime_ns == old_mtime, "touch() set the mtime of a file outside the root"
        (result,) = read(disk, [k])
        assert not result.ok and result.error is IoError.CORRUPT and disk.stats.corrupt_quarantined == 1
        assert target.stat().st_mtime_ns == old_mtime and not path.is_symlink()
        assert (disk.quarantine_dir / f"{disk.namespace_dir.name}_r0__{k.hex()}.bin").is_symlink()
    finally:
        disk.close()


# ---------------------------------------------------------------------- finding 2: reads that never end


def test_fifos_as_indexed_records_are_misses_and_close_returns(tmp_path, resolution):
    disk = make_tier(tmp_path / "root")
    keys = [key("abcde", n) for n in range(17)]
    fifos = []
    try:
        assert all(r.ok for r in write(disk, keys))
        for k in keys[:16]:
            path = disk.block_path(k, 0)
            os.unlink(path)
            os.mkfifo(path)
            fifos.append(path)
        in_time, results = bounded(lambda: read(disk, keys, timeout=60), 90, fifos)
        assert in_time and len(results) == 17, f"{len(results or [])} of 17 reads finished"
        by_key = {r.key: r for r in results}
        assert by_key[keys[16]].ok, "the genuine record was not served"
        assert all(by_key[k].error is IoError.CORRUPT for k in keys[:16])
        assert disk.stats.corrupt_quarantined == 16
    finally:
        in_time, _ = bounded(disk.close, 60, fifos)
    assert in_time, "DiskTier.close() blocked"
    assert all(stat.S_ISFIFO(p.lstat().st_mode) for p in disk.quarantine_dir.iterdir())  # moved, never opened


def _plant_snapshot_fifo(root: Path) -> list[str]:
    disk = make_tier(root)
    write(disk, [key("abcde", 1)])
    disk.close()
    path = snapshot_path(disk._layout)  # noqa: SLF001
    os.unlink(path)
    os.mkfifo(path)
    return [path]


def test_a_fifo_as_the_index_snapshot_is_ignored(tmp_path):
    fifos = _plant_snapshot_fifo(tmp_path / "root")
    in_time, disk = bounded(lambda: make_tier(tmp_path / "root"), 60, fifos)
    assert in_time, "start-up waited on a FIFO planted as the index snapshot"
    assert isinstance(disk, DiskTier) and disk.contains(key("abcde", 1))  # found by the scan instead
    disk.close()


@pytest.mark.parametrize("plant", ["fifo", "symlink to a fifo", "symlink to a file outside", "directory"])
def test_a_planted_config_json_refuses_start_up_at_once(tmp_path, plant):
    root = tmp_path / "root"
    make_tier(root).close()
    config = root / f"m_{DIGEST.hex()[:16]}" / "config.json"
    config.unlink()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    outside = tmp_path / "outside.json"
    outside.write_text('{"model_name": "m"}')
    if plant == "fifo":
        os.mkfifo(config)
    elif plant == "directory":
        config.mkdir()
    else:
        os.symlink(fifo if "fifo" in plant else outside, config)
    in_time, outcome = bounded(lambda: make_tier(root), 60, [str(fifo), str(config)])
    if isinstance(outcome, DiskTier):
        outcome.close()
    assert in_time, "start-up waited on a FIFO planted as config.json"
    assert isinstance(outcome, PlantedEntryError) and "config.json" in str(outcome), outcome


DEV_ZERO_CONFIG = """
    import json, os
    from kvtier.tiers.disk import DiskTier
    from kvtier.tiers.disk.layout import PlantedEntryError
    root, how = {root!r}, {how!r}
    make = lambda: DiskTier(root_dir=root, model_name="m", engine_digest=b"\\x02" * 32, rank_digests=[b"\\xab" * 32],
                            namespace_json='{{"model_name": "m"}}', payload_bytes=4096, capacity_bytes=1 << 24,
                            n_read_threads=1, n_write_threads=1, max_pending_writes=8)
    make().close()
    config = os.path.join(root, "m_" + "02" * 8, "config.json")
    os.unlink(config)
    if how == "symlink":
        os.symlink("/dev/zero", config)
    else:
        os.mknod(config, 0o600 | 0o020000, os.makedev(1, 5))  # a character device: /dev/zero's numbers
    try:
        make().close()
        outcome = "started"
    except PlantedEntryError as exc:
        outcome = "refused: " + str(exc)
    except MemoryError:
        outcome = "MemoryError"
    print(json.dumps({{"outcome": outcome}}))
"""


@pytest.mark.parametrize("how", ["symlink", "device"])
def test_config_json_as_dev_zero_is_refused_without_reading_it(tmp_path, how):
    if how == "device" and os.geteuid() != 0:
        pytest.skip("planting a device node needs root")
    out = child(DEV_ZERO_CONFIG.format(root=str(tmp_path / "root"), how=how), timeout=60, memory_limit=1 << 30)
    assert out["outcome"].startswith("refused: ") and "config.json" in out["outcome"], out


SPARSE_SNAPSHOT = """
    import json, os, resource
    from kvtier.tiers.disk import DiskTier
    from kvtier.tiers.disk.snapshot import HEADER_BYTES, snapshot_path
    make = lambda: DiskTier(root_dir={root!r}, model_name="m", engine_digest=b"\\x02" * 32,
                            rank_digests=[b"\\xab" * 32], namespace_json='{{"model_name": "m"}}', payload_bytes=4096,
                            capacity_bytes=1 << 24, n_read_threads=1, n_write_threads=1, max_pending_writes=8)
    disk = make()
    disk.close()
    count = ({size} - HEADER_BYTES) // 32
    import struct, xxhash
    # A valid header of this tier's snapshots, naming `count` keys (their sum is not checked before they are read).
    fields = struct.pack("<8sIIQQQ", b"KVTSNAP1", 1, 1, disk.block_bytes, count, 0)
    with open(snapshot_path(disk._layout), "wb") as f:
        f.write(fields + struct.pack("<Q", xxhash.xxh3_64_intdigest(fields)))
        f.truncate(HEADER_BYTES + 32 * count)  # sparse: 512 MiB of zeros, no disk used
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    disk = make()
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(json.dumps({{"grew_kib": grew, "blocks": len(disk.lru_keys())}}))
    disk.close()
"""


def test_a_sparse_512_mib_snapshot_is_not_read(tmp_path):
    size = 512 << 20
    out = child(SPARSE_SNAPSHOT.format(root=str(tmp_path / "root"), size=size))
    assert out["grew_kib"] < 32 << 10, f"start-up grew by {out['grew_kib'] >> 10} MiB reading a snapshot"
    assert out["blocks"] == 0


def test_planted_names_forge_no_log_lines(tmp_path, caplog):
    """A writer of a shared root names entries as it likes: a name carrying a newline and terminal
    escapes, where a rescan and a clear log it (directories, which unlink refuses, named as a dead
    writer's temp file and as a misplaced record), is logged escaped, one record a line. Before:
    the name went into the log as it was, a forged "kvtier disk:" line and live escapes."""
    forged = "x\nkvtier disk: all records verified\x1b[2J"
    disk = make_tier(tmp_path / "root")
    try:
        assert all(r.ok for r in write(disk, [key("abcde", 1)]))
        leaf = disk.block_path(key("abcde", 1), 0).parent
        planted = [leaf / f"{forged}.bin.{dead_pid()}.0a0b.tmp", leaf / f"{forged}.bin"]
        for path in planted:
            path.mkdir()
            os.utime(path, (OLD, OLD))
        with caplog.at_level("WARNING", logger="kvtier"):
            disk.rescan(wait=True)
            disk.clear()
            disk.close()  # joins the write thread: the sweep (it reports nothing) is over, its lines logged
    finally:
        disk.close()
    logged = [record.getMessage() for record in caplog.records]
    assert sum("stale temp file" in m for m in logged) == 1 and sum("cannot remove" in m for m in logged) == 2
    assert not any("\n" in m or "\x1b" in m for m in logged), logged
    assert all(path.is_dir() for path in planted)  # left where they were


# ---------------------------------------------------------------------- the cache tools on such a root


def test_cache_tools_never_follow_or_wait_on_planted_objects(tmp_path):
    from kvtier.cachetools import inspect_cache, purge_cache, verify_cache
    from kvtier.cachetools.purge import PurgeSelection
    from kvtier.tiers.disk.ledger import ledger_path

    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    for n in range(3):
        (outside / f"file{n}").write_bytes(b"keep me")
    keys = [key("abcde", n) for n in range(4)]
    disk = make_tier(root)
    assert all(r.ok for r in write(disk, keys))
    layout = disk._layout  # noqa: SLF001
    disk.close()
    fifos = [disk.block_path(keys[0], 0), snapshot_path(layout), ledger_path(layout)]
    for path in fifos:
        os.unlink(path)
        os.mkfifo(path)
    os.symlink(outside, root / "quarantine")
    before = outside_tree(outside)

    in_time, inventory = bounded(lambda: inspect_cache(root, count_tails=True), 60, fifos)
    assert in_time and not isinstance(inventory, BaseException), inventory
    (ns,) = inventory.namespaces
    assert ns.ledger_bytes is None and ns.snapshot_blocks is None and ns.complete_blocks == 4

    in_time, report = bounded(lambda: verify_cache(root), 60, fifos)
    assert in_time and not isinstance(report, BaseException), report
    problems = {p.path: p for p in report.problems}
    assert report.files_ok == 3 and set(problems) == {str(fifos[0]), str(root / "quarantine")}, problems
    assert "not a block file" in problems[str(fifos[0])].reason  # (removed: the quarantine is no directory)
    assert problems[str(root / "quarantine")].action == "left in place"

    in_time, purged = bounded(lambda: purge_cache(root, PurgeSelection(quarantine=True)), 60, fifos)
    assert in_time and not isinstance(purged, BaseException), purged
    assert outside_tree(outside) == before, "a cache tool acted through a symlinked quarantine"
    assert purged.quarantine_files == 0


def test_doctor_samples_no_planted_fifo(tmp_path):
    from kvtier.doctor import fleet_checks

    root = tmp_path / "root"
    disk = make_tier(root)
    keys = [key("abcde", n) for n in range(3)]
    assert all(r.ok for r in write(disk, keys))
    disk.close()
    fifo = disk.block_path(keys[0], 0)
    os.unlink(fifo)
    os.mkfifo(fifo)
    in_time, headers = bounded(lambda: list(fleet_checks._disk_headers(root)), 60, [fifo])  # noqa: SLF001
    assert in_time and not isinstance(headers, BaseException) and len(headers) == 2


# ---------------------------------------------------------------------- finding 3: a huge Redis value


HUGE_REDIS_VALUE = """
    import json, resource, time
    import redis
    from support.namespaces import toy_namespace
    from kvtier.core.tier_config import RedisTierConfig
    from kvtier.tiers.redis import RedisTier
    from kvtier.cachetools.remote import RemoteTarget, verify_remote

    url, payload = {url!r}, {payload}
    ns = toy_namespace()  # a real namespace: kvtier verify checks its values
    tier = RedisTier(RedisTierConfig(url=url), engine_digest=ns.digest, rank_digests=ns.rank_digests(),
                     namespace_json=ns.config_json("m"), payload_bytes=payload)
    key = bytes(range(32))
    name = tier._keys.block(key)
    client = redis.Redis.from_url(url)
    client.setrange(name, (256 << 20) - 1, b"x")  # 256 MiB, made by the server: nothing sent
    dest = bytearray(payload)

    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    before = peak()
    tier.submit_read(1, key, [memoryview(dest)])
    results = []
    while not results:
        tier.wait(5.0)
        results = tier.poll()
    read_grew = peak() - before
    error = results[0].error.name if results[0].error else None
    deadline = time.monotonic() + 60
    while client.exists(name) and time.monotonic() < deadline:  # deleted right after the batch
        time.sleep(0.01)
    removed = client.exists(name) == 0
    client.setrange(name, (256 << 20) - 1, b"x")
    before = peak()
    report = verify_remote(RemoteTarget(url))
    print(json.dumps({{"read_grew_kib": read_grew, "error": error, "removed": removed,
                      "verify_grew_kib": peak() - before, "problems": len(report.problems)}}))
    tier.close()
"""


@pytest.mark.parametrize("payload", [4096, 4 << 20], ids=["whole-value-read", "piecewise-read"])
def test_a_256_mib_redis_value_costs_the_reader_no_memory(redis_factory, payload):  # noqa: F811
    server = redis_factory()
    out = child(HUGE_REDIS_VALUE.format(url=server.url(), payload=payload), timeout=180)
    assert out["error"] == "CORRUPT" and out["removed"], out  # a counted miss, and the value deleted
    assert out["read_grew_kib"] < 32 << 10, f"the read grew the reader by {out['read_grew_kib'] >> 10} MiB"
    assert out["problems"] == 1
    assert out["verify_grew_kib"] < 32 << 10, f"kvtier verify grew by {out['verify_grew_kib'] >> 10} MiB"


# ---------------------------------------------------------------------- encrypt: true


def test_an_encrypting_tier_refuses_records_signed_but_not_encrypted(tmp_path):
    fleet = FleetKey(bytes(range(32)), "k")
    root = tmp_path / "root"
    k = key("abcde", 1)
    signer = make_tier(root, sealer=Sealer(AuthConfig(fleet)))
    assert all(r.ok for r in write(signer, [k]))
    signer.close()
    encrypting = make_tier(root, sealer=Sealer(AuthConfig(fleet, encrypt=True)))
    try:
        assert encrypting.contains(k)
        (result,) = read(encrypting, [k])
        assert not result.ok and result.error is IoError.UNAUTHENTICATED
        assert encrypting.stats.unauthenticated == 1
        assert all(r.ok for r in write(encrypting, [key("abcde", 2)]))  # its own records: served
        (result,) = read(encrypting, [key("abcde", 2)])
        assert result.ok
    finally:
        encrypting.close()


def test_a_snapshot_beyond_the_capacity_is_scanned_instead(tmp_path):
    """The snapshot's bound is the tier's capacity: a genuine snapshot larger than that (written by a
    tier with a larger one) is not read; the files are scanned and the index keeps what it holds."""
    root = tmp_path / "root"
    big = make_tier(root)
    keys = [key("abcde", n) for n in range(8)]
    assert all(r.ok for r in write(big, keys))
    big.close()
    assert os.path.getsize(snapshot_path(big._layout)) == HEADER_BYTES + 8 * 32  # noqa: SLF001
    small = make_tier(root, capacity=4 * big.block_bytes)
    try:
        assert len(small.lru_keys()) == 4
    finally:
        small.close()
