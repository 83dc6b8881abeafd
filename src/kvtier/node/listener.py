"""The ``kvtier node`` service's socket: the lock that makes it one service per socket, and the
listening socket with its permissions.

- :func:`hold_socket_lock`: an ``flock`` on ``<socket>.lock``, held while the service runs (a
  second service on the same socket gets :class:`NodeAlreadyRunning`, naming the holder's pid);
  the lock file is opened with ``O_NOFOLLOW`` and used only if it is a regular file of this
  user's with one link: anything else was planted by someone who can write the socket's
  directory, and is refused (:class:`NodeConfigError`), never followed or truncated.
- :func:`clear_dead_socket`: a socket file left by a dead service is removed (the caller holds
  the lock, so nobody serves it); anything else at the path is refused.
- :func:`listen`: the socket, created owner-only (0600), or 0660 and owned by a group (its gid
  from :func:`resolve_group`); non-blocking. Each peer's credentials are checked at accept by the
  server (:mod:`kvtier.node.credentials`).

Called by :meth:`kvtier.node.server.NodeServer.start` only, before its loop runs.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import os
import socket
import stat
from pathlib import Path


class NodeAlreadyRunning(RuntimeError):
    """Another live service holds the socket's lock."""


class NodeConfigError(ValueError):
    """A service option cannot work (named in the message)."""


def resolve_group(group: str | None) -> int | None:
    """The gid of ``--group`` (a name or a number), or None."""
    if group is None:
        return None
    try:
        return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise NodeConfigError(f"--group {group!r}: no such group on this node") from None


def hold_socket_lock(path: Path) -> int:
    """``<socket>.lock`` opened without following a symlink, held (``flock``) and holding this
    process's pid: its descriptor, which holds the lock until closed."""
    lock_path = path.with_name(path.name + ".lock")
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(lock_path, flags, 0o600)
    except OSError as exc:
        why = "is a symbolic link" if exc.errno == errno.ELOOP else f"cannot be opened ({exc.strerror})"
        raise NodeConfigError(f"{lock_path} {why}: remove it (someone who can write {path.parent} may have put "
                              "it there), or give another --socket") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1 or info.st_uid != os.geteuid():
        os.close(fd)
        raise NodeConfigError(f"{lock_path} is not a regular file of this user's with one link (mode "
                              f"{info.st_mode:o}, owner uid {info.st_uid}, {info.st_nlink} links): remove it, or "
                              "give another --socket")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise NodeAlreadyRunning(
                f"another kvtier node (pid {holder}) already serves {path}: stop it first, or give this "
                "one another --socket") from None
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def clear_dead_socket(path: Path) -> None:
    """Remove the socket file at ``path`` (the caller holds its lock: nobody serves it); refuse
    anything else there."""
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise NodeConfigError(f"--socket {path} exists and is not a socket: remove it or choose another path")
        path.unlink()


def listen(path: Path, gid: int | None) -> socket.socket:
    """A non-blocking Unix socket listening at ``path``: mode 0600, or 0660 owned by ``gid``."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)
        try:
            listener.bind(str(path))
        finally:
            os.umask(old)
        if gid is not None:
            os.chown(path, -1, gid)
            os.chmod(path, 0o660)
        else:
            os.chmod(path, 0o600)
        listener.listen(128)
        listener.setblocking(False)
    except BaseException:
        listener.close()
        raise
    return listener
