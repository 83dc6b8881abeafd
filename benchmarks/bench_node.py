"""One request's lookup of 1,000 blocks through the node service, with 8 simulated engines
attached. Prints one JSON object.

A real ``kvtier node`` process (pool of ``--blocks`` x ``--width`` slots and room to store more);
engine 0 stores the blocks (reserve, writes its slots in its own mapping, commit). Then each
simulated engine is a process of its own with a ``NodeClient`` (scheduler role: it maps the pool)
that issues ``--rounds`` lookups of all ``--blocks`` keys (one round trip each, pinned like a
full hit, then unpinned), ``--interval-ms`` apart, all engines at once. Phases:

- ``alone``: one engine, nobody else attached;
- ``shared``: ``--engines`` engines looking up at once;
- ``shared_with_io``: the same, while one more engine stores 1,000-block batches without pause
  (reserve, copy ``--slot-bytes`` into each slot, commit; capped at one batch, it churns through
  evictions of its own blocks, never the looked-up ones: ``missed_blocks`` stays 0) and
  one more sends requests and never reads the replies (a stalled engine): neither may slow the
  others' lookups, since the service never waits on a client and copies happen in the engines.

Latency is the client's round trip (send, service's index work, reply, decode);
``service_lookup_us`` is the service's own handling time of the latest lookups (the index work,
no socket, no scheduling). Goal: round-trip p50 <= 0.5 ms for ``shared_with_io``.

    python benchmarks/bench_node.py [--engines 8] [--blocks 1000] [--rounds 200] [--interval-ms 10]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvtier.node import NodeClient, Role
from kvtier.node.protocol import PROTOCOL_VERSION, Reservation, pack

GOAL_P50_MS = 0.5


def keys_for(seed: int, n: int) -> list[bytes]:
    return [seed.to_bytes(4, "little") + i.to_bytes(28, "little") for i in range(n)]


def store(client: NodeClient, keys: list[bytes], width: int, payload: bytes) -> int:
    stored = []
    for key, (status, slots) in zip(keys, client.reserve(keys, width)):
        if status is Reservation.RESERVED:
            for s in slots:
                client.pool.slot(s)[:] = payload
            stored.append(key)
    client.commit(stored)
    return len(stored)


def engine(sock: str, name: str, slot_bytes: int, width: int, keys: list[bytes], rounds: int, interval_s: float,
           start_at: float, out) -> None:
    client = NodeClient(sock, engine=name, slot_bytes=slot_bytes)
    client.connect()
    client.lookup(keys[:10])  # warm
    times, misses = [], 0
    while time.time() < start_at:
        time.sleep(0.001)
    for _ in range(rounds):
        t0 = time.perf_counter()
        hits, _, pin, _, _ = client.lookup(keys, pin=True, width=width)
        times.append(time.perf_counter() - t0)
        misses += len(keys) - hits
        client.unpin([pin])
        time.sleep(interval_s)
    out.put((name, (times, misses)))
    client.close()


def writer(sock: str, slot_bytes: int, width: int, batch: int, interval_s: float, stop_at: float, out) -> None:
    # capped at one batch's worth: it churns through its own blocks, never the others' (cpu_bytes_to_use)
    stride = -(-slot_bytes // 4096) * 4096
    client = NodeClient(sock, engine="writer", slot_bytes=slot_bytes, cap_bytes=batch * width * stride)
    client.connect()
    payload = os.urandom(slot_bytes)
    stored, seed = 0, 1000
    while time.time() < stop_at:
        stored += store(client, keys_for(seed, batch), width, payload)
        seed += 1
        time.sleep(interval_s)
    out.put(("writer", stored))
    client.close()


def stalled(sock: str, stop_at: float) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock)
    s.sendall(pack({"op": "hello", "version": PROTOCOL_VERSION, "engine": "stalled", "role": "observer"}))
    s.setblocking(False)
    try:
        while True:
            s.send(pack({"op": "stats"}))
    except BlockingIOError:
        pass
    while time.time() < stop_at:
        time.sleep(0.05)
    s.close()


def phase(sock: str, args, n_engines: int, keys: list[bytes], with_io: bool) -> dict:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    start_at = time.time() + 1.0
    duration = args.rounds * (args.interval_ms / 1000 + 0.002) + 2.0
    procs = [ctx.Process(target=engine, args=(sock, f"engine-{i}", args.slot_bytes, args.width, keys, args.rounds,
                                              args.interval_ms / 1000, start_at, out)) for i in range(n_engines)]
    if with_io:
        procs.append(ctx.Process(target=writer, args=(sock, args.slot_bytes, args.width, args.blocks,
                                                       args.writer_interval_ms / 1000, start_at + duration, out)))
        procs.append(ctx.Process(target=stalled, args=(sock, start_at + duration)))
    for p in procs:
        p.start()
    results = {}
    for _ in range(n_engines + (1 if with_io else 0)):
        name, value = out.get(timeout=600)
        results[name] = value
    for p in procs:
        p.join(timeout=60)
    lookups = {name: value for name, value in results.items() if name != "writer"}
    times = sorted(t * 1000 for ts, _ in lookups.values() for t in ts)
    q = statistics.quantiles(times, n=100)
    summary = {
        "engines": n_engines, "lookups": len(times), "p50_ms": round(statistics.median(times), 4),
        "p90_ms": round(q[89], 4), "p99_ms": round(q[98], 4), "max_ms": round(times[-1], 4),
        "missed_blocks": sum(m for _, m in lookups.values()),
        "per_engine_p50_ms": {name: round(statistics.median(ts) * 1000, 4) for name, (ts, _) in sorted(lookups.items())},
    }
    if with_io:
        summary["writer_blocks_stored"] = results["writer"]
    with NodeClient(sock, engine="bench", role=Role.OBSERVER) as observer:
        summary["service_lookup_us"] = observer.stats()["lookup_service_us"]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=1000, help="keys per lookup (all hits)")
    parser.add_argument("--width", type=int, default=1, help="slots per block (tensor-parallel ranks)")
    parser.add_argument("--slot-bytes", type=int, default=64 * 1024)
    parser.add_argument("--rounds", type=int, default=200, help="lookups per engine per phase")
    parser.add_argument("--interval-ms", type=float, default=10.0, help="pause between an engine's lookups")
    parser.add_argument("--writer-interval-ms", type=float, default=100.0,
                        help="pause between the storing engine's 1,000-block batches")
    args = parser.parse_args()

    load_at_start = os.getloadavg()[0]  # other work on the machine inflates round trips: say how much there was
    folder = Path(tempfile.mkdtemp(prefix="kvtier-bench-node-"))
    sock = str(folder / "node.sock")
    stride = -(-args.slot_bytes // 4096) * 4096
    pool_bytes = 3 * args.blocks * args.width * stride  # the hot blocks + room for the writer to churn
    env = {**os.environ}
    service = subprocess.Popen([sys.executable, "-m", "kvtier.cli.main", "node", "--socket", sock, "--pool-bytes",
                                str(pool_bytes), "--slot-bytes", str(args.slot_bytes), "--log-level", "warning"],
                               env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                probe = NodeClient(sock, engine="probe", slot_bytes=args.slot_bytes)
                probe.connect()
                break
            except OSError:
                assert service.poll() is None and time.monotonic() < deadline, "kvtier node did not start"
                time.sleep(0.05)
        keys = keys_for(0, args.blocks)
        assert store(probe, keys, args.width, os.urandom(args.slot_bytes)) == args.blocks
        probe.close()
        alone = phase(sock, args, 1, keys, with_io=False)
        shared = phase(sock, args, args.engines, keys, with_io=False)
        shared_io = phase(sock, args, args.engines, keys, with_io=True)
    finally:
        service.send_signal(signal.SIGTERM)
        service.wait(timeout=30)
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()
    print(json.dumps({
        "benchmark": "node_lookup",
        "blocks_per_lookup": args.blocks, "width": args.width, "slot_bytes": args.slot_bytes,
        "pool_bytes": pool_bytes, "cpus": os.cpu_count(), "interval_ms": args.interval_ms,
        "load_average_at_start": load_at_start,
        "alone": alone, "shared": shared, "shared_with_io": shared_io,
        "goal_p50_ms": GOAL_P50_MS, "goal_met": shared_io["p50_ms"] <= GOAL_P50_MS,
    }, indent=2))


if __name__ == "__main__":
    main()
