"""What the disk tier's worker threads post to its completion queue, and the write job they carry.

Workers (read, write and scan pools) only ever ``put`` these tuples; the tier's caller thread
drains the queue in ``poll()`` and is the only one that touches the index.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass

from kvtier.core.keys import BlockKey


class Msg(enum.IntEnum):
    """The first element of every completion-queue tuple; the rest by kind:"""

    IO = 0  # (IO, IoResult, read: key generation at submit or None; write: WriteOutcome, None if no job ran)
    REMOVED = 1  # (REMOVED, keys unlinked or None for a clear() sweep, future, io_errors)
    SCAN = 2  # (SCAN, ScanResult, gen at scan start)
    NO_ROOM = 3  # (NO_ROOM, WriteJob): the usage ledger refused a write that may be retried


@dataclass(slots=True)
class WriteJob:
    """A write in flight: what a retry needs (``sources`` stay valid until its result is returned)."""

    job_id: int
    key: BlockKey
    parent: BlockKey
    num_tokens: int
    sources: list[memoryview]
    attempt: int = 0  # retries after the usage ledger refused it


def distinct_futures(futures: Iterable[Future | None]) -> tuple[Future, ...]:
    """The futures that are not None, each once, in order."""
    return tuple({id(f): f for f in futures if f is not None}.values())
