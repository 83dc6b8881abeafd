"""``openat2(2)`` with ``RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH``: a path below a directory
descriptor resolved in one syscall, no symlink followed at any component and nothing outside that
directory reached (Linux 5.6+; :mod:`kvtier.core.rootfs` walks one directory at a time where it
is missing). Bound through libc's ``syscall`` (Python has no ``openat2``).

:data:`OPENAT2` is the process's one binding; :attr:`Openat2.usable` is False where the kernel, the
architecture or a seccomp filter lacks the call (checked once, at import, by opening ``.``).
Every open adds ``O_NOFOLLOW | O_CLOEXEC``.

Threads: any (the cache of ``open_how`` structures only grows, one per (flags, mode)).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import sys

logger = logging.getLogger(__name__)

_ALWAYS = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_SYS_OPENAT2 = 437  # the same number on every Linux architecture (a syscall added after 5.1)
_HOW_SIZE = ctypes.sizeof(_OpenHow)


class Openat2:
    """``openat2(dir_fd, path, flags | O_NOFOLLOW | O_CLOEXEC, RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH)``
    through libc's ``syscall``; :attr:`usable` False where the kernel (or a seccomp filter) lacks it."""

    def __init__(self) -> None:
        self.usable = False
        self._hows: dict[tuple[int, int], tuple[_OpenHow, object]] = {}  # (flags, mode) -> (how, byref(how))
        if not sys.platform.startswith("linux") or platform.machine() not in (
            "x86_64", "aarch64", "arm64", "ppc64le", "s390x", "riscv64"
        ):
            return
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            call = libc.syscall
        except (OSError, AttributeError):
            return
        call.restype = ctypes.c_long
        call.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
        self._call = call
        try:
            os.close(self.open(-100, ".", os.O_RDONLY | _O_DIRECTORY))  # AT_FDCWD: does the kernel have it?
        except OSError as exc:
            logger.debug("kvtier disk: openat2 unavailable (%s); walking paths one directory at a time", exc)
            return
        self.usable = True

    def open(self, dir_fd: int, path: str, flags: int, mode: int = 0) -> int:
        entry = self._hows.get((flags, mode))
        if entry is None:
            entry = self._how(flags, mode)
        fd = self._call(_SYS_OPENAT2, dir_fd, path.encode(), entry[1], _HOW_SIZE)
        if fd >= 0:
            return fd
        for _ in range(8):  # EAGAIN: a rename raced the lookup; the kernel asks to try again
            err = ctypes.get_errno()
            if err not in (errno.EAGAIN, errno.EINTR):
                break
            fd = self._call(_SYS_OPENAT2, dir_fd, path.encode(), entry[1], _HOW_SIZE)
            if fd >= 0:
                return fd
        raise OSError(err, os.strerror(err), path)

    def _how(self, flags: int, mode: int) -> tuple[_OpenHow, object]:
        full = flags | _ALWAYS
        how = _OpenHow(full, mode if full & (os.O_CREAT | getattr(os, "O_TMPFILE", 0)) else 0,  # (else EINVAL)
                       _RESOLVE_NO_SYMLINKS | _RESOLVE_BENEATH)
        return self._hows.setdefault((flags, mode), (how, ctypes.byref(how)))


OPENAT2 = Openat2()


def openat2_available() -> bool:
    """Whether paths are resolved in one ``openat2`` call (else one ``openat`` per directory)."""
    return OPENAT2.usable
