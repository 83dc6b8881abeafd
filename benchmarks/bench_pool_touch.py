"""First touch of the node pool in a fresh process: what a second engine's first reads of slots
another engine wrote cost, with and without ``MAP_POPULATE``. Prints one JSON object.

The pool is a real one (:func:`kvtier.node.pool.create_pool_fd`, pre-faulted as the service does);
this process writes all of it (engine A's stores), then a forked child per variant maps it afresh
(engine B attaching) and copies it out in ``--chunk-mib`` pieces (one request's bytes) twice: the
first pass reads pages its mapping has never touched, the second the same pages again. The child's
destination buffer is touched before the timing, so only the pool's side faults.

    python benchmarks/bench_pool_touch.py [--pool-mib 512] [--chunk-mib 50]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import time

import numpy as np

from kvtier.node.pool import create_pool_fd


def copy_out(fd: int, size: int, chunk: int, flags: int) -> dict:
    """In this (fresh) process: map, then two passes of chunked copy-outs; times in ms."""
    out = np.ones(chunk, np.uint8)  # touched: only the pool's pages fault below
    t0 = time.perf_counter()
    mm = mmap.mmap(fd, size, flags)
    map_ms = (time.perf_counter() - t0) * 1000
    src = np.frombuffer(mm, np.uint8)
    chunks = size // chunk
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    passes = []
    for _ in range(2):
        times = []
        for j in range(chunks):
            t = time.perf_counter()
            np.copyto(out, src[j * chunk:(j + 1) * chunk])
            times.append(round((time.perf_counter() - t) * 1000, 2))
        passes.append(times)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    del src
    mm.close()
    return {"map_ms": round(map_ms, 1), "first_touch_ms": passes[0], "again_ms": passes[1],
            "minor_faults": faults}


def in_child(fd: int, size: int, chunk: int, flags: int) -> dict:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.write(w, json.dumps(copy_out(fd, size, chunk, flags)).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while block := os.read(r, 1 << 16):
        data += block
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool-mib", type=int, default=512)
    parser.add_argument("--chunk-mib", type=int, default=50, help="bytes copied per request")
    args = parser.parse_args()
    size, chunk = args.pool_mib * 2**20, args.chunk_mib * 2**20
    fd = create_pool_fd(size)
    with mmap.mmap(fd, size, mmap.MAP_SHARED) as mm:  # engine A writes every slot
        np.frombuffer(mm, np.uint8)[:] = 7
    print(json.dumps({
        "benchmark": "pool_first_touch", "pool_bytes": size, "chunk_bytes": chunk,
        "load_average": os.getloadavg(), "page_size": mmap.PAGESIZE,
        "fresh_mapping": in_child(fd, size, chunk, mmap.MAP_SHARED),
        "map_populate": in_child(fd, size, chunk, mmap.MAP_SHARED | mmap.MAP_POPULATE),
    }, indent=2))
    os.close(fd)


if __name__ == "__main__":
    main()
