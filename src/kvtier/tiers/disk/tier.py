"""The disk tier: blocks as files under a root directory (local NVMe or a shared filesystem).

Modules: :mod:`kvtier.tiers.disk.layout` (the directory layout and file names, documented there,
and the scan that finds block files), :mod:`kvtier.tiers.disk.ledger` (the usage ledger shared by
the processes writing a namespace), :mod:`kvtier.tiers.disk.writer` (writing a block) and
:mod:`kvtier.tiers.disk.files` (reading, verifying and removing block files),
:mod:`kvtier.tiers.disk.jobs` (what the worker threads do, one job each),
:mod:`kvtier.tiers.disk.refused` (writes the usage ledger refused), :mod:`kvtier.tiers.disk.index` (the
index, capacity and LRU order, keys with jobs in flight, and how job outcomes change them: a
:class:`~kvtier.tiers.disk.index.DiskIndex` the tier owns) and this one (:class:`DiskTier`: the
contract, job submission, the worker pools and :meth:`DiskTier.poll`).

Threading. Every public method runs on the caller's (orchestrator's) thread and never waits for
file I/O, except the constructor (creates directories, scans the files), :meth:`close` (waits
for the jobs in flight) and ``rescan(wait=True)``. Three private executors do the I/O:
``kvtier-disk-read`` (reads; a pool of its own so they never queue behind writes),
``kvtier-disk-write`` (writes, unlinks, clear sweeps, mtime updates) and ``kvtier-disk-scan``
(one thread, :meth:`rescan`). Workers never touch the in-memory index: they do file I/O only (including
renaming corrupt files into quarantine, unlinking orphans found by a scan and updating the usage
ledger under its file lock, which may wait briefly for another process) and post their outcome on
a :class:`~kvtier.tiers.outbox.Outbox`. :meth:`poll` drains it and applies every index change on the
caller's thread, so the index needs no lock. The caller's thread never takes the ledger's lock.

Index and capacity. ``key -> generation`` in an ``OrderedDict`` kept in LRU
order. Every valid file has the same size (header + ``payload_bytes``), so a block costs
``world_size * (HEADER_LEN + payload_bytes)`` bytes. Space for a write is reserved (evicting
LRU blocks) when it is submitted, so indexed plus in-flight bytes never exceed
``capacity_bytes``; :meth:`DiskTier.write_room` counts only the writes whose space the writes in
flight leave, so a caller that holds writes back (:class:`~kvtier.tiers.stack.WriteBacklog`)
submits the rest as earlier ones complete instead of having them refused (a root smaller than the
writes one prefill step hands it). A key with a read in flight is never evicted. An evicted or deleted key
leaves the index at once, before its files are unlinked on the write pool; a later write of the
same key waits for that unlink (and for a pending :meth:`clear` sweep) first, so an unlink can
never remove a newer file. A write also waits for the unlink of the blocks evicted to make room for
it, so that their bytes are back in the usage ledger (below) before it charges its own.

Sharing a root. ``capacity_bytes`` bounds the block files of the namespace and group on disk,
however many processes write them: they share its usage ledger (:mod:`kvtier.tiers.disk.ledger`,
a small file updated under ``flock``). A write charges its block's bytes there before writing
anything and is refused when that would exceed ``capacity_bytes``; this process then gives way
(evicts its own least recently used block and retries), or, with nothing of its own to evict,
rescans early and waits for that scan, so the namespace keeps turning over
(:mod:`kvtier.tiers.disk.refused`; a write still refused completes ``DROPPED``, counted in
``writes_no_room``). Files
are content addressed and published from a unique temp name without replacing a file
(:mod:`kvtier.tiers.disk.writer`): when another process published the same file first
(``EEXIST``, identical bytes) the charge is given back, so each file is paid for once. Every removal (eviction, delete, clear, quarantine, orphans, ``kvtier purge``) gives back
exactly the files it removed. A file another process deleted is a ``NOT_FOUND`` miss.
:meth:`rescan` merges files written by other processes into the index, forgets indexed blocks
whose files vanished and reconciles the ledger with the files it counted (drift: a writer killed
mid-write, files deleted by hand). Each process also keeps its own index within ``capacity_bytes``
(the reservation above). On a filesystem that cannot lock (:attr:`DiskTier.sharing` is
``PER_PROCESS``, logged) only that per-process bound holds.

Disk full. A write the filesystem refuses for lack of space (``ENOSPC``, ``EDQUOT``, ``EFBIG``)
leaves nothing behind, gives its charge back and completes ``DROPPED`` (``writes_no_space``); the
first one is logged as a warning, later ones in at most one line a minute. Writes succeed again
by themselves once there is space.

Hostile roots. Whoever can write a shared root may plant anything in it. Every path below the
root is reached through the layout's :class:`~kvtier.core.rootfs.RootFS`: no symlink is
followed at any component (directories included), only regular files are opened, never waiting
(``O_NONBLOCK``: a FIFO is refused, not read), and every read is bounded by the format (a record
by its header and ``payload_bytes``, the index snapshot by the capacity, ``config.json`` by
1 MiB). A planted record is a counted miss (``corrupt_quarantined``; the entry itself moved into
quarantine), a planted directory is ignored by the walks; nothing outside the root is read,
written, removed or touched (see docs/security.md).

Order across restarts: the scan orders blocks by file mtime; writes set it, and read hits and
:meth:`touch` refresh it (``futimens`` through the file's descriptor: regular files only, reached
without following a symlink; off the caller's thread).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Container, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from kvtier.core.keys import KEY_BYTES, BlockKey
from kvtier.core.priority import become_background_thread
from kvtier.core.residency import ResidencyLog
from kvtier.tiers.base import IoError, IoKind, IoResult, Medium, Presence, SecondaryTier, TierUsage
from kvtier.tiers.blockfile import HEADER_LEN
from kvtier.tiers.disk import files as disk_io
from kvtier.tiers.disk.index import DiskIndex, DiskTierStats
from kvtier.tiers.disk.jobs import DiskJobs
from kvtier.tiers.disk.layout import Access, DiskLayout, ScanResult
from kvtier.tiers.disk.ledger import Ledger, Sharing
from kvtier.tiers.disk.messages import Msg, WriteJob, distinct_futures
from kvtier.tiers.disk.refused import RefusedWrites
from kvtier.tiers.disk.snapshot import read_snapshot, write_snapshot
from kvtier.tiers.disk.writer import NoSpaceLog
from kvtier.tiers.sealing import PLAIN, Sealer
from kvtier.tiers.outbox import Outbox

logger = logging.getLogger(__name__)
_PRESENT, _ABSENT = Presence.PRESENT, Presence.ABSENT

SNAPSHOT_INTERVAL_S = 120.0
"""At most one index snapshot per interval while running (after a rescan, if the index changed)."""


class DiskTier(SecondaryTier):
    """Blocks stored as files; see the module docstring for threading and sharing, and
    :mod:`kvtier.tiers.disk.layout` for the layout."""

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
        access: Access = Access.OWNER,
        sealer: Sealer = PLAIN,
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

        self._layout = DiskLayout(root_dir, model_name, engine_digest, len(rank_digests), group, access)
        self._world = len(rank_digests)
        self._payload_bytes = payload_bytes
        self._file_bytes = HEADER_LEN + payload_bytes
        self._max_pending_writes = max_pending_writes
        # The caller-thread state (index, capacity, keys in flight): never touched by workers.
        self._state = DiskIndex(
            block_bytes=self._world * self._file_bytes, capacity_bytes=capacity_bytes, remove_files=self._remove_files
        )
        self._index = self._state.index  # the same dict for the tier's life (presence reads it)
        self._done = Outbox()  # the workers' posts
        self._applied: list[IoResult] = []  # results applied by close(), not yet returned by poll()
        self._closed = False

        self._layout.create(namespace_json)
        # Shared by every process writing this namespace and group: the bound on its files on disk.
        self._ledger = Ledger.for_engine(self._layout, self._file_bytes, capacity_bytes)
        self._ledger.attach()
        self._jobs = DiskJobs(self._layout, self._ledger, NoSpaceLog(self._layout.root),
                              tuple(bytes(d) for d in rank_digests), sealer, payload_bytes, self._done)

        self._read_pool = ThreadPoolExecutor(n_read_threads, thread_name_prefix="kvtier-disk-read")
        # Writes and scans are background work (lower priority); reads serve waiting requests.
        self._write_pool = ThreadPoolExecutor(
            n_write_threads, thread_name_prefix="kvtier-disk-write", initializer=become_background_thread
        )
        self._scan_pool = ThreadPoolExecutor(
            1, thread_name_prefix="kvtier-disk-scan", initializer=become_background_thread
        )

        self._snapshot_taken = (0.0, -1)  # (monotonic time, index signature) of the last snapshot
        self._refused = RefusedWrites(self._state, self._resubmit, self.rescan)
        keys = read_snapshot(self._layout, self._file_bytes, max_keys=capacity_bytes // self._state.block_bytes)
        if keys is None:
            self._state.merge_scan(self._jobs.scan_files(None), scan_gen=None)
        else:
            # Serve from the snapshot now; the files written after it, or gone since, are found
            # by a rescan in the background (and any block read is verified anyway).
            self._state.load(keys)
            self._snapshot_taken = (time.monotonic(), self._index_signature())
            self.rescan()

    @property
    def outbox(self) -> Outbox:  # type: ignore[override]
        return self._done

    @property
    def residency(self) -> ResidencyLog:  # type: ignore[override]
        return self._state.residency

    # ------------------------------------------------------------------ paths

    @property
    def namespace_dir(self) -> Path:
        return Path(self._layout.ns_dir)

    def rank_dir(self, rank: int) -> Path:
        return Path(self._layout.rank_dirs[rank])

    @property
    def quarantine_dir(self) -> Path:
        return Path(self._layout.quarantine_dir)

    def block_path(self, key: BlockKey, rank: int) -> Path:
        """Where ``key``'s file of ``rank`` lives."""
        return Path(self._layout.path(key.hex(), rank))

    # ------------------------------------------------------------------ contract

    def contains(self, key: BlockKey) -> bool:
        return key in self._state.index

    def presence(self, key: BlockKey) -> Presence:
        return _PRESENT if key in self._index else _ABSENT

    @property
    def held_keys(self) -> Container[BlockKey]:
        return self._index

    def submit_read(self, job_id: int, key: BlockKey, dests: Sequence[memoryview]) -> None:
        views = self._byte_views(dests, writable=True, what="dests")
        if len(key) != KEY_BYTES:
            raise ValueError(f"key must be {KEY_BYTES} bytes, got {len(key)}")
        if self._closed:
            self._done.put((Msg.IO, IoResult(job_id, IoKind.READ, key, False, error=IoError.IO), None))
            return
        gen = self._state.index.get(key)
        self._state.reading[key] = self._state.reading.get(key, 0) + 1
        if key in self._state.unlinking or self._state.clearing is not None:
            self._state.removed_while_reading.add(key)  # the read may still find doomed files: never adopt them
        self._read_pool.submit(self._read_job, job_id, key, gen, views)

    def submit_write(
        self,
        job_id: int,
        key: BlockKey,
        parent: BlockKey,
        num_tokens: int,
        sources: Sequence[memoryview],
        *,
        tail: bool = False,
    ) -> bool:
        views = self._byte_views(sources, writable=False, what="sources")
        if len(key) != KEY_BYTES or len(parent) != KEY_BYTES:
            raise ValueError(f"key and parent must be {KEY_BYTES} bytes, got {len(key)} and {len(parent)}")
        if not 0 <= num_tokens < 2**32:
            raise ValueError(f"num_tokens must fit in a u32, got {num_tokens}")
        if self._closed:
            return False
        if key in self._state.index:  # dedup: content addressed, the stored bytes are these bytes
            self._state.touch_one(key)
            return self._settle_write(job_id, key)
        if key in self._state.writing:  # the same bytes are on their way
            if self._state.cancelled.get(key) is False:  # cancelled by clear(): cannot be revived
                return self._settle_write(job_id, key, IoError.DROPPED)
            self._state.cancelled.pop(key, None)
            return self._settle_write(job_id, key)
        if len(self._state.writing) >= self._max_pending_writes:
            self._state.counts["writes_dropped"] += 1
            return False
        wait_for = self._state.reserve_write(key)
        if wait_for is None:
            return self._settle_write(job_id, key, IoError.DROPPED)
        if tail:
            self._state.tail_writes.add(key)
        self._write_pool.submit(self._jobs.write, WriteJob(job_id, key, parent, num_tokens, views), wait_for)
        return True

    def write_room(self) -> int | None:
        """At most ``max_pending_writes`` in flight, and only writes whose blocks fit in the
        capacity beside those in flight (a write can evict indexed blocks, not reservations)."""
        if self._closed:
            return None
        room = self._max_pending_writes - len(self._state.writing)
        fit = self._state.writes_that_fit()
        return max(0, room if fit is None else min(room, fit))

    def poll(self) -> list[IoResult]:
        results, self._applied = self._applied, []
        self._apply_finished(results)
        return results

    def _apply_finished(self, results: list[IoResult]) -> None:
        """Apply every finished job to the index and append its result to ``results``."""
        done = self._done
        while True:
            try:
                msg = done.get_nowait()
            except queue.Empty:
                break
            kind = msg[0]
            if kind == Msg.IO:
                result: IoResult = msg[1]
                if result.kind is IoKind.READ:
                    self._state.finish_read(result, msg[2])
                elif msg[2] is not None:  # a write job that ran (not a dedup or refusal decided at submit)
                    self._state.finish_write(result, msg[2])
                results.append(result)
            elif kind == Msg.NO_ROOM:
                self._refused.refused(msg[1], results, closed=self._closed)
            elif kind == Msg.REMOVED:
                self._state.finish_removal(msg[1], msg[2], msg[3])
            elif kind == Msg.SCAN:
                self._merge_scan(msg[1], msg[2], results)
                self._snapshot_if_due()

    def touch(self, keys: Sequence[BlockKey]) -> None:
        touched = [key for key in keys if self._state.touch_one(key)]
        if touched and not self._closed:
            self._write_pool.submit(disk_io.touch_blocks, self._layout, [k.hex() for k in touched])

    def delete(self, keys: Sequence[BlockKey]) -> int:
        removed: list[BlockKey] = []
        for key in keys:
            if key in self._state.writing:
                self._state.cancelled.setdefault(key, True)
                if key in self._state.reading:
                    self._state.removed_while_reading.add(key)
            if self._state.forget(key):
                removed.append(key)
        self._state.schedule_unlink(removed)
        return len(removed)

    def clear(self) -> int:
        """Remove every block file of this namespace and group (all ranks, whoever wrote it).

        The index empties at once; the files are removed by one sweep on the write pool (writes
        submitted afterwards wait for it, so they survive it). Writes in flight are cancelled:
        their files are removed when they complete. Returns the number of indexed blocks.
        """
        count = len(self._state.index)
        for key in list(self._state.index):
            self._state.forget(key)
        self._state.cancelled.update(dict.fromkeys(self._state.writing, False))
        self._state.removed_while_reading.update(self._state.reading)
        self._state.clear_epoch += 1
        # The sweep runs after every unlink queued so far (none can then hit a newer file).
        future = self._remove_files(None, [*self._state.unlinking.values(), self._state.clearing])
        if future is not None:
            self._state.clearing = future
        return count

    def usage(self) -> TierUsage:
        """``used_bytes`` counts indexed blocks plus space reserved by writes in flight."""
        return TierUsage(
            medium=Medium.DISK,
            used_bytes=self._state.used + self._state.reserved,
            capacity_bytes=self._state.capacity,
            num_blocks=len(self._state.index),
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
        self._apply_finished(self._applied)  # returned by the next poll()
        self._refused.drop_parked(self._applied)  # a scan cancelled by the shutdown never posts
        write_snapshot(self._layout, b"".join(self._state.index), self._file_bytes)
        self._layout.fs.close()  # the root's descriptor (opened again if a removal still runs)

    # ------------------------------------------------------------------ index snapshots

    def _index_signature(self) -> tuple[int, int]:
        return self._state.gen, len(self._state.index)

    def _snapshot_if_due(self) -> None:
        """Queue a snapshot of the index on the scan thread if the last one is older than
        :data:`SNAPSHOT_INTERVAL_S` and the index changed since (copying the keys here costs
        about 30 ms per million blocks on the caller's thread)."""
        taken_at, signature = self._snapshot_taken
        now = time.monotonic()
        if self._closed or now - taken_at < SNAPSHOT_INTERVAL_S or signature == self._index_signature():
            return
        self._snapshot_taken = (now, self._index_signature())
        self._scan_pool.submit(write_snapshot, self._layout, b"".join(self._state.index), self._file_bytes)

    # ------------------------------------------------------------------ extras

    @property
    def stats(self) -> DiskTierStats:
        return DiskTierStats(**self._state.counts)

    @property
    def evictions(self) -> int:
        return int(self._state.counts["evictions"])

    @property
    def sharing(self) -> Sharing:
        """Whether ``capacity_bytes`` bounds the namespace across processes (the usage ledger) or,
        on a filesystem that cannot lock, only what this process indexes."""
        return self._ledger.sharing

    @property
    def block_bytes(self) -> int:
        """Bytes one block occupies on disk (all ranks, headers included)."""
        return self._state.block_bytes

    def lru_keys(self) -> list[BlockKey]:
        """Indexed keys, least recently used first (for tests and ``kvtier inspect``)."""
        return list(self._state.index)

    def refresh(self) -> None:
        self.rescan()

    def rescan(self, *, wait: bool = False) -> None:
        """Merge block files written by other processes into the index; forget vanished ones.

        Also quarantines wrong-sized files, removes temp files of dead writers and removes
        blocks missing some rank's file for more than 10 minutes. The directory walk runs on
        the scan thread and its result is merged by a later :meth:`poll` (``wait=True``: now,
        blocking). Only new files are ``stat``-ed. A call while a scan runs does nothing.
        """
        if self._closed or self._state.scan_running or self._state.clearing is not None:
            return
        self._state.scan_running = True
        self._state.scan_forgotten = set()
        self._state.scan_epoch = self._state.clear_epoch
        known = list(self._state.index)  # a snapshot (C speed); the worker converts it to hex
        gen = self._state.gen
        self._refused.scan_started()
        if wait:
            self._merge_scan(self._jobs.scan_files(known), gen, self._applied)
        else:
            self._scan_pool.submit(self._jobs.scan, known, gen)

    # ------------------------------------------------------------------ submission helpers (caller thread)

    def _merge_scan(self, scan: ScanResult, gen: int | None, results: list[IoResult]) -> None:
        """Apply a rescan, then settle the writes that waited for it (:mod:`kvtier.tiers.disk.refused`)."""
        evicted = self._state.merge_scan(scan, scan_gen=gen)
        self._refused.after_scan(scan, evicted, results, closed=self._closed)

    def _resubmit(self, job: WriteJob, wait_for: tuple[Future, ...]) -> None:
        self._write_pool.submit(self._jobs.write, job, wait_for)

    def _byte_views(self, buffers: Sequence[memoryview], *, writable: bool, what: str) -> list[memoryview]:
        return disk_io.byte_views(
            buffers, count=self._world, nbytes=self._payload_bytes, writable=writable, what=what
        )

    def _settle_write(self, job_id: int, key: BlockKey, error: IoError | None = None) -> bool:
        """Complete a write decided at submit, without a job: ok, or ``error`` (counted as dropped)."""
        if error is not None:
            self._state.counts["writes_dropped"] += 1
        self._done.put((Msg.IO, IoResult(job_id, IoKind.WRITE, key, error is None, error=error), None))
        return True

    def _remove_files(self, keys: list[BlockKey] | None, earlier: Iterable[Future | None]) -> Future | None:
        """Queue the removal of ``keys``' files (None: a :meth:`clear` sweep) after ``earlier``.

        Returns the future the job resolves when done; None once closed (removed at once).
        """
        if self._closed:  # synchronous: no pool any more
            self._state.counts["io_errors"] += self._jobs.remove(keys, None, ())
            return None
        future: Future = Future()  # resolved by the job itself, so it can be waited on before it starts
        self._write_pool.submit(self._jobs.remove, keys, future, distinct_futures(earlier))
        return future

    def _read_job(self, job_id: int, key: BlockKey, gen: int | None, dests: list[memoryview]) -> None:
        """The read pool's job (a seam: tests gate it to hold a read in flight)."""
        self._jobs.read(job_id, key, gen, dests)
