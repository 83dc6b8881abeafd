"""One client connection of the node service.

Loop thread only (:mod:`kvtier.node.server`); memory and non-blocking sockets only.
"""

from __future__ import annotations

import selectors
import socket
import statistics
from collections import deque

from kvtier.node.index import Session
from kvtier.node.protocol import FrameReader, Role


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
