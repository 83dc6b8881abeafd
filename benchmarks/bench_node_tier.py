"""What ``kvtier_node`` (the node pool behind vLLM's own offloading) costs per request. Prints one JSON object.

vLLM asks a secondary tier one chunk at a time; ``kvtier_node`` answers an unknown chunk "ask again",
buffers the keys of the request's lookup pass and asks the service once for all of them
(:mod:`kvtier.node.pool_tier`). This measures, against a real ``kvtier node`` process holding
``--chunks`` chunks of ``--width`` x ``--slot-bytes``:

- ``lookup_one_key_us``: one round trip for one key (what a per-chunk lookup would cost per chunk,
  on vLLM's scheduler thread);
- ``lookup_per_chunk_us``: ``--chunks`` such round trips, one after the other (a request's lookup
  done per chunk);
- ``lookup_batched_us``: one round trip for all ``--chunks`` keys (what the tier does);
- ``probe_answered_us``: through :class:`~kvtier.node.pool_tier.NodeTier`: probe every chunk,
  flush, poll until every answer is in (the worker thread's round trip plus the hand-over);
- ``load_us`` / ``load_gbps``: the tier loading every chunk into plain buffers (one pinned lookup,
  copies out of the pool on the worker thread, one unpin).

p50 of ``--rounds`` rounds each.

    python benchmarks/bench_node_tier.py [--chunks 64] [--width 1] [--slot-bytes 65536] [--rounds 50]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.node_process import NodeProcess  # noqa: E402

from kvtier.core.tier_config import NodeTierConfig  # noqa: E402
from kvtier.node import NodeClient  # noqa: E402
from kvtier.node.pool_tier import NodeTier  # noqa: E402
from kvtier.tiers.outbox import wait_for_any  # noqa: E402


def p50_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--width", type=int, default=1)
    parser.add_argument("--slot-bytes", type=int, default=65536)
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    pool = 2 * args.chunks * args.width * args.slot_bytes + (1 << 20)
    node = NodeProcess(Path(tempfile.mkdtemp(prefix="kvtier-bench-")) / "node.sock", str(pool)).start()
    try:
        keys = [os.urandom(32) for _ in range(args.chunks)]
        client = NodeClient(node.sock, engine="writer", slot_bytes=args.slot_bytes)
        client.connect()
        answers = client.reserve(keys, args.width)
        for _, slots in answers:
            for slot in slots:
                client.pool.slot(slot)[:] = os.urandom(args.slot_bytes)
        client.commit(keys)

        one, per_chunk, batched = [], [], []
        for _ in range(args.rounds):
            started = time.perf_counter()
            client.lookup(keys[:1], width=args.width)
            one.append(time.perf_counter() - started)
            started = time.perf_counter()
            for key in keys:
                client.lookup([key], width=args.width)
            per_chunk.append(time.perf_counter() - started)
            started = time.perf_counter()
            client.lookup(keys, width=args.width)
            batched.append(time.perf_counter() - started)
        client.close()

        tier = NodeTier(NodeTierConfig(node.sock), engine="reader", payload_bytes=args.slot_bytes, width=args.width)
        dests = [[memoryview(bytearray(args.slot_bytes)) for _ in range(args.width)] for _ in keys]
        probes, loads = [], []
        try:
            for index in range(args.rounds):
                tier.clear()  # forget the answers: every round asks the service again
                tier.group = index
                started = time.perf_counter()
                tier.probe(keys)
                tier.flush()
                while tier.probing:
                    wait_for_any([tier.outbox], tier.outbox.bell, 0.01)  # as vLLM's idle step does
                    tier.poll()
                probes.append(time.perf_counter() - started)
                started = time.perf_counter()
                for job, (key, dest) in enumerate(zip(keys, dests, strict=True)):
                    tier.submit_read(job, key, dest)
                tier.flush()
                done = 0
                while done < len(keys):
                    wait_for_any([tier.outbox], tier.outbox.bell, 0.01)
                    done += sum(1 for result in tier.poll() if result.ok)
                loads.append(time.perf_counter() - started)
        finally:
            tier.close()
        load_s = statistics.median(loads)
        print(json.dumps({
            "chunks": args.chunks, "width": args.width, "slot_bytes": args.slot_bytes, "rounds": args.rounds,
            "lookup_one_key_us": p50_us(one), "lookup_per_chunk_us": p50_us(per_chunk),
            "lookup_batched_us": p50_us(batched), "probe_answered_us": p50_us(probes),
            "load_us": p50_us(loads),
            "load_gbps": round(args.chunks * args.width * args.slot_bytes / load_s / 1e9, 2),
            "loadavg_1m": os.getloadavg()[0],
        }))
    finally:
        node.stop()


if __name__ == "__main__":
    main()
