"""Block file I/O of the disk tier: what its worker threads do with the files (writes:
:mod:`kvtier.tiers.disk.writer`).

Pure functions on paths (a :class:`~kvtier.tiers.disk.layout.DiskLayout`, whose
:class:`~kvtier.core.rootfs.RootFS` reaches every path without following a symlink and opens
only regular files, never waiting on a FIFO), buffers and the namespace's usage ledger
(:mod:`kvtier.tiers.disk.ledger`: every file they remove from its place is removed under its
lock, which gives its bytes back). They never touch the tier's in-memory
index or completion queue and never raise for an I/O failure: they return what happened (an
:class:`~kvtier.tiers.base.IoError`, or a count of failed removals) and the tier posts it for
:meth:`~kvtier.tiers.disk.DiskTier.poll` to apply.
:func:`byte_views` is the exception: the tier calls it on the caller's thread when a job is
submitted. :func:`check_header` and :func:`verify_file` (shared with ``kvtier verify``) raise
:class:`~kvtier.tiers.blockfile.CorruptBlockError` for their callers to handle.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from functools import partial

from kvtier.core.keys import BlockKey
from kvtier.core.rootfs import READ, NotRegularFile, RootFS
from kvtier.tiers.base import IoError
from kvtier.tiers.blockfile import (
    HEADER_LEN,
    BlockHeader,
    CorruptBlockError,
    decode_header,
)
from kvtier.tiers.disk.layout import DiskLayout, Removal, ScanResult, is_unit
from kvtier.tiers.disk.ledger import Ledger, Reconciled
from kvtier.tiers.sealing import PLAIN, Sealer, UnauthenticatedRecord

logger = logging.getLogger(__name__)


def byte_views(
    buffers: Sequence[memoryview], *, count: int, nbytes: int, writable: bool, what: str
) -> list[memoryview]:
    """Byte views of the caller's buffers; a wrong count or size is a caller bug (ValueError)."""
    if len(buffers) != count:
        raise ValueError(f"{what}: expected {count} buffers (one per rank), got {len(buffers)}")
    views = [_as_byte_view(b, writable=writable, what=what) for b in buffers]
    for rank, view in enumerate(views):
        if view.nbytes != nbytes:
            raise ValueError(f"{what}[{rank}] is {view.nbytes} bytes; this tier's payload_bytes is {nbytes}")
    return views


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


# ---------------------------------------------------------------------- reads

NOT_A_BLOCK_FILE = frozenset({errno.ELOOP, errno.EISDIR, errno.ENOTDIR, errno.ENXIO, errno.ENODEV})
"""Errors that say a record's path holds something no writer of kvtier puts there (a symlink, at the
record or at a directory on the way, which is never followed; a directory; a device or socket):
treated as a corrupt record, like a :class:`~kvtier.core.rootfs.NotRegularFile` (a FIFO)."""


def not_a_block_file(exc: OSError) -> bool:
    """Whether ``exc`` says a record's path holds something that is not a block file (see above)."""
    return isinstance(exc, NotRegularFile) or exc.errno in NOT_A_BLOCK_FILE


def read_block(
    layout: DiskLayout, ledger: Ledger, namespaces: Sequence[bytes], key: BlockKey, dests: Sequence[memoryview],
    sealer: Sealer = PLAIN,
) -> IoError | None:
    """Read and verify every rank's file of ``key`` into ``dests``; None when all are valid.

    A corrupt file (bad header, wrong size, checksum mismatch) is moved into quarantine, and so is
    one that ``sealer`` does not accept (``UNAUTHENTICATED``: no valid MAC under the tier's keys,
    or sealed where it has none), and anything planted where a record should be (a symlink, at the
    record or on the way to it, a FIFO, a directory: never followed or read). After a successful
    read of a file its mtime is refreshed through its descriptor (mtimes order blocks after a
    restart). Reads never wait on anything but the file's bytes: the open does not block and at
    most the header and ``dests``' bytes are read.
    """
    hex_key = key.hex()
    paths = layout.paths(hex_key)
    rank = 0
    try:
        for rank, (path, dest) in enumerate(zip(paths, dests)):
            _read_file(layout.fs, path, namespaces[rank], rank, key, dest, sealer)
    except CorruptBlockError as exc:
        unauthenticated = isinstance(exc, UnauthenticatedRecord)
        logger.warning("kvtier disk: %s block file %s (%s); quarantined",
                       "unauthenticated" if unauthenticated else "corrupt", paths[rank], exc)
        ledger.remove([paths[rank]], lambda _: layout.quarantine(hex_key, rank))
        return IoError.UNAUTHENTICATED if unauthenticated else IoError.CORRUPT
    except FileNotFoundError:
        return IoError.NOT_FOUND
    except OSError as exc:
        if not_a_block_file(exc):  # a symlink (never followed), a FIFO, a directory, ...
            logger.warning("kvtier disk: %s is not a block file (%s); quarantined", paths[rank], exc.strerror)
            ledger.remove([paths[rank]], lambda _: layout.quarantine(hex_key, rank))
            return IoError.CORRUPT
        logger.warning("kvtier disk: reading %s failed: %s", paths[rank], exc)
        return IoError.IO
    except Exception:  # a bug, but the job must still complete
        logger.exception("kvtier disk: reading %s failed", paths[rank])
        return IoError.IO
    return None


def _read_file(
    fs: RootFS, path: str, namespace: bytes, rank: int, key: BlockKey, dest: memoryview, sealer: Sealer
) -> None:
    """Read and check one record into ``dest``, then refresh its mtime through its descriptor."""
    fd, st = fs.open_regular(path, READ)
    try:
        size = st.st_size
        raw = os.pread(fd, HEADER_LEN, 0)
        header = decode_header(raw)
        check_header(header, size, namespace=namespace, key=key, rank=rank, payload_len=dest.nbytes)
        opener = sealer.opener(header, raw)
        view, offset = dest, HEADER_LEN
        while view.nbytes:
            n = os.preadv(fd, [view], offset)
            if n <= 0:
                raise CorruptBlockError(f"short read at offset {offset}")
            view, offset = view[n:], offset + n
        opener.land_in_place(dest)  # checksum or MAC (AES-GCM: decrypted in place)
        opener.finish()
        try:
            os.utime(fd)  # futimens: the file read, wherever its name is by now
        except OSError:
            pass
    finally:
        os.close(fd)


def check_header(
    header: BlockHeader,
    file_size: int,
    *,
    namespace: bytes | None,
    key: bytes | None,
    rank: int,
    payload_len: int | None = None,
) -> None:
    """Raise :class:`CorruptBlockError` unless the decoded ``header`` belongs to ``rank``'s file of
    ``key`` in ``namespace``, announces ``payload_len`` bytes and the file is ``file_size`` =
    header + payload long. A check whose expected value is None is skipped."""
    if namespace is not None and header.namespace != namespace:
        raise CorruptBlockError(f"namespace {header.namespace.hex()[:16]}.. is not rank {rank}'s")
    if key is not None and header.key != key:
        raise CorruptBlockError(f"header key {header.key.hex()[:16]}.. does not match the file name")
    if payload_len is not None and header.payload_len != payload_len:
        raise CorruptBlockError(f"payload length {header.payload_len}, expected {payload_len}")
    if file_size != HEADER_LEN + header.payload_len:
        raise CorruptBlockError(f"file is {file_size} bytes, expected {HEADER_LEN + header.payload_len}")


def verify_file(
    fs: RootFS, path: str, *, namespace: bytes | None, key: bytes | None, rank: int, chunk_bytes: int = 1 << 20,
    sealer: Sealer = PLAIN,
) -> BlockHeader:
    """Check one block file as :func:`read_block` does (accepting what ``sealer`` accepts), reading
    the payload in ``chunk_bytes`` chunks (bounded memory) and copying it nowhere; returns its header.

    Raises :class:`CorruptBlockError` (the reason) or ``OSError`` (``FileNotFoundError`` if the
    file vanished; :class:`~kvtier.core.rootfs.NotRegularFile`, ``ELOOP``: not a block file).
    Does not refresh the mtime: verifying is not a use.
    """
    fd, st = fs.open_regular(path, READ)
    try:
        size = st.st_size
        raw = os.pread(fd, HEADER_LEN, 0)
        header = decode_header(raw)
        check_header(header, size, namespace=namespace, key=key, rank=rank)
        opener = sealer.opener(header, raw)
        buf = memoryview(bytearray(min(chunk_bytes, header.payload_len) or 1))
        offset, remaining = HEADER_LEN, header.payload_len
        while remaining:
            n = os.preadv(fd, [buf[: min(remaining, buf.nbytes)]], offset)
            if n <= 0:
                raise CorruptBlockError(f"short read at offset {offset}")
            opener.land_in_place(buf[:n])
            offset, remaining = offset + n, remaining - n
        opener.finish()
        return header
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- removal and mtimes


def unlink_blocks(layout: DiskLayout, ledger: Ledger, keys: Sequence[BlockKey]) -> int:
    """Unlink every rank's file of ``keys`` under the ledger's lock; returns how many unlinks failed."""
    paths = [path for key in keys for path in layout.paths(key.hex())]
    errors = sum(outcome is Removal.FAILED for outcome in ledger.remove(paths))
    for leaf in dict.fromkeys(os.path.dirname(path) for path in paths):
        # Drop the leaf directory if that emptied it, so that churn does not leave up
        # to 4096*256 empty directories per rank for the start-up scan to walk.
        layout.fs.rmdir_quiet(leaf)
    return errors


SWEEP_BATCH = 64
"""Leaf directories whose block files one hold of the ledger's lock removes during a sweep."""


def sweep_blocks(layout: DiskLayout, ledger: Ledger) -> int:
    """Unlink every ``.bin`` entry of the layout's namespace and group (those in their place under
    the ledger's lock, a batch of directories at a time), dropping emptied leaf directories. Only
    entries of leaf directories reached without following a symlink are removed (a planted
    ``.bin`` symlink: the link itself). Returns how many unlinks failed."""
    errors = 0
    for rank_dir in layout.rank_dirs:
        batch: list[str] = []
        charged: list[str] = []
        for leaf, prefix, leaf_fd in layout.walk_leaves(rank_dir):
            for name in os.listdir(leaf_fd):
                if not name.endswith(".bin"):
                    continue
                if is_unit(name, prefix):
                    charged.append(f"{leaf}/{name}")
                else:  # not in its place: never charged
                    errors += _unlink_at(leaf_fd, name, leaf)
            batch.append(leaf)
            if len(batch) >= SWEEP_BATCH:
                errors += _settle_sweep(layout, ledger, batch, charged)
                batch, charged = [], []
        errors += _settle_sweep(layout, ledger, batch, charged)
    return errors


def _settle_sweep(layout: DiskLayout, ledger: Ledger, leaves: list[str], charged: list[str]) -> int:
    errors = sum(outcome is Removal.FAILED for outcome in ledger.remove(charged))
    for leaf in leaves:
        layout.fs.rmdir_quiet(leaf)
    return errors


def _unlink_at(dir_fd: int, name: str, where: str) -> int:
    """Unlink ``name`` in the directory ``dir_fd``: 0, or 1 if it failed (logged)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return 0
    except OSError as exc:  # name comes from a listing: %r, so a planted name forges no log line
        logger.warning("kvtier disk: cannot remove %s/%r: %s", where, name, exc)
        return 1
    return 0


def settle_scan(layout: DiskLayout, ledger: Ledger, result: ScanResult, since: int | None) -> None:
    """Finish a scan that began at ledger version ``since``: quarantine the wrong-sized files and
    remove the orphans it listed, and reconcile the ledger with the files it counted (all under
    the ledger's lock; see :meth:`Ledger.reconcile`). Fills in ``result.quarantined`` and
    ``io_errors``. Worker threads (the scan thread; the constructor at start-up)."""
    removals = [partial(layout.quarantine, hex_key, rank) for hex_key, rank in result.to_quarantine]
    removals += [partial(layout.remove, path) for path in result.orphans]
    try:
        done = ledger.reconcile(since, result.units, removals)
    except OSError as exc:  # the ledger is unusable: remove anyway (it then counts more than is there)
        logger.warning("kvtier disk: usage ledger %s: %s", ledger.path, exc)
        done = Reconciled([remove() for remove in removals])
    quarantines = done.removals[: len(result.to_quarantine)]
    result.quarantined += sum(outcome is Removal.MOVED for outcome in quarantines)
    result.io_errors += sum(outcome is Removal.FAILED for outcome in done.removals[len(quarantines) :])
    if done.before is not None and done.before != done.after:
        logger.info("kvtier disk: usage ledger %s corrected from %d to the %d bytes of files on disk",
                    ledger.path, done.before, done.after)


def touch_blocks(layout: DiskLayout, hex_keys: Sequence[str]) -> None:
    """Refresh the mtime of every rank's file of ``hex_keys`` (the order after a restart), each
    through its descriptor: only regular files reached without following a symlink; those that are
    gone, refuse or are something else are skipped."""
    touch = layout.fs.touch_quiet
    for hex_key in hex_keys:
        for path in layout.paths(hex_key):
            touch(path)
