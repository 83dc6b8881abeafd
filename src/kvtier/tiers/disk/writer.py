"""Writing one block's files: what a disk tier write job does on the write pool.

:func:`write_block` keeps the usage ledger's invariants (:mod:`kvtier.tiers.disk.ledger`):

1. in one hold of the ledger's lock (:meth:`~kvtier.tiers.disk.ledger.Ledger.charge_creating`),
   charge the block's bytes (refused: :attr:`WriteOutcome.NO_ROOM`, nothing created) and create
   every rank's temp file ``<hash>.bin.<pid>.<random>.tmp`` in its final directory, that directory
   reached from the root without following a symlink (a planted one fails the write: ``ELOOP``)
   and kept open, so every later step acts in that same directory;
2. write each temp file and publish it under its final name without replacing one:
   ``renameat2(RENAME_NOREPLACE)`` (:mod:`kvtier.core.noreplace`), or where the filesystem lacks
   it ``link(temp, final)`` then unlink the temp. ``EEXIST``: another process published that file
   first (content addressed: the same bytes), so its charge is given back and the temp removed.
   Filesystems without either (some FUSE ones: ``link`` fails ``EPERM``, ``ENOTSUP``, ``ENOSYS``)
   get ``rename`` once the final name is found free; a file published between that check and
   the rename is then paid for twice (the ledger counts more than is there until a scan
   reconciles it, never less);
3. on any failure nothing of the block stays: the files it published are unlinked under the
   ledger's lock and its whole remaining charge given back, then the temps are removed.

Outcomes: ``WRITTEN``; ``NO_ROOM`` (the namespace is full across the processes sharing the root);
``NO_SPACE`` (``ENOSPC``, ``EDQUOT``, ``EFBIG``: the filesystem, a quota or a file-size limit;
reported through :class:`NoSpaceLog`, rate-limited); ``FAILED`` (any other error, logged).

Threads: the write pool's workers only (file I/O; may wait for the ledger's lock). Never touches
the tier's index.
"""

from __future__ import annotations

import enum
import errno
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.core.keys import BlockKey
from kvtier.core.noreplace import UNSUPPORTED as NOREPLACE_UNSUPPORTED
from kvtier.core.noreplace import rename_noreplace
from kvtier.core.rootfs import O_BINARY, O_CLOEXEC, O_NOFOLLOW
from kvtier.tiers.base import IoError
from kvtier.tiers.blockfile import HEADER_LEN
from kvtier.tiers.disk.layout import DiskLayout, Removal
from kvtier.tiers.disk.ledger import Ledger
from kvtier.tiers.sealing import PLAIN, Sealer

logger = logging.getLogger(__name__)

_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_BINARY | O_CLOEXEC | O_NOFOLLOW
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
"""Write errors meaning "no space": a full filesystem, an exhausted quota, a file-size limit."""
_NO_LINK_ERRNOS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS})
"""``link`` errors meaning the filesystem has no hard links: publish with ``rename`` instead."""
_LINK_ROOTS: set[str] = set()  # roots found without RENAME_NOREPLACE (checked once per root and process)
_RENAME_ROOTS: set[str] = set()  # roots found without hard links either


class WriteOutcome(enum.Enum):
    """How a block write ended (see the module docstring)."""

    WRITTEN = "written"
    NO_ROOM = "no_room"
    NO_SPACE = "no_space"
    FAILED = "failed"

    @property
    def error(self) -> IoError | None:
        """The error a tier result reports: the refusals are ``DROPPED``, other failures ``IO``."""
        if self is WriteOutcome.WRITTEN:
            return None
        return IoError.IO if self is WriteOutcome.FAILED else IoError.DROPPED


@dataclass(slots=True)
class _Temp:
    """One rank's temp file: its name and its final name in the leaf directory ``dir_fd`` (opened
    by :func:`_create_temp`, closed by :func:`_close`); ``fd``: the temp file while it is written."""

    name: str
    final_name: str
    leaf: str  # the leaf directory's path (for logs and the ledger)
    dir_fd: int = -1
    fd: int = -1

    @property
    def final(self) -> str:
        return f"{self.leaf}/{self.final_name}"


def write_block(
    layout: DiskLayout,
    ledger: Ledger,
    no_space: NoSpaceLog,
    namespaces: Sequence[bytes],
    key: BlockKey,
    parent: BlockKey,
    num_tokens: int,
    sources: Sequence[memoryview],
    sealer: Sealer = PLAIN,
) -> WriteOutcome:
    """Write every rank's file of ``key`` from ``sources``, records sealed by ``sealer`` (see the
    module docstring; an encrypted record's ciphertext is a buffer of this call's)."""
    hex_key = key.hex()
    file_bytes = HEADER_LEN + sources[0].nbytes  # every rank's payload has the same size
    temps: list[_Temp] = []
    published: list[str] = []  # final files this call created
    charged = 0
    try:
        try:
            made = ledger.charge_creating(file_bytes * len(sources),
                                          lambda: _create_temps(layout, hex_key, len(sources)))
            if made is None:
                return WriteOutcome.NO_ROOM
            temps, charged = made, file_bytes * len(sources)
            surplus: list[_Temp] = []  # files another process published first
            for rank, (temp, source) in enumerate(zip(temps, sources)):
                header, payload = sealer.seal(
                    namespace=namespaces[rank], key=key, parent=parent, num_tokens=num_tokens, source=source,
                )
                _fill(temp, header, payload)
                if _publish(layout, temp):
                    published.append(temp.final)
                else:
                    surplus.append(temp)
        except Exception as exc:  # noqa: BLE001 - OSError (ENOSPC, EIO, ...) or a bug: the job must still complete
            _roll_back(layout, ledger, temps, published, charged, file_bytes)
            return _failed(layout, hex_key, exc, no_space)
        if surplus:
            _give_back_surplus(ledger, surplus, file_bytes)
    finally:
        _close_dirs(temps)  # the leaf directories the temps were made in
    no_space.written()
    return WriteOutcome.WRITTEN


def _give_back_surplus(ledger: Ledger, surplus: list[_Temp], file_bytes: int) -> None:
    """Give back the charge of files another process published first, then remove their temps."""
    try:
        ledger.give_back(file_bytes * len(surplus))
    except OSError as exc:  # the ledger keeps counting them until a scan reconciles it (more, never less)
        logger.warning("kvtier disk: usage ledger %s: %s", ledger.path, exc)
    _remove_temps(surplus)


def _failed(layout: DiskLayout, hex_key: str, exc: Exception, no_space: NoSpaceLog) -> WriteOutcome:
    if isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS:
        no_space.dropped(exc)
        return WriteOutcome.NO_SPACE
    if isinstance(exc, OSError):
        logger.warning("kvtier disk: writing block %s under %s failed: %s", hex_key, layout.root, exc)
    else:
        logger.exception("kvtier disk: writing block %s failed", hex_key)
    return WriteOutcome.FAILED


def _create_temps(layout: DiskLayout, hex_key: str, ranks: int) -> list[_Temp]:
    """Every rank's temp file of ``hex_key``; on a failure the ones made are removed first."""
    temps: list[_Temp] = []
    try:
        for rank in range(ranks):
            temps.append(_create_temp(layout, hex_key, rank))
    except BaseException:
        _remove_temps(temps)
        _close_dirs(temps)
        raise
    return temps


def _create_temp(layout: DiskLayout, hex_key: str, rank: int) -> _Temp:
    leaf, _, final_name = layout.path(hex_key, rank).rpartition("/")
    temp = _Temp(f"{final_name}.{os.getpid()}.{secrets.token_hex(4)}.tmp", final_name, leaf)
    for attempt in range(3):  # the leaf directory may be missing, or removed by an unlink job
        try:
            temp.dir_fd = layout.fs.open_dir(leaf)
            temp.fd = os.open(temp.name, _TEMP_FLAGS, layout.access.file_mode, dir_fd=temp.dir_fd)
            break
        except FileNotFoundError:
            _close_dirs([temp])
            if attempt == 2:
                raise
            layout.make_dir(leaf)
        except BaseException:
            _close_dirs([temp])
            raise
    try:
        os.fchmod(temp.fd, layout.access.file_mode)  # the umask must not change it
    except BaseException:
        _remove_temps([temp])
        _close_dirs([temp])
        raise
    return temp


def _fill(temp: _Temp, header: bytes, payload: memoryview) -> None:
    """Write header + payload into the temp file and close it."""
    buffers = [memoryview(header), payload]
    while buffers:
        n = os.writev(temp.fd, buffers)
        if n <= 0:
            raise OSError(errno.EIO, "writev wrote nothing")
        while buffers and n >= buffers[0].nbytes:
            n -= buffers[0].nbytes
            buffers.pop(0)
        if n:
            buffers[0] = buffers[0][n:]
    fd, temp.fd = temp.fd, -1
    os.close(fd)


def _publish(layout: DiskLayout, temp: _Temp) -> bool:
    """Give the temp file its final name; False if another process published that file first
    (the temp is then still there)."""
    dir_fd = temp.dir_fd
    if layout.root not in _LINK_ROOTS:
        done = _publish_by(layout, _LINK_ROOTS, NOREPLACE_UNSUPPORTED, logging.INFO, (
            "kvtier disk: %s: no renameat2(RENAME_NOREPLACE) (%s); publishing block files by link"),
            lambda: rename_noreplace(temp.name, temp.final_name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd))
        if done is not None:
            return done
    if layout.root not in _RENAME_ROOTS:
        done = _publish_by(layout, _RENAME_ROOTS, _NO_LINK_ERRNOS, logging.WARNING, (
            "kvtier disk: %s has no hard links (%s); publishing block files by rename, so a block two "
            "engines write at the same moment may be charged twice to the usage ledger until a rescan"),
            lambda: _link(temp))
        if done is not None:
            return done
    try:
        os.stat(temp.final_name, dir_fd=dir_fd, follow_symlinks=False)
        return False
    except FileNotFoundError:
        pass
    os.rename(temp.name, temp.final_name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    return True


def _publish_by(layout: DiskLayout, unable: set[str], unsupported: frozenset[int], level: int, note: str,
                publish: Callable[[], None]) -> bool | None:
    """One way of publishing: True done, False the name was taken (``EEXIST``), None this root
    cannot publish that way (an error in ``unsupported``: the root joins ``unable``, ``note``
    logged once)."""
    try:
        publish()
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in unsupported:
            raise
        unable.add(layout.root)
        logger.log(level, note, layout.root, exc.strerror or exc)
        return None
    return True


def _link(temp: _Temp) -> None:
    os.link(temp.name, temp.final_name, src_dir_fd=temp.dir_fd, dst_dir_fd=temp.dir_fd, follow_symlinks=False)
    _unlink_temp(temp)


def _roll_back(
    layout: DiskLayout, ledger: Ledger, temps: list[_Temp], published: list[str], charged: int, file_bytes: int
) -> None:
    """Undo a failed write: unlink the files it published and give back its charge (under the
    ledger's lock), then remove its temps (after: a charged temp never disappears first)."""
    for temp in temps:
        if temp.fd >= 0:
            os.close(temp.fd)
            temp.fd = -1
    if charged:
        try:
            with ledger.locked() as usage:
                kept = sum(layout.remove(path) is Removal.FAILED for path in published)
                published = []
                usage.give_back(charged - kept * file_bytes)
        except OSError as exc:  # the ledger is unusable: its charge stays (more than is there)
            logger.warning("kvtier disk: usage ledger %s: %s", ledger.path, exc)
    for path in published:
        layout.remove(path)
    _remove_temps(temps)


def _remove_temps(temps: list[_Temp]) -> None:
    for temp in temps:
        if temp.fd >= 0:
            os.close(temp.fd)
            temp.fd = -1
        _unlink_temp(temp)


def _unlink_temp(temp: _Temp) -> None:
    if temp.dir_fd < 0:
        return
    try:
        os.unlink(temp.name, dir_fd=temp.dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("kvtier disk: cannot remove %s/%s: %s", temp.leaf, temp.name, exc)


def _close_dirs(temps: list[_Temp]) -> None:
    for temp in temps:
        if temp.dir_fd >= 0:
            os.close(temp.dir_fd)
            temp.dir_fd = -1


class NoSpaceLog:
    """Reports writes dropped for lack of space without a line per block (thread-safe).

    The first drop logs a warning naming the root, the error and that stores are being dropped;
    later drops at most one summary line per ``interval`` seconds with their count. The first
    write that succeeds afterwards says so, and the next drop warns again.
    """

    def __init__(self, root: str, interval: float = 60.0) -> None:
        self.root = root
        self.interval = interval
        self._lock = threading.Lock()
        self._active = False
        self._last_line = 0.0
        self._since_line = 0  # drops not yet reported
        self._episode = 0  # drops since the first warning

    def dropped(self, exc: OSError) -> None:
        with self._lock:
            now = time.monotonic()
            self._episode += 1
            if not self._active:
                self._active, self._last_line, self._since_line = True, now, 0
                logger.warning(
                    "kvtier disk: no space to write under %s (%s): dropping stores to the disk tier until "
                    "space returns (counted in writes_dropped; summarized at most every %.0f s)",
                    self.root, exc.strerror or exc, self.interval,
                )
                return
            self._since_line += 1
            if now - self._last_line >= self.interval:
                logger.warning(
                    "kvtier disk: still no space under %s (%s): %d more stores dropped in the last %.0f s",
                    self.root, exc.strerror or exc, self._since_line, now - self._last_line,
                )
                self._last_line, self._since_line = now, 0

    def written(self) -> None:
        if not self._active:  # the common case: no lock
            return
        with self._lock:
            if self._active:
                logger.warning("kvtier disk: writes under %s succeed again (%d stores were dropped for lack "
                               "of space)", self.root, self._episode)
                self._active, self._episode, self._since_line = False, 0, 0
