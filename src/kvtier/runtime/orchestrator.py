"""The orchestrator: lookup across tiers, admission, promotion, cascade. Knows no engine.

It lives in one process (vLLM's scheduler process) and is driven by ONE thread; it never blocks
on I/O. Tier I/O runs on the tiers' own threads and is collected by :meth:`Orchestrator.poll`.

Tiers: the host tier, then the secondary tiers in order (a local disk, then a shared remote).

Block flow::

    store:   begin_store (host slot WRITING) -> [engine copies bytes in] -> finish_store
             -> READY in host -> cascade: a write to every secondary tier that lacks the block
             (the slot is pinned while any of them runs; a tier whose writes in flight are at
             their bound gets the block later, in order, as its writes complete: the slot stays
             pinned while it waits, so a long prompt's blocks all reach a slow tier)
    load:    acquire (host READY blocks pinned for the owner; blocks only in a secondary tier are
             promoted into host slots first, from the first tier that holds them, and the caller
             is told to ask again) -> [engine copies bytes out] -> release (unpin)
    promotion from a slower tier is also cascaded to the faster tiers before it (a remote hit
    is kept on the local disk).

Tails (the partial block a finished request leaves, :func:`kvtier.core.keys.tail_key`) flow like
blocks through the host and disk tiers, are evicted before blocks, and stay local: they are never
written to a shared remote tier (a lookup there would have to probe every candidate length).

A remote tier may not know yet whether it holds a block (:attr:`Presence.UNKNOWN`): the lookup
asks it to probe (in the background) and answers "ask again"; the next lookup sees the answer.

Waiting: the driving thread never waits for I/O, with one bounded exception:
:meth:`Orchestrator.wait_for_tiers`, for a caller that has nothing else to do while an owner was
told to ask again (an engine step that computes nothing): it blocks until any tier posts an
outcome (the tiers share one bell, :mod:`kvtier.tiers.outbox`) or the timeout passes, so the
tiers' threads run instead of waiting for the GIL behind a spinning loop.

Ownership of host slots: a slot is written only by its WRITING owner (the engine's store job or
a promotion); a READY slot may be read by any number of pinned readers; unpinned READY slots
may be evicted and reused by :meth:`begin_store` or promotions.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.core.keys import BlockKey
from kvtier.core.residency import ResidencyChange
from kvtier.core.stats import KVTierStats
from kvtier.policy.admission import StoreAdmission
from kvtier.tiers.base import IoError, IoKind, IoResult, Medium, SecondaryTier, first_holder
from kvtier.tiers.host import HostIndex
from kvtier.tiers.outbox import wait_for_any

logger = logging.getLogger(__name__)


class HostBytes:
    """The scheduler's mapping of the host tier: slot ``s`` of rank ``r`` as a memoryview."""

    def __init__(self, rank_views: Sequence[memoryview], slot_bytes: int):
        self.rank_views = list(rank_views)
        self.slot_bytes = slot_bytes

    def slot(self, slot: int) -> list[memoryview]:
        start = slot * self.slot_bytes
        return [view[start : start + self.slot_bytes] for view in self.rank_views]


class AcquireStatus(enum.Enum):
    READY = "ready"  # the returned run is pinned in host slots for the owner
    RETRY = "retry"  # promotions or presence probes are running; ask again later (never wait)


@dataclass(frozen=True)
class Acquired:
    status: AcquireStatus
    num_blocks: int = 0
    promoted: dict[Medium, int] = field(default_factory=dict)  # of num_blocks: promoted for this owner, by source

    @property
    def from_disk(self) -> int:
        return self.promoted.get(Medium.DISK, 0)


@dataclass
class _Hold:
    """Host blocks pinned for one owner (a request) while it loads them.

    ``keys``: the run its last answer counted, in order. ``parked``: promotions that finished for it
    outside that run (reads land out of order: a later block can be in while an earlier one is still
    read), pinned until its next answer takes them into the run or lets them go, so none is evicted
    before it asks again. ``promoted``: the keys of both that were promoted for it, by source. Every
    key of ``keys`` and ``parked`` holds one pin, which :meth:`Orchestrator.release` or the next
    answer gives back.
    """

    keys: list[BlockKey] = field(default_factory=list)
    parked: list[BlockKey] = field(default_factory=list)
    promoted: dict[BlockKey, Medium] = field(default_factory=dict)

    def pinned(self) -> list[BlockKey]:
        return self.keys + self.parked


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What the stored format needs besides the bytes: the chain parent and the token count;
    ``tail``: a partial block (fewer tokens than a block, never a parent)."""

    parent: BlockKey
    num_tokens: int
    tail: bool = False


@dataclass(frozen=True, slots=True)
class _Promotion:
    key: BlockKey
    tier: SecondaryTier
    owner: str
    info: BlockInfo | None


@dataclass(frozen=True, slots=True)
class _Cascade:
    key: BlockKey
    tier: SecondaryTier


REFRESH_INTERVAL_S = 30.0
"""How often secondary tiers look for blocks other engines stored (shared disk roots)."""


DRAIN_TIMEOUT_S = 10.0
"""How long :meth:`Orchestrator.close` waits for block writes in flight to reach their tiers."""


class Orchestrator:
    def __init__(
        self,
        host: HostIndex,
        host_bytes: HostBytes | None,
        tiers: Sequence[SecondaryTier],
        admission: StoreAdmission,
    ):
        """``tiers``: the secondary tiers, fastest first (lookups and promotions go in this order)."""
        if tiers and host_bytes is None:
            raise ValueError("secondary tiers need the scheduler to map the host tier's bytes")
        self.host = host
        self.host_bytes = host_bytes
        self.tiers: tuple[SecondaryTier, ...] = tuple(tiers)
        self.admission = admission
        self.stats = KVTierStats()
        self._job_ids = itertools.count(1)
        self._holds: dict[str, _Hold] = {}
        self._promoting: dict[BlockKey, str] = {}  # key -> owner that asked
        self._promotion_jobs: dict[int, _Promotion] = {}
        self._cascading: dict[int, _Cascade] = {}  # write job -> what it writes (host slot pinned)
        self._info: dict[BlockKey, BlockInfo] = {}  # for blocks stored but not yet cascaded
        # per tier: READY host blocks waiting for room in its write queue (slot pinned), in order
        self._waiting: dict[SecondaryTier, deque[tuple[BlockKey, BlockInfo]]] = {t: deque() for t in tiers}
        self._next_refresh = time.monotonic() + REFRESH_INTERVAL_S
        self._evictions_reported: dict[Medium, int] = {}
        self._asked_again: set[str] = set()  # owners last answered RETRY (waiting for a tier)
        self._bell = threading.Event()  # rung by every tier's workers on each post
        self._outboxes = [tier.outbox for tier in self.tiers]
        for outbox in self._outboxes:
            outbox.share_bell(self._bell)

    @property
    def disk(self) -> SecondaryTier | None:
        return self.tier(Medium.DISK)

    def tier(self, medium: Medium) -> SecondaryTier | None:
        return next((t for t in self.tiers if t.medium is medium), None)

    # --- lookups (memory only) -------------------------------------------------------------
    def locate(self, key: BlockKey) -> Medium | None:
        """The fastest tier known to hold ``key`` (memory only; UNKNOWN counts as not known)."""
        if self.host.is_ready(key):
            return Medium.HOST
        for tier in self.tiers:
            if tier.contains(key):
                return tier.medium
        return None

    def leading_run(self, keys: Sequence[BlockKey]) -> int:
        """Blocks at the start of ``keys`` known to be in some tier (memory only)."""
        for index, key in enumerate(keys):
            if self.locate(key) is None:
                return index
        return len(keys)

    def media_of(self, key: BlockKey) -> list[Medium]:
        """Every tier ``key`` is known to be readable from (memory only)."""
        media = [Medium.HOST] if self.host.is_ready(key) else []
        media += [tier.medium for tier in self.tiers if tier.contains(key)]
        return media

    def is_stored(self, key: BlockKey) -> bool:
        """Present or being written anywhere known: a store of ``key`` would be redundant."""
        return key in self.host or any(tier.contains(key) for tier in self.tiers)

    # --- loads ------------------------------------------------------------------------------
    def acquire(
        self,
        owner: str,
        keys: Sequence[BlockKey],
        first_parent: BlockKey | None = None,
        block_tokens: int = 0,
        *,
        tail_tokens: int = 0,
    ) -> Acquired:
        """Pin the longest available run of ``keys`` in host slots for ``owner``.

        Replaces any earlier hold of ``owner``. Blocks only in a secondary tier are promoted into
        host slots (asynchronously, from the first tier that holds them): then the answer is
        RETRY and nothing is pinned yet except finished promotions, which stay held for
        ``owner`` so they cannot be evicted before it asks again. A tier that does not know yet
        whether it holds a block is asked to probe the rest of the run, and the answer is RETRY
        too. A run is cut at the first block that no tier holds, that is being stored, or that
        cannot get a host slot. ``first_parent`` (the key before ``keys[0]``, or the namespace
        digest) and ``block_tokens`` let promoted blocks be written to the faster tiers too.
        ``tail_tokens`` > 0: the last of ``keys`` is a tail of that many tokens.
        """
        self.poll()
        previous = self._holds.pop(owner, None)
        hold = _Hold(promoted=dict(previous.promoted) if previous else {})
        pending = False
        parent = first_parent
        last = len(keys) - 1
        for index, key in enumerate(keys):
            is_tail = bool(tail_tokens) and index == last
            tokens = tail_tokens if is_tail else block_tokens
            info = BlockInfo(parent, tokens, is_tail) if parent is not None and tokens else None
            parent = key
            if self.host.is_ready(key):
                self.host.pin(key)
                hold.keys.append(key)
                continue
            if key in self._promoting:
                pending = True
                break
            if key in self.host:  # being stored by the engine right now
                break
            source, unknown = first_holder(self.tiers, key)
            if source is None:
                if unknown is not None:  # a remote tier has not looked yet: look, then ask again
                    unknown.probe(keys[index:])
                    pending = True
                break
            slot, evicted = self.host.allocate(key, tail=is_tail)
            self._count_evictions(evicted)
            if slot is None:
                break
            job_id = next(self._job_ids)
            self._promoting[key] = owner
            self._promotion_jobs[job_id] = _Promotion(key, source, owner, info)
            assert self.host_bytes is not None
            source.submit_read(job_id, key, self.host_bytes.slot(slot))
            pending = True
            # keep walking: start the whole run's reads at once
        held = set(hold.keys)
        if previous is not None:
            if pending:  # promotions past the run's end stay pinned until the owner asks again
                for key in previous.pinned():
                    if key in hold.promoted and key not in held and self.host.is_ready(key):
                        self.host.pin(key)
                        hold.parked.append(key)
                        held.add(key)
            for key in previous.pinned():
                self.host.unpin(key)
        hold.promoted = {key: medium for key, medium in hold.promoted.items() if key in held}
        self._holds[owner] = hold
        if pending:
            self.stats.lookups_retried += 1
            self._asked_again.add(owner)
            return Acquired(AcquireStatus.RETRY, len(hold.keys))
        self._asked_again.discard(owner)
        self.host.touch(hold.keys)
        promoted: dict[Medium, int] = {}
        for medium in hold.promoted.values():
            promoted[medium] = promoted.get(medium, 0) + 1
        return Acquired(AcquireStatus.READY, len(hold.keys), promoted=promoted)

    def promoted_source(self, owner: str, key: BlockKey) -> Medium | None:
        """The tier ``owner``'s held ``key`` was promoted from for it (None: it was in the host tier)."""
        hold = self._holds.get(owner)
        return hold.promoted.get(key) if hold else None

    def held(self, owner: str) -> list[BlockKey]:
        hold = self._holds.get(owner)
        return list(hold.keys) if hold else []

    def trim_hold(self, owner: str, num_blocks: int) -> None:
        """Keep only the first ``num_blocks`` of ``owner``'s hold (the engine loads fewer)."""
        hold = self._holds.get(owner)
        if hold is None:
            return
        for key in hold.keys[num_blocks:]:
            self.host.unpin(key)
            hold.promoted.pop(key, None)
        del hold.keys[num_blocks:]

    def release(self, owner: str) -> None:
        """Unpin everything held for ``owner``. Idempotent."""
        self._asked_again.discard(owner)
        hold = self._holds.pop(owner, None)
        if hold is None:
            return
        for key in hold.pinned():
            self.host.unpin(key)

    def slots_of(self, keys: Sequence[BlockKey]) -> list[int]:
        return [self.host.slot_of(key) for key in keys]

    def held_slots(self, owner: str) -> list[tuple[int, ...]]:
        """The host slot of each of ``owner``'s held blocks, key order, as 1-tuples: the same
        slot number on every rank (the shape :class:`kvtier.runtime.node_host.NodeHost` answers)."""
        return [(slot,) for slot in self.slots_of(self.held(owner))]

    # --- stores -----------------------------------------------------------------------------
    def begin_store(self, key: BlockKey, info: BlockInfo) -> int | None:
        """Reserve a host slot to receive ``key`` from the engine, or None (skipped/dropped).

        None when the block is already stored anywhere known (it is touched instead), when
        admission refuses it (``store_threshold``), or when every host slot is pinned (counted
        as dropped).
        """
        if key in self.host:
            self.host.touch((key,))
            return None
        for tier in self.tiers:
            if tier.contains(key):
                tier.touch((key,))
                return None
        if not self.admission.offer(key):
            self.stats.stores_skipped_threshold += 1
            return None
        slot, evicted = self.host.allocate(key, tail=info.tail)
        self._count_evictions(evicted)
        if slot is None:
            self.stats.stores_dropped += 1
            return None
        self.stats.stores_submitted += 1
        self._info[key] = info
        return slot

    def begin_stores(self, blocks: Sequence[tuple[BlockKey, BlockInfo]]) -> list[tuple[int, ...] | None]:
        """:meth:`begin_store` of each block, in order, each slot as a 1-tuple (the same number on
        every rank); the batched call :class:`kvtier.runtime.node_host.NodeHost` answers in one
        round trip."""
        out: list[tuple[int, ...] | None] = []
        for key, info in blocks:
            slot = self.begin_store(key, info)
            out.append(None if slot is None else (slot,))
        return out

    def finish_store(self, keys: Sequence[BlockKey], ok: bool) -> None:
        """The engine finished (or failed) copying ``keys`` into their slots on every rank."""
        for key in keys:
            info = self._info.pop(key, None)
            if not ok:
                self.host.abort(key)
                continue
            self.host.commit(key)
            if info is not None:
                self._cascade(key, info, self.tiers)

    def _cascade(self, key: BlockKey, info: BlockInfo, tiers: Sequence[SecondaryTier]) -> None:
        """Write the READY host block ``key`` to each of ``tiers`` that lacks it (slot pinned per write)."""
        if not self.host.is_ready(key):
            return
        for tier in tiers:
            if tier.contains(key) or (info.tail and tier.medium is Medium.REMOTE):
                continue
            self.host.pin(key)
            waiting = self._waiting[tier]
            if waiting or not tier.write_room():  # others wait first, or no room now (or no writes)
                waiting.append((key, info))
                self._feed(tier)
            else:
                self._write(tier, key, info)

    def _write(self, tier: SecondaryTier, key: BlockKey, info: BlockInfo) -> None:
        """Submit the pinned READY host block ``key`` to ``tier`` (unpinned if it is refused)."""
        assert self.host_bytes is not None
        job_id = next(self._job_ids)
        sources = self.host_bytes.slot(self.host.slot_of(key))
        if tier.submit_write(job_id, key, info.parent, info.num_tokens, sources, tail=info.tail):
            self._cascading[job_id] = _Cascade(key, tier)
        else:
            self.host.unpin(key)
            self.stats.count_write_dropped(tier.medium)

    def _feed(self, tier: SecondaryTier) -> None:
        """Give ``tier`` the blocks waiting for it while it has room; drop them all (counted, a
        future miss) while it takes no writes at all (closed, server down)."""
        waiting = self._waiting[tier]
        while waiting:
            room = tier.write_room()
            if room == 0:
                return
            key, info = waiting.popleft()
            if room is None or not self.host.is_ready(key):
                self.host.unpin(key)
                self.stats.count_write_dropped(tier.medium)
                continue
            self._write(tier, key, info)

    # --- completions ------------------------------------------------------------------------
    def poll(self) -> None:
        """Collect tier completions. Cheap when idle; call it every step."""
        if not self.tiers:
            return
        now = time.monotonic()
        refresh = now >= self._next_refresh
        if refresh:
            self._next_refresh = now + REFRESH_INTERVAL_S
        for tier in self.tiers:
            if refresh:
                tier.refresh()
            for result in tier.poll():
                if result.kind is IoKind.WRITE:
                    self._on_write_done(result)
                else:
                    self._on_read_done(result)
            if self._waiting[tier]:
                self._feed(tier)

    def _on_write_done(self, result: IoResult) -> None:
        cascade = self._cascading.pop(result.job_id, None)
        if cascade is None:
            return
        self.host.unpin(cascade.key)
        medium = cascade.tier.medium
        if result.ok:
            self.stats.written_to(medium).record(result.num_bytes, result.seconds)
        elif result.error is IoError.DROPPED:
            self.stats.count_write_dropped(medium)

    def _on_read_done(self, result: IoResult) -> None:
        promotion = self._promotion_jobs.pop(result.job_id, None)
        if promotion is None:
            return
        key = promotion.key
        owner = self._promoting.pop(key, None)
        medium = promotion.tier.medium
        if not result.ok:
            self.host.abort(key)
            self.stats.promotion_failures += 1
            if result.error is IoError.CORRUPT:
                self.stats.checksum_failures += 1
            elif result.error is IoError.UNAUTHENTICATED:
                self.stats.auth_failures += 1
            logger.warning("kvtier: %s block %s unreadable (%s): it is a miss", medium.value.lower(),
                           key.hex()[:16], result.error)
            return
        self.host.commit(key)
        self.stats.promotions += 1
        self.stats.read_from(medium).record(result.num_bytes, result.seconds)
        if not self.host.is_ready(key):
            return  # deleted while the read ran (clear(), reset_prefix_cache): commit freed the slot
        faster = self.tiers[: self.tiers.index(promotion.tier)]
        if faster and promotion.info is not None:
            self._cascade(key, promotion.info, faster)  # keep a remote hit on the local disk
        hold = self._holds.get(owner) if owner is not None else None
        if hold is not None:
            # Held for the owner until it asks again, so the promotion cannot be evicted first.
            self.host.pin(key)
            hold.parked.append(key)
            hold.promoted[key] = medium

    def wait_for_tiers(self, timeout_s: float) -> bool:
        """If an owner was told to ask again (its blocks are being read or probed), block until any
        tier posts an outcome, at most ``timeout_s``; True if one is ready for :meth:`poll`. Only
        for a caller with nothing else to do meanwhile (an engine step that computes nothing)."""
        if not self._asked_again or not self.tiers:
            return False
        return wait_for_any(self._outboxes, self._bell, timeout_s)

    def has_pending_io(self) -> bool:
        return bool(self._promotion_jobs or self._cascading or any(self._waiting.values()))

    def _count_evictions(self, evicted: list[BlockKey]) -> None:
        self.stats.host_evictions += len(evicted)

    # --- residency (KV events) -------------------------------------------------------------
    def track_residency(self) -> None:
        """Start recording which blocks become visible in / vanish from each tier (off by
        default). Blocks already present (e.g. found on disk at start-up) are not reported."""
        self.host.residency.enable()
        for tier in self.tiers:
            tier.residency.enable()

    def take_residency_changes(self) -> list[ResidencyChange]:
        """Changes since the last call: per tier in the order they happened (see
        :mod:`kvtier.core.residency`). They reflect the completions :meth:`poll` has applied, as
        :meth:`media_of` does."""
        changes = self.host.residency.take()
        for tier in self.tiers:
            changes += tier.residency.take()
        return changes

    # --- management -------------------------------------------------------------------------
    def clear(self) -> None:
        """Drop every block from the host tier and the local secondary tiers (blocks in flight are
        freed when they complete). A shared remote tier is left alone: one engine's reset must not
        wipe the fleet's cache (``kvtier purge`` clears it)."""
        self.host.clear()
        for tier in self.tiers:
            if tier.medium is not Medium.REMOTE:
                tier.clear()

    def take_stats(self) -> KVTierStats:
        """The counters since the last call, with a fresh sample of every tier's usage."""
        stats, self.stats = self.stats, KVTierStats()
        host = self.host
        stats.host_blocks = host.used_slots
        stats.host_pinned_blocks = host.pinned_slots()
        if self.host_bytes is not None:
            block_bytes = self.host_bytes.slot_bytes * len(self.host_bytes.rank_views)
            stats.set_usage(Medium.HOST, host.used_slots * block_bytes, host.num_slots * block_bytes, host.used_slots)
        for tier in self.tiers:
            usage = tier.usage()
            stats.set_usage(tier.medium, usage.used_bytes, usage.capacity_bytes, usage.num_blocks)
            evictions = tier.evictions
            if tier.medium is Medium.DISK:
                stats.disk_evictions = evictions - self._evictions_reported.get(Medium.DISK, 0)
            self._evictions_reported[tier.medium] = evictions
        return stats

    def close(self, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Shut down (the engine is stopping; caller's thread). Blocks in flight to a secondary
        tier (and the cascades they start) are given up to ``drain_timeout_s`` to land, so a
        graceful shutdown keeps what the engine stored for the next start and for other engines;
        then every tier closes (in-flight writes finish, queued ones fail)."""
        deadline = time.monotonic() + drain_timeout_s
        while self.has_pending_io() and time.monotonic() < deadline:
            self.poll()
            if self.has_pending_io():
                wait_for_any(self._outboxes, self._bell, max(0.0, deadline - time.monotonic()))
        if self.has_pending_io():
            logger.warning("%s: shutting down with %d block writes not done after %.0f s (dropped)",
                           "kvtier", len(self._cascading) + sum(map(len, self._waiting.values())), drain_timeout_s)
        for tier in self.tiers:
            tier.close()
            self._feed(tier)  # what still waits is dropped (the tier takes no writes now)
        usages = [tier.usage() for tier in self.tiers]
        held = "".join(f", {u.medium.value} tier {u.num_blocks} blocks" for u in usages if u.num_blocks is not None)
        # pinned: blocks still being written or read. 0 once every request finished: more is a leak.
        logger.info("kvtier: stopped; host tier %d blocks (%d pinned)%s",
                    self.host.used_slots, self.host.pinned_slots(), held)
