"""Counters of the Redis tier: what :attr:`~kvtier.tiers.redis.RedisTier.stats` returns.

The tier keeps them in a dict keyed by :data:`COUNTED` on the caller's thread (only
:meth:`~kvtier.tiers.redis.RedisTier.poll` and the submit methods change them) and snapshots
them into a frozen :class:`RedisTierStats`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RedisTierStats:
    """Counters of one :class:`RedisTier` (a snapshot; read ``RedisTier.stats`` again).

    Reads: ``reads_ok``; ``read_misses`` (NOT_FOUND); ``corrupt`` (values that failed a check:
    never served, deleted); ``unauthenticated`` (values without a valid MAC under the tier's fleet
    keys, or sealed where the tier has none: never served, deleted); ``io_errors`` (reads, writes and removals that failed, including
    ``breaker_rejects``: reads refused at once while the breaker was open, and ``unreachable``: reads
    and writes whose batch found the server unreachable; the two make ``RedisTier.unavailable``). Writes:
    ``writes_ok``; ``writes_dropped`` (not stored: queue full, breaker open, or server full;
    ``writes_oom`` of them refused by a full server); ``writes_deduped`` (completed at once: the
    block was known present or already being written). ``probes``: keys probed (``probe_failures``
    of them without an answer). ``removed``: values that UNLINK removed (deletes, clears,
    corrupt values). ``*_batches``: round trips (per server) of each kind. ``breaker_opens``: how
    often the circuit breaker opened.
    """

    reads_ok: int = 0
    read_misses: int = 0
    corrupt: int = 0
    unauthenticated: int = 0
    io_errors: int = 0
    breaker_rejects: int = 0
    unreachable: int = 0
    writes_ok: int = 0
    writes_dropped: int = 0
    writes_oom: int = 0
    writes_deduped: int = 0
    probes: int = 0
    probe_failures: int = 0
    removed: int = 0
    read_batches: int = 0
    write_batches: int = 0
    probe_batches: int = 0
    breaker_opens: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0


COUNTED = tuple(f.name for f in dataclasses.fields(RedisTierStats) if f.name != "breaker_opens")
"""The counters the tier keeps itself (``breaker_opens`` is the breaker's)."""
