"""Keep the Redis tier's reply buffers on the heap (glibc): one warm-up free at start-up.

redis-py (with hiredis) builds every GET reply in two fresh buffers the size of the value (the
reader's buffer and the ``bytes`` object). glibc serves an allocation at or above its mmap
threshold (128 KiB at process start) with a fresh ``mmap`` and returns it with ``munmap``, so
every multi-MB reply page-faults its whole size twice: measured 2,857 minor faults and 14-18 ms
per 5.9 MB GET, against 80 faults and 7 ms once the replies come from the heap (read throughput
280 -> 640 MB/s; docs/benchmarks.md).

glibc raises the threshold by itself ("dynamic mmap threshold") when a process frees an mmapped
chunk: to that chunk's size (at most 32 MiB on 64-bit), and the heap trim threshold to twice
that. :func:`raise_mmap_threshold` frees one buffer of 31 MiB, which puts the process in the
state it would reach after freeing any such buffer (a serving engine that
loaded a model usually is already). Process-wide, no allocator setting is changed, and on other
allocators it is one harmless allocation. Called once by the tier's constructor.
"""

from __future__ import annotations

GLIBC_MAX_DYNAMIC_THRESHOLD = 32 * 2**20
"""glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: a freed chunk above it does not raise the threshold."""
WARM_UP_BYTES = GLIBC_MAX_DYNAMIC_THRESHOLD - 2**20
"""The buffer freed: as large as glibc allows, so the threshold (and the heap trim threshold, twice
it) covers the biggest values and what several read threads hold at once (each holds one reply
and its reader buffer; before reads landed each reply as it came, a batch of 4 x 5.9 MB replies
alive together measured 1,432 faults per get with a threshold of one value)."""
READER_SLACK = 2 * 2**20
"""Room above a value for the reply reader's buffer growth (hiredis preallocates up to 1 MiB)."""


def raise_mmap_threshold(max_reply_bytes: int) -> int:
    """Free one buffer of :data:`WARM_UP_BYTES`; returns its size, or 0 when a value (plus the
    reader's slack) is too big for the heap to help (its replies stay mmapped)."""
    if max_reply_bytes + READER_SLACK >= WARM_UP_BYTES:
        return 0
    buffer = bytearray(WARM_UP_BYTES)  # above the threshold: mmapped; freeing it raises the threshold
    del buffer
    return WARM_UP_BYTES
