"""A slot index and the secondary tiers below it: lookup across them, promotion into slots,
cascade out of slots, their completions and counters. Written once, for every way in: an embedded
engine runs it over its host tier (:class:`kvtier.runtime.orchestrator.Orchestrator`), the node
service over its pool, one per namespace (:class:`kvtier.node.tiers.NodeTiers`), so what happens
to a block is the same whichever way it came in:

- **lookup** (memory only): READY in the slots, else the first tier that holds it;
- **promotion** (:meth:`TierStack.promote`): the blocks of a run not READY in the slots are read,
  all at once, from the first tier that holds each into slots reserved for them (WRITING); a
  remote tier that does not know yet is asked to probe; the asker is told to ask again. What
  lands is *parked* for the asker (pinned) until its answer is final (:meth:`TierStack.settle`)
  or it goes (:meth:`TierStack.forget`), so it is not evicted before it asks again; a block read
  from a slower tier is also written to the faster ones (a remote hit is kept on the local disk);
- **cascade** (:meth:`TierStack.cascade`): a READY block is written to each tier that lacks it, in
  order (tails stay off a remote tier: a lookup there would probe every length), pinned until the
  write completes; a tier at its bound of writes in flight gets it later, in order
  (:class:`WriteBacklog`), so a long prompt's blocks all reach a slow tier; one that takes no
  writes (closed, server down) drops them, counted;
- **completions** (:meth:`TierStack.poll`) are counted in :attr:`TierStack.stats` (failed reads by
  :data:`~kvtier.tiers.base.READ_FAILURES`, failed writes by :data:`~kvtier.tiers.base.WRITE_FAILURES`); every :data:`REFRESH_INTERVAL_S` the tiers look for
  blocks other processes stored.

Threads: ONE thread calls every method and never waits on I/O, except in :meth:`TierStack.wait`
and :meth:`TierStack.close`; the tiers' workers post on outboxes that ring :attr:`TierStack.bell`.
Buffers: a block's slots are WRITING while a promotion reads into them and pinned while a write
reads them, from ``submit_*`` until the job's result comes out of :meth:`TierStack.poll`; a
``submit_*`` that raises gives them back (aborted, unpinned) before the error goes on, so no error
path leaves a block held.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from kvtier.core.keys import BlockKey
from kvtier.core.stats import KVTierStats
from kvtier.tiers.base import (IoError, IoKind, IoResult, Medium, SecondaryTier, first_holder, read_failure,
                               write_failure)
from kvtier.tiers.outbox import wait_for_any

logger = logging.getLogger(__name__)

REFRESH_INTERVAL_S = 30.0
"""How often the tiers look for blocks that other processes stored (shared disk roots)."""
DRAIN_TIMEOUT_S = 10.0
"""How long :meth:`TierStack.close` waits for the block writes in flight to reach their tiers."""


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What the stored format needs besides the bytes: the chain parent and the token count;
    ``tail``: a partial block (fewer tokens than a block, never a parent)."""

    parent: BlockKey
    num_tokens: int
    tail: bool = False


@dataclass(frozen=True, slots=True)
class Chain:
    """What names the records of a run of keys: the key before its first (or the namespace digest;
    None: unknown, then promotions are not written to faster tiers), the tokens of a block, and
    of its last key when that is a tail (0: no tail)."""

    parent: BlockKey | None = None
    block_tokens: int = 0
    tail_tokens: int = 0

    def info(self, keys: Sequence[BlockKey], position: int) -> BlockInfo | None:
        parent = keys[position - 1] if position else self.parent
        tail = bool(self.tail_tokens) and position == len(keys) - 1
        tokens = self.tail_tokens if tail else self.block_tokens
        return BlockInfo(parent, tokens, tail) if parent is not None and tokens else None


class SlotIndex(Protocol):
    """What the stack needs of a slot index (:class:`~kvtier.tiers.host.HostIndex`, the node pool's
    :class:`~kvtier.node.tiers.PoolSlots`): one thread, memory only."""

    def is_ready(self, key: BlockKey) -> bool: ...

    def __contains__(self, key: object) -> bool: ...  # READY or being written

    def take(self, key: BlockKey, tail: bool) -> tuple[int, ...] | None: ...  # WRITING slots (evicting), or None

    def commit(self, key: BlockKey) -> None: ...  # WRITING -> READY (a block deleted meanwhile goes)

    def abort(self, key: BlockKey) -> None: ...

    def pin(self, key: BlockKey) -> None: ...  # a READY block: not evicted until unpinned

    def unpin(self, key: BlockKey) -> None: ...

    def slots(self, key: BlockKey) -> tuple[int, ...]: ...


SlotViews = Callable[[tuple[int, ...]], list[memoryview]]
"""A block's slots -> its bytes, one memoryview per rank (each exactly one payload)."""

T = TypeVar("T")


class RefreshClock:
    """When the tiers below a poller next look for blocks other processes stored
    (:meth:`~kvtier.tiers.base.SecondaryTier.refresh`): every :data:`REFRESH_INTERVAL_S` (as it
    was when the clock was made), the first one interval after that. The one periodic refresh of
    :class:`TierStack` and of the tier behind vLLM's offloading
    (:class:`kvtier.runtime.chunks.store.ChunkStore`). The poller's thread only; memory only."""

    __slots__ = ("interval_s", "_next")

    def __init__(self) -> None:
        self.interval_s = REFRESH_INTERVAL_S
        self._next = time.monotonic() + self.interval_s

    def due(self) -> bool:
        """True once an interval has passed since the last True (then the poller refreshes its tiers)."""
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.interval_s
        return True


class WriteBacklog(Generic[T]):
    """Writes waiting, in order, for room in one tier's write queue
    (:meth:`~kvtier.tiers.base.SecondaryTier.write_room`). The caller's thread only."""

    __slots__ = ("tier", "_items")

    def __init__(self, tier: SecondaryTier) -> None:
        self.tier = tier
        self._items: deque[T] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: T) -> None:
        self._items.append(item)

    def feed(self, submit: Callable[[SecondaryTier, T], bool], drop: Callable[[SecondaryTier, T], None]) -> None:
        """Submit waiting items while the tier has room (``submit`` False: it refused that one,
        which is dropped); drop them all while the tier takes no writes (a future miss each).
        An item whose ``submit`` raises is dropped before the error goes on."""
        items, tier = self._items, self.tier
        while items:
            room = tier.write_room()
            if room == 0:
                return
            item = items.popleft()
            try:
                submitted = room is not None and submit(tier, item)
            except BaseException:
                drop(tier, item)
                raise
            if not submitted:
                drop(tier, item)


@dataclass(frozen=True, slots=True)
class _Read:
    key: BlockKey
    tier: SecondaryTier
    asker: Hashable
    info: BlockInfo | None


class TierStack:
    """``index`` (its bytes: ``views``) above ``tiers``, fastest first. See the module docstring."""

    def __init__(self, index: SlotIndex, views: SlotViews | None, tiers: Sequence[SecondaryTier], *,
                 bell: threading.Event | None = None) -> None:
        """``bell``: rung by every tier's workers on each post (a caller that waits on several
        stacks shares one); a fresh one by default."""
        if tiers and views is None:
            raise ValueError("secondary tiers need the slots' bytes")
        self.index = index
        self.views: SlotViews = views or (lambda _slots: [])
        self.tiers: tuple[SecondaryTier, ...] = tuple(tiers)
        self.stats = KVTierStats()
        self.bell = bell if bell is not None else threading.Event()
        self._outboxes = [tier.outbox for tier in self.tiers]
        for outbox in self._outboxes:
            outbox.share_bell(self.bell)
        self._job_ids = itertools.count(1)
        self._reads: dict[int, _Read] = {}
        self._promoting: set[BlockKey] = set()
        self._writes: dict[int, tuple[BlockKey, SecondaryTier]] = {}  # a write job -> its block (pinned), tier
        self._backlogs: dict[SecondaryTier, WriteBacklog[tuple[BlockKey, BlockInfo]]] = {
            tier: WriteBacklog(tier) for tier in self.tiers}
        self._parked: dict[Hashable, dict[BlockKey, Medium]] = {}  # asker told to ask again -> its promotions
        self._refresh = RefreshClock()

    # --- lookups (memory only) ----------------------------------------------------------
    def locate(self, key: BlockKey) -> Medium | None:
        """The fastest tier known to hold ``key`` (a remote tier's UNKNOWN counts as no)."""
        if self.index.is_ready(key):
            return Medium.HOST
        for tier in self.tiers:
            if tier.contains(key):
                return tier.medium
        return None

    def leading_run(self, keys: Sequence[BlockKey]) -> int:
        """Blocks at the start of ``keys`` known to be in the slots or a tier."""
        for count, key in enumerate(keys):
            if self.locate(key) is None:
                return count
        return len(keys)

    def media_of(self, key: BlockKey) -> list[Medium]:
        """Every tier ``key`` is known to be readable from."""
        media = [Medium.HOST] if self.index.is_ready(key) else []
        return media + [tier.medium for tier in self.tiers if tier.contains(key)]

    # --- promotion ----------------------------------------------------------------------
    def promote(self, asker: Hashable, keys: Sequence[BlockKey], start: int = 0, chain: Chain = Chain()) -> bool:
        """Promote the blocks of ``keys[start:]`` not READY in the slots (all at once); True if
        ``asker`` must ask again (reads or probes under way): what lands is then parked for it.
        The run ends at the first block no tier holds, being stored into the slots, promoted
        already (for anyone: ask again), or for which no slot can be freed. ``chain`` names the
        blocks' records, for the faster tiers a promoted block is written to."""
        index, pending = self.index, False
        for position in range(start, len(keys)):
            key = keys[position]
            if index.is_ready(key):
                continue
            if key in self._promoting:
                pending = True
                break
            if key in index:  # being stored by an engine right now
                break
            source, unknown = first_holder(self.tiers, key)
            if source is None:
                if unknown is not None:  # a remote tier has not looked yet: look, then ask again
                    unknown.probe(keys[position:])
                    pending = True
                break
            info = chain.info(keys, position)
            slots = index.take(key, info is not None and info.tail)
            if slots is None:
                break
            job_id = next(self._job_ids)
            try:
                source.submit_read(job_id, key, self.views(slots))
            except BaseException:
                index.abort(key)
                raise
            self._reads[job_id] = _Read(key, source, asker, info)  # its result comes out of a later poll()
            self._promoting.add(key)
            pending = True
        if pending:
            self._parked.setdefault(asker, {})
        return pending

    def settle(self, asker: Hashable) -> dict[BlockKey, Medium]:
        """``asker``'s answer is final (or it is gone: :meth:`forget`): its parked promotions are
        let go; returns them, each with the tier it came from."""
        parked = self._parked.pop(asker, None)
        if not parked:
            return {}
        for key in parked:
            self.index.unpin(key)
        return parked

    forget = settle

    # --- cascade ------------------------------------------------------------------------
    def cascade(self, key: BlockKey, info: BlockInfo, tiers: Sequence[SecondaryTier] | None = None) -> None:
        """Write READY ``key`` to each of ``tiers`` (default: all) that lacks it, pinned per write;
        one that holds it is touched instead (stored again: recently used, as a store of a block a
        tier holds touches it there)."""
        if not self.index.is_ready(key):
            return
        for tier in self.tiers if tiers is None else tiers:
            if info.tail and tier.medium.shared:
                continue
            if tier.contains(key):
                tier.touch((key,))
                continue
            self.index.pin(key)
            backlog = self._backlogs[tier]
            backlog.add((key, info))
            backlog.feed(self._write, self._drop)

    def _write(self, tier: SecondaryTier, item: tuple[BlockKey, BlockInfo]) -> bool:
        key, info = item
        if not self.index.is_ready(key):  # deleted while it waited
            return False
        job_id = next(self._job_ids)
        sources = self.views(self.index.slots(key))
        if not tier.submit_write(job_id, key, info.parent, info.num_tokens, sources, tail=info.tail):
            return False
        self._writes[job_id] = (key, tier)
        return True

    def _drop(self, tier: SecondaryTier, item: tuple[BlockKey, BlockInfo]) -> None:
        self.index.unpin(item[0])
        self.stats.count_write_dropped(tier.medium, write_failure(IoError.DROPPED).counter)

    # --- completions --------------------------------------------------------------------
    def poll(self) -> None:
        """Apply the tiers' outcomes and feed their backlogs. Cheap when idle; never waits."""
        if not self.tiers:
            return
        refresh = self._refresh.due()
        for tier in self.tiers:
            if refresh:
                tier.refresh()
            for result in tier.poll():
                if result.kind is IoKind.WRITE:
                    self._written(result)
                else:
                    self._read(result)
            backlog = self._backlogs[tier]
            if backlog:
                backlog.feed(self._write, self._drop)

    def _written(self, result: IoResult) -> None:
        write = self._writes.pop(result.job_id, None)
        if write is None:
            return
        key, tier = write
        self.index.unpin(key)
        if result.ok:
            self.stats.written_to(tier.medium).record(result.num_bytes, result.seconds)
        else:  # dropped or failed: not stored either way
            self.stats.count_write_dropped(tier.medium, write_failure(result.error).counter)

    def _read(self, result: IoResult) -> None:
        read = self._reads.pop(result.job_id, None)
        if read is None:
            return
        key, medium = read.key, read.tier.medium
        self._promoting.discard(key)
        if not result.ok:
            self.index.abort(key)
            self.stats.count_failed_read(read_failure(result.error).counter)
            # counted; the tier itself warned of what needs an operator (a corrupt record, an I/O
            # error), and a block gone meanwhile (evicted or purged elsewhere) is routine: as behind
            # vLLM's offloading (kvtier.vllm.native), which logs none of them again
            logger.debug("kvtier: %s block %s unreadable (%s): it is a miss", medium.value.lower(), key.hex()[:16],
                         result.error.value if result.error is not None else "?")
            return
        self.index.commit(key)
        self.stats.promotions += 1
        self.stats.read_from(medium).record(result.num_bytes, result.seconds)
        if not self.index.is_ready(key):
            return  # deleted while the read ran (clear(), reset_prefix_cache): commit freed the slot
        faster = self.tiers[: self.tiers.index(read.tier)]
        if faster and read.info is not None:
            self.cascade(key, read.info, faster)  # keep a remote hit on the local disk
        parked = self._parked.get(read.asker)
        if parked is not None:  # held for the asker until it asks again
            self.index.pin(key)
            parked[key] = medium

    def wait(self, timeout_s: float) -> bool:
        """If an asker was told to ask again, block until any tier posts an outcome, at most
        ``timeout_s``; True if one is ready for :meth:`poll`. Only for a caller with nothing else
        to do meanwhile (an engine step that computes nothing)."""
        if not self._parked or not self.tiers:
            return False
        return wait_for_any(self._outboxes, self.bell, timeout_s)

    @property
    def busy(self) -> bool:
        """Reads or writes in flight, or writes waiting for room."""
        return bool(self._reads or self._writes or any(self._backlogs.values()))

    def in_flight(self) -> tuple[int, int]:
        """``(promotions, writes)`` in flight."""
        return len(self._reads), len(self._writes)

    # --- management ---------------------------------------------------------------------
    def close(self, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Give the jobs in flight (and the writes waiting for room) up to ``drain_timeout_s`` to
        land, so that a graceful stop keeps what was stored; then close every tier (what still
        waits is dropped). The caller's thread; once."""
        deadline = time.monotonic() + drain_timeout_s
        while self.busy and time.monotonic() < deadline:
            self.poll()
            if self.busy:
                wait_for_any(self._outboxes, self.bell, max(0.0, deadline - time.monotonic()))
        if self.busy:
            logger.warning("kvtier: shutting down with %d block writes not done after %.0f s (dropped)",
                           len(self._writes) + sum(map(len, self._backlogs.values())), drain_timeout_s)
        for tier in self.tiers:
            tier.close()
            self._backlogs[tier].feed(self._write, self._drop)
