"""One client connection of the node service, and the listener's back-off when accepting fails.

Loop thread only (:mod:`kvtier.node.server`); memory and non-blocking sockets only.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import statistics
import time
from collections import deque

from kvtier.node.frames import FrameReader
from kvtier.node.index import Session
from kvtier.node.protocol import Role


class Conn:
    """One client connection: its socket, frame reader, reply queue and (after hello) session.

    ``out`` holds replies not yet written (the socket is non-blocking: :meth:`NodeServer._flush`
    writes what the peer's buffer takes). ``fds`` are descriptors to pass (``SCM_RIGHTS``) with
    the byte at ``out[fd_at]``, the first of the hello's reply; they stay the server's (not
    closed when sent). ``hang_up``: close once the replies queued so far were tried (a bad
    request). ``events``: what the selector watches for it now."""

    __slots__ = ("sock", "reader", "out", "fds", "fd_at", "session", "role", "uid", "pid", "closing", "hang_up",
                 "events")

    def __init__(self, sock: socket.socket, uid: int, pid: int) -> None:
        self.sock = sock
        self.reader = FrameReader(requests=True)
        self.out = bytearray()
        self.fds: list[int] = []
        self.fd_at = 0
        self.session: Session | None = None
        self.role: Role | None = None
        self.uid = uid
        self.pid = pid
        self.closing = False
        self.hang_up = False
        self.events = selectors.EVENT_READ


def percentiles(seconds: deque[float]) -> dict[str, float]:
    """p50/p99 in microseconds of the latest lookups' handling time (index work only, no socket)."""
    if len(seconds) < 2:
        return {"count": len(seconds)}
    q = statistics.quantiles(seconds, n=100)
    return {"count": len(seconds), "p50": round(statistics.median(seconds) * 1e6, 1), "p99": round(q[98] * 1e6, 1)}


RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
"""``accept`` failing for want of descriptors or memory: the listener pauses (:class:`AcceptBackoff`)."""


class AcceptBackoff:
    """When ``accept`` fails for want of resources (:data:`RESOURCE_ERRNOS`), the loop stops
    watching the listener for a while (it would be readable at once again: a spin), then tries
    again; the pause doubles from :attr:`FIRST_S` up to :attr:`MOST_S` while accepts keep failing
    and resets on the next success. Connections wait in the listen backlog meanwhile. Logged at
    most once per :attr:`LOG_EVERY_S`, with the failures since."""

    FIRST_S = 0.05
    MOST_S = 1.0
    LOG_EVERY_S = 10.0

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self.failures = 0  # accepts that failed for want of resources, in all
        self.until = 0.0  # monotonic time the listener is watched again (0: watched)
        self._pause = 0.0
        self._unlogged = 0
        self._logged_at = -float("inf")

    def failed(self, exc: OSError) -> None:
        """An accept failed with ``exc`` (one of :data:`RESOURCE_ERRNOS`): pause."""
        self.failures += 1
        self._unlogged += 1
        self._pause = min(self.MOST_S, max(self.FIRST_S, 2 * self._pause))
        now = time.monotonic()
        self.until = now + self._pause
        if now - self._logged_at >= self.LOG_EVERY_S:
            self._log.warning("kvtier node: accepting a connection failed (%s; %d times since the last message): "
                              "not accepting for %.2f s (raise the service's LimitNOFILE, or lower "
                              "--max-connections)", exc, self._unlogged, self._pause)
            self._logged_at, self._unlogged = now, 0

    def succeeded(self) -> None:
        self._pause = 0.0

    def due(self) -> bool:
        """Whether a pause is over (the caller watches the listener again)."""
        if self.until and time.monotonic() >= self.until:
            self.until = 0.0
            return True
        return False
