"""Disk tier throughput against ``dd`` on the same directory, same file sizes and total bytes.

    python benchmarks/bench_disk.py [--dir DIR] [--payload-bytes N] [--blocks N] [--repeat N]

Prints one JSON document. For each direction it measures:

- ``kvtier``: a :class:`~kvtier.tiers.disk.DiskTier` writing/reading ``blocks`` block files
  (header + payload, checksummed) with its own thread pools, driven by a poll loop.
- ``kvtier_1thread``: the same with one read and one write thread (the like-for-like case for
  a single ``dd`` stream).
- ``dd_per_file``: one ``dd`` process per file, one after another
  (``dd if=/dev/zero of=FILE bs=<file size> count=1``, ``dd if=FILE of=/dev/null bs=<file size>``).
  Includes a fork+exec per file, as a shell script copying files would.
- ``dd_stream``: a single ``dd`` moving the same bytes as one file (no per-file cost at all: an
  upper bound for one sequential stream).

Page cache: writes are buffered (neither kvtier nor dd fsyncs); ``*_incl_sync`` adds the time of
a ``sync`` after the phase. "warm" reads come from the page cache (the files were just written:
this measures memory copies, checksumming and syscall overhead). "cold" reads run after
``echo 3 > /proc/sys/vm/drop_caches`` when that is permitted (root), and are skipped otherwise.
Each measurement is repeated ``--repeat`` times, interleaved; the JSON has the median and all runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvtier.tiers.base import IoKind
from kvtier.tiers.blockfile import HEADER_LEN
from kvtier.tiers.disk import DiskTier

SMOLLM2_BLOCK = 30 * 196608  # one SmolLM2-135M fp32 block of 128 tokens: 30 layers x 196608 B


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
    except OSError:
        return False
    return True


def make_tier(root: Path, args, read_threads: int, write_threads: int) -> DiskTier:
    file_bytes = HEADER_LEN + args.payload_bytes
    return DiskTier(
        root_dir=root,
        model_name="bench",
        engine_digest=b"\x11" * 32,
        rank_digests=[b"\x22" * 32],
        namespace_json='{"bench":true}',
        payload_bytes=args.payload_bytes,
        capacity_bytes=(args.blocks + 1) * file_bytes,
        n_read_threads=read_threads,
        n_write_threads=write_threads,
        max_pending_writes=args.window,
    )


def kvtier_write(tier: DiskTier, keys: list[bytes], sources: list[memoryview]) -> float:
    start = time.perf_counter()
    submitted = done = 0
    while done < len(keys):
        while submitted < len(keys) and tier.submit_write(
            submitted, keys[submitted], b"\0" * 32, 128, [sources[submitted % len(sources)]]
        ):
            submitted += 1
        results = tier.poll()
        for result in results:
            if not result.ok:
                raise RuntimeError(f"write failed: {result}")
        done += len(results)
        if not results:
            time.sleep(0.0002)
    return time.perf_counter() - start


def kvtier_read(tier: DiskTier, keys: list[bytes], dests: list[memoryview]) -> float:
    free = list(range(len(dests)))  # a destination buffer is busy until its read completes
    busy: dict[int, int] = {}
    start = time.perf_counter()
    submitted = done = 0
    while done < len(keys):
        while submitted < len(keys) and free:
            slot = free.pop()
            busy[submitted] = slot
            tier.submit_read(submitted, keys[submitted], [dests[slot]])
            submitted += 1
        results = tier.poll()
        for result in results:
            if result.kind is not IoKind.READ or not result.ok:
                raise RuntimeError(f"read failed: {result}")
            free.append(busy.pop(result.job_id))
        done += len(results)
        if not results:
            time.sleep(0.0002)
    return time.perf_counter() - start


def dd_write_per_file(directory: Path, n: int, file_bytes: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={directory}/{i}.bin", f"bs={file_bytes}", "count=1", "status=none"],
            check=True,
        )
    return time.perf_counter() - start


def dd_read_per_file(directory: Path, n: int, file_bytes: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        subprocess.run(
            ["dd", f"if={directory}/{i}.bin", "of=/dev/null", f"bs={file_bytes}", "status=none"], check=True
        )
    return time.perf_counter() - start


def dd_stream(src: str, dst: str, file_bytes: int, n: int) -> float:
    start = time.perf_counter()
    command = ["dd", f"if={src}", f"of={dst}", f"bs={file_bytes}", f"count={n}", "status=none"]
    subprocess.run(command, check=True)
    return time.perf_counter() - start


def timed_sync() -> float:
    start = time.perf_counter()
    os.sync()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="directory to measure (default: the temp dir)")
    parser.add_argument("--payload-bytes", type=int, default=SMOLLM2_BLOCK)
    parser.add_argument("--blocks", type=int, default=200)
    parser.add_argument("--read-threads", type=int, default=4)
    parser.add_argument("--write-threads", type=int, default=2)
    parser.add_argument("--window", type=int, default=16, help="writes / reads in flight (buffers)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-cold", action="store_true", help="skip the drop_caches (cold) reads")
    args = parser.parse_args()
    if shutil.which("dd") is None:
        sys.exit("dd not found")

    file_bytes = HEADER_LEN + args.payload_bytes
    total = file_bytes * args.blocks
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-disk-", dir=args.dir))
    cold = not args.no_cold and drop_caches()
    sources = [memoryview(os.urandom(args.payload_bytes)) for _ in range(8)]
    dests = [memoryview(bytearray(args.payload_bytes)) for _ in range(args.window)]
    runs: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        runs.setdefault(name, []).append(seconds)

    try:
        for rep in range(args.repeat):
            variants = (("kvtier", (args.read_threads, args.write_threads)), ("kvtier_1thread", (1, 1)))
            for variant, (rt, wt) in variants:
                root = work / variant
                shutil.rmtree(root, ignore_errors=True)
                os.sync()
                tier = make_tier(root, args, rt, wt)
                keys = [os.urandom(32) for _ in range(args.blocks)]
                try:
                    seconds = kvtier_write(tier, keys, sources)
                    record(f"write.{variant}", seconds)
                    record(f"write_incl_sync.{variant}", seconds + timed_sync())
                    record(f"read_warm.{variant}", kvtier_read(tier, keys, dests))
                    if cold:
                        drop_caches()
                        record(f"read_cold.{variant}", kvtier_read(tier, keys, dests))
                    stats = tier.stats
                    assert stats.corrupt_quarantined == 0 and stats.io_errors == 0, stats
                finally:
                    tier.close()
                shutil.rmtree(root, ignore_errors=True)

            dd_dir = work / "dd"
            shutil.rmtree(dd_dir, ignore_errors=True)
            dd_dir.mkdir()
            os.sync()
            seconds = dd_write_per_file(dd_dir, args.blocks, file_bytes)
            record("write.dd_per_file", seconds)
            record("write_incl_sync.dd_per_file", seconds + timed_sync())
            record("read_warm.dd_per_file", dd_read_per_file(dd_dir, args.blocks, file_bytes))
            if cold:
                drop_caches()
                record("read_cold.dd_per_file", dd_read_per_file(dd_dir, args.blocks, file_bytes))
            shutil.rmtree(dd_dir, ignore_errors=True)

            stream = work / "stream.bin"
            os.sync()
            seconds = dd_stream("/dev/zero", str(stream), file_bytes, args.blocks)
            record("write.dd_stream", seconds)
            record("write_incl_sync.dd_stream", seconds + timed_sync())
            record("read_warm.dd_stream", dd_stream(str(stream), "/dev/null", file_bytes, args.blocks))
            if cold:
                drop_caches()
                record("read_cold.dd_stream", dd_stream(str(stream), "/dev/null", file_bytes, args.blocks))
            stream.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    results: dict[str, dict] = {}
    for name, seconds in runs.items():
        phase, who = name.split(".")
        gbps = [total / s / 1e9 for s in seconds]
        results.setdefault(phase, {})[who] = {
            "gb_per_s": round(statistics.median(gbps), 3),
            "runs_gb_per_s": [round(g, 3) for g in gbps],
        }
    for phase, entries in results.items():
        kv = entries["kvtier"]["gb_per_s"]
        entries["ratio_kvtier_vs_dd_per_file"] = round(kv / entries["dd_per_file"]["gb_per_s"], 3)
        entries["ratio_kvtier_vs_dd_stream"] = round(kv / entries["dd_stream"]["gb_per_s"], 3)
        entries["ratio_kvtier_1thread_vs_dd_per_file"] = round(
            entries["kvtier_1thread"]["gb_per_s"] / entries["dd_per_file"]["gb_per_s"], 3
        )

    df = subprocess.run(["df", "-T", str(work.parent)], capture_output=True, text=True).stdout
    fs = df.splitlines()[-1].split() if df else []
    print(
        json.dumps(
            {
                "config": {
                    "dir": str(work.parent),
                    "filesystem": fs[1] if len(fs) > 1 else None,
                    "payload_bytes": args.payload_bytes,
                    "file_bytes": file_bytes,
                    "blocks": args.blocks,
                    "total_bytes": total,
                    "read_threads": args.read_threads,
                    "write_threads": args.write_threads,
                    "window": args.window,
                    "repeat": args.repeat,
                    "cold_reads": cold,
                },
                "machine": {
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "kernel": platform.release(),
                    "loadavg_at_end": os.getloadavg(),
                },
                "results": results,
                "notes": [
                    "GB/s = blocks x file size (header + payload) / seconds, 1 GB = 1e9 B; median of runs.",
                    "write: buffered (page cache), no fsync by either side; write_incl_sync adds one sync.",
                    "read_warm: page-cache hits (memory copies + xxh3 verify for kvtier).",
                    "read_cold: after drop_caches, i.e. from the device." if cold else "cold reads skipped",
                    "dd_per_file pays one fork+exec per file; dd_stream is one process, one file.",
                ],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
