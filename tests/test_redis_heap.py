"""The Redis tier's warm-up free (kvtier.tiers.redis.heap): after it, GET replies of engine-sized
blocks, as hiredis builds them (a reader buffer grown while 64 KiB reads are fed, then a ``bytes``
object), are reused heap memory instead of fresh mmaps that page-fault their whole size on every
reply. Each case runs in a fresh interpreter (the allocator's state is process-wide)."""

from __future__ import annotations

import subprocess
import sys

from kvtier.tiers.redis.heap import READER_SLACK, WARM_UP_BYTES, raise_mmap_threshold

VALUE = 5_898_240 + 136  # one SmolLM2 fp32 128-token block and its header
PAGES = VALUE // 4096

REPLIES = f"""
import resource, sys, hiredis
if sys.argv[1] == "warm":
    from kvtier.tiers.redis.heap import raise_mmap_threshold
    raise_mmap_threshold({VALUE})
wire = b"${VALUE}\\r\\n" + b"x" * {VALUE} + b"\\r\\n"
view = memoryview(wire)
def reply():
    reader = hiredis.Reader()  # as redis-py feeds its socket reads (64 KiB) to hiredis
    for i in range(0, len(wire), 65536):
        reader.feed(view[i : i + 65536])
    assert len(reader.gets()) == {VALUE}
for _ in range(3):
    reply()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    reply()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


def faults_per_reply(state: str) -> float:
    out = subprocess.run([sys.executable, "-c", REPLIES, state], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def test_size_and_cap():
    assert raise_mmap_threshold(VALUE) == WARM_UP_BYTES
    assert raise_mmap_threshold(WARM_UP_BYTES - READER_SLACK) == 0  # too big for the heap to help


def test_replies_stop_page_faulting_after_the_warm_up():
    cold = faults_per_reply("cold")
    if cold < PAGES / 2:  # the negative control: without the warm-up, every reply faults
        import pytest

        pytest.skip(f"this C library does not mmap each reply ({cold:.0f} faults per reply)")
    warm = faults_per_reply("warm")
    assert warm < PAGES / 10, f"{warm:.0f} page faults per reply after the warm-up (cold: {cold:.0f})"
