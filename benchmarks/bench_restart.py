"""Disk tier restart at scale: how soon a restarted engine serves hits from a big disk tier.

    python benchmarks/bench_restart.py [--blocks 1000000] [--dir DIR] [--keep]

Prints one JSON document. It fills a disk tier's namespace with ``--blocks`` block files (a few
hundred written through :class:`~kvtier.tiers.disk.DiskTier`, so they can be read back and
verified; the rest are right-sized files made directly, which is all a start-up looks at), then
measures, each after ``echo 3 > /proc/sys/vm/drop_caches`` when permitted (root; "cold"):

- ``scan_start_s``: start-up without a snapshot (the synchronous scan of every file, as after a
  crash before the first snapshot, or before kvtier had snapshots);
- ``snapshot_close_s`` and ``snapshot_bytes``: ``close()`` writing the index snapshot;
- ``snapshot_start_s``: start-up from the snapshot; ``first_hit_s``: from the start of the
  constructor until a block read back (verified) succeeds: the goal is under 2 s at 1,000,000;
- ``background_rescan_s``: until the rescan the snapshot start-up begins has been merged (files
  written after the snapshot, files gone since; the engine serves meanwhile).

Making a million files takes a few minutes and about 4 GB of disk (one filesystem block each).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import tempfile
import time
from pathlib import Path

from bench_disk import drop_caches  # (this folder is on sys.path when run as a script)

from kvtier.tiers.base import IoKind
from kvtier.tiers.blockfile import HEADER_LEN
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk.snapshot import snapshot_path

PAYLOAD = 512
REAL_BLOCKS = 256


def open_tier(root: Path, blocks: int) -> DiskTier:
    return DiskTier(
        root_dir=root, model_name="bench", engine_digest=b"\x22" * 32, rank_digests=[b"\x33" * 32],
        namespace_json='{"model_name": "bench"}', payload_bytes=PAYLOAD,
        capacity_bytes=2 * blocks * (HEADER_LEN + PAYLOAD), n_read_threads=2, n_write_threads=2,
        max_pending_writes=512,
    )


def wait(tier: DiskTier, count: int, kind: IoKind, timeout: float = 120.0) -> list:
    results, deadline = [], time.monotonic() + timeout
    while len(results) < count:
        results += [r for r in tier.poll() if r.kind is kind]
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(results)} of {count} {kind.name} results")
        time.sleep(0.001)
    return results


def fill(root: Path, blocks: int) -> list[bytes]:
    """``blocks`` block files: REAL_BLOCKS real ones (returned), the rest right-sized stand-ins."""
    tier = open_tier(root, blocks)
    real = [os.urandom(32) for _ in range(REAL_BLOCKS)]
    for job, key in enumerate(real):
        assert tier.submit_write(job, key, b"\0" * 32, 16, [memoryview(os.urandom(PAYLOAD))])
    assert all(r.ok for r in wait(tier, len(real), IoKind.WRITE))
    layout = tier._layout  # noqa: SLF001 (the file names the tier itself would use)
    tier.close()
    os.unlink(snapshot_path(layout))
    filler = b"\0" * (HEADER_LEN + PAYLOAD)
    made_dirs: set[str] = set()
    for _ in range(blocks - REAL_BLOCKS):
        path = layout.path(os.urandom(32).hex(), 0)
        folder = os.path.dirname(path)
        if folder not in made_dirs:
            os.makedirs(folder, exist_ok=True)
            made_dirs.add(folder)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, filler)
        os.close(fd)
    return real


def first_hit(tier: DiskTier, key: bytes) -> None:
    dest = bytearray(PAYLOAD)
    tier.submit_read(1, key, [memoryview(dest)])
    (result,) = wait(tier, 1, IoKind.READ)
    assert result.ok, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--dir", type=Path, default=None, help="where to make the tier (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the files")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvtier-restart-", dir=args.dir))
    out: dict = {"blocks": args.blocks, "payload_bytes": PAYLOAD, "host": platform.node(),
                 "cpus": os.cpu_count(), "dir": str(root)}
    try:
        started = time.perf_counter()
        real = fill(root, args.blocks)
        out["fill_s"] = round(time.perf_counter() - started, 1)

        out["cold"] = drop_caches()
        started = time.perf_counter()
        tier = open_tier(root, args.blocks)
        out["scan_start_s"] = round(time.perf_counter() - started, 3)
        assert tier.usage().num_blocks == args.blocks, tier.usage()
        started = time.perf_counter()
        tier.close()
        out["snapshot_close_s"] = round(time.perf_counter() - started, 3)
        out["snapshot_bytes"] = os.path.getsize(snapshot_path(tier._layout))  # noqa: SLF001

        drop_caches()
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        started = time.perf_counter()
        tier = open_tier(root, args.blocks)
        out["snapshot_start_s"] = round(time.perf_counter() - started, 3)
        assert tier.usage().num_blocks == args.blocks and tier.contains(real[0])
        first_hit(tier, real[len(real) // 2])
        out["first_hit_s"] = round(time.perf_counter() - started, 3)
        while tier._state.scan_running:  # noqa: SLF001 (the background rescan)
            tier.poll()
            time.sleep(0.01)
        out["background_rescan_s"] = round(time.perf_counter() - started, 3)
        out["max_rss_mb"] = round(max(rss_before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024)
        assert tier.usage().num_blocks == args.blocks
        tier.close()
        out["goal_first_hit_under_2s"] = out["first_hit_s"] < 2.0
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
