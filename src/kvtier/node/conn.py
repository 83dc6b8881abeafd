"""One client connection of the node service, and the peer checks made when it is accepted.

Loop thread only (:mod:`kvtier.node.server`); memory and non-blocking sockets only.
"""

from __future__ import annotations

import socket
import statistics
import struct
from collections import deque
from pathlib import Path

from kvtier.node.index import Session
from kvtier.node.protocol import FrameReader, Role

_UCRED = struct.Struct("3i")


class Conn:
    """One client connection: its socket, frame reader, reply queue and (after hello) session."""

    __slots__ = ("sock", "reader", "out", "session", "role", "uid", "pid", "closing")

    def __init__(self, sock: socket.socket, uid: int, pid: int) -> None:
        self.sock = sock
        self.reader = FrameReader()
        self.out = bytearray()
        self.session: Session | None = None
        self.role: Role | None = None
        self.uid = uid
        self.pid = pid
        self.closing = False


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket (SO_PEERCRED)."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


def groups_of(pid: int) -> set[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()


def percentiles(seconds: deque[float]) -> dict[str, float]:
    """p50/p99 in microseconds of the latest lookups' handling time (index work only, no socket)."""
    if len(seconds) < 2:
        return {"count": len(seconds)}
    q = statistics.quantiles(seconds, n=100)
    return {"count": len(seconds), "p50": round(statistics.median(seconds) * 1e6, 1), "p99": round(q[98] * 1e6, 1)}
