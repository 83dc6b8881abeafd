"""What the Redis tier's worker threads do: batches of reads, writes, probes and removals.

:class:`DataPath` turns a batch of jobs into ONE :meth:`~kvtier.tiers.redis.client.RedisClient.run`
(one redis-py pipeline, so one round trip, per server), classifies every reply, reports the
batch's outcome to the circuit breaker and posts what happened on the tier's completion queue
(``post``) for :meth:`~kvtier.tiers.redis.RedisTier.poll` to apply on the caller's thread: ONE
post (a list of messages) per batch, after all of its work, so a caller blocked in
:meth:`~kvtier.tiers.redis.RedisTier.wait` wakes once per batch, when it has everything, instead
of waking to half a batch and competing with the worker for the GIL while it copies. It never
touches the tier's caller-side state and never raises.

- Reads: ``GETRANGE name 0 <value length>``, never ``GET``: a reply is at most one byte longer
  than a record of this tier can be, so a value planted under a block key that is larger (any
  size: 256 MiB cost the reader +514 MiB with ``GET``) costs the reader that many bytes and a
  counted CORRUPT miss, not its size in memory; the extra byte shows that it is longer. Each reply
  (``bytes``, parsed by redis-py) is handled as soon as it is read,
  while the server is already sending the next one (``run(on_reply=...)``): its length and
  headers are checked where it is, then its payloads are copied into the caller's buffers, each
  checksummed as it is copied (:func:`~kvtier.tiers.redis.codec.decode_value`: one pass, the
  least a maintained client allows), and the reply is dropped, so a batch holds one value at a
  time. A wrong length, a failed check, an empty value (below) or a non-string value
  (``WRONGTYPE``) is CORRUPT: counted, never served (the read is not ok, so the caller discards
  its buffers), and the key is UNLINKed right after the batch's results are posted. A batch
  whose exchange fails after some values landed fails every read of it (IO): the caller
  discards those buffers too.
- A value is called corrupt (and UNLINKed) only from one atomic observation of it: one
  ``GETRANGE`` reply, never a check that failed across pieces (those are read again, whole:
  :data:`REREAD`). ``GETRANGE`` answers "" both for a missing key and for an empty value, so an
  empty reply decides nothing by itself (:data:`EMPTY`): the key is read again in a second round
  trip as ``EXISTS name`` then ``GETRANGE`` in one pipeline (one connection, run in order; a
  cluster sends both to the key's node, grouped by ``args[1]``). EXISTS 0 (or an error): NOT_FOUND,
  a miss. EXISTS 1 then "": when the GETRANGE ran, the key held no record of this tier (a record is
  never empty): an empty value, or one deleted between the two commands. Either way nothing valid
  is lost by UNLINKing it: the only value the UNLINK can remove that the read did not see is one
  written after the read, the window every corrupt value's removal has. It is CORRUPT (counted in
  ``corrupt`` / ``checksum_failures``, UNLINKed, then a miss), so an empty value is not found
  present again by every later probe (EXISTS answers 1 for it). The other order (GETRANGE "", then
  EXISTS 1) could be a valid value written in between, and is never used. A value that is no
  longer empty by then is read and checked like any other.
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
``unreachable``, part of ``RedisTier.unavailable``); a batch that got answers is a success. While the breaker is not closed, batches fail at once without
touching the network (reads IO, writes DROPPED, probes ABSENT).

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
from kvtier.tiers.redis.codec import (
    HEADER_LEN,
    CorruptBlockError,
    KeySpace,
    PieceLander,
    decode_value,
    encode_value,
    value_bytes,
)
from kvtier.tiers.redis.pipeline import Reply
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

LANDED = object()
"""A read's reply once its value passed every check and was copied into the job's buffers."""
REREAD = object()
"""A read's outcome when its pieces did not land: the value is read again, whole, after EXISTS."""
EMPTY = object()
"""A whole read's outcome when ``GETRANGE`` answered "" (no such key, or an empty value): read
again after EXISTS, which tells the two apart."""
PIECE_BYTES = 1 << 20
"""Reads of a single-rank value of at least twice this size go as ``value // PIECE_BYTES`` even
``GETRANGE`` pieces: each piece is copied and hashed while it is in cache and while the server
sends the next one (5.9 MB at depth 1, main thread: 2.8-3.05 -> 2.3-2.6 ms per read; 16 MiB:
19 -> 8.2-8.6 ms). Smaller values go whole: one more command costs more than it saves."""


def read_reply_bytes(world: int, payload_bytes: int, piece_bytes: int = PIECE_BYTES) -> int:
    """The largest reply a read expects: one value, or (one rank, a value of at least two
    ``piece_bytes``) one of its ``value // piece_bytes`` even pieces."""
    total = value_bytes(world, payload_bytes)
    pieces = max(1, total // piece_bytes) if world == 1 else 1
    return -(-total // pieces)


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
        self.client = client
        self.keys = keys
        self.rank_digests = tuple(rank_digests)
        self.world = len(self.rank_digests)
        self.payload_bytes = payload_bytes
        self.ttl_seconds = ttl_seconds
        self.breaker = breaker
        self.post = post
        self.sealer = sealer  # how records are sealed and which are accepted (kvtier.tiers.sealing)
        self.piece_bytes = read_reply_bytes(self.world, payload_bytes, piece_bytes)
        self.piecewise = self.piece_bytes < HEADER_LEN + payload_bytes
        """Reads go as pieces (:meth:`_read_pieces`): one rank, values of at least two ``piece_bytes``."""
        self._oom_logged = False
        self._errors_logged: set[str] = set()

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
        messages: list[tuple] = []
        if self.piecewise:
            replies = self._read_pieces(jobs, messages)
            again = [index for index, reply in enumerate(replies) if reply is REREAD]
        else:
            replies = self._read_whole(jobs, messages)
            again = [index for index, reply in enumerate(replies) if reply is EMPTY]
        if again:  # only an atomic read may call a value corrupt; an empty reply only after EXISTS said 1
            for index, reply in zip(again, self._read_whole([jobs[i] for i in again], messages, checked=True)):
                replies[index] = reply
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

    def _read_whole(self, jobs: list[ReadJob], messages: list[tuple], *, checked: bool = False) -> list[Reply]:
        """One ``GETRANGE`` of the whole value (and one byte more) per job; each value landed as soon
        as it is read. Per job: LANDED, a CorruptBlockError, EMPTY (GETRANGE's "": no such key, or
        an empty value), or the failure as read. ``checked``: each ``GETRANGE`` follows an
        ``EXISTS`` of the same key in the same pipeline (one connection, in order; a cluster sends
        both to the key's node), and an empty reply is then a CorruptBlockError where EXISTS
        answered 1, else None (no such key): see the module docstring."""
        step = 2 if checked else 1  # commands per job: [EXISTS,] GETRANGE
        existed = [False] * len(jobs)  # checked: what EXISTS answered (written only by the thread of its node)

        def land(index: int, reply: Reply) -> Reply:
            position, part = divmod(index, step)
            if part != step - 1:  # EXISTS
                existed[position] = isinstance(reply, int) and reply > 0
                return reply
            if not isinstance(reply, bytes):
                return reply
            if not reply:  # GETRANGE answers "" for a missing key and for an empty value
                if not checked:
                    return EMPTY
                return CorruptBlockError("empty value") if existed[position] else None
            job = jobs[position]
            try:
                decode_value(reply, job.dests, rank_digests=self.rank_digests, key=job.key, sealer=self.sealer)
            except CorruptBlockError as exc:
                return exc
            return LANDED

        last = self.world * (HEADER_LEN + self.payload_bytes)  # inclusive end: one byte past a record
        commands: list[tuple] = []
        for job in jobs:
            name = self.keys.block(job.key)
            if checked:
                commands.append((b"EXISTS", name))
            commands.append((b"GETRANGE", name, 0, last))
        replies = self.client.run(commands, on_reply=land)
        messages.append((MSG_BATCH, "read", replies.round_trips))
        return list(replies)[step - 1 :: step]

    def _read_pieces(self, jobs: list[ReadJob], messages: list[tuple]) -> list[Reply]:
        """Each job's value as ``GETRANGE`` pieces of about ``piece_bytes`` (single rank), each landed as
        soon as it is read (:class:`~kvtier.tiers.redis.codec.PieceLander`): the copy of one piece
        overlaps the server sending the next, even for a lone block. The last piece asks for one
        byte more, so a longer value shows. Per job: LANDED, REREAD (a check failed, or the key
        is missing: GETRANGE answers "" for both), or the failure of the exchange."""
        commands: list[tuple] = []
        owners: list[tuple[PieceLander, int, bool]] = []  # per command: its job's lander, offset, last?
        landers = []
        total = HEADER_LEN + self.payload_bytes
        offsets = range(0, total, self.piece_bytes)
        for job in jobs:
            lander = PieceLander(job.dests[0], rank_digest=self.rank_digests[0], key=job.key, sealer=self.sealer)
            landers.append(lander)
            name = self.keys.block(job.key)
            for offset in offsets:
                last = offset == offsets[-1]
                commands.append((b"GETRANGE", name, offset, total if last else offset + self.piece_bytes - 1))
                owners.append((lander, offset, last))
        stopped: set[int] = set()  # id() of the landers a check failed (their later pieces are dropped)

        def land(index: int, reply: Reply) -> None:
            lander, offset, last = owners[index]
            if id(lander) in stopped:
                return
            try:
                if not isinstance(reply, bytes):
                    raise CorruptBlockError(f"piece reply {type(reply).__name__}")
                if lander.received != offset:  # an earlier piece came short
                    raise CorruptBlockError(f"piece at {offset} follows {lander.received} bytes")
                lander.feed(reply)
                if last:
                    lander.finish()
            except CorruptBlockError:
                stopped.add(id(lander))

        replies = self.client.run(commands, on_reply=land)
        messages.append((MSG_BATCH, "read", replies.round_trips))
        outcomes: list[Reply] = []
        position = 0
        for lander in landers:
            pieces = replies[position : position + len(offsets)]
            position += len(offsets)
            lost = next((reply for reply in pieces if reply is not None), None)  # the exchange failed
            outcomes.append(lost if lost is not None else LANDED if lander.done else REREAD)
        return outcomes

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
