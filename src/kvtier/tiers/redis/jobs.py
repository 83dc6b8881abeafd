"""What the Redis tier's worker threads do: batches of reads, writes, probes and removals.

:class:`DataPath` turns a batch of jobs into ONE :meth:`~kvtier.tiers.redis.client.RedisClient.run`
(one redis-py pipeline, so one round trip, per server), classifies every reply, reports the
batch's outcome to the circuit breaker and posts what happened on the tier's completion queue
(``post``) for :meth:`~kvtier.tiers.redis.RedisTier.poll` to apply on the caller's thread: ONE
post (a list of messages) per batch, after all of its work, so a caller blocked in
:meth:`~kvtier.tiers.redis.RedisTier.wait` wakes once per batch, when it has everything, instead
of waking to half a batch and competing with the worker for the GIL while it copies. It never
touches the tier's caller-side state and never raises.

- Reads: ``GETRANGE`` (never ``GET``), each value landed in the caller's buffers as its reply is
  read, by :class:`~kvtier.tiers.redis.reads.ValueReader` (:mod:`~kvtier.tiers.redis.reads`: how
  values are read, in pieces or whole, and when one is called corrupt). Here its outcomes are
  classified: a value that is no record of this tier (a wrong length, a failed check, an empty
  value) or a non-string value (``WRONGTYPE``) is CORRUPT, or UNAUTHENTICATED for a record the
  tier's sealer refused (each counted), never served (the read is not ok, so the caller discards
  its buffers), and the key is UNLINKed right after the batch's results are posted. No such key:
  NOT_FOUND, a miss. A batch whose exchange fails after some values landed fails every read of it
  (IO): the caller discards those buffers too.
- Writes: ``SET name value [EX ttl]``, the value ONE argument given as its parts
  (:class:`~kvtier.tiers.redis.wire.ValueParts` of :func:`~kvtier.tiers.redis.codec.encode_value`:
  each rank's header, then its payload, the host slot itself): the packer sends the slots as
  they are, uncopied, so a write's only pass over its bytes is the checksum. ``OOM``
  (``OutOfMemoryError``: server full under ``noeviction``) is DROPPED and counted as such: the
  server answered, so it is not a breaker failure. Any other error reply is IO.
- Probes: ``EXISTS`` per key. Removals and TTL refreshes: ``UNLINK`` / ``EXPIRE`` per key.
  ``clear``: ``SCAN MATCH {prefix}:{ns}:*`` per server, then UNLINK in batches of 1000.

A batch that could not reach a server (refused, reset, timed out) is one breaker failure, and its
reads and writes fail with the detail :data:`~kvtier.tiers.remote.UNREACHABLE` (counted in
``unreachable``, part of ``RedisTier.unavailable``); a batch that got answers is a success.
While the breaker is not closed, batches fail at once without touching the network (reads IO,
writes DROPPED, probes ABSENT).

Threading: every method runs on one of the tier's worker threads (reads on the read pool,
writes/removals on the write pool, probes on the probe thread).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from redis.exceptions import OutOfMemoryError, ResponseError

from kvtier.core.keys import BlockKey
from kvtier.tiers.base import IoError, IoKind, IoResult
from kvtier.tiers.breaker import CircuitBreaker
from kvtier.tiers.remote import MSG_IO, MSG_PROBE, UNREACHABLE, ReadJob, WriteJob
from kvtier.tiers.redis.client import RedisClient
from kvtier.tiers.redis.errors import describe, error_code, is_connection_failure, safe_text
from kvtier.tiers.redis.codec import HEADER_LEN, CorruptBlockError, KeySpace, encode_value
from kvtier.tiers.redis.reads import LANDED, PIECE_BYTES, ValueReader
from kvtier.tiers.redis.reads import read_reply_bytes  # noqa: F401 - re-exported (imported from here)
from kvtier.tiers.redis.wire import ValueParts
from kvtier.tiers.sealing import PLAIN, Sealer, UnauthenticatedRecord

logger = logging.getLogger(__name__)

# Messages posted on the completion queue (each post is a list of them: one batch's outcomes, in order).
# MSG_IO (detail: None | "oom" | "breaker" | UNREACHABLE) and MSG_PROBE: kvtier.tiers.remote's, shared with the
# S3 tier.
MSG_BATCH = "batch"  # (MSG_BATCH, "read" | "write" | "probe", round trips)
MSG_USAGE = "usage"  # (MSG_USAGE, used_bytes, capacity_bytes)
MSG_REMOVED = "removed"  # (MSG_REMOVED, keys removed (count), failed commands (count))

SCAN_BATCH = 1000

class DataPath:
    """The tier's batches, run on its worker threads; outcomes go to ``post``."""

    def __init__(
        self,
        *,
        client: RedisClient,
        keys: KeySpace,
        rank_digests: Sequence[bytes],
        payload_bytes: int,
        ttl_seconds: int | None,
        breaker: CircuitBreaker,
        post: Callable[[list[tuple]], None],
        piece_bytes: int = PIECE_BYTES,
        sealer: Sealer = PLAIN,
    ) -> None:
        self.reader = ValueReader(client=client, keys=keys, rank_digests=rank_digests,
                                  payload_bytes=payload_bytes, piece_bytes=piece_bytes, sealer=sealer)
        self.client, self.keys, self.payload_bytes = client, keys, payload_bytes
        self.rank_digests, self.world = self.reader.rank_digests, self.reader.world
        self.sealer = sealer  # how records are sealed and which are accepted (kvtier.tiers.sealing)
        self.ttl_seconds = ttl_seconds
        self.breaker = breaker
        self.post = post
        self._oom_logged = False
        self._errors_logged: set[str] = set()

    @property
    def piecewise(self) -> bool:
        """Reads go as pieces (:attr:`~kvtier.tiers.redis.reads.ValueReader.piecewise`)."""
        return self.reader.piecewise

    # ------------------------------------------------------------------ reads

    def read_batch(self, jobs: list[ReadJob]) -> None:
        try:
            self._read_batch(jobs)
        except Exception:  # a bug: every job must still complete
            logger.exception("kvtier redis: read batch failed")
            self.post(
                [
                    (MSG_IO, IoResult(job.job_id, IoKind.READ, job.key, False, error=IoError.IO), None)
                    for job in jobs
                ]
            )

    def _read_batch(self, jobs: list[ReadJob]) -> None:
        if not self.breaker.closed:
            self.post(
                [
                    (MSG_IO, IoResult(job.job_id, IoKind.READ, job.key, False, error=IoError.IO), "breaker")
                    for job in jobs
                ]
            )
            return
        start = time.perf_counter()
        replies, runs = self.reader.read(jobs)
        messages: list[tuple] = [(MSG_BATCH, "read", round_trips) for round_trips in runs]
        failed = False
        corrupt: list[BlockKey] = []
        results = []
        for job, reply in zip(jobs, replies):
            error: IoError | None = None
            lost = False
            if reply is LANDED:
                pass
            elif isinstance(reply, CorruptBlockError):
                error = self._corrupt(job.key, str(reply), corrupt, isinstance(reply, UnauthenticatedRecord))
            elif reply is None:
                error = IoError.NOT_FOUND
            elif isinstance(reply, ResponseError) and error_code(reply) == "WRONGTYPE":
                error = self._corrupt(job.key, "not a string value", corrupt)
            else:
                error = IoError.IO
                lost = self._note_error("read", reply)
                failed |= lost
            results.append((job, error, UNREACHABLE if lost else None))
        seconds = (time.perf_counter() - start) / len(jobs)
        nbytes = self.world * self.payload_bytes
        posts = [
            (MSG_IO, IoResult(job.job_id, IoKind.READ, job.key, True, nbytes, seconds), None)
            if error is None
            else (MSG_IO, IoResult(job.job_id, IoKind.READ, job.key, False, 0, seconds, error), detail)
            for job, error, detail in results
        ]
        self._report(failed)
        self.post(messages + posts)
        if corrupt:
            self.remove(corrupt)

    def _corrupt(self, key: BlockKey, reason: str, corrupt: list[BlockKey], unauthenticated: bool = False) -> IoError:
        logger.warning(
            "kvtier redis: %s value for block %s (%s); deleting it",
            "unauthenticated" if unauthenticated else "corrupt", key.hex()[:16], safe_text(reason)
        )
        corrupt.append(key)
        return IoError.UNAUTHENTICATED if unauthenticated else IoError.CORRUPT

    # ------------------------------------------------------------------ writes

    def write_batch(self, jobs: list[WriteJob]) -> None:
        try:
            self._write_batch(jobs)
        except Exception:
            logger.exception("kvtier redis: write batch failed")
            self.post(
                [
                    (MSG_IO, IoResult(job.job_id, IoKind.WRITE, job.key, False, error=IoError.IO), None, job)
                    for job in jobs
                ]
            )

    def _write_batch(self, jobs: list[WriteJob]) -> None:
        if not self.breaker.closed:
            self.post(
                [
                    (
                        MSG_IO,
                        IoResult(job.job_id, IoKind.WRITE, job.key, False, error=IoError.DROPPED),
                        "breaker",
                        job,
                    )
                    for job in jobs
                ]
            )
            return
        start = time.perf_counter()
        expire: tuple = (b"EX", self.ttl_seconds) if self.ttl_seconds else ()
        commands = [(b"SET", self.keys.block(job.key), self._value(job), *expire) for job in jobs]
        replies = self.client.run(commands)
        seconds = (time.perf_counter() - start) / len(jobs)
        nbytes = self.world * (HEADER_LEN + self.payload_bytes)
        failed = False
        posts: list[tuple] = [(MSG_BATCH, "write", replies.round_trips)]
        for job, reply in zip(jobs, replies):
            if reply == b"OK" or reply is True:  # SET's reply (True if a response callback parsed it)
                self._oom_logged = False
                posts.append(
                    (MSG_IO, IoResult(job.job_id, IoKind.WRITE, job.key, True, nbytes, seconds), None, job)
                )
                continue
            if isinstance(reply, OutOfMemoryError):
                if not self._oom_logged:
                    self._oom_logged = True
                    logger.warning(
                        "kvtier redis: the server is full (OOM %s); dropping writes until it has room",
                        safe_text(str(reply)),
                    )
                result = IoResult(job.job_id, IoKind.WRITE, job.key, False, 0, seconds, IoError.DROPPED)
                posts.append((MSG_IO, result, "oom", job))
                continue
            lost = self._note_error("write", reply)
            failed |= lost
            posts.append(
                (
                    MSG_IO,
                    IoResult(job.job_id, IoKind.WRITE, job.key, False, 0, seconds, IoError.IO),
                    UNREACHABLE if lost else None,
                    job,
                )
            )
        self._report(failed)
        self.post(posts)

    def _value(self, job: WriteJob) -> ValueParts:
        """The value of ``job``'s block: every rank's header and payload (the job's sources,
        borrowed: they stay pinned until the job's result is polled)."""
        return ValueParts(encode_value(self.rank_digests, job.key, job.parent, job.num_tokens, job.sources,
                                       self.sealer))

    # ------------------------------------------------------------------ probes

    def probe_batch(self, groups: list[list[BlockKey]]) -> None:
        keys = [key for group in groups for key in group]
        messages: list[tuple] = []
        try:
            found = self._probe(keys, messages)
        except Exception:
            logger.exception("kvtier redis: probe batch failed")
            found = [None] * len(keys)
        self.post(messages + [(MSG_PROBE, keys, found)])

    def _probe(self, keys: list[BlockKey], messages: list[tuple]) -> list[bool | None]:
        if not self.breaker.closed:
            return [None] * len(keys)
        replies = self.client.run([(b"EXISTS", self.keys.block(key)) for key in keys])
        messages.append((MSG_BATCH, "probe", replies.round_trips))
        found: list[bool | None] = []
        failed = False
        for reply in replies:
            if isinstance(reply, int):
                found.append(reply > 0)
            else:
                found.append(None)
                failed |= self._note_error("probe", reply)
        self._report(failed)
        return found

    # ------------------------------------------------------------------ removals, TTLs

    def remove(self, keys: Sequence[BlockKey]) -> None:
        """UNLINK ``keys``' values."""
        self._per_key(b"UNLINK", keys, removal=True)

    def expire(self, keys: Sequence[BlockKey]) -> None:
        """Mark ``keys`` used: EXPIRE ttl_seconds (the TTL starts again), or without a TTL, TOUCH
        (the server's LRU/LFU clock of the key)."""
        if self.ttl_seconds:
            self._per_key(b"EXPIRE", keys, removal=False, extra=(self.ttl_seconds,))
        else:
            self._per_key(b"TOUCH", keys, removal=False)

    def _per_key(self, command: bytes, keys: Sequence[BlockKey], *, removal: bool, extra: tuple = ()) -> None:
        if not keys:
            return
        if not self.breaker.closed:
            self.post([(MSG_REMOVED, 0, len(keys)) if removal else (MSG_REMOVED, 0, 0)])
            return
        try:
            replies = self.client.run([(command, self.keys.block(key), *extra) for key in keys])
        except Exception:
            logger.exception("kvtier redis: %s batch failed", command.decode())
            replies = [RuntimeError("bug")] * len(keys)
        done = sum(1 for r in replies if isinstance(r, int) and r > 0)
        errors = sum(1 for r in replies if not isinstance(r, int))
        self._report(any(is_connection_failure(r) for r in replies if isinstance(r, BaseException)))
        self.post([(MSG_REMOVED, done if removal else 0, errors)])

    def sweep(self) -> None:
        """Remove every block of this namespace (``clear``): SCAN every server, UNLINK in batches.
        The config key stays (it names the namespace for operators)."""
        removed = errors = 0
        try:
            if not self.breaker.closed:
                raise ConnectionError("circuit breaker open")
            batch: list[bytes] = []
            config = self.keys.config
            for name in self.client.scan(self.keys.pattern, count=SCAN_BATCH):
                if name != config:
                    batch.append(name)
                if len(batch) >= SCAN_BATCH:
                    r, e = self._unlink_names(batch)
                    removed, errors, batch = removed + r, errors + e, []
            if batch:
                r, e = self._unlink_names(batch)
                removed, errors = removed + r, errors + e
        except Exception as exc:
            errors += 1
            logger.warning("kvtier redis: clear() stopped early: %s", describe(exc))
            if is_connection_failure(exc):
                self._report(True)
        self.post([(MSG_REMOVED, removed, errors)])

    def _unlink_names(self, names: list[bytes]) -> tuple[int, int]:
        replies = self.client.run([(b"UNLINK", name) for name in names])
        errors = [r for r in replies if not isinstance(r, int)]
        if errors:
            self._report(any(is_connection_failure(r) for r in errors if isinstance(r, BaseException)))
        return sum(1 for r in replies if isinstance(r, int) and r > 0), len(errors)

    # ------------------------------------------------------------------ outcome bookkeeping

    def _note_error(self, what: str, reply: object) -> bool:
        """Log an unexpected reply (once per kind); True if it is a connection failure."""
        if isinstance(reply, BaseException):
            if is_connection_failure(reply):
                logger.debug("kvtier redis: %s batch failed: %s", what, describe(reply))
                return True
            code = error_code(reply) if isinstance(reply, ResponseError) else type(reply).__name__
            kind = f"{what}:{code}"
            text = describe(reply)
        else:
            kind, text = f"{what}:{type(reply).__name__}", f"unexpected reply of type {type(reply).__name__}"
        if kind not in self._errors_logged:
            self._errors_logged.add(kind)
            logger.warning("kvtier redis: %s failed: %s (logged once)", what, text)
        return False

    def _report(self, failed: bool) -> None:
        if not failed:
            self.breaker.success()
        elif self.breaker.failure():
            logger.warning(
                "kvtier redis: %s did not answer %d times in a row; the Redis tier is off (misses) "
                "and retries in %.0f s",
                self.client.config.redacted_url(),
                self.breaker.threshold,
                self.breaker.backoff,
            )
