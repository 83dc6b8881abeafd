"""Per-file cost of the disk tier's file operations, from the page cache, one thread.

    PYTHONPATH=src python benchmarks/bench_disk_ops.py [--files 2000] [--payload-bytes 65536] [--repeat 7]

Prints one JSON document: the cost per block file of what the tier's worker threads do, each
operation timed one file at a time, as the CPU time of the calling thread (``thread_time``: user +
system time, so time spent waiting for a core on a busy machine drops out; file data comes from the
page cache) and as wall time; per operation the median and the 10th percentile over every file of
every pass (``--repeat`` passes over ``--files`` files):

- ``read``: ``files.read_block`` (open, header and payload read, checksum, mtime refreshed) of one
  block of one rank, into a preallocated buffer;
- ``write``: ``writer.write_block`` (temp file, ledger charge under its lock, write, ``link`` into place);
- ``touch``: ``files.touch_blocks`` of one block;
- ``unlink``: ``files.unlink_blocks`` of one block (under the ledger's lock, leaf directory dropped);
- ``scan``: ``DiskLayout.scan`` of the whole root (the start-up scan: every file ``stat``-ed),
  divided by its files.

``payload_hash_us``: xxh3 of one payload from memory (the part of a read that is not per-file
overhead). The payload is small on purpose (64 KiB): what is measured is the per-file overhead
(syscalls, path resolution), which a larger block only hides. The files' names spread over the leaf
directories as block keys do. Run it with two source trees on ``PYTHONPATH``, alternately, to
compare them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import xxhash

from kvtier.tiers.blockfile import HEADER_LEN
from kvtier.tiers.disk import files
from kvtier.tiers.disk.layout import DiskLayout
from kvtier.tiers.disk.ledger import Ledger
from kvtier.tiers.disk.writer import NoSpaceLog, write_block

NS = b"\xab" * 32


def timed(fn, items) -> tuple[list[float], list[float]]:
    """CPU and wall microseconds of ``fn(item)`` for each item."""
    cpu, wall = [], []
    thread_ns, clock_ns = time.thread_time_ns, time.perf_counter_ns
    for item in items:
        c0, w0 = thread_ns(), clock_ns()
        fn(item)
        c1, w1 = thread_ns(), clock_ns()
        cpu.append((c1 - c0) / 1e3)
        wall.append((w1 - w0) / 1e3)
    return cpu, wall


def summary(cpu: list[float], wall: list[float]) -> dict[str, float]:
    cpu, wall = sorted(cpu), sorted(wall)
    return {"cpu_median": round(statistics.median(cpu), 2), "cpu_p10": round(cpu[len(cpu) // 10], 2),
            "wall_median": round(statistics.median(wall), 2), "wall_p10": round(wall[len(wall) // 10], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--payload-bytes", type=int, default=65536)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to make the root (default: the temp dir)")
    parser.add_argument("--no-openat2", action="store_true",
                        help="resolve paths one directory at a time, as on kernels without openat2")
    args = parser.parse_args()
    if args.no_openat2:
        from kvtier.core import rootfs

        rootfs._OPENAT2.usable = False

    base = Path(tempfile.mkdtemp(prefix="kvtier-bench-ops-", dir=args.dir))
    try:
        root = base / "root"
        layout = DiskLayout(root, "bench", b"\x11" * 32, 1, 0)
        layout.create('{"model_name": "bench"}')
        file_bytes = HEADER_LEN + args.payload_bytes
        ledger = Ledger.for_engine(layout, file_bytes, 1 << 62)
        ledger.attach()
        no_space = NoSpaceLog(str(root))
        keys = [xxhash.xxh3_128_digest(n.to_bytes(8, "little")) * 2 for n in range(args.files)]
        source = [memoryview(os.urandom(args.payload_bytes))]
        dest = [memoryview(bytearray(args.payload_bytes))]

        def write_one(key: bytes) -> None:
            write_block(layout, ledger, no_space, [NS], key, bytes(32), 16, source)

        def read_one(key: bytes) -> None:
            assert files.read_block(layout, ledger, [NS], key, dest) is None

        samples: dict[str, tuple[list[float], list[float]]] = {
            name: ([], []) for name in ("write", "read", "touch", "unlink", "scan")}

        def add(name: str, got: tuple[list[float], list[float]]) -> None:
            samples[name][0].extend(got[0])
            samples[name][1].extend(got[1])

        for _ in range(args.repeat):
            add("write", timed(write_one, keys))
            add("read", timed(read_one, keys))
            add("touch", timed(lambda key: files.touch_blocks(layout, [key.hex()]), keys))
            cpu, wall = timed(lambda _: layout.scan(None, file_bytes), [None])
            add("scan", ([cpu[0] / args.files], [wall[0] / args.files]))
            add("unlink", timed(lambda key: files.unlink_blocks(layout, ledger, [key]), keys))
        out: dict = {"files": args.files, "payload_bytes": args.payload_bytes, "repeat": args.repeat,
                     "paths": "walk" if args.no_openat2 else "default",
                     "host": platform.node(), "cpus": os.cpu_count(), "kernel": platform.release(),
                     "us_per_file": {name: summary(*got) for name, got in samples.items()}}
        hashed = timed(lambda _: xxhash.xxh3_64_intdigest(source[0]), range(200))
        out["payload_hash_us"] = summary(*hashed)["cpu_median"]
        out["loadavg_at_end"] = list(os.getloadavg())
        print(json.dumps(out))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
