"""The disk tier: blocks as files under a root directory (local NVMe or a shared filesystem).

Layout (the one vLLM's fs tier documents, so operators know it)::

    <root>/<model>_<digest16>/config.json                 the namespace, as JSON
    <root>/<model>_<digest16>_r<rank>/<hhh>/<hh>_g<group>/<hash_hex>.bin
    <root>/quarantine/<model>_<digest16>_r<rank>__<hash_hex>.bin

``<model>`` is the model name reduced to ``[A-Za-z0-9._-]`` (:func:`sanitize_model_name`),
``<digest16>`` the first 16 hex digits of the rank-independent namespace digest, ``<hash_hex>``
the block key in hex, ``<hhh>``/``<hh>`` its first 3 and next 2 hex digits. Each ``.bin`` is a
"kvtier block file v1" (:mod:`kvtier.tiers.blockfile`). A block is present only when the file
of every rank exists.

Threading. Every public method runs on the caller's (orchestrator's) thread and never waits for
file I/O, except the constructor (creates directories, scans the files), :meth:`close` (waits
for the jobs in flight) and ``rescan(wait=True)``. Three private executors do the I/O:
``kvtier-disk-read`` (reads; a pool of its own so they never queue behind writes),
``kvtier-disk-write`` (writes, unlinks, clear sweeps, mtime updates) and ``kvtier-disk-scan``
(one thread, :meth:`rescan`). Workers never touch the in-memory index: they do file I/O only (including
renaming corrupt files into quarantine and unlinking orphans found by a scan) and post their
outcome on a :class:`queue.SimpleQueue`. :meth:`poll` drains it and applies every index change
on the caller's thread, so the index needs no lock.

Index and capacity. ``key -> (bytes, last use, generation)`` in an ``OrderedDict`` kept in LRU
order. Every valid file has the same size (header + ``payload_bytes``), so a block costs
``world_size * (HEADER_LEN + payload_bytes)`` bytes. Space for a write is reserved (evicting
LRU blocks) when it is submitted, so indexed plus in-flight bytes never exceed
``capacity_bytes``. A key with a read in flight is never evicted. An evicted or deleted key
leaves the index at once, before its files are unlinked on the write pool; a later write of the
same key waits for that unlink (and for a pending :meth:`clear` sweep) first, so an unlink can
never remove a newer file.

Sharing a root. Files are content addressed and published by ``rename`` from a unique temp
name, so two processes writing the same key write identical bytes and the last rename wins. A
file another process deleted is a ``NOT_FOUND`` miss. :meth:`rescan` merges files written by
other processes into the index and forgets indexed blocks whose files vanished. Each process
enforces its own ``capacity_bytes`` over what its index knows.

Order across restarts: the scan orders blocks by file mtime; writes set it, and read hits and
:meth:`touch` refresh it (``os.utime``, off the caller's thread).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import queue
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvtier.keys import KEY_BYTES, BlockKey
from kvtier.tiers.base import IoError, IoKind, IoResult, Medium, SecondaryTier, TierUsage
from kvtier.tiers.blockfile import (
    HEADER_LEN,
    CorruptBlockError,
    decode_header,
    encode_header,
    payload_checksum,
)

logger = logging.getLogger(__name__)

QUARANTINE_DIR = "quarantine"
STALE_TMP_SECONDS = 3600.0  # a temp file this old is removed even if its writer's pid looks alive
ORPHAN_SECONDS = 600.0  # files of a block missing some rank's file, this old, are removed by a scan

_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]")
_HEX = frozenset("0123456789abcdef")
_BIN_NAME_LEN = 2 * KEY_BYTES + 4  # "<64 hex>.bin"
_O_BINARY = getattr(os, "O_BINARY", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def sanitize_model_name(model_name: str) -> str:
    """The ``<model>`` part of directory names: only ``[A-Za-z0-9._-]``.

    A filesystem path (absolute, or starting with ``.`` or ``~``) contributes its last
    component (``/models/llama-3/`` -> ``llama-3``); in anything else, such as a Hugging Face
    repo id, separators become ``_`` like every other character outside the set
    (``HuggingFaceTB/SmolLM2-135M`` -> ``HuggingFaceTB_SmolLM2-135M``).
    """
    name = model_name.strip()
    if name.startswith(("/", ".", "~")) or os.path.isabs(name):
        name = re.split(r"[/\\]", name.rstrip("/\\"))[-1]
    name = _UNSAFE_CHARS.sub("_", name)
    if name.strip(".") == "":
        name = "model" if not name else name.replace(".", "_")
    return name


@dataclass(frozen=True, slots=True)
class DiskTierStats:
    """Counters of one :class:`DiskTier` (a snapshot; read ``DiskTier.stats`` again to refresh).

    ``read_misses`` counts ``NOT_FOUND`` reads, ``corrupt_quarantined`` files moved to quarantine
    (by reads or by scans), ``io_errors`` failed reads, writes and unlinks. ``writes_dropped``
    counts writes refused because the queue was full (``submit_write`` returned False) or that
    completed ``DROPPED`` (block larger than the capacity, no evictable space, or a re-store of
    a block whose write :meth:`DiskTier.clear` cancelled while it was in flight).
    """

    reads_ok: int = 0
    read_misses: int = 0
    corrupt_quarantined: int = 0
    io_errors: int = 0
    writes_ok: int = 0
    writes_dropped: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0


_STAT_FIELDS = tuple(f.name for f in dataclasses.fields(DiskTierStats))


class _Entry:
    __slots__ = ("nbytes", "last_use", "gen")

    def __init__(self, nbytes: int, last_use: float, gen: int) -> None:
        self.nbytes = nbytes
        self.last_use = last_use
        self.gen = gen


@dataclass(slots=True)
class _ScanResult:
    """What a scan of the rank directories found (built on a worker thread)."""

    new: list[tuple[int, str]]  # (newest mtime_ns over ranks, hex key) of complete blocks not known
    vanished: list[str]  # known hex keys not complete on disk any more
    quarantined: int = 0
    io_errors: int = 0


# Messages a worker posts to the completion queue (besides IoResult jobs).
_MSG_IO = 0  # (kind, IoResult, read: key generation at submit or None; write: True if a job ran)
_MSG_UNLINKED = 1  # (kind, keys, future, io_errors)
_MSG_SCAN = 2  # (kind, _ScanResult, gen at scan start)
_MSG_CLEARED = 3  # (kind, future, io_errors)


def _as_byte_view(buf: memoryview, *, writable: bool, what: str) -> memoryview:
    view = memoryview(buf)
    if writable and view.readonly:
        raise ValueError(f"{what} buffers must be writable")
    if not view.c_contiguous:
        raise ValueError(f"{what} buffers must be C-contiguous")
    if view.format != "B" or view.ndim != 1:
        try:
            view = view.cast("B")
        except TypeError as exc:
            raise ValueError(f"{what} buffers must be C-contiguous: {exc}") from None
    return view


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: exists, owned by someone else
        return True
    return True


def _unlink_quiet(path: str) -> bool:
    """Unlink ``path``; False only on an error other than "already gone"."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("kvtier disk: cannot remove %s: %s", path, exc)
        return False
    return True


class DiskTier(SecondaryTier):
    """Blocks stored as files; see the module docstring for layout, threading and sharing."""

    medium = Medium.DISK

    def __init__(
        self,
        *,
        root_dir: Path | str,
        model_name: str,
        engine_digest: bytes,
        rank_digests: Sequence[bytes],
        namespace_json: str,
        payload_bytes: int,
        capacity_bytes: int,
        n_read_threads: int,
        n_write_threads: int,
        max_pending_writes: int,
        group: int = 0,
    ) -> None:
        if len(engine_digest) < 8:
            raise ValueError(f"engine_digest must be at least 8 bytes, got {len(engine_digest)}")
        if not rank_digests:
            raise ValueError("rank_digests must name at least one rank (one digest per rank)")
        for rank, digest in enumerate(rank_digests):
            if len(digest) != KEY_BYTES:
                raise ValueError(f"rank_digests[{rank}] must be {KEY_BYTES} bytes, got {len(digest)}")
        for name, value, low in (
            ("payload_bytes", payload_bytes, 1),
            ("capacity_bytes", capacity_bytes, 0),
            ("n_read_threads", n_read_threads, 1),
            ("n_write_threads", n_write_threads, 1),
            ("max_pending_writes", max_pending_writes, 1),
            ("group", group, 0),
        ):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")

        self._root = str(Path(root_dir))
        self._prefix = f"{sanitize_model_name(model_name)}_{bytes(engine_digest).hex()[:16]}"
        self._ns_dir = os.path.join(self._root, self._prefix)
        self._rank_dirs = tuple(
            os.path.join(self._root, f"{self._prefix}_r{rank}") for rank in range(len(rank_digests))
        )
        self._quarantine_dir = os.path.join(self._root, QUARANTINE_DIR)
        self._rank_digests = tuple(bytes(d) for d in rank_digests)
        self._world = len(self._rank_digests)
        self._group_suffix = f"_g{group}"
        self._payload_bytes = payload_bytes
        self._file_bytes = HEADER_LEN + payload_bytes
        self._block_bytes = self._world * self._file_bytes
        self._capacity = capacity_bytes
        self._max_pending_writes = max_pending_writes

        # Caller-thread state (see the module docstring): never touched by workers.
        self._index: OrderedDict[BlockKey, _Entry] = OrderedDict()
        self._used = 0  # bytes of indexed blocks
        self._reserved = 0  # bytes of writes in flight
        self._writing: set[BlockKey] = set()  # keys with a write in flight
        # In-flight writes deleted meanwhile (files unlinked on completion) -> whether a new submit
        # of the key may revive them: yes after delete(), no after clear() (its sweep may race them).
        self._cancelled: dict[BlockKey, bool] = {}
        self._reading: dict[BlockKey, int] = {}  # keys with reads in flight (never evicted)
        self._removed_while_reading: set[BlockKey] = set()  # such keys deleted meanwhile: never adopt
        self._unlinking: dict[BlockKey, Future] = {}  # keys whose files an unlink job will remove
        self._gen = 0  # bumped on every index insert
        self._scan_running = False
        self._scan_forgotten: set[BlockKey] = set()  # keys removed while a rescan runs
        self._clearing: Future | None = None  # the sweep of clear(), until it is done
        self._clear_epoch = 0  # bumped by clear(): a scan that saw the files before must not re-add them
        self._scan_epoch = 0  # _clear_epoch when the running scan started
        self._counts: dict[str, int | float] = dict.fromkeys(_STAT_FIELDS, 0)
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False

        os.makedirs(self._ns_dir, exist_ok=True)
        for rank_dir in self._rank_dirs:
            os.makedirs(rank_dir, exist_ok=True)
        self._check_config(namespace_json)

        self._read_pool = ThreadPoolExecutor(n_read_threads, thread_name_prefix="kvtier-disk-read")
        self._write_pool = ThreadPoolExecutor(n_write_threads, thread_name_prefix="kvtier-disk-write")
        self._scan_pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-disk-scan")

        result = self._scan(known=None)
        self._merge_scan(result, scan_gen=None)

    # ------------------------------------------------------------------ paths

    @property
    def namespace_dir(self) -> Path:
        return Path(self._ns_dir)

    def rank_dir(self, rank: int) -> Path:
        return Path(self._rank_dirs[rank])

    @property
    def quarantine_dir(self) -> Path:
        return Path(self._quarantine_dir)

    def block_path(self, key: BlockKey, rank: int) -> Path:
        """Where ``key``'s file of ``rank`` lives."""
        return Path(self._path(key.hex(), rank))

    def _path(self, hex_key: str, rank: int) -> str:
        return f"{self._rank_dirs[rank]}/{hex_key[:3]}/{hex_key[3:5]}{self._group_suffix}/{hex_key}.bin"

    def _quarantine_path(self, hex_key: str, rank: int) -> str:
        return f"{self._quarantine_dir}/{self._prefix}_r{rank}__{hex_key}.bin"

    # ------------------------------------------------------------------ start-up

    def _check_config(self, namespace_json: str) -> None:
        path = os.path.join(self._ns_dir, "config.json")
        try:
            with open(path, encoding="utf-8") as fh:
                existing = fh.read()
        except FileNotFoundError:
            tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(namespace_json)
            os.replace(tmp, path)  # atomic; a concurrent start-up writes the same bytes
            return
        if existing == namespace_json:
            return
        try:
            same = json.loads(existing) == json.loads(namespace_json)
        except ValueError:
            same = False
        if not same:
            raise ValueError(
                f"disk tier directory {self._ns_dir} holds config.json of a different namespace than "
                f"this engine's, although the directory name (digest {self._prefix[-16:]}) says they are "
                "the same: the directory was modified by hand. Move it away or use another root_dir."
            )

    # ------------------------------------------------------------------ contract

    def contains(self, key: BlockKey) -> bool:
        return key in self._index

    def submit_read(self, job_id: int, key: BlockKey, dests: Sequence[memoryview]) -> None:
        views = self._check_buffers(dests, writable=True, what="dests")
        if len(key) != KEY_BYTES:
            raise ValueError(f"key must be {KEY_BYTES} bytes, got {len(key)}")
        if self._closed:
            self._done.put((_MSG_IO, IoResult(job_id, IoKind.READ, key, False, error=IoError.IO), None))
            return
        entry = self._index.get(key)
        self._reading[key] = self._reading.get(key, 0) + 1
        if key in self._unlinking or self._clearing is not None:
            self._removed_while_reading.add(key)  # the read may still find doomed files: never adopt them
        gen = entry.gen if entry is not None else None
        self._read_pool.submit(self._read_job, job_id, key, views, gen)

    def submit_write(
        self, job_id: int, key: BlockKey, parent: BlockKey, num_tokens: int, sources: Sequence[memoryview]
    ) -> bool:
        views = self._check_buffers(sources, writable=False, what="sources")
        if len(key) != KEY_BYTES or len(parent) != KEY_BYTES:
            raise ValueError(f"key and parent must be {KEY_BYTES} bytes, got {len(key)} and {len(parent)}")
        if not 0 <= num_tokens < 2**32:
            raise ValueError(f"num_tokens must fit in a u32, got {num_tokens}")
        if self._closed:
            return False
        if key in self._index:  # dedup: content addressed, the stored bytes are these bytes
            self._touch_one(key, time.time())
            self._done.put((_MSG_IO, IoResult(job_id, IoKind.WRITE, key, True), False))
            return True
        if key in self._writing:  # the same bytes are on their way
            if self._cancelled.get(key) is False:  # cancelled by clear(): cannot be revived
                self._counts["writes_dropped"] += 1
                dropped = IoResult(job_id, IoKind.WRITE, key, False, error=IoError.DROPPED)
                self._done.put((_MSG_IO, dropped, False))
                return True
            self._cancelled.pop(key, None)
            self._done.put((_MSG_IO, IoResult(job_id, IoKind.WRITE, key, True), False))
            return True
        if len(self._writing) >= self._max_pending_writes:
            self._counts["writes_dropped"] += 1
            return False
        if not self._make_room(self._block_bytes):
            self._counts["writes_dropped"] += 1
            self._done.put(
                (_MSG_IO, IoResult(job_id, IoKind.WRITE, key, False, error=IoError.DROPPED), False)
            )
            return True
        self._reserved += self._block_bytes
        self._writing.add(key)
        # Unlinks (of this key) and a clear() sweep queued earlier must not remove the new files.
        wait_for = tuple(f for f in (self._unlinking.get(key), self._clearing) if f is not None)
        self._write_pool.submit(self._write_job, job_id, key, parent, num_tokens, views, wait_for)
        return True

    def poll(self) -> list[IoResult]:
        results: list[IoResult] = []
        done = self._done
        while True:
            try:
                msg = done.get_nowait()
            except queue.Empty:
                break
            kind = msg[0]
            if kind == _MSG_IO:
                result: IoResult = msg[1]
                if result.kind is IoKind.READ:
                    self._finish_read(result, msg[2])
                elif msg[2]:  # a write job that ran (not a dedup or refusal decided at submit)
                    self._finish_write(result)
                results.append(result)
            elif kind == _MSG_UNLINKED:
                _, keys, future, errors = msg
                self._counts["io_errors"] += errors
                for key in keys:
                    if self._unlinking.get(key) is future:
                        del self._unlinking[key]
            elif kind == _MSG_SCAN:
                self._merge_scan(msg[1], scan_gen=msg[2])
            elif kind == _MSG_CLEARED:
                self._counts["io_errors"] += msg[2]
                if self._clearing is msg[1]:
                    self._clearing = None
        return results

    def touch(self, keys: Sequence[BlockKey]) -> None:
        now = time.time()
        touched = [key for key in keys if self._touch_one(key, now)]
        if touched and not self._closed:
            self._write_pool.submit(self._utime_job, [k.hex() for k in touched])

    def delete(self, keys: Sequence[BlockKey]) -> int:
        removed: list[BlockKey] = []
        for key in keys:
            if key in self._writing:
                self._cancelled.setdefault(key, True)
                if key in self._reading:
                    self._removed_while_reading.add(key)
            if self._forget(key):
                removed.append(key)
        self._schedule_unlink(removed)
        return len(removed)

    def clear(self) -> int:
        """Remove every block file of this namespace and group (all ranks, whoever wrote it).

        The index empties at once; the files are removed by one sweep on the write pool (writes
        submitted afterwards wait for it, so they survive it). Writes in flight are cancelled:
        their files are removed when they complete. Returns the number of indexed blocks.
        """
        count = len(self._index)
        for key in list(self._index):
            self._forget(key)
        self._cancelled.update(dict.fromkeys(self._writing, False))
        self._removed_while_reading.update(self._reading)
        self._clear_epoch += 1
        if self._closed:
            self._sweep_job(None, ())
            return count
        # The sweep runs after every unlink queued so far (none can then hit a newer file).
        earlier = {id(f): f for f in self._unlinking.values()}
        if self._clearing is not None:
            earlier[id(self._clearing)] = self._clearing
        future: Future = Future()
        self._write_pool.submit(self._sweep_job, future, tuple(earlier.values()))
        self._clearing = future
        return count

    def usage(self) -> TierUsage:
        """``used_bytes`` counts indexed blocks plus space reserved by writes in flight."""
        return TierUsage(
            medium=Medium.DISK,
            used_bytes=self._used + self._reserved,
            capacity_bytes=self._capacity,
            num_blocks=len(self._index),
        )

    def close(self) -> None:
        """Finish queued reads and in-flight writes, then stop the threads. Idempotent.

        Results of jobs that finish here can still be collected with :meth:`poll`.
        """
        if self._closed:
            return
        self._closed = True
        self._scan_pool.shutdown(wait=True, cancel_futures=True)
        self._read_pool.shutdown(wait=True)
        self._write_pool.shutdown(wait=True)

    # ------------------------------------------------------------------ extras

    @property
    def stats(self) -> DiskTierStats:
        return DiskTierStats(**self._counts)

    @property
    def block_bytes(self) -> int:
        """Bytes one block occupies on disk (all ranks, headers included)."""
        return self._block_bytes

    def lru_keys(self) -> list[BlockKey]:
        """Indexed keys, least recently used first (for tests and ``kvtier inspect``)."""
        return list(self._index)

    def rescan(self, *, wait: bool = False) -> None:
        """Merge block files written by other processes into the index; forget vanished ones.

        Also quarantines wrong-sized files, removes temp files of dead writers and removes
        blocks missing some rank's file for more than 10 minutes. The directory walk runs on
        the scan thread and its result is merged by a later :meth:`poll` (``wait=True``: now,
        blocking). Only new files are ``stat``-ed. A call while a scan runs does nothing.
        """
        if self._closed or self._scan_running or self._clearing is not None:
            return
        self._scan_running = True
        self._scan_forgotten = set()
        self._scan_epoch = self._clear_epoch
        known = list(self._index)  # a snapshot (C speed); the worker converts it to hex
        gen = self._gen
        if wait:
            self._merge_scan(self._scan(known), scan_gen=gen)
        else:
            self._scan_pool.submit(self._scan_job, known, gen)

    # ------------------------------------------------------------------ index (caller thread)

    def _check_buffers(
        self, buffers: Sequence[memoryview], *, writable: bool, what: str
    ) -> list[memoryview]:
        """Byte views of the caller's buffers; a wrong count or size is a caller bug (ValueError)."""
        if len(buffers) != self._world:
            raise ValueError(f"{what}: expected {self._world} buffers (one per rank), got {len(buffers)}")
        views = [_as_byte_view(b, writable=writable, what=what) for b in buffers]
        for rank, view in enumerate(views):
            if view.nbytes != self._payload_bytes:
                raise ValueError(
                    f"{what}[{rank}] is {view.nbytes} bytes; "
                    f"this tier's payload_bytes is {self._payload_bytes}"
                )
        return views

    def _touch_one(self, key: BlockKey, now: float) -> bool:
        entry = self._index.get(key)
        if entry is None:
            return False
        entry.last_use = now
        self._index.move_to_end(key)
        return True

    def _insert(self, key: BlockKey, last_use: float) -> None:
        self._gen += 1
        self._index[key] = _Entry(self._block_bytes, last_use, self._gen)
        self._used += self._block_bytes

    def _forget(self, key: BlockKey) -> bool:
        entry = self._index.pop(key, None)
        if entry is None:
            return False
        self._used -= entry.nbytes
        if self._scan_running:
            self._scan_forgotten.add(key)
        if key in self._reading:
            self._removed_while_reading.add(key)
        return True

    def _make_room(self, extra: int) -> bool:
        """Evict LRU blocks (not being read) until ``extra`` more bytes fit. False if impossible."""
        if extra > self._capacity:
            return False
        victims: list[BlockKey] = []
        if self._used + self._reserved + extra > self._capacity:
            for key in self._index:
                if key not in self._reading:
                    victims.append(key)
                    freed = len(victims) * self._block_bytes
                    if self._used + self._reserved + extra - freed <= self._capacity:
                        break
            else:
                return False  # not enough evictable blocks: evict nothing
        for key in victims:
            self._forget(key)
        self._counts["evictions"] += len(victims)
        self._schedule_unlink(victims)
        return True

    def _evict_to_capacity(self) -> None:
        victims: list[BlockKey] = []
        over = self._used + self._reserved - self._capacity
        if over <= 0:
            return
        for key in self._index:
            if over <= 0:
                break
            if key not in self._reading:
                victims.append(key)
                over -= self._index[key].nbytes
        for key in victims:
            self._forget(key)
        self._counts["evictions"] += len(victims)
        self._schedule_unlink(victims)

    def _schedule_unlink(self, keys: list[BlockKey]) -> None:
        if not keys:
            return
        reading = self._reading
        self._removed_while_reading.update(key for key in keys if key in reading)
        if self._closed:
            self._unlink_job(keys, None, ())  # synchronous: no pool any more
            return
        # Earlier unlinks of these keys still pending: this one runs after them, so a write that
        # waits for the latest unlink of its key (see submit_write) waits for all of them.
        earlier = {id(f): f for f in map(self._unlinking.get, keys) if f is not None}
        future: Future = Future()  # resolved by the job itself, so it can be waited on before it starts
        self._write_pool.submit(self._unlink_job, keys, future, tuple(earlier.values()))
        for key in keys:
            self._unlinking[key] = future

    def _finish_read(self, result: IoResult, gen: int | None) -> None:
        key = result.key
        left = self._reading.get(key, 0) - 1
        removed_meanwhile = key in self._removed_while_reading
        if left > 0:
            self._reading[key] = left
        else:
            self._reading.pop(key, None)
            self._removed_while_reading.discard(key)
        counts = self._counts
        if result.ok:
            counts["reads_ok"] += 1
            counts["bytes_read"] += result.num_bytes
            counts["read_seconds"] += result.seconds
            if (
                not self._touch_one(key, time.time())
                and gen is None
                and not removed_meanwhile
                and key not in self._writing
                and key not in self._unlinking
                and self._clearing is None
            ):
                # Not indexed at submit, found on disk: written by another process. Adopt it.
                # (Indexed at submit and gone now, or deleted since: it was removed on purpose.)
                self._insert(key, time.time())
                self._evict_to_capacity()
            return
        if result.error is IoError.NOT_FOUND:
            counts["read_misses"] += 1
        elif result.error is IoError.CORRUPT:
            counts["corrupt_quarantined"] += 1
        else:
            counts["io_errors"] += 1
            return  # maybe transient: keep the block
        entry = self._index.get(key)
        if entry is not None and entry.gen == gen:  # not rewritten since the read was submitted
            self._forget(key)
            if result.error is IoError.CORRUPT:
                self._schedule_unlink([key])  # the other ranks' files are useless now

    def _finish_write(self, result: IoResult) -> None:
        key = result.key
        self._writing.discard(key)
        self._reserved -= self._block_bytes
        counts = self._counts
        if not result.ok:
            counts["io_errors"] += 1
            self._cancelled.pop(key, None)
            return
        counts["writes_ok"] += 1
        counts["bytes_written"] += result.num_bytes
        counts["write_seconds"] += result.seconds
        if key in self._cancelled:
            del self._cancelled[key]
            self._schedule_unlink([key])
            return
        if key not in self._index:
            self._insert(key, time.time())
        self._evict_to_capacity()

    def _merge_scan(self, result: _ScanResult, scan_gen: int | None) -> None:
        """Apply a scan. ``scan_gen`` None: the start-up scan (the index is empty)."""
        self._counts["corrupt_quarantined"] += result.quarantined
        self._counts["io_errors"] += result.io_errors
        forgotten = self._scan_forgotten
        self._scan_running = False
        self._scan_forgotten = set()
        index = self._index
        if scan_gen is not None and (self._scan_epoch != self._clear_epoch or self._clearing is not None):
            return  # clear() ran since the scan started: what it saw is being swept
        if scan_gen is not None:
            # Indexed before the scan started, no longer complete on disk: another process removed it.
            for hex_key in result.vanished:
                key = bytes.fromhex(hex_key)
                entry = index.get(key)
                if entry is not None and entry.gen <= scan_gen and key not in self._reading:
                    self._forget(key)
        # New blocks go to the MRU end in mtime order (at start-up: the whole index, oldest first).
        result.new.sort()
        block_bytes, gen, added = self._block_bytes, self._gen, 0
        fromhex = bytes.fromhex
        for mtime_ns, hex_key in result.new:
            try:
                key = fromhex(hex_key)
            except ValueError:  # not a name kvtier writes: leave the file alone
                continue
            if scan_gen is not None and (
                key in index or key in self._writing or key in self._unlinking or key in forgotten
            ):
                continue
            gen += 1
            index[key] = _Entry(block_bytes, mtime_ns / 1e9, gen)
            added += 1
        self._gen = gen
        self._used += added * block_bytes
        self._evict_to_capacity()

    # ------------------------------------------------------------------ workers (no index access)

    def _read_job(self, job_id: int, key: BlockKey, dests: list[memoryview], gen: int | None) -> None:
        start = time.perf_counter()
        hex_key = key.hex()
        paths = [self._path(hex_key, rank) for rank in range(self._world)]
        rank = 0
        try:
            for rank, (path, dest) in enumerate(zip(paths, dests)):
                self._read_one(path, rank, key, dest)
        except CorruptBlockError as exc:
            logger.warning("kvtier disk: corrupt block file %s (%s); quarantined", paths[rank], exc)
            self._quarantine(hex_key, rank)
            error = IoError.CORRUPT
        except FileNotFoundError:
            error = IoError.NOT_FOUND
        except OSError as exc:
            logger.warning("kvtier disk: reading %s failed: %s", paths[rank], exc)
            error = IoError.IO
        except Exception:  # a bug, but the job must still complete
            logger.exception("kvtier disk: reading %s failed", paths[rank])
            error = IoError.IO
        else:
            for path in paths:  # record the use for the order after a restart
                try:
                    os.utime(path)
                except OSError:
                    pass
            seconds = time.perf_counter() - start
            nbytes = self._payload_bytes * self._world
            self._done.put((_MSG_IO, IoResult(job_id, IoKind.READ, key, True, nbytes, seconds), gen))
            return
        seconds = time.perf_counter() - start
        self._done.put((_MSG_IO, IoResult(job_id, IoKind.READ, key, False, 0, seconds, error), gen))

    def _read_one(self, path: str, rank: int, key: BlockKey, dest: memoryview) -> None:
        fd = os.open(path, os.O_RDONLY | _O_BINARY | _O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            header = decode_header(os.pread(fd, HEADER_LEN, 0))
            if header.namespace != self._rank_digests[rank]:
                raise CorruptBlockError(f"namespace {header.namespace.hex()[:16]}.. is not rank {rank}'s")
            if header.key != key:
                raise CorruptBlockError(f"header key {header.key.hex()[:16]}.. does not match the file name")
            if header.payload_len != dest.nbytes:
                raise CorruptBlockError(f"payload length {header.payload_len}, expected {dest.nbytes}")
            if size != HEADER_LEN + header.payload_len:
                raise CorruptBlockError(f"file is {size} bytes, expected {HEADER_LEN + header.payload_len}")
            view, offset = dest, HEADER_LEN
            while view.nbytes:
                n = os.preadv(fd, [view], offset)
                if n <= 0:
                    raise CorruptBlockError(f"short read at offset {offset}")
                view, offset = view[n:], offset + n
            if payload_checksum(dest) != header.checksum:
                raise CorruptBlockError("payload checksum mismatch")
        finally:
            os.close(fd)

    def _quarantine(self, hex_key: str, rank: int) -> bool:
        """Move a bad file aside (worker threads). True if it was moved."""
        src = self._path(hex_key, rank)
        dst = self._quarantine_path(hex_key, rank)
        try:
            try:
                os.rename(src, dst)
            except FileNotFoundError:
                if not os.path.exists(src):
                    return False
                os.makedirs(self._quarantine_dir, exist_ok=True)
                os.rename(src, dst)
        except OSError as exc:
            logger.warning("kvtier disk: cannot quarantine %s: %s; removing it", src, exc)
            _unlink_quiet(src)
            return False
        return True

    def _write_job(
        self,
        job_id: int,
        key: BlockKey,
        parent: BlockKey,
        num_tokens: int,
        sources: list[memoryview],
        wait_for: tuple[Future, ...],
    ) -> None:
        for future in wait_for:  # queued before this job, so already running or done: no deadlock
            future.result()
        start = time.perf_counter()
        hex_key = key.hex()
        written: list[str] = []
        tmp = ""
        try:
            for rank, source in enumerate(sources):
                final = self._path(hex_key, rank)
                header = encode_header(
                    namespace=self._rank_digests[rank],
                    key=key,
                    parent=parent,
                    num_tokens=num_tokens,
                    payload_len=source.nbytes,
                    checksum=payload_checksum(source),
                )
                tmp = f"{final}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
                self._write_file(tmp, header, source)
                os.rename(tmp, final)
                tmp = ""
                written.append(final)
        except Exception as exc:  # OSError (ENOSPC, EIO, ...) or a bug: the job must still complete
            if isinstance(exc, OSError):
                logger.warning("kvtier disk: writing block %s failed: %s", hex_key, exc)
            else:
                logger.exception("kvtier disk: writing block %s failed", hex_key)
            if tmp:
                _unlink_quiet(tmp)
            for path in written:  # ranks already published are useless without the rest
                _unlink_quiet(path)
            seconds = time.perf_counter() - start
            failed = IoResult(job_id, IoKind.WRITE, key, False, 0, seconds, IoError.IO)
            self._done.put((_MSG_IO, failed, True))
            return
        seconds = time.perf_counter() - start
        nbytes = self._block_bytes
        self._done.put((_MSG_IO, IoResult(job_id, IoKind.WRITE, key, True, nbytes, seconds), True))

    @staticmethod
    def _write_file(tmp: str, header: bytes, payload: memoryview) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_BINARY | _O_CLOEXEC
        for attempt in range(3):  # the leaf directory may be missing, or removed by an unlink job
            try:
                fd = os.open(tmp, flags, 0o644)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
                os.makedirs(os.path.dirname(tmp), exist_ok=True)
        try:
            buffers = [memoryview(header), payload]
            while buffers:
                n = os.writev(fd, buffers)
                if n <= 0:
                    raise OSError(errno.EIO, "writev wrote nothing")
                while buffers and n >= buffers[0].nbytes:
                    n -= buffers[0].nbytes
                    buffers.pop(0)
                if n:
                    buffers[0] = buffers[0][n:]
        finally:
            os.close(fd)

    def _unlink_job(self, keys: list[BlockKey], future: Future | None, earlier: tuple[Future, ...]) -> None:
        errors = 0
        try:
            for previous in earlier:  # queued before this job: started already, maybe not done
                previous.result()
            for key in keys:
                hex_key = key.hex()
                for rank in range(self._world):
                    path = self._path(hex_key, rank)
                    errors += not _unlink_quiet(path)
                    # Drop the leaf directory if that emptied it, so that churn does not leave up
                    # to 4096*256 empty directories per rank for the start-up scan to walk.
                    # rmdir refuses a non-empty directory (e.g. holding a writer's temp file).
                    try:
                        os.rmdir(os.path.dirname(path))
                    except OSError:
                        pass
        finally:
            if future is not None:
                future.set_result(None)
                self._done.put((_MSG_UNLINKED, keys, future, errors))
            else:
                self._counts["io_errors"] += errors  # closed: called on the caller's thread

    def _sweep_job(self, future: Future | None, earlier: tuple[Future, ...]) -> None:
        """Unlink every ``.bin`` of this namespace and group; drop emptied leaf directories."""
        errors = 0
        try:
            for previous in earlier:
                previous.result()
            for rank_dir in self._rank_dirs:
                for leaf in self._leaf_dirs(rank_dir):
                    try:
                        names = os.listdir(leaf)
                    except (FileNotFoundError, NotADirectoryError):
                        continue
                    for name in names:
                        if name.endswith(".bin"):
                            errors += not _unlink_quiet(f"{leaf}/{name}")
                    try:
                        os.rmdir(leaf)
                    except OSError:
                        pass
        finally:
            if future is not None:
                future.set_result(None)
                self._done.put((_MSG_CLEARED, future, errors))
            else:
                self._counts["io_errors"] += errors  # closed: called on the caller's thread

    def _utime_job(self, hex_keys: list[str]) -> None:
        for hex_key in hex_keys:
            for rank in range(self._world):
                try:
                    os.utime(self._path(hex_key, rank))
                except OSError:
                    pass

    def _scan_job(self, known: list[BlockKey], gen: int) -> None:
        try:
            result = self._scan(known)
        except Exception:  # never lose the "scan finished" message
            logger.exception("kvtier disk: rescan failed")
            self._done.put((_MSG_SCAN, _ScanResult(new=[], vanished=[], io_errors=1), None))
            return
        self._done.put((_MSG_SCAN, result, gen))

    def _leaf_dirs(self, rank_dir: str) -> list[str]:
        """The ``<hhh>/<hh>_g<group>`` directories under ``rank_dir`` (any thread)."""
        suffix = self._group_suffix
        sub_len = 2 + len(suffix)
        leaves: list[str] = []
        listdir = os.listdir
        try:
            tops = listdir(rank_dir)
        except FileNotFoundError:
            return leaves
        for top in tops:
            if len(top) != 3:
                continue
            top_dir = f"{rank_dir}/{top}"
            try:
                subs = listdir(top_dir)
            except (FileNotFoundError, NotADirectoryError):
                continue
            leaves.extend(f"{top_dir}/{sub}" for sub in subs if len(sub) == sub_len and sub.endswith(suffix))
        return leaves

    def _scan(self, known: Sequence[BlockKey] | None) -> _ScanResult:
        """Walk the rank directories (any thread; file I/O only, no index access).

        ``known``: keys indexed when the scan started; their files are not ``stat``-ed (None:
        start-up, stat everything). Quarantines wrong-sized files, removes stale temp files and
        old orphans (see :meth:`rescan`).
        """
        known_hex = frozenset(key.hex() for key in known) if known is not None else frozenset()
        file_bytes = self._file_bytes
        result = _ScanResult(new=[], vanished=[])
        now = time.time()
        stat, listdir = os.stat, os.listdir
        per_rank: list[dict[str, int]] = []  # hex key -> mtime_ns (0 for known keys, not stat-ed)
        for rank, rank_dir in enumerate(self._rank_dirs):
            found: dict[str, int] = {}
            for leaf in self._leaf_dirs(rank_dir):
                try:
                    names = listdir(leaf)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                for name in names:
                    if name.endswith(".bin"):
                        if len(name) != _BIN_NAME_LEN:
                            continue
                        hex_key = name[:-4]
                        if hex_key in known_hex:
                            found[hex_key] = 0
                            continue
                        try:
                            st = stat(f"{leaf}/{name}")
                        except FileNotFoundError:
                            continue
                        except OSError:
                            result.io_errors += 1
                            continue
                        if st.st_size != file_bytes:
                            if set(hex_key) <= _HEX:
                                logger.warning(
                                    "kvtier disk: %s/%s is %d bytes, expected %d; quarantined",
                                    leaf, name, st.st_size, file_bytes,
                                )
                                result.quarantined += self._quarantine(hex_key, rank)
                            continue
                        found[hex_key] = st.st_mtime_ns
                    elif name.endswith(".tmp"):
                        self._maybe_remove_tmp(f"{leaf}/{name}", name, now)
            per_rank.append(found)

        first = per_rank[0]
        if len(per_rank) == 1:
            complete = first.keys()
            result.new = [(mtime, hex_key) for hex_key, mtime in first.items() if hex_key not in known_hex]
        else:
            complete = set(first).intersection(*per_rank[1:])
            result.new = [
                (max(found[hex_key] for found in per_rank), hex_key)
                for hex_key in complete
                if hex_key not in known_hex
            ]
            # Blocks missing some rank's file: completed soon (a writer is between ranks) or orphans.
            partial = set(first).union(*per_rank[1:]) - complete
            for hex_key in partial:
                ranks = [rank for rank, found in enumerate(per_rank) if hex_key in found]
                stamps = self._mtimes(hex_key, ranks)
                if stamps and now - max(stamps) / 1e9 > ORPHAN_SECONDS:
                    for rank in ranks:
                        result.io_errors += not _unlink_quiet(self._path(hex_key, rank))
        result.vanished = list(known_hex.difference(complete))
        return result

    def _mtimes(self, hex_key: str, ranks: list[int]) -> list[int]:
        stamps = []
        for rank in ranks:
            try:
                stamps.append(os.stat(self._path(hex_key, rank)).st_mtime_ns)
            except OSError:
                pass
        return stamps

    @staticmethod
    def _maybe_remove_tmp(path: str, name: str, now: float) -> None:
        """Remove a temp file whose writer died, or any temp file older than an hour.

        Temp names are ``<hash>.bin.<pid>.<random>.tmp``. A pid from another PID namespace can
        look dead while its writer lives; removing its temp file then only fails that write.
        """
        parts = name.split(".")
        pid = int(parts[-3]) if len(parts) >= 5 and parts[-3].isdigit() else -1
        if pid > 0 and not _pid_alive(pid):
            _unlink_quiet(path)
            return
        try:
            age = now - os.stat(path).st_mtime
        except OSError:
            return
        if age > STALE_TMP_SECONDS:
            _unlink_quiet(path)
