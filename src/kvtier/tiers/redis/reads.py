"""How the Redis tier reads a batch's values into the callers' buffers: :class:`ValueReader`, used
by :class:`~kvtier.tiers.redis.jobs.DataPath` for a batch of reads. It sends the ``GETRANGE``
commands (one :meth:`~kvtier.tiers.redis.client.RedisClient.run`, so one round trip per server,
and a second one for the values that must be read again), lands every reply as soon as it is
read, and gives one outcome per job. What an outcome means for the job, the circuit breaker and
the key (a miss, CORRUPT and UNLINKed, IO) is the data path's (:mod:`~kvtier.tiers.redis.jobs`).

- ``GETRANGE name 0 <value length>``, never ``GET``: a reply is at most one byte longer than a
  record of this tier can be, so a value planted under a block key that is larger (any size:
  256 MiB cost the reader +514 MiB with ``GET``) costs the reader that many bytes and a counted
  CORRUPT miss, not its size in memory; the extra byte shows that it is longer. Each reply
  (``bytes``, parsed by redis-py) is handled as soon as it is read, while the server is already
  sending the next one (``run(on_reply=...)``): its length and headers are checked where it is,
  then its payloads are copied into the caller's buffers, each checksummed as it is copied
  (:func:`~kvtier.tiers.redis.codec.decode_value`: one pass, the least a maintained client
  allows), and the reply is dropped, so a batch holds one value at a time. Values of one rank
  and at least two :data:`PIECE_BYTES` go as ``GETRANGE`` pieces instead, each landed as it is
  read (:class:`~kvtier.tiers.redis.codec.PieceLander`).
- A value is called corrupt only from one atomic observation of it: one ``GETRANGE`` reply, never
  a check that failed across pieces (those are read again, whole: :data:`REREAD`). ``GETRANGE``
  answers "" both for a missing key and for an empty value, so an empty reply decides nothing by
  itself (:data:`EMPTY`): the key is read again in a second round trip as ``EXISTS name`` then
  ``GETRANGE`` in one pipeline (one connection, run in order; a cluster sends both to the key's
  node, grouped by ``args[1]``). EXISTS 0 (or an error): not found. EXISTS 1 then "": when the
  GETRANGE ran, the key held no record of this tier (a record is never empty): an empty value, or
  one deleted between the two commands. Either way nothing valid is lost by UNLINKing it: the only
  value the UNLINK can remove that the read did not see is one written after the read, the window
  every corrupt value's removal has. It is corrupt, so an empty value is not found present again
  by every later probe (EXISTS answers 1 for it). The other order (GETRANGE "", then EXISTS 1)
  could be a valid value written in between, and is never used. A value that is no longer empty
  by then is read and checked like any other.

Outcomes (:meth:`ValueReader.read`), one per job, in order: :data:`LANDED` (every payload passed
its checks and is in the job's buffers), a :class:`~kvtier.tiers.redis.codec.CorruptBlockError`
(one reply that is no record of this tier: a wrong length, a failed check, empty where EXISTS
said 1), ``None`` (no such key), or what came instead of a value: an error reply (``WRONGTYPE``:
not a string value) or the failure of the job's exchange.

Invariants: a job's buffers hold its value only where its outcome is :data:`LANDED`; any other
outcome may leave them partly written (a failed check, or an exchange that failed after the
value landed: :meth:`~kvtier.tiers.redis.client.RedisClient.run` then gives the failure for every
command of that server), and the caller discards them. It never posts, never reports to the
breaker, logs nothing itself and never UNLINKs: it only reads and lands.

Threading: :meth:`ValueReader.read` runs on one of the tier's read worker threads; its replies
are landed on the threads reading each server (a cluster batch: several at once), and all of one
job's commands go to its key's server, so each job's buffers are written by one thread.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.tiers.redis.client import RedisClient
from kvtier.tiers.redis.codec import (
    HEADER_LEN,
    CorruptBlockError,
    KeySpace,
    PieceLander,
    decode_value,
    value_bytes,
)
from kvtier.tiers.redis.pipeline import Reply
from kvtier.tiers.remote import ReadJob
from kvtier.tiers.sealing import PLAIN, Sealer

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


class ValueReader:
    """Reads of one tier's values (``keys``, ``rank_digests``, ``payload_bytes``, ``sealer``) into
    the jobs' buffers, through ``client``; read-only after construction."""

    def __init__(self, *, client: RedisClient, keys: KeySpace, rank_digests: Sequence[bytes],
                 payload_bytes: int, piece_bytes: int = PIECE_BYTES, sealer: Sealer = PLAIN) -> None:
        self.client = client
        self.keys = keys
        self.rank_digests = tuple(rank_digests)
        self.world = len(self.rank_digests)
        self.payload_bytes = payload_bytes
        self.sealer = sealer  # how records are sealed and which are accepted (kvtier.tiers.sealing)
        self.piece_bytes = read_reply_bytes(self.world, payload_bytes, piece_bytes)
        self.piecewise = self.piece_bytes < HEADER_LEN + payload_bytes
        """Reads go as pieces (:meth:`_read_pieces`): one rank, values of at least two ``piece_bytes``."""

    def read(self, jobs: list[ReadJob]) -> tuple[list[Reply], list[int]]:
        """Read ``jobs``' values into their buffers: one outcome per job, in order (see the module
        docstring), and the round trips of each ``run`` it took (one, then one more for the
        values read again)."""
        runs: list[int] = []
        if self.piecewise:
            replies = self._read_pieces(jobs, runs)
            again = [index for index, reply in enumerate(replies) if reply is REREAD]
        else:
            replies = self._read_whole(jobs, runs)
            again = [index for index, reply in enumerate(replies) if reply is EMPTY]
        if again:  # only an atomic read may call a value corrupt; an empty reply only after EXISTS said 1
            for index, reply in zip(again, self._read_whole([jobs[i] for i in again], runs, checked=True)):
                replies[index] = reply
        return replies, runs

    def _read_whole(self, jobs: list[ReadJob], runs: list[int], *, checked: bool = False) -> list[Reply]:
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
        runs.append(replies.round_trips)
        return list(replies)[step - 1 :: step]

    def _read_pieces(self, jobs: list[ReadJob], runs: list[int]) -> list[Reply]:
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
        runs.append(replies.round_trips)
        outcomes: list[Reply] = []
        position = 0
        for lander in landers:
            pieces = replies[position : position + len(offsets)]
            position += len(offsets)
            lost = next((reply for reply in pieces if reply is not None), None)  # the exchange failed
            outcomes.append(lost if lost is not None else LANDED if lander.done else REREAD)
        return outcomes
