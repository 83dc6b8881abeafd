"""Rename a file without replacing one: ``renameat2(..., RENAME_NOREPLACE)`` (Linux 3.15+, glibc
2.28+), the one call that publishes a file under its final name atomically and fails ``EEXIST``
when that name is taken, without the instant of two names that ``link`` + ``unlink`` leaves.

:func:`rename_noreplace` raises ``OSError`` as the call fails. Where the C library has no
``renameat2`` (musl before 1.2.5, other systems) it raises ``ENOSYS`` without trying; a filesystem
that does not support the flag answers ``EINVAL`` (NFS, some FUSE ones), and a seccomp filter
that does not know the call (old container runtimes) ``EPERM`` or ``ENOSYS``. Callers fall back to
``link`` on those: :data:`UNSUPPORTED` holds them (a real permission problem then fails the
fallback too, with its own error).

Threads: any (one system call, no state).
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys

RENAME_NOREPLACE = 1  # <linux/fs.h>
UNSUPPORTED = frozenset({errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM})
"""Errors meaning "this system or filesystem cannot do it", not "the name is taken"."""


def _bind():
    """libc's ``renameat2`` as rootfs binds ``syscall``: the C library already loaded, no lookup."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_renameat2 = _bind()


def rename_noreplace(src: str, dst: str, *, src_dir_fd: int, dst_dir_fd: int) -> None:
    """Rename ``src`` (relative to ``src_dir_fd``) to ``dst`` (relative to ``dst_dir_fd``) unless
    ``dst`` exists (``FileExistsError``). Neither name is followed if it is a symlink."""
    if _renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    if _renameat2(src_dir_fd, os.fsencode(src), dst_dir_fd, os.fsencode(dst), RENAME_NOREPLACE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), dst)
