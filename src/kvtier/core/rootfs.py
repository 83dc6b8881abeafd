"""Files under a disk tier root, reached without following a symlink and opened only when regular.

Whoever can write a shared root (a member of a ``group_access`` root's group) can put anything
anywhere under it: a symlink where a directory or a record should be, a FIFO, a socket, a sparse
file of any size. So every path kvtier uses below its root is resolved by :class:`RootFS` relative
to a descriptor of the root, with no symlink followed at any component: one ``openat2(2)`` with
``RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH`` where the kernel has it (:mod:`kvtier.core.openat2`;
Linux 5.6+; one syscall, as fast as a plain ``open``), else one ``openat(O_DIRECTORY | O_NOFOLLOW)`` per directory, each
relative to the one before. The last step (open, ``unlinkat``, ``renameat``, ``linkat``,
``fstatat``, ``mkdirat``, ``unlinkat(AT_REMOVEDIR)``) is taken relative to the descriptor of the
directory so reached and never follows a symlink either. A symlink anywhere in a path is then
``ELOOP``, a file where a directory should be ``ENOTDIR``: the operation fails; nothing outside
the root is read, written, renamed, removed or touched.

Files are opened with ``O_NONBLOCK`` (opening a FIFO never waits; a regular file ignores the
flag) and used only when ``fstat`` says they are regular (:class:`NotRegularFile` otherwise);
what is read from them is bounded by the caller (:meth:`RootFS.read_bytes` refuses a file longer
than its limit before reading it). Times are set through a regular file's descriptor (``futimens``).

Trusted: the root itself and the directories above it (the operator's ``root_dir``, which may be
a symlink, e.g. to a mount). What is not defended: a hard link planted in the root to a file the
attacker may already write (with ``fs.protected_hardlinks = 1``, the default of every major
distribution, nobody can hard-link a file they cannot write), and a directory that kvtier opened
and that is then renamed elsewhere on the same filesystem (kvtier goes on acting in it: on its own
files, inside that directory).

Threading: :class:`RootFS` is thread-safe; its root descriptor is opened on first use, kept for
the object's life and opened again when the root path was replaced (an operation that meets
``ENOENT`` checks, then retries once). Old descriptors stay open until the object dies, so a
thread using one never acts relative to a reused descriptor number. Every call is a few
syscalls; nothing waits on a FIFO or a lock.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
import threading
import weakref
from collections.abc import Iterator

from kvtier.core.dirs import make_dirs
from kvtier.core.openat2 import OPENAT2 as _OPENAT2
from kvtier.core.openat2 import openat2_available  # noqa: F401 (re-exported: rootfs is where callers look)

logger = logging.getLogger(__name__)

O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
O_BINARY = getattr(os, "O_BINARY", 0)
READ = os.O_RDONLY | O_BINARY | O_NONBLOCK
"""Flags to open a file for reading (plus the O_NOFOLLOW | O_CLOEXEC every open here gets)."""
DIR_OPEN = os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC
"""Flags to open one directory component relative to another (never through a symlink)."""
_DIR_PATH = getattr(os, "O_PATH", os.O_RDONLY) | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC
"""A directory used only as ``dir_fd`` (no read permission needed, nothing to set up)."""
_ALWAYS = O_NOFOLLOW | O_CLOEXEC

NOT_THERE = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP})
"""Errors meaning "no such file or directory of kvtier's here": missing, or a component is a file
or a symlink (planted). Listing and walking code treats them alike (nothing to see)."""


class NotRegularFile(OSError):
    """A path under the root names something that is not a regular file (a FIFO, a socket, a
    device, a directory): never read, written or touched."""

    def __init__(self, path: str, mode: int) -> None:
        super().__init__(errno.EINVAL, f"not a regular file ({_kind(mode)})", path)


class FileTooLarge(OSError):
    """A file under the root is longer than its format allows: never read."""

    def __init__(self, path: str, size: int, limit: int) -> None:
        super().__init__(errno.EFBIG, f"{size} bytes, more than the {limit} its format allows", path)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return f"mode {oct(mode)}"


def require_regular(fd: int, path: str) -> os.stat_result:
    """``fstat(fd)``; raises :class:`NotRegularFile` unless it is a regular file."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(path, st.st_mode)
    return st


def _walk_open(dir_fd: int, rel: str, flags: int, mode: int) -> int:
    """Open ``rel`` below ``dir_fd`` one component at a time, none followed if a symlink."""
    parts = [part for part in rel.split("/") if part and part != "."]
    if ".." in parts:
        raise OSError(errno.EXDEV, "'..' in a path below the disk tier root", rel)
    if not parts:
        return os.open(".", flags | _ALWAYS, mode, dir_fd=dir_fd)
    opened: list[int] = []
    try:
        current = dir_fd
        for part in parts[:-1]:
            current = os.open(part, DIR_OPEN, dir_fd=current)
            opened.append(current)
        return os.open(parts[-1], flags | _ALWAYS, mode, dir_fd=current)
    finally:
        for fd in opened:
            os.close(fd)


# ---------------------------------------------------------------------- the root


class RootFS:
    """Paths below one root directory, resolved as the module docstring says.

    Every method takes absolute paths under :attr:`root` (as :class:`~kvtier.tiers.disk.layout.
    DiskLayout` builds them) and raises ``OSError`` as the syscall does (``ELOOP``: a symlink on the
    way, ``ENOTDIR``: a file on the way); a path not under the root is a ``ValueError`` (a bug).
    """

    def __init__(self, root: str) -> None:
        self.root = str(root)
        self._prefix = self.root if self.root.endswith("/") else self.root + "/"
        self._lock = threading.Lock()
        self._fds: list[int] = []  # the current root descriptor last; older ones kept (see the module docstring)
        self._finalizer = weakref.finalize(self, _close_all, self._fds)
        self.use_openat2 = _OPENAT2.usable  # tests turn it off to cover the one-directory-at-a-time walk

    def close(self) -> None:
        """Close the root descriptor(s) once no other thread uses this object; a later call opens
        the root again."""
        with self._lock:
            _close_all(self._fds)

    # ------------------------------------------------------------------ resolution

    def relative(self, path: str) -> str:
        """``path`` relative to the root (``"."`` for the root itself)."""
        prefix = self._prefix
        if path.startswith(prefix) and len(path) > len(prefix):
            return path[len(prefix):]
        if path == self.root or path + "/" == prefix:
            return "."
        raise ValueError(f"{path} is not below the disk tier root {self.root}")

    def _root_fd(self) -> int:
        fds = self._fds
        if fds:
            return fds[-1]
        with self._lock:
            if not fds:
                fds.append(os.open(self.root, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC))
            return fds[-1]

    def _root_replaced(self) -> bool:
        """Whether the root path now names another directory than the descriptor (it was removed and
        made again): then a fresh descriptor is opened, and True returned."""
        with self._lock:
            try:
                now = os.stat(self.root)
            except OSError:
                return False
            if self._fds:
                held = os.fstat(self._fds[-1])
                if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
                    return False
            self._fds.append(os.open(self.root, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC))
            return True

    def _open_rel(self, rel: str, flags: int, mode: int) -> int:
        fds = self._fds
        try:
            root_fd = fds[-1] if fds else self._root_fd()
        except FileNotFoundError:
            if not self._root_replaced():
                raise
            root_fd = self._root_fd()
        try:
            if self.use_openat2:
                return _OPENAT2.open(root_fd, rel, flags, mode)
            return _walk_open(root_fd, rel, flags, mode)
        except FileNotFoundError:
            if not self._root_replaced():
                raise
            return self._resolve(self._root_fd(), rel, flags, mode)

    def _resolve(self, root_fd: int, rel: str, flags: int, mode: int) -> int:
        if self.use_openat2:
            return _OPENAT2.open(root_fd, rel, flags, mode)
        return _walk_open(root_fd, rel, flags, mode)

    # ------------------------------------------------------------------ opening

    def open(self, path: str, flags: int = READ, mode: int = 0o600) -> int:
        """A descriptor of the file at ``path`` (``O_NOFOLLOW | O_CLOEXEC`` added). Unless it was just
        created (``O_CREAT | O_EXCL``), raises :class:`NotRegularFile` for anything but a regular file.
        The caller closes it."""
        if flags & (os.O_CREAT | os.O_EXCL) == (os.O_CREAT | os.O_EXCL):
            return self._open_rel(self.relative(path), flags, mode)
        return self.open_regular(path, flags)[0]

    def open_regular(self, path: str, flags: int = READ) -> tuple[int, os.stat_result]:
        """``(descriptor, fstat)`` of the regular file at ``path``; :class:`NotRegularFile` for
        anything else (a FIFO opened here never blocks: ``READ`` has ``O_NONBLOCK``). The caller
        closes the descriptor."""
        fd = self._open_rel(self.relative(path), flags, 0)
        try:
            return fd, require_regular(fd, path)
        except BaseException:
            os.close(fd)
            raise

    def open_dir(self, path: str) -> int:
        """A descriptor of the directory at ``path`` (readable: ``os.listdir(fd)`` works); the caller closes it."""
        return self._open_rel(self.relative(path), DIR_OPEN, 0)

    @contextlib.contextmanager
    def directory(self, path: str) -> Iterator[int]:
        fd = self.open_dir(path)
        try:
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def parent(self, path: str) -> Iterator[tuple[int, str]]:
        """``(descriptor of path's directory, path's last component)``, for an ``*at`` call (the
        descriptor is ``O_PATH`` where there is one: it serves as ``dir_fd`` only)."""
        fd, name = self._parent(path)
        try:
            yield fd, name
        finally:
            os.close(fd)

    def _parent(self, path: str) -> tuple[int, str]:
        """:meth:`parent` without a context manager (the hot paths); the caller closes the descriptor."""
        head, _, name = path.rpartition("/")
        if not name or name in (".", ".."):
            raise ValueError(f"{path} names no entry of a directory")
        return self._open_rel(self.relative(head or "/"), _DIR_PATH, 0), name

    # ------------------------------------------------------------------ entries

    def lstat(self, path: str) -> os.stat_result:
        """``path``'s own status (a symlink is reported as one, never followed)."""
        fd, name = self._parent(path)
        try:
            return os.stat(name, dir_fd=fd, follow_symlinks=False)
        finally:
            os.close(fd)

    def lexists(self, path: str) -> bool:
        try:
            self.lstat(path)
        except OSError as exc:
            if exc.errno in NOT_THERE:
                return False
            raise
        return True

    def unlink(self, path: str) -> None:
        """Remove the entry at ``path`` (whatever it is but a directory; a symlink itself, never its target)."""
        fd, name = self._parent(path)
        try:
            os.unlink(name, dir_fd=fd)
        finally:
            os.close(fd)

    def rmdir(self, path: str) -> None:
        """Remove the empty directory at ``path``."""
        with self.parent(path) as (fd, name):
            os.rmdir(name, dir_fd=fd)

    def rename(self, src: str, dst: str) -> None:
        """Rename the entry at ``src`` (whatever it is; a symlink itself) to ``dst``, replacing an entry there."""
        with self.parent(src) as (src_fd, src_name), self.parent(dst) as (dst_fd, dst_name):
            os.rename(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)

    def listdir(self, path: str) -> list[str]:
        """The names in the directory at ``path``."""
        with self.directory(path) as fd:
            return os.listdir(fd)

    def entries(self, path: str) -> list[tuple[str, os.stat_result | None]]:
        """``(name, own status)`` of every entry of the directory at ``path`` (None: vanished meanwhile)."""
        with self.directory(path) as fd:
            return [(name, lstat_at(fd, name)) for name in os.listdir(fd)]

    def listing(self, path: str, *, stat: bool = True) -> list[tuple[str, os.stat_result | None]] | None:
        """:meth:`entries` (statuses None without ``stat``) of ``path`` if it is a directory: None if it
        is not (a file, a symlink: never followed), [] if it is gone."""
        try:
            return self.entries(path) if stat else [(name, None) for name in self.listdir(path)]
        except FileNotFoundError:
            return []
        except OSError as exc:
            if exc.errno in NOT_THERE:
                return None
            raise

    def make_dirs(self, path: str, mode: int) -> None:
        """Create the directory ``path`` and its missing parents with ``mode`` (exactly: the umask does
        not narrow or widen it). Below the root, every component is created and then opened without
        following a symlink, so a planted one fails (``ELOOP``) instead of being created through;
        the root and its parents (the operator's) are created as ordinary paths."""
        if not os.path.isdir(self.root):
            _make_trusted_dirs(self.root, mode)
        rel = self.relative(path)
        if rel == ".":
            return
        try:
            self._make_below(self._root_fd(), rel, mode)
        except FileNotFoundError:  # the root was removed (and made again above) since its descriptor was opened
            if not self._root_replaced():
                raise
            self._make_below(self._root_fd(), rel, mode)

    @staticmethod
    def _make_below(root_fd: int, rel: str, mode: int) -> None:
        current = os.dup(root_fd)
        try:
            for part in (p for p in rel.split("/") if p and p != "."):
                created = False
                try:
                    os.mkdir(part, mode, dir_fd=current)
                    created = True
                except FileExistsError:
                    pass
                child = os.open(part, DIR_OPEN, dir_fd=current)
                os.close(current)
                current = child
                if created:
                    os.fchmod(current, mode)  # the umask must not narrow (or widen) it
        finally:
            os.close(current)

    # ------------------------------------------------------------------ whole files

    def read_bytes(self, path: str, limit: int) -> bytes:
        """The contents of the regular file at ``path``; :class:`FileTooLarge` if it is longer than
        ``limit`` bytes (checked before reading, and again while reading: a file that grows)."""
        fd = self.open(path)
        try:
            return read_bounded(fd, path, limit)
        finally:
            os.close(fd)

    def write_atomic(self, path: str, data: bytes, mode: int) -> None:
        """Publish ``data`` at ``path``: written to a unique temp file beside it (``O_EXCL``), then
        renamed over whatever entry ``path`` holds (a planted symlink is replaced, not followed)."""
        with self.parent(path) as (fd, name):
            tmp = f"{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_BINARY | _ALWAYS, mode, dir_fd=fd)
            try:
                try:
                    os.fchmod(out, mode)  # the umask must not change it
                    view = memoryview(data)
                    while view.nbytes:
                        view = view[os.write(out, view):]
                finally:
                    os.close(out)
                os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=fd)
                raise

    def touch(self, path: str) -> None:
        """Set the times of the regular file at ``path`` to now, through its descriptor (``futimens``):
        a planted symlink, FIFO or other object is never touched (:class:`NotRegularFile`, ``ELOOP``)."""
        fd = self.open_regular(path)[0]
        try:
            os.utime(fd)
        finally:
            os.close(fd)

    def touch_quiet(self, path: str) -> None:
        """:meth:`touch`, skipping a file that is gone, refuses, or is not a regular file."""
        try:
            self.touch(path)
        except OSError:
            pass

    def rmdir_quiet(self, path: str) -> None:
        """Remove ``path`` if it is an empty directory (``rmdir`` refuses a non-empty one, e.g. holding a
        writer's temp file, and a symlink)."""
        try:
            self.rmdir(path)
        except OSError:
            pass


def lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    """``name``'s own status in the directory ``dir_fd``; None if it vanished (or a component is not there)."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in NOT_THERE:
            return None
        raise


def read_bounded(fd: int, path: str, limit: int) -> bytes:
    """At most ``limit`` bytes of the regular file ``fd`` from offset 0; :class:`FileTooLarge` if it
    holds more (by ``fstat``, or found while reading)."""
    st = require_regular(fd, path)
    if st.st_size > limit:
        raise FileTooLarge(path, st.st_size, limit)
    chunks: list[bytes] = []
    offset = 0
    while True:
        chunk = os.pread(fd, min(limit + 1 - offset, max(st.st_size + 1 - offset, 1 << 16)), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
        if offset > limit:
            raise FileTooLarge(path, offset, limit)
    return b"".join(chunks)


def _make_trusted_dirs(path: str, mode: int) -> None:
    """Create ``path`` and its missing parents with ``mode`` (the root: the operator's path), as
    :func:`kvtier.core.dirs.make_dirs` does for the root when the configuration is read."""
    make_dirs(path, mode)


def _close_all(fds: list[int]) -> None:
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.pop())
