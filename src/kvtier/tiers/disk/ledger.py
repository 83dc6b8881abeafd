"""The usage ledger: how many bytes of one namespace and group's block files are on disk, shared
by every process that writes them, so that ``capacity_bytes`` bounds the namespace on disk however
many engines share the root.

File ``<root>/<model>_<digest16>/usage_g<group>``, 40 bytes, little-endian, owner-only like the
blocks (group-writable with ``Access.GROUP``)::

    offset  size  field
         0     8  magic       b"KVTUSAG1"
         8     8  unit_bytes  u64, bytes of one block file (header + payload), fixed per namespace
        16     8  bytes       u64, bytes charged
        24     8  version     u64, changes with every update (a fresh random value after a rebuild)
        32     8  checksum    u64, xxh3_64 of bytes [0, 32)

It is read and rewritten in place only while holding an exclusive ``flock`` on it; every update
opens it anew (and opens it again if the path was removed or replaced while it waited for the lock),
so a ledger deleted by hand is recreated, never split between two inodes. It is reached through the
layout's :class:`~kvtier.core.rootfs.RootFS` (no symlink followed, on the way or at the file)
and used only if it is a regular file: anything else planted there makes the ledger unusable (as
on a filesystem that cannot lock), never something written or locked elsewhere.

What is charged: every ``<hash>.bin`` in its place under the group's leaf directories of the
namespace's ranks, and every block writer's temp file there
(:meth:`~kvtier.tiers.disk.layout.DiskLayout.count_units` counts them), ``unit_bytes`` each.
Invariants, kept by every writer and remover of those files:

- A writer charges the whole block and creates its temp files in one hold of the lock
  (:meth:`Ledger.charge_creating`), refusing ("no room", nothing created) when the ledger would
  exceed ``capacity_bytes``: so no temp file exists uncharged for a scan to count. It publishes
  each file under its final name without replacing one (``EEXIST``: another process published it
  first, and that file's charge is given back), by ``renameat2(RENAME_NOREPLACE)`` where the
  filesystem has it, so a file never has two names that a scan could count twice, else by
  ``link`` then ``unlink`` of the temp. A failed write gives back what it charged. So exactly one
  process pays for each file on disk.
- A charge is given back only under the lock, and before the file it paid for disappears: temp
  files are removed after their charge is given back; block files are removed (unlinked, renamed
  into quarantine) while holding the lock, together with giving back exactly the files removed.
- Hence the ledger never counts less than the charged files present (absent tampering, such as
  block files copied in by hand), so the block files of the namespace never exceed
  ``capacity_bytes`` on disk. It may count more (drift: a writer killed between its charge and its
  clean-up, a file deleted by hand, a write whose temp files could not all be created, or, where
  files are published by ``link`` + ``unlink``, a file a scan saw under both names): a scan of the
  files sets it to what it counted when no update happened during its walk
  (:meth:`Ledger.reconcile`), which needs a moment when no engine charges or gives back; until
  then the namespace holds that much less. (That walk relies on listing a leaf directory being
  atomic with respect to a rename or ``link`` in it, as on local filesystems for directories this
  small; a network filesystem may rarely let a walk miss a file being published, and the ledger
  then counts that file less until the next reconcile.)
- A missing or unreadable ledger is rebuilt by the next engine update, from the files, under the
  lock (temp files included, so charges of writes in flight are kept).

Threads: engines update it from the disk tier's worker threads only (writes and removals on the
write pool, quarantines on the read pool, scans on the scan thread; the constructor attaches it);
each update may wait for the lock (microseconds; a write's charge also creates its temp files, a
rebuild walks the namespace's names), and at most :data:`LOCK_WAIT_S`: a lock held longer by
another process (hung, or a writer of the root holding it on purpose) makes this process give the
ledger up (:attr:`Sharing.PER_PROCESS`, logged), never wait on it forever. The operator
tools (``kvtier purge``, ``kvtier verify``) give back what they remove through the same lock, and
leave a missing or unreadable ledger to the engines.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import logging
import os
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import xxhash

from kvtier.core.rootfs import RootFS
from kvtier.tiers.disk.layout import DiskLayout, Removal, per_group_files

logger = logging.getLogger(__name__)

MAGIC = b"KVTUSAG1"
_RECORD = struct.Struct("<8sQQQ")
_SUM = struct.Struct("<Q")
RECORD_BYTES = _RECORD.size + _SUM.size  # 40
_NAME_PREFIX = "usage_g"  # usage_g<group>
_NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL})
"""``flock`` errors meaning this filesystem cannot lock (some NFS setups and FUSE filesystems)."""
_Made = TypeVar("_Made")
REMOVE_BATCH = 256
"""Most files removed under one hold of the lock (a sweep of millions releases it in between)."""
LOCK_WAIT_S = 10.0
"""Longest wait for the ledger's lock. kvtier's processes hold it for microseconds (a rebuild walks
the namespace's names: longer, once); a process that holds it longer (hung, or a writer of the root
holding a lock on the file on purpose) makes this one give the ledger up, as on a filesystem that
cannot lock (:attr:`Sharing.PER_PROCESS`, logged), rather than wait on it forever."""
_LOCK_PAUSE_S = (0.0005, 0.02)
"""The first and the longest pause between tries of the lock while it is held."""


class Sharing(enum.Enum):
    """How ``capacity_bytes`` is enforced on this root."""

    LEDGER = "ledger"  # across every process writing the namespace, through the ledger
    PER_PROCESS = "per_process"  # the root cannot be locked: each process bounds what it indexes


class Role(enum.Enum):
    """Who holds the ledger: an engine creates and rebuilds it; a tool only gives bytes back."""

    ENGINE = "engine"
    TOOL = "tool"


def ledger_path(layout: DiskLayout) -> str:
    return os.path.join(layout.ns_dir, f"usage{layout.group_suffix}")


def ledger_files(fs: RootFS, ns_dir: str) -> list[str]:
    """The ledger files of a namespace directory (one per group), sorted."""
    return per_group_files(fs, ns_dir, _NAME_PREFIX)


def encode(unit_bytes: int, nbytes: int, version: int) -> bytes:
    record = _RECORD.pack(MAGIC, unit_bytes, nbytes, version)
    return record + _SUM.pack(xxhash.xxh3_64_intdigest(record))


def decode(data: bytes) -> tuple[int, int, int]:
    """``(unit_bytes, bytes, version)`` of a ledger's bytes; ValueError naming what is wrong."""
    if len(data) != RECORD_BYTES:
        raise ValueError(f"{len(data)} bytes, expected {RECORD_BYTES}")
    magic, unit_bytes, nbytes, version = _RECORD.unpack_from(data)
    if magic != MAGIC:
        raise ValueError("not a kvtier usage ledger (bad magic)")
    if _SUM.unpack_from(data, _RECORD.size)[0] != xxhash.xxh3_64_intdigest(data[: _RECORD.size]):
        raise ValueError("checksum mismatch")
    return unit_bytes, nbytes, version


def peek_bytes(fs: RootFS, path: str) -> int | None:
    """The bytes a ledger file charges, read without its lock (for ``kvtier inspect``; a record
    caught mid-update fails its checksum); None if it is missing, unreadable or not a ledger."""
    try:
        return decode(fs.read_bytes(path, RECORD_BYTES))[1]
    except (OSError, ValueError):
        return None


@dataclass(slots=True)
class Usage:
    """The ledger's content while its lock is held (``tracked`` False: no usable ledger, changes
    are dropped). Changing it marks it for writing back when the lock is released."""

    unit_bytes: int
    bytes: int
    version: int
    tracked: bool = True
    changed: bool = False

    def charge(self, nbytes: int) -> None:
        self._change(self.bytes + nbytes)

    def give_back(self, nbytes: int) -> None:
        self._change(max(0, self.bytes - nbytes))

    def set(self, nbytes: int) -> None:
        self._change(nbytes)

    def _change(self, nbytes: int) -> None:
        if nbytes == self.bytes:
            return
        self.bytes = nbytes
        if not self.changed:  # one new version per hold of the lock: the one written back
            self.version = (self.version + 1) % 2**64
            self.changed = True


@dataclass(frozen=True, slots=True)
class Reconciled:
    """What :meth:`Ledger.reconcile` did: each removal's outcome, and the bytes the ledger held
    before and after it was set to the files counted (None: not set, files were charged or given
    back during the walk)."""

    removals: list[Removal]
    before: int | None = None
    after: int | None = None


class Ledger:
    """One namespace and group's usage ledger (see the module docstring).

    Thread-safe: every operation takes the file lock, which also excludes this process's other
    threads (each operation opens its own file description).
    """

    def __init__(self, layout: DiskLayout, role: Role, unit_bytes: int = 0, capacity_bytes: int = 0) -> None:
        self.path = ledger_path(layout)
        self.role = role
        self.sharing = Sharing.LEDGER
        self._layout = layout
        self._unit_bytes = unit_bytes
        self._capacity = capacity_bytes

    @classmethod
    def for_engine(cls, layout: DiskLayout, unit_bytes: int, capacity_bytes: int) -> Ledger:
        return cls(layout, Role.ENGINE, unit_bytes, capacity_bytes)

    @classmethod
    def for_tool(cls, layout: DiskLayout) -> Ledger:
        return cls(layout, Role.TOOL)

    # ------------------------------------------------------------------ operations

    def attach(self) -> Sharing:
        """Engine start-up: create or rebuild the ledger. When it cannot be locked (a filesystem
        without locks) or opened, :attr:`sharing` becomes ``PER_PROCESS`` (logged): never a
        start-up failure."""
        try:
            with self.locked():
                pass
        except OSError as exc:
            self.sharing = Sharing.PER_PROCESS
            why = "this filesystem cannot lock files" if exc.errno in _NO_LOCKS else "the ledger is unusable"
            logger.warning(
                "kvtier disk: %s: %s (%s): capacity_bytes bounds only what this process indexes; engines "
                "sharing this root may together exceed it", self.path, why, exc.strerror or exc,
            )
        return self.sharing

    def charge(self, nbytes: int) -> bool:
        """Charge ``nbytes`` unless that would exceed the capacity (False: no room)."""
        return self.charge_creating(nbytes, lambda: True) is not None

    def charge_creating(self, nbytes: int, create: Callable[[], _Made]) -> _Made | None:
        """Charge ``nbytes`` and run ``create`` (a writer makes the files it charges for) in one
        hold of the lock; None, ``create`` not run, when that would exceed the capacity. If
        ``create`` raises, nothing is charged (it must remove what it made before raising)."""
        with self.locked() as usage:
            if usage.bytes + nbytes > self._capacity:
                return None
            made = create()
            usage.charge(nbytes)
            return made

    def give_back(self, nbytes: int) -> None:
        with self.locked() as usage:
            usage.give_back(nbytes)

    def version(self) -> int | None:
        """The current version (None: no usable ledger); a scan reads it before its walk."""
        with self.locked() as usage:
            return usage.version if usage.tracked else None

    def reconcile(
        self, since: int | None, units: int, removals: Sequence[Callable[[], Removal]] = ()
    ) -> Reconciled:
        """After a walk that began at version ``since`` and counted ``units`` charged files: run the
        walk's ``removals`` (files it found bad, among those counted) under the lock, then set the
        ledger to the files left if nothing was charged or given back since the walk began, else
        give back the removed files only."""
        with self.locked() as usage:
            outcomes = [remove() for remove in removals]
            removed = sum(o.removed for o in outcomes)
            if since is None or not usage.tracked or usage.version != since:
                usage.give_back(removed * usage.unit_bytes)
                return Reconciled(outcomes)
            before = usage.bytes
            usage.set(max(0, units - removed) * usage.unit_bytes)
            return Reconciled(outcomes, before, usage.bytes)

    def remove(self, paths: Sequence[str], how: Callable[[str], Removal] | None = None) -> list[Removal]:
        """Remove charged files (``how``: unlink, the default, or move into quarantine) while holding the lock, and
        give back the bytes of those actually removed; the outcome of each, in order.

        When the ledger cannot be locked (logged), the files are removed anyway and their bytes stay
        charged until a scan reconciles the ledger (it then counts more than is there, never less).
        """
        how = self._layout.remove if how is None else how
        outcomes: list[Removal] = []
        for start in range(0, len(paths), REMOVE_BATCH):
            batch = paths[start : start + REMOVE_BATCH]
            done: list[Removal] = []
            try:
                with self.locked() as usage:
                    done.extend(how(path) for path in batch)
                    usage.give_back(sum(o.removed for o in done) * usage.unit_bytes)
            except OSError as exc:
                logger.warning("kvtier disk: usage ledger %s: %s; removing files without it", self.path, exc)
                done.extend(how(path) for path in batch[len(done) :])
            outcomes.extend(done)
        return outcomes

    # ------------------------------------------------------------------ the locked record

    @contextlib.contextmanager
    def locked(self) -> Iterator[Usage]:
        """Hold the ledger's lock; yields its content, written back on exit if changed (only when
        the body did not raise). Raises ``OSError`` when the ledger cannot be opened or locked."""
        if self.sharing is Sharing.PER_PROCESS:
            yield self._untracked()
            return
        try:
            fd = self._open_locked()
        except LockTimeout as exc:
            self.sharing = Sharing.PER_PROCESS
            logger.warning("kvtier disk: %s: %s; capacity_bytes now bounds only what this process indexes "
                           "(processes sharing this root may together exceed it)", self.path, exc)
            fd = None
        if fd is None:  # a tool and no ledger (the engines build it from the files), or given up
            yield self._untracked()
            return
        try:
            usage = self._read(fd)
            yield usage
            if usage.changed and usage.tracked:
                data = encode(usage.unit_bytes, usage.bytes, usage.version)
                if os.pwrite(fd, data, 0) != len(data):
                    raise OSError(errno.EIO, f"short write to {self.path}")
                if os.fstat(fd).st_size != len(data):  # a rebuilt file that was longer
                    os.ftruncate(fd, len(data))
        finally:
            os.close(fd)  # releases the lock

    def _untracked(self) -> Usage:
        return Usage(self._unit_bytes, 0, 0, tracked=False)

    def _read(self, fd: int) -> Usage:
        """The record under the lock; an engine rebuilds a missing or unreadable one from the files."""
        try:
            unit_bytes, nbytes, version = decode(os.pread(fd, RECORD_BYTES + 1, 0))
            if self.role is Role.ENGINE and unit_bytes != self._unit_bytes:
                raise ValueError(f"written for {unit_bytes}-byte files, this engine writes {self._unit_bytes}")
            return Usage(unit_bytes, nbytes, version)
        except ValueError as exc:
            if self.role is Role.TOOL:
                return self._untracked()
            if os.fstat(fd).st_size:
                logger.warning("kvtier disk: usage ledger %s unreadable (%s); rebuilding it from the files",
                               self.path, exc)
        units = self._layout.count_units()
        fresh = int.from_bytes(os.urandom(6), "little")  # no scan's "since" can match it by chance
        return Usage(self._unit_bytes, units * self._unit_bytes, fresh, changed=True)

    def _open_locked(self) -> int | None:
        """An fd of the ledger holding its exclusive lock, re-opened if the path was replaced or
        removed while waiting. None: a tool and no ledger file."""
        for _ in range(100):
            fd = self._open()
            if fd is None:
                return None
            try:
                _lock(fd, self.path)
                mine = os.fstat(fd)
                current = self._layout.fs.lstat(self.path)
                if (mine.st_dev, mine.st_ino) == (current.st_dev, current.st_ino):
                    return fd
            except FileNotFoundError:
                pass  # removed while we waited: open the new one
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        raise OSError(errno.EAGAIN, f"{self.path} keeps being replaced")

    def _open(self) -> int | None:
        """The ledger file, opened read-write (created by an engine when missing); raises
        ``OSError`` if it is not a regular file (``NotRegularFile``) or reached through a symlink."""
        flags = os.O_RDWR | os.O_NONBLOCK
        mode = self._layout.access.file_mode
        fs = self._layout.fs
        if self.role is Role.TOOL:
            try:
                return fs.open(self.path, flags)
            except FileNotFoundError:
                return None
        for attempt in range(3):
            try:
                fd = fs.open(self.path, flags | os.O_CREAT | os.O_EXCL, mode)
            except FileExistsError:
                try:
                    return fs.open(self.path, flags)
                except FileNotFoundError:
                    continue  # removed in between: create it
            except FileNotFoundError:
                if attempt == 2:
                    raise
                self._layout.make_dir(self._layout.ns_dir)  # removed by hand or by kvtier purge
                continue
            try:
                os.fchmod(fd, mode)  # the umask must not change it
            except BaseException:
                os.close(fd)
                raise
            return fd
        raise OSError(errno.EAGAIN, f"cannot create {self.path}")


class LockTimeout(OSError):
    """The ledger's lock stayed held for :data:`LOCK_WAIT_S`."""


def _lock(fd: int, path: str) -> None:
    """Take the exclusive ``flock`` of ``fd``, waiting at most :data:`LOCK_WAIT_S` (tries a
    moment apart: ``flock`` itself cannot time out); raises :class:`LockTimeout`."""
    deadline = time.monotonic() + LOCK_WAIT_S
    pause, longest = _LOCK_PAUSE_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise LockTimeout(errno.ETIMEDOUT, f"its lock was held by another process for over {LOCK_WAIT_S:g} s",
                                  path) from None
            time.sleep(pause)
            pause = min(2 * pause, longest)
