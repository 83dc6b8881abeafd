"""What a tier behind a server knows about which blocks the server holds, answered from memory.

Used by the Redis tier (:mod:`kvtier.tiers.redis`), the S3 tier (:mod:`kvtier.tiers.s3`, which
also lists its namespace in the background: :meth:`PresenceCache.reconcile`) and by the node
pool's tier for vLLM's own offloading (:mod:`kvtier.node.pool_tier`); the Redis tier is the
example below.

A shared remote cannot be asked on the caller's thread (a round trip is 0.1-1 ms on a LAN and
up to ``timeout_s`` on a sick server, and the caller is vLLM's scheduler). So the tier answers
:meth:`~kvtier.tiers.base.SecondaryTier.presence` from this cache, filled by background
probes (one EXISTS pipeline per :meth:`~kvtier.tiers.base.SecondaryTier.probe` call) and by
the outcomes of its own reads and writes:

- PRESENT: a probe found the block, or this process wrote or read it, less than
  ``present_ttl`` (30 s) ago. Another engine (or the server's eviction, or a TTL) may remove it
  meanwhile; the read then fails NOT_FOUND and costs a miss, never wrong bytes.
- ABSENT: a probe did not find it, or a read found it missing or corrupt, or a probe/read failed,
  less than ``absent_ttl`` (1 s) ago. Short, because another engine may store it any moment.
- UNKNOWN: nothing recent. The caller probes and asks again later.

The cost of this choice: a prefix never seen before costs one "ask again" round of the caller
(in vLLM: one scheduler step) before its blocks can be loaded: the first lookup answers UNKNOWN
and starts a probe, the next finds the answer. In exchange nothing ever waits on the network on
the scheduler's thread. Blocks this process stored itself, or looked up recently, are known
at once.

The cache is bounded: an LRU of ``max_entries`` (default 2^20) keys. Measured on CPython 3.11:
185 bytes per entry (entry object, ordered-dict slot and links) plus the 65-byte key object if
nothing else holds it, so about 250 MB when full; an insert costs ~10 us, a lookup ~4 us. The
least recently updated entry is dropped first (it then answers UNKNOWN again). When the
server came back after the breaker was open (it may have restarted and lost everything), every
entry is made stale at once (:meth:`PresenceCache.invalidate`, O(1)).

Residency: the cache also remembers, per key, whether a STORED change was recorded for it, so
that the tier's :class:`~kvtier.core.residency.ResidencyLog` alternates STORED/REMOVED per key:
STORED when a block is found or written while not already reported, REMOVED when a reported
block is found missing or corrupt, deleted, cleared, or dropped from the LRU (then the tier no
longer vouches for it). Evictions and expiries on the server are only seen when a later read or
probe finds the block gone.

Keys being probed are tracked so that a key is never probed twice at once, and so that a probe
in flight when its key is removed (:meth:`PresenceCache.missing` on a delete, :meth:`forget_all`
on a clear) is not taken: it may have found the block before the removal reached the server.

Threading: the caller's (orchestrator's) thread only; no locks, no I/O.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Container, Iterable, Sequence

from kvtier.core.keys import BlockKey
from kvtier.core.residency import ResidencyLog
from kvtier.tiers.base import Presence

PRESENT_TTL = 30.0
ABSENT_TTL = 1.0
MAX_ENTRIES = 1 << 20
_PRESENT, _ABSENT, _UNKNOWN = Presence.PRESENT, Presence.ABSENT, Presence.UNKNOWN
_NEVER = float("-inf")


class _Entry:
    __slots__ = ("present", "reported", "until")

    def __init__(self, until: float, present: bool, reported: bool) -> None:
        self.until = until
        self.present = present
        self.reported = reported


class PresenceCache:
    """Per-key PRESENT/ABSENT answers with an expiry, LRU-bounded; see the module docstring."""

    def __init__(
        self,
        residency: ResidencyLog,
        *,
        present_ttl: float = PRESENT_TTL,
        absent_ttl: float = ABSENT_TTL,
        max_entries: int = MAX_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if present_ttl <= 0 or absent_ttl <= 0 or max_entries < 1:
            raise ValueError("TTLs must be > 0 and max_entries >= 1")
        self.residency = residency
        self.present_ttl = present_ttl
        self.absent_ttl = absent_ttl
        self.max_entries = max_entries
        self.clock = clock
        self._entries: OrderedDict[BlockKey, _Entry] = OrderedDict()
        self._stale_before = _NEVER
        # Keys answered PRESENT now, as one set a caller's hot path can test without a call (see
        # :attr:`present_keys`); their expiries in the order they were set, swept by :meth:`expire`.
        self.present_keys: set[BlockKey] = set()
        self._expiries: deque[tuple[float, BlockKey]] = deque()
        self.probing: set[BlockKey] = set()
        self._voided: set[BlockKey] = set()  # probing keys removed since their probe was asked

    def __len__(self) -> int:
        return len(self._entries)

    # ------------------------------------------------------------------ answers

    def get(self, key: BlockKey, now: float | None = None) -> Presence:
        # The scheduler's hot path (once per chunk per lookup pass): module constants, no enum look-ups.
        entry = self._entries.get(key)
        if entry is None:
            return _UNKNOWN
        if now is None:
            now = self.clock()
        if now >= entry.until or (self._stale_before != _NEVER and not self._fresh(entry, now)):
            return _UNKNOWN
        return _PRESENT if entry.present else _ABSENT

    def to_probe(self, keys: Iterable[BlockKey]) -> list[BlockKey]:
        """The keys of ``keys`` worth probing (no fresh answer, no probe in flight), each once;
        they are marked as being probed."""
        now = self.clock()
        wanted: list[BlockKey] = []
        for key in keys:
            if key in self.probing:
                continue
            entry = self._entries.get(key)
            if entry is not None and self._fresh(entry, now):
                continue
            self.probing.add(key)
            wanted.append(key)
        return wanted

    # ------------------------------------------------------------------ outcomes

    def found(self, key: BlockKey, now: float | None = None) -> None:
        """The server holds ``key`` (a probe found it, a read or write succeeded)."""
        self._set(key, True, self.clock() if now is None else now)

    def missing(self, key: BlockKey, now: float | None = None) -> None:
        """The server does not hold a valid ``key`` (probe miss, read NOT_FOUND or CORRUPT, delete);
        a probe of it in flight will not be taken."""
        if key in self.probing:
            self._voided.add(key)
        self._set(key, False, self.clock() if now is None else now)

    def failed(self, key: BlockKey, now: float | None = None) -> None:
        """Asking about ``key`` failed: answer ABSENT for ``absent_ttl`` (a miss, never a wait),
        without claiming that it is gone (no residency change)."""
        now = self.clock() if now is None else now
        entry = self._entries.get(key)
        if entry is None:
            self._insert(key, _Entry(now + self.absent_ttl, False, False))
        else:
            entry.until, entry.present = now + self.absent_ttl, False
            self._entries.move_to_end(key)
        self.present_keys.discard(key)

    def probed(self, keys: Sequence[BlockKey], found: Sequence[bool] | None) -> None:
        """A probe of ``keys`` answered (``found[i]``), or failed (None). The answer for a key
        removed while it was being probed is dropped (the removal's answer stands)."""
        now = self.clock()
        voided = self._voided
        for index, key in enumerate(keys):
            self.probing.discard(key)
            if voided and key in voided:
                voided.discard(key)
                continue
            if found is None:
                self.failed(key, now)
            elif found[index]:
                self._set(key, True, now)
            else:
                self._set(key, False, now)

    def invalidate(self) -> None:
        """Make every answer stale (the server may have lost everything)."""
        self._stale_before = self.clock()
        self.present_keys.clear()
        self._expiries.clear()

    def expire(self, now: float | None = None) -> None:
        """Take the keys whose PRESENT answer has expired out of :attr:`present_keys` (call it often:
        each step). Amortized O(1) per answer set."""
        now = self.clock() if now is None else now
        expiries, entries, present = self._expiries, self._entries, self.present_keys
        while expiries and expiries[0][0] <= now:
            until, key = expiries.popleft()
            entry = entries.get(key)
            if entry is None or not entry.present or entry.until <= now:
                present.discard(key)

    def reconcile(self, listed: Container[BlockKey], since: float) -> int:
        """A complete listing of the server, begun at ``since`` (this cache's clock), holds
        ``listed``: a key answered PRESENT since before then that the listing lacks is gone (another
        process deleted it, or the server's lifecycle did), so it becomes ABSENT (REMOVED recorded).
        Keys found after ``since`` are kept (written after the listing saw their place). Returns how
        many went. Cost: one pass over the keys answered PRESENT."""
        entries, ttl, now = self._entries, self.present_ttl, self.clock()
        gone = []
        for key in self.present_keys:
            entry = entries.get(key)
            if key not in listed and entry is not None and entry.present and entry.until - ttl < since:
                gone.append(key)
        for key in gone:
            self._set(key, False, now)
        return len(gone)

    def forget_all(self) -> int:
        """Drop every entry (a clear), recording REMOVED for reported ones; the probes in flight
        will not be taken. Returns how many keys were known PRESENT."""
        self._voided |= self.probing
        now = self.clock()
        present = 0
        for key, entry in self._entries.items():
            if entry.present and self._fresh(entry, now):
                present += 1
            if entry.reported:
                self.residency.removed(key)
        self._entries.clear()
        self.present_keys.clear()
        self._expiries.clear()
        return present

    # ------------------------------------------------------------------ internals

    def _fresh(self, entry: _Entry, now: float) -> bool:
        if now >= entry.until:
            return False
        ttl = self.present_ttl if entry.present else self.absent_ttl
        return entry.until - ttl > self._stale_before

    def _set(self, key: BlockKey, present: bool, now: float) -> None:
        until = now + (self.present_ttl if present else self.absent_ttl)
        if present:
            self.present_keys.add(key)
            self._expiries.append((until, key))
        else:
            self.present_keys.discard(key)
        entry = self._entries.get(key)
        if entry is None:
            if present:
                self.residency.stored(key)
            self._insert(key, _Entry(until, present, present))
            return
        entry.until, entry.present = until, present
        if present and not entry.reported:
            self.residency.stored(key)
            entry.reported = True
        elif not present and entry.reported:
            self.residency.removed(key)
            entry.reported = False
        self._entries.move_to_end(key)

    def _insert(self, key: BlockKey, entry: _Entry) -> None:
        entries = self._entries
        entries[key] = entry
        while len(entries) > self.max_entries:
            old_key, old = entries.popitem(last=False)
            self.present_keys.discard(old_key)
            if old.reported:
                self.residency.removed(old_key)
