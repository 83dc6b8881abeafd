"""The contract every secondary tier (disk, Redis, ...) implements.

Threading: every method here is called from ONE thread, the orchestrator's (in vLLM: the
scheduler's). Methods never block on I/O: ``presence``/``contains`` answer from memory (an index,
or for a remote tier a cache of what background probes found); ``probe``,
``submit_read``/``submit_write`` hand work to the tier's own threads and return at once;
completions are collected by polling :meth:`SecondaryTier.poll`.

Presence: a local tier knows its contents (:attr:`Presence.PRESENT` or :attr:`Presence.ABSENT`).
A shared remote tier cannot, without asking the server: for a key it has not asked about recently
it answers :attr:`Presence.UNKNOWN`; the orchestrator then calls :meth:`~SecondaryTier.probe` and
asks again later (vLLM: "ask again next step"). A tier that cannot find out (server down) answers
ABSENT: a miss, never a wait.

Buffers: a tier reads into and writes from caller-owned buffers (host slots, one per rank).
The caller keeps those buffers pinned (neither evicted nor reused) from ``submit_*`` until the
job's :class:`IoResult` has come out of ``poll``; the tier never keeps a reference after that.

Outcomes: a tier's workers post what they did on its :attr:`SecondaryTier.outbox`, whose bell
the orchestrator shares between all tiers so that it can wait for the next outcome of any of them
(:mod:`kvtier.tiers.outbox`) when it has nothing else to do.

Failures never raise into the caller: a failed read is an ``IoResult`` with ``ok=False`` and a
:class:`IoError` reason; the block is then a miss. A failed write only costs a future miss
(counted by :data:`WRITE_FAILURES`, as failed reads are by :data:`READ_FAILURES`).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvtier.core.keys import BlockKey
from kvtier.core.residency import Medium, ResidencyLog
from kvtier.tiers.outbox import Outbox

__all__ = ["READ_FAILURES", "WRITE_FAILURES", "IoError", "IoKind", "IoResult", "Medium", "Presence", "ReadFailure",
           "SecondaryTier", "TierUsage", "WriteFailure", "first_holder", "read_failure", "write_failure"]


class Presence(enum.Enum):
    """What a tier knows, from memory, about whether it holds a block."""

    PRESENT = "present"
    ABSENT = "absent"
    UNKNOWN = "unknown"  # a remote tier has not asked its server yet: probe, then ask again


class IoKind(enum.Enum):
    READ = "read"
    WRITE = "write"


class IoError(enum.Enum):
    """Why a tier job failed. Every failure is counted by reason."""

    NOT_FOUND = "not_found"  # the block vanished (evicted, purged, or deleted by another process)
    CORRUPT = "corrupt"  # bad header, short file or checksum mismatch: quarantined
    UNAUTHENTICATED = "unauthenticated"  # no valid MAC under the tier's fleet keys (kvtier.tiers.sealing): removed
    IO = "io"  # the OS or server refused (EIO, ENOSPC, connection refused, ...)
    DROPPED = "dropped"  # not stored: no room or no queue space


class ReadFailure(NamedTuple):
    """How one failed read is counted, whichever way in: ``reason``, the label of
    ``kvtier_offload_failed_reads`` (kvtier's tiers behind vLLM's offloading); ``counter``, the
    :class:`~kvtier.core.stats.KVTierStats` counter it adds to besides ``promotion_failures`` (an
    embedded engine, the node service), or None."""

    reason: str
    counter: str | None


READ_FAILURES: dict[IoError, ReadFailure] = {
    IoError.CORRUPT: ReadFailure("rejected", "checksum_failures"),  # quarantined or deleted
    IoError.UNAUTHENTICATED: ReadFailure("unauthenticated", "auth_failures"),  # quarantined or deleted
    IoError.NOT_FOUND: ReadFailure("vanished", None),  # evicted or deleted since the lookup
    IoError.IO: ReadFailure("io_error", None),
}
"""The one IoError -> counter mapping of failed reads."""


def read_failure(error: IoError | None) -> ReadFailure:
    failure = READ_FAILURES.get(error) if error is not None else None
    return failure or READ_FAILURES[IoError.IO]


class WriteFailure(NamedTuple):
    """How one failed write (the block was not stored: a future miss) is counted, whichever way in:
    ``reason``, the :class:`~kvtier.runtime.chunks.store.ChunkStore` count (every reason adds to
    ``kvtier_offload_stores_dropped``: kvtier's tiers behind vLLM's offloading); ``counter``, the
    :class:`~kvtier.core.stats.KVTierStats` counter of the tier it adds to (``<tier>_<counter>``:
    ``kvtier_writes_dropped{tier}`` of an embedded engine, ``writes_dropped_<tier>`` /
    ``kvtier_node_cascade_dropped_blocks{tier}`` of the node service)."""

    reason: str
    counter: str


WRITE_FAILURES: dict[IoError, WriteFailure] = {
    IoError.DROPPED: WriteFailure("stores_dropped", "writes_dropped"),  # no room, queue full, server full or down
    IoError.IO: WriteFailure("store_errors", "writes_dropped"),  # failed: EIO, an error reply, a PUT that failed
}
"""The one IoError -> counter mapping of failed writes: dropped or failed, each counted."""


def write_failure(error: IoError | None) -> WriteFailure:
    failure = WRITE_FAILURES.get(error) if error is not None else None
    return failure or WRITE_FAILURES[IoError.IO]


@dataclass(frozen=True, slots=True)
class IoResult:
    """Completion of one ``submit_read`` / ``submit_write`` job."""

    job_id: int
    kind: IoKind
    key: BlockKey
    ok: bool
    num_bytes: int = 0
    seconds: float = 0.0
    error: IoError | None = None


@dataclass(frozen=True, slots=True)
class TierUsage:
    """A tier's usage; a remote tier reports its server's memory (``num_blocks`` None: unknown)."""

    medium: Medium
    used_bytes: int
    capacity_bytes: int
    num_blocks: int | None


class SecondaryTier(ABC):
    """A bounded store of blocks below the host tier. See the module docstring for threading."""

    medium: Medium
    residency: ResidencyLog  # records index inserts (STORED) and removals (REMOVED) once enabled
    outbox: Outbox  # the workers' posts; each rings its bell (poll() applies them)

    @abstractmethod
    def contains(self, key: BlockKey) -> bool:
        """Whether a complete copy of ``key`` (all ranks) is known to be here. Memory only, never I/O."""

    def presence(self, key: BlockKey) -> Presence:
        """What this tier knows of ``key`` from memory (never I/O). Local tiers know."""
        return Presence.PRESENT if self.contains(key) else Presence.ABSENT

    knows_absence: bool = True
    """Whether a key this tier does not know is absent (a local tier knows its contents); False for
    a remote tier, which must be asked (:meth:`presence` UNKNOWN, :meth:`probe`)."""

    @property
    def held_keys(self) -> Container[BlockKey] | None:
        """A live view of keys this tier holds, for a caller's hot path (``key in held_keys`` is
        PRESENT without a call; a key not in it is ABSENT only if :attr:`knows_absence`, else ask
        :meth:`presence`); None for a tier without one. The caller's thread only."""
        return None

    def probe(self, keys: Sequence[BlockKey]) -> None:
        """Find out in the background whether ``keys`` are here (a remote tier asks its server);
        the answers show in :meth:`presence` after a later :meth:`poll`. Local tiers: nothing."""

    def flush(self) -> None:
        """Send what :meth:`probe` and ``submit_*`` buffered, as few round trips as the tier can (a
        tier that batches until told, such as the node service's: one lookup per request). Never
        blocks. Default: nothing (tiers that send at once)."""

    unavailable: int = 0
    """Calls to the tier's server that found it gone or refusing (each a miss or a dropped store),
    since the tier was made: a running total, for tiers that count them."""

    def leading_run(self, keys: Sequence[BlockKey]) -> int:
        """Length of the leading run of ``keys`` present here."""
        for index, key in enumerate(keys):
            if not self.contains(key):
                return index
        return len(keys)

    @abstractmethod
    def submit_read(self, job_id: int, key: BlockKey, dests: Sequence[memoryview]) -> None:
        """Read block ``key`` into ``dests`` (one buffer per rank, each exactly one payload)."""

    @abstractmethod
    def submit_write(
        self,
        job_id: int,
        key: BlockKey,
        parent: BlockKey,
        num_tokens: int,
        sources: Sequence[memoryview],
        *,
        tail: bool = False,
    ) -> bool:
        """Store ``sources`` (one payload per rank) under ``key``; ``tail``: a partial block
        (``num_tokens`` short of a block), which the tier may evict before blocks.

        Returns False, without queuing anything, when the tier's write queue is full or the tier
        takes no writes (:meth:`write_room`): the caller counts a dropped store and unpins the
        sources at once. A caller with more blocks to write than there is room keeps them and
        submits them as room frees up (see :meth:`write_room`), rather than drop them.
        """

    @abstractmethod
    def write_room(self) -> int | None:
        """How many more writes :meth:`submit_write` would queue now (its bound on I/O in flight;
        the disk tier also leaves out writes that could not fit beside those in flight, so a small
        root is not handed more than it can take); 0 while that many are in flight (room frees as
        their results come out of :meth:`poll`);
        None when the tier takes no writes at all for now (closed, or a remote tier whose server
        is down): a caller holding writes back should drop them (a future miss) rather than wait.
        Memory only."""

    @abstractmethod
    def poll(self) -> list[IoResult]:
        """Completed jobs since the last call. Never blocks."""

    def refresh(self) -> None:
        """Start picking up blocks that other processes stored (asynchronously; results are
        merged by a later :meth:`poll`). Called periodically by the orchestrator. Default: nothing."""

    @abstractmethod
    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Mark ``keys`` as recently used (for this tier's eviction order)."""

    @abstractmethod
    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Remove ``keys``; returns how many were present."""

    @abstractmethod
    def clear(self) -> int:
        """Remove every block of this namespace; returns how many were removed."""

    @abstractmethod
    def usage(self) -> TierUsage: ...

    @property
    @abstractmethod
    def evictions(self) -> int:
        """Blocks this tier evicted to make room, since it was created (a running total)."""

    @abstractmethod
    def close(self) -> None:
        """Finish or cancel in-flight jobs and release threads/connections. Idempotent."""


def first_holder(tiers: Sequence[SecondaryTier], key: BlockKey) -> tuple[SecondaryTier | None, SecondaryTier | None]:
    """Where to promote ``key`` from (memory only): the first of ``tiers`` (fastest first) that
    holds it, or None; and the first that does not know yet (a remote tier to probe), or None."""
    unknown = None
    for tier in tiers:
        presence = tier.presence(key)
        if presence is Presence.PRESENT:
            return tier, None
        if presence is Presence.UNKNOWN and unknown is None:
            unknown = tier
    return None, unknown
