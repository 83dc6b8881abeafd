"""The S3 tier's monitor thread: the namespace's listing, the capacity sweep, recovery.

One daemon thread per tier, ``kvtier-s3-monitor`` (background priority):

- Listing: at start-up, every ``list_interval_s``, right after a recovery, and when the caller asks
  (its estimate of the prefix went past ``capacity_bytes``; at most every :data:`MIN_GAP_S`), one
  paginated ``LIST``: of the whole prefix when the tier has a ``capacity_bytes`` (the bound is
  shared by every writer of the prefix, whatever its namespace), else of this namespace's folder
  only. What it found is posted (:class:`Listing`): the keys of this namespace's blocks (objects of
  a value's size), when the LIST began, bytes and objects. The caller answers presence from it
  (:meth:`~kvtier.tiers.s3.S3Tier.presence`) and forgets blocks it lacks.
- Sweep (with ``capacity_bytes``): when the prefix's block objects hold more bytes than that, the
  least recently written ones (LastModified, then key) are deleted until they hold at most
  :data:`SWEEP_TO` of it. Every engine of the prefix sweeps by the same order, so they agree on what
  goes; between two sweeps the prefix may exceed the bound by what the fleet writes meanwhile.
  The listing keeps only the oldest :data:`SWEEP_MAX` objects' entries (:class:`OldestEntries`:
  its memory is bounded by the sweep, not by the bucket); a sweep that this cuts short lists and
  sweeps again :data:`MIN_GAP_S` later. A bucket lifecycle rule can replace the sweep
  (docs/object-store.md).
- Recovery: while the circuit breaker is open, once its back-off has passed, ONE trial (a LIST of
  one page); success stores the namespace's config.json again and closes the breaker, then lists.
- The namespace's ``config.json`` is stored at start-up and after each recovery.

Threading: its own thread; talks to the rest of the tier only through the thread-safe breaker,
the ``post`` callback (the outbox) and :class:`~kvtier.tiers.s3.jobs.ObjectPath` (whose removals it
runs itself, here). A LIST stops between pages when the tier closes.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime

from kvtier.core.keys import BlockKey
from kvtier.core.priority import become_background_thread
from kvtier.tiers.breaker import CircuitBreaker
from kvtier.tiers.s3.client import Fault, classify, describe
from kvtier.tiers.s3.jobs import MSG_FAULT, MSG_LISTED, ObjectPath
from kvtier.tiers.s3.keys import parse_block

logger = logging.getLogger(__name__)

SWEEP_TO = 0.9
"""A sweep deletes the oldest objects until the prefix holds at most this fraction of capacity_bytes."""
MIN_GAP_S = 5.0
"""The least time between two listings the caller asks for (capped by ``list_interval_s``)."""
PAGE = 1000
SWEEP_MAX = 50_000
"""The most objects one sweep deletes: a listing keeps the entries of the oldest this many block
objects of the prefix, whatever the bucket holds (at most twice as many between trims: 28 MiB at
the peak, measured with 71-character keys)."""


@dataclass
class Listing:
    """What one LIST found (posted to the caller, who owns it from then on)."""

    keys: set[BlockKey]  # this namespace's blocks (objects of exactly a value's size)
    started: float  # time.monotonic() when the LIST began
    used_bytes: int  # bytes of the block objects listed (the prefix, or this namespace), after the sweep
    blocks: int  # this namespace's block objects
    objects: int  # block objects listed
    swept: int = 0  # objects the sweep chose to delete
    victims: list[str] = field(default_factory=list, repr=False)


class OldestEntries:
    """The ``limit`` least recently written of the ``(last_modified, path, size)`` entries given
    to :meth:`add`, in memory for at most ``2 * limit`` of them (cut back to the oldest ``limit``
    each time that many are held). One thread (the monitor's listing)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"kvtier s3: keep at least one entry, not {limit}")
        self._limit = limit
        self._entries: list[tuple[datetime, str, int]] = []
        self.seen = 0  # entries given
        self.cut = False  # some entry was dropped: a sweep of these may not reach its target

    def add(self, entry: tuple[datetime, str, int]) -> None:
        self._entries.append(entry)
        self.seen += 1
        if len(self._entries) >= 2 * self._limit:
            self._trim()

    def oldest(self) -> list[tuple[datetime, str, int]]:
        """The kept entries, oldest (then least key) first."""
        self._trim()
        return self._entries

    def _trim(self) -> None:
        if len(self._entries) > self._limit:
            self.cut = True
        self._entries = heapq.nsmallest(self._limit, self._entries)


def choose_victims(entries: Iterable[tuple[datetime, str, int]], used_bytes: int, capacity_bytes: int,
                   sweep_to: float = SWEEP_TO) -> list[tuple[str, int]]:
    """``(path, size)`` of the objects to delete, least recently written first (then by key), so
    that ``used_bytes`` comes down to ``sweep_to * capacity_bytes``; none while it is within
    ``capacity_bytes``. ``entries``: ``(last_modified, path, size)`` of every block object, or of
    the oldest of them (:class:`OldestEntries`): then the victims are all of those at most."""
    if used_bytes <= capacity_bytes:
        return []
    target = int(capacity_bytes * sweep_to)
    victims = []
    for _modified, path, size in sorted(entries):
        if used_bytes <= target:
            break
        victims.append((path, size))
        used_bytes -= size
    return victims


class Monitor:
    """The listing, sweep and recovery loop of one tier (see the module docstring)."""

    def __init__(self, *, path: ObjectPath, prefix: str, value_bytes: int, capacity_bytes: int | None,
                 list_interval_s: float, namespace_json: str, breaker: CircuitBreaker,
                 post: Callable[[list[tuple]], None], stop: threading.Event) -> None:
        self._path = path
        self._prefix = prefix
        self._value_bytes = value_bytes
        self._capacity = capacity_bytes
        self._interval = list_interval_s
        self._min_gap = min(MIN_GAP_S, list_interval_s)
        self._namespace_json = namespace_json
        self._breaker = breaker
        self._post = post
        self._stop = stop
        self._wake = threading.Event()
        self._asked = False
        self._config_stored = False
        self._thread = threading.Thread(target=self._run, name="kvtier-s3-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Re-check now (the breaker just opened)."""
        self._wake.set()

    def ask_listing(self) -> None:
        """List (and sweep) soon: at once if the last listing is at least :data:`MIN_GAP_S` old."""
        self._asked = True
        self._wake.set()

    def join(self) -> None:
        """Wait for the thread (the tier set ``stop``): at most one request, about ``timeout_s``."""
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        become_background_thread()
        next_list = 0.0  # at once
        last_list = float("-inf")
        while not self._stop.is_set():
            try:
                self._wake.clear()
                if self._breaker.begin_trial() and self._trial():
                    next_list = 0.0
                now = time.monotonic()
                if self._breaker.closed:
                    if not self._config_stored:
                        self._store_config()
                    due = now >= next_list or (self._asked and now >= last_list + self._min_gap)
                    if due:
                        self._asked = False
                        last_list = now
                        next_list = now + self._interval
                        self._list()
                        continue
                    wait = min(next_list, last_list + self._min_gap if self._asked else next_list) - now
                else:
                    retry_at = self._breaker.retry_at()
                    wait = 0.1 if retry_at is None else retry_at - now
                self._wake.wait(min(max(wait, 0.01), self._interval))
            except Exception:  # never let the loop die: the tier could not recover any more
                logger.exception("kvtier s3: monitor loop failed")
                self._stop.wait(1.0)

    def _trial(self) -> bool:
        """HALF_OPEN: list one page; on success store the config BEFORE closing the breaker."""
        import obstore

        try:
            next(iter(obstore.list(self._path.store, self._prefix + "/", chunk_size=1)), None)
            ok = True
        except Exception as exc:  # noqa: BLE001 (a trial that fails only keeps the breaker open)
            ok = classify(exc) is Fault.BAD_KEY  # the store answered (its listings fail until the key goes)
            if classify(exc) is Fault.REFUSED:  # e.g. the credentials were rotated under us
                logger.error("kvtier s3: reconnecting: the store refuses the credentials: %s", describe(exc))
            else:
                logger.debug("kvtier s3: reconnect trial failed: %s", describe(exc))
        if ok:
            self._store_config()
        self._breaker.end_trial(ok)
        if ok:
            logger.warning("kvtier s3: %s answers again; the S3 tier is back on", self._path.keys.base)
        return ok

    def _store_config(self) -> None:
        import obstore

        try:
            obstore.put(self._path.store, self._path.keys.config, self._namespace_json.encode(), use_multipart=False)
        except Exception as exc:  # noqa: BLE001 (an operator's aid: not fatal)
            fault = classify(exc)
            if fault in (Fault.UNREACHABLE, Fault.TLS):
                self._breaker.failure()
            logger.warning("kvtier s3: storing %s failed: %s", self._path.keys.config, describe(exc))
            return
        self._config_stored = True

    def _list(self) -> None:
        """One LIST (the prefix with a capacity, else the namespace), then the sweep; posts the listing."""
        import obstore

        keys = self._path.keys
        scope = self._prefix + "/" if self._capacity is not None else keys.base
        started = time.monotonic()
        mine: set[BlockKey] = set()
        entries = OldestEntries(SWEEP_MAX) if self._capacity is not None else None
        used = blocks = 0
        try:
            for chunk in obstore.list(self._path.store, scope, chunk_size=PAGE):
                if self._stop.is_set():
                    return
                for meta in chunk:
                    path, size = meta["path"], meta["size"]
                    block = parse_block(path, self._prefix)
                    if block is None:
                        continue
                    used += size
                    if entries is not None:
                        entries.add((meta["last_modified"], path, size))
                    if block.folder == keys.folder:
                        blocks += 1
                        if size == self._value_bytes:
                            mine.add(block.key)
        except Exception as exc:  # noqa: BLE001 (an abandoned listing is retried at the next interval)
            fault = classify(exc)
            if fault in (Fault.UNREACHABLE, Fault.TLS):
                self._breaker.failure()
            else:
                self._breaker.success()
            self._post([(MSG_FAULT, "listing_failures"), (MSG_FAULT, fault.value)])
            if fault is Fault.BAD_KEY:  # the store answers: HEAD probes keep finding blocks meanwhile
                logger.error("kvtier s3: listing %s failed: %s", scope, describe(exc))
            else:
                logger.warning("kvtier s3: listing %s failed: %s", scope, describe(exc))
            return
        self._breaker.success()
        listing = Listing(mine, started, used, blocks, entries.seen if entries is not None else blocks)
        if entries is not None:
            victims = choose_victims(entries.oldest(), used, self._capacity)
            for path, size in victims:
                listing.used_bytes -= size
                listing.victims.append(path)
                key = keys.block_key_of(path)
                if key is not None:
                    mine.discard(key)
                    listing.blocks -= 1
            listing.swept = len(victims)
            if entries.cut and listing.used_bytes > self._capacity:  # cut short: the rest at the next sweep
                self._asked = True
        self._post([(MSG_LISTED, listing)])
        if listing.victims:
            logger.info("kvtier s3: %s holds %.1f MiB of blocks, over capacity_bytes %.1f MiB: deleting the %d "
                        "least recently written", scope, used / 2**20, self._capacity / 2**20, len(listing.victims))
            self._path.remove(listing.victims, evicted=True)
