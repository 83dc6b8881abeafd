"""What the S3 tier's worker threads do: one request per job, its outcome posted for the caller.

:class:`ObjectPath` runs a job with one blocking obstore call (which releases the GIL while it
waits), sorts any error (:func:`~kvtier.tiers.s3.client.classify`), reports to the circuit breaker
and the throttle, and posts what happened on the tier's outbox (``post``: one list of messages
per job) for :meth:`~kvtier.tiers.s3.S3Tier.poll` to apply on the caller's thread. It never
touches the tier's caller-side state and never raises.

- Reads: ``GET`` of the block's object with ``Range: bytes=0-<value bytes>``: at most one byte
  more than a valid value is ever transferred, so a huge object (another tenant's, a hostile
  writer's) costs one value's bytes. The reply's length and every header are checked, then the
  payloads are copied into the caller's buffers, each checksummed (or its MAC checked, or
  decrypted) as it lands (:func:`~kvtier.tiers.value.decode_value`). 404: NOT_FOUND (evicted,
  swept, purged since the lookup). A short or long reply, a 416 (an empty object), a failed check:
  CORRUPT; no valid MAC under the tier's keys: UNAUTHENTICATED; both are never served and the
  object is deleted right after. A GET is atomic (one version of the object), so a reply is never
  a mix of two writes.
- Writes: one ``PUT`` of the value's parts (each rank's header, then the caller's buffer; obstore
  joins them into the request body, the one copy of the write), never multipart (no upload is
  ever left half done in the bucket). Before sending, a write waits out the throttle's back-off.
- Probes: ``HEAD`` per key; an object of any other size than a value's is not a block (absent).
- Removals: bulk ``DELETE`` (DeleteObjects) of up to 1000 keys per request.

Failures: no answer (refused, reset, timed out) is a breaker failure; any answer a success. 503
SlowDown / 429 (after object_store's own retries) also doubles the throttle's back-off. While the
breaker is not closed, jobs fail at once without touching the network (reads IO, writes DROPPED,
probes unanswered).

Threading: every method runs on one of the tier's worker threads (reads, writes, probes, removals:
one pool each).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from kvtier.core.keys import BlockKey
from kvtier.tiers.base import IoError, IoKind, IoResult
from kvtier.tiers.breaker import CircuitBreaker
from kvtier.tiers.remote import MSG_IO, MSG_PROBE, ReadJob, WriteJob
from kvtier.tiers.s3.client import Fault, classify, describe
from kvtier.tiers.s3.keys import ObjectKeys
from kvtier.tiers.sealing import PLAIN, Sealer, UnauthenticatedRecord
from kvtier.tiers.value import CorruptBlockError, decode_value, encode_value

logger = logging.getLogger(__name__)

# Messages posted on the outbox (each post is a list of them).
# MSG_IO (detail: None | a Fault's value | "breaker") and MSG_PROBE: kvtier.tiers.remote's.
MSG_REMOVED = "removed"  # (MSG_REMOVED, keys of this namespace removed, objects removed, failed, evicted: bool,
#                            keys of this namespace whose DELETE failed)
MSG_CLEARED = "cleared"  # (MSG_CLEARED,): a clear's LIST + DELETE run is over (after its MSG_REMOVED)
MSG_LISTED = "listed"  # (MSG_LISTED, Listing)
MSG_FAULT = "fault"  # (MSG_FAULT, Fault value): a request without a job failed (counted by kind)

DELETE_BATCH = 1000
"""Keys per bulk DELETE (S3's DeleteObjects limit)."""


class Throttle:
    """The store asked to slow down (503 SlowDown, 429): writes wait until :attr:`until`; the wait
    starts at ``base`` seconds, doubles with every throttled answer up to ``maximum`` and resets
    with the next write that goes through. Read without a lock by the caller's thread
    (:attr:`until`, a float); changed under a lock by the worker threads."""

    def __init__(self, base: float = 0.1, maximum: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.base, self.maximum, self.clock = base, maximum, clock
        self.until = 0.0
        self.backoff = base
        self._lock = threading.Lock()

    def hit(self) -> None:
        with self._lock:
            self.until = max(self.until, self.clock() + self.backoff)
            self.backoff = min(self.backoff * 2, self.maximum)

    def passed(self) -> None:
        if self.backoff != self.base:
            with self._lock:
                self.backoff = self.base

    @property
    def active(self) -> bool:
        return self.clock() < self.until

    def wait(self, stop: threading.Event) -> None:
        """Sleep until the back-off has passed (or ``stop`` is set)."""
        while (left := self.until - self.clock()) > 0 and not stop.is_set():
            stop.wait(min(left, 0.5))


_READ_ERRORS = {Fault.NOT_FOUND: IoError.NOT_FOUND, Fault.NO_BUCKET: IoError.NOT_FOUND, Fault.BAD_RANGE: IoError.CORRUPT}


class ObjectPath:
    """The tier's requests, run on its worker threads; outcomes go to ``post``."""

    def __init__(self, *, store, keys: ObjectKeys, rank_digests: Sequence[bytes], payload_bytes: int,
                 value_bytes: int, breaker: CircuitBreaker, throttle: Throttle, post: Callable[[list[tuple]], None],
                 stop: threading.Event, remove: Callable[[list[str]], None], sealer: Sealer = PLAIN) -> None:
        self.store = store
        self.keys = keys
        self.rank_digests = tuple(rank_digests)
        self.payload_bytes = payload_bytes
        self.value_bytes = value_bytes
        self.breaker = breaker
        self.throttle = throttle
        self.post = post
        self.stop = stop
        self.remove_later = remove  # queue paths for the removal thread
        self.sealer = sealer
        self._warned: set[Fault] = set()

    # ------------------------------------------------------------------ outcomes of a request

    def _failed(self, exc: BaseException, what: str) -> Fault:
        """Sort ``exc``, tell the breaker / throttle, log once per kind; returns the fault."""
        fault = classify(exc)
        if fault in (Fault.UNREACHABLE, Fault.TLS):
            self.breaker.failure()
        else:
            self.breaker.success()  # it answered
            if fault is Fault.THROTTLED:
                self.throttle.hit()
        if fault not in (Fault.NOT_FOUND, Fault.UNREACHABLE) and fault not in self._warned:
            self._warned.add(fault)
            logger.warning("kvtier s3: %s %s: %s (further such errors are counted, not logged)", what,
                           self.keys.base, describe(exc))
        return fault

    # ------------------------------------------------------------------ jobs

    def read(self, job: ReadJob) -> None:
        import obstore

        if not self.breaker.closed:
            self.post([(MSG_IO, IoResult(job.job_id, IoKind.READ, job.key, False, error=IoError.IO), "breaker")])
            return
        path = self.keys.block(job.key)
        start = time.perf_counter()
        try:
            data = obstore.get(self.store, path, options={"range": (0, self.value_bytes + 1)}).bytes()
        except Exception as exc:  # noqa: BLE001 (sorted by _failed)
            fault = self._failed(exc, "GET")
            error = _READ_ERRORS.get(fault, IoError.IO)
            self.post([(MSG_IO, IoResult(job.job_id, IoKind.READ, job.key, False, error=error), fault.value)])
            if error is IoError.CORRUPT:
                self.remove_later([path])
            return
        self.breaker.success()
        try:
            decode_value(memoryview(data), job.dests, rank_digests=self.rank_digests, key=job.key, sealer=self.sealer)
        except UnauthenticatedRecord as exc:
            self._bad(job, path, IoError.UNAUTHENTICATED, exc)
            return
        except CorruptBlockError as exc:
            self._bad(job, path, IoError.CORRUPT, exc)
            return
        seconds = time.perf_counter() - start
        self.post([(MSG_IO, IoResult(job.job_id, IoKind.READ, job.key, True, len(data), seconds), None)])

    def _bad(self, job: ReadJob, path: str, error: IoError, exc: Exception) -> None:
        logger.warning("kvtier s3: %s is not a valid block (%s): a miss; deleting it", path, exc)
        self.post([(MSG_IO, IoResult(job.job_id, IoKind.READ, job.key, False, error=error), None)])
        self.remove_later([path])

    def write(self, job: WriteJob) -> None:
        import obstore

        self.throttle.wait(self.stop)
        if not self.breaker.closed or self.stop.is_set():
            result = IoResult(job.job_id, IoKind.WRITE, job.key, False, error=IoError.DROPPED)
            self.post([(MSG_IO, result, "breaker", job)])
            return
        start = time.perf_counter()
        try:
            parts = encode_value(self.rank_digests, job.key, job.parent, job.num_tokens, job.sources, self.sealer)
            obstore.put(self.store, self.keys.block(job.key), parts, use_multipart=False)
        except Exception as exc:  # noqa: BLE001 (sorted by _failed)
            fault = self._failed(exc, "PUT")
            self.post([(MSG_IO, IoResult(job.job_id, IoKind.WRITE, job.key, False, error=IoError.IO), fault.value,
                        job)])
            return
        self.breaker.success()
        self.throttle.passed()
        seconds = time.perf_counter() - start
        self.post([(MSG_IO, IoResult(job.job_id, IoKind.WRITE, job.key, True, self.value_bytes, seconds), None, job)])

    def probe(self, keys: list[BlockKey]) -> None:
        """HEAD each key (one after the other on this thread; the tier spreads a probe over its
        probe threads)."""
        import obstore

        found: list[bool | None] = []
        for key in keys:
            if not self.breaker.closed or self.stop.is_set():
                found.append(None)
                continue
            try:
                meta = obstore.head(self.store, self.keys.block(key))
            except Exception as exc:  # noqa: BLE001 (sorted by _failed)
                fault = self._failed(exc, "HEAD")
                found.append(False if fault is Fault.NOT_FOUND else None)
                continue
            self.breaker.success()
            found.append(meta["size"] == self.value_bytes)
        self.post([(MSG_PROBE, keys, found)])

    def remove(self, paths: list[str], *, evicted: bool = False) -> None:
        """Bulk DELETE ``paths`` (a removal thread); posts which of them were this namespace's
        blocks, removed and not."""
        import obstore

        gone: list[str] = []
        missed: list[str] = []
        for begin in range(0, len(paths), DELETE_BATCH):
            batch = paths[begin:begin + DELETE_BATCH]
            if not self.breaker.closed:
                missed += batch
                continue
            try:
                obstore.delete(self.store, batch)
            except Exception as exc:  # noqa: BLE001 (sorted by _failed)
                self._failed(exc, "DELETE")
                missed += batch
                continue
            self.breaker.success()
            gone += batch
        block_key_of = self.keys.block_key_of
        mine = [key for key in map(block_key_of, gone) if key is not None]
        kept = [key for key in map(block_key_of, missed) if key is not None]
        self.post([(MSG_REMOVED, mine, len(gone), len(missed), evicted, kept)])

    def clear(self) -> None:
        """Delete every block object of this namespace, whoever wrote it (LIST its folder, then bulk
        DELETE; the config.json stays). A removal thread."""
        import obstore

        paths: list[str] = []
        try:
            for chunk in obstore.list(self.store, self.keys.base, chunk_size=DELETE_BATCH):
                paths += [meta["path"] for meta in chunk if self.keys.block_key_of(meta["path"]) is not None]
        except Exception as exc:  # noqa: BLE001 (sorted by _failed)
            self._failed(exc, "LIST")
        try:
            if paths:
                self.remove(paths)
        finally:
            self.post([(MSG_CLEARED,)])
