"""Counters of the S3 tier: what :attr:`~kvtier.tiers.s3.S3Tier.stats` returns.

The tier keeps them in a dict keyed by the fields' names (:class:`~kvtier.tiers.remote.RemoteTier`)
on the caller's thread (only :meth:`~kvtier.tiers.s3.S3Tier.poll` and the submit methods change
them) and snapshots them into a frozen :class:`S3TierStats`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class S3TierStats:
    """Counters of one :class:`~kvtier.tiers.s3.S3Tier` (a snapshot; read ``S3Tier.stats`` again).

    Reads: ``reads_ok``; ``read_misses`` (NOT_FOUND: evicted, purged or swept since the lookup);
    ``corrupt`` (objects that failed a check: truncated, oversized, another namespace's or key's,
    bad checksum: never served, deleted); ``unauthenticated`` (no valid MAC under the tier's fleet
    keys, or sealed where the tier has none: never served, deleted); ``io_errors`` (reads, writes
    and removals that failed, including ``breaker_rejects``: refused at once while the breaker was
    open, ``throttled``: answered 503 SlowDown / 429 after object_store's retries, ``refused``: 401 /
    403, and ``unreachable``: no answer). Writes: ``writes_ok``; ``writes_dropped`` (not stored:
    queue full, breaker open, closed); ``writes_deduped`` (completed at once: known present or being
    written). ``probes``: keys asked with HEAD (``probe_failures`` of them without an answer).
    ``listings``: LISTs of the prefix completed (``listing_failures``: abandoned). ``removed``:
    objects deleted (deletes, clears, bad objects); ``evicted``: by this tier's capacity sweeps.
    ``breaker_opens``: how often the circuit breaker opened.
    """

    reads_ok: int = 0
    read_misses: int = 0
    corrupt: int = 0
    unauthenticated: int = 0
    io_errors: int = 0
    breaker_rejects: int = 0
    throttled: int = 0
    refused: int = 0
    unreachable: int = 0
    writes_ok: int = 0
    writes_dropped: int = 0
    writes_deduped: int = 0
    probes: int = 0
    probe_failures: int = 0
    listings: int = 0
    listing_failures: int = 0
    removed: int = 0
    evicted: int = 0
    breaker_opens: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
