"""Counters and gauges kvtier keeps, as plain data that crosses process boundaries (pickle/msgpack-safe).

:class:`TransferCounters` is filled by workers (bytes and seconds they moved between the engine
and the host tier) and by the orchestrator (host <-> disk). :class:`KVTierStats` is the
interval snapshot the vLLM connector reports as its connector stats; ``as_dict`` keys are the
stable names used in logs, JSON and (prefixed ``kvtier_``) Prometheus.

Counters are additive: merging two intervals sums them. Gauges (fields marked :data:`GAUGE`:
tier usage) are samples: merging keeps the later sample, and None means "not sampled".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from kvtier.core.residency import Medium

GAUGE = {"gauge": True}
"""Field metadata of a gauge (a sample, merged by keeping the later value)."""


_TIER_NAMES = {Medium.HOST: "host", Medium.DISK: "disk", Medium.REMOTE: "remote", Medium.S3: "s3"}
"""How each tier is named in the field names below (and in metric labels): ``remote`` is the Redis /
Valkey tier (its name since before the object tier), ``s3`` the S3-compatible object tier."""


@dataclass
class TransferCounters:
    """Bytes/seconds/jobs moved in one direction between two tiers."""

    bytes: int = 0
    seconds: float = 0.0
    jobs: int = 0

    def record(self, num_bytes: int, seconds: float) -> None:
        self.bytes += num_bytes
        self.seconds += seconds
        self.jobs += 1

    def add(self, other: "TransferCounters") -> None:
        self.bytes += other.bytes
        self.seconds += other.seconds
        self.jobs += other.jobs


@dataclass
class KVTierStats:
    """One interval of kvtier activity: additive counters, then the latest usage sample."""

    lookups: int = 0
    lookup_tokens: int = 0
    lookups_retried: int = 0  # "ask again": promotions or remote probes under way
    hit_tokens_host: int = 0
    hit_tokens_disk: int = 0
    hit_tokens_remote: int = 0
    hit_tokens_s3: int = 0
    stores_submitted: int = 0
    stores_dropped: int = 0
    stores_voided: int = 0  # in flight on blocks the runner rewrote first (V2), or tails unsent at a reset: never published
    stores_skipped_threshold: int = 0
    stores_skipped_loaded_elsewhere: int = 0  # blocks another connector of vLLM's MultiConnector loaded
    disk_writes_dropped: int = 0
    remote_writes_dropped: int = 0
    s3_writes_dropped: int = 0
    promotions: int = 0
    promotion_failures: int = 0
    load_errors: int = 0
    checksum_failures: int = 0
    auth_failures: int = 0  # tier records without a valid MAC under the fleet keys (removed, a miss)
    uncacheable_requests: int = 0
    host_evictions: int = 0
    host_run_evictions: int = 0  # of host_evictions: cold blocks evicted to continue a run of slots
    node_unavailable: int = 0  # calls that found the kvtier node service unreachable: each a miss or a dropped store
    copy_jobs_staged: int = 0  # engine <-> host copy jobs (each rank's), by how they moved (kvtier.copy)
    copy_jobs_runs: int = 0
    copy_jobs_pages: int = 0
    engine_to_host: TransferCounters = field(default_factory=TransferCounters)
    host_to_engine: TransferCounters = field(default_factory=TransferCounters)
    host_to_disk: TransferCounters = field(default_factory=TransferCounters)
    disk_to_host: TransferCounters = field(default_factory=TransferCounters)
    host_to_remote: TransferCounters = field(default_factory=TransferCounters)
    remote_to_host: TransferCounters = field(default_factory=TransferCounters)
    host_to_s3: TransferCounters = field(default_factory=TransferCounters)
    s3_to_host: TransferCounters = field(default_factory=TransferCounters)
    disk_evictions: int = 0
    s3_evictions: int = 0  # by this engine's capacity sweeps (a Redis server evicts without telling)
    # calls to the tier's server that found it unreachable, and reads refused at once while its
    # circuit breaker was open (RemoteTier.unavailable): each a miss or a store lost
    remote_unavailable: int = 0
    s3_unavailable: int = 0
    host_used_bytes: int | None = field(default=None, metadata=GAUGE)
    host_capacity_bytes: int | None = field(default=None, metadata=GAUGE)
    host_blocks: int | None = field(default=None, metadata=GAUGE)
    host_pinned_blocks: int | None = field(default=None, metadata=GAUGE)  # being written or read: 0 at rest
    disk_used_bytes: int | None = field(default=None, metadata=GAUGE)
    disk_capacity_bytes: int | None = field(default=None, metadata=GAUGE)
    disk_blocks: int | None = field(default=None, metadata=GAUGE)
    remote_used_bytes: int | None = field(default=None, metadata=GAUGE)
    remote_capacity_bytes: int | None = field(default=None, metadata=GAUGE)
    s3_used_bytes: int | None = field(default=None, metadata=GAUGE)  # the whole prefix, as of the last listing
    s3_capacity_bytes: int | None = field(default=None, metadata=GAUGE)  # capacity_bytes (0: unbounded)
    s3_blocks: int | None = field(default=None, metadata=GAUGE)  # this namespace's blocks, as of the last listing

    def written_to(self, medium: Medium) -> TransferCounters:
        """Host -> ``medium`` transfers (a secondary tier's writes)."""
        return getattr(self, f"host_to_{_TIER_NAMES[medium]}")

    def read_from(self, medium: Medium) -> TransferCounters:
        """``medium`` -> host transfers (promotions)."""
        return getattr(self, f"{_TIER_NAMES[medium]}_to_host")

    def count_write_dropped(self, medium: Medium, counter: str = "writes_dropped") -> None:
        """A write to ``medium`` that did not store its block (dropped or failed): ``counter`` names
        its reason's counter of that tier (:data:`kvtier.tiers.base.WRITE_FAILURES`)."""
        name = f"{_TIER_NAMES[medium]}_{counter}"
        setattr(self, name, getattr(self, name) + 1)

    def count_failed_read(self, counter: str | None) -> None:
        """A promotion whose read failed (a miss): ``counter`` (``checksum_failures``,
        ``auth_failures``, or None) names its reason's counter (:data:`kvtier.tiers.base.READ_FAILURES`)."""
        self.promotion_failures += 1
        if counter is not None:
            setattr(self, counter, getattr(self, counter) + 1)

    def count_copy_job(self, method: str, jobs: int = 1) -> None:
        """Engine <-> host copy jobs moved as ``method`` ("staged", "runs" or "pages"; others ignored)."""
        name = f"copy_jobs_{method}"
        if hasattr(self, name):
            setattr(self, name, getattr(self, name) + jobs)

    def count_hit_tokens(self, medium: Medium, tokens: int) -> None:
        name = f"hit_tokens_{_TIER_NAMES.get(medium, 'host')}"
        setattr(self, name, getattr(self, name) + tokens)

    def set_usage(self, medium: Medium, used_bytes: int, capacity_bytes: int, blocks: int | None) -> None:
        """Record a tier's usage sample (gauges)."""
        name = _TIER_NAMES.get(medium, "host")
        setattr(self, f"{name}_used_bytes", used_bytes)
        setattr(self, f"{name}_capacity_bytes", capacity_bytes)
        if hasattr(self, f"{name}_blocks"):
            setattr(self, f"{name}_blocks", blocks)

    def add(self, other: "KVTierStats") -> "KVTierStats":
        """Merge ``other`` (a later interval) into this one: sum counters, keep later gauges."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.metadata.get("gauge"):
                if theirs is not None:
                    setattr(self, f.name, theirs)
            elif isinstance(mine, TransferCounters):
                mine.add(theirs)
            else:
                setattr(self, f.name, mine + theirs)
        return self

    def gauges(self) -> dict[str, int | None]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("gauge")}

    def has_counts(self) -> bool:
        """Whether any counter is non-zero (gauges aside)."""
        empty = KVTierStats()
        return any(
            getattr(self, f.name) != getattr(empty, f.name) for f in fields(self) if not f.metadata.get("gauge")
        )

    def is_empty(self) -> bool:
        return self == KVTierStats()

    def as_dict(self) -> dict[str, int | float]:
        """Flat view: nested transfer counters become ``<direction>_<bytes|seconds|jobs>``."""
        flat: dict[str, int | float] = {}
        for name, value in asdict(self).items():
            if isinstance(value, dict):
                for sub, number in value.items():
                    flat[f"{name}_{sub}"] = number
            else:
                flat[name] = value
        return flat

    @classmethod
    def from_dict(cls, flat: dict[str, int | float]) -> "KVTierStats":
        stats = cls()
        for f in fields(stats):
            current = getattr(stats, f.name)
            if isinstance(current, TransferCounters):
                for sub in ("bytes", "seconds", "jobs"):
                    setattr(current, sub, flat.get(f"{f.name}_{sub}", 0))
            else:
                setattr(stats, f.name, flat.get(f.name, None if f.metadata.get("gauge") else 0))
        return stats
