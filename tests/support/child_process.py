"""Server processes the tests start (Redis, SeaweedFS): started so they die with the test process,
and signalled the same way whoever started them.

Hygiene: each child gets ``PR_SET_PDEATHSIG`` (SIGKILL when the test process dies, even by
SIGKILL) and is registered for an ``atexit`` kill until :func:`stop` or :func:`kill` reaps it; a
paused (SIGSTOPped) child is continued first, so it can die.

Threading: test code only, one thread.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess

_LIVE: set[subprocess.Popen] = set()


def _kill_all() -> None:
    for proc in list(_LIVE):
        kill(proc)
    _LIVE.clear()


atexit.register(_kill_all)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def spawn(argv: list[str], **popen) -> subprocess.Popen:
    """Start ``argv`` (``popen``: Popen's other arguments) as a registered child that dies with us."""
    proc = subprocess.Popen(argv, preexec_fn=_die_with_parent, **popen)  # noqa: PLW1509 (prctl only)
    _LIVE.add(proc)
    return proc


def stop(proc: subprocess.Popen | None, grace: float) -> None:
    """SIGTERM (continued first if paused), SIGKILL after ``grace`` seconds; reaped, unregistered."""
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(OSError):
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    _LIVE.discard(proc)


def kill(proc: subprocess.Popen | None) -> None:
    """SIGKILL (a crash); reaped, unregistered."""
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(OSError):
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(5)
    _LIVE.discard(proc)


def pause(proc: subprocess.Popen) -> None:
    """SIGSTOP: the kernel still accepts connections; nothing answers."""
    os.kill(proc.pid, signal.SIGSTOP)


def resume(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGCONT)
