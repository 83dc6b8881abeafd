"""Who the node service admits on its socket: each peer's credentials, and the bound on connections.

Access: the socket is created owner-only (0600), or 0660 and owned by ``group`` when one is
given (:mod:`kvtier.node.listener`); each peer's credentials (``SO_PEERCRED``,
:mod:`kvtier.node.credentials`) are checked at accept: root, the service's own uid, or (with a
group) a member of it. Any other peer gets an error frame naming its uid and is disconnected
(``rejected_peers``). A peer beyond ``--max-connections`` open connections
(:attr:`kvtier.node.server.NodeOptions.max_connections`) gets an error frame and is closed at
once (``refused_connections``).

Who calls what: the service's loop thread only (:meth:`kvtier.node.server.NodeServer._accept`
calls :func:`admit` on each socket it accepted, and registers the connection returned); the
counters it changes are the server's, read by the metrics thread under
:attr:`~kvtier.node.server.NodeServer.lock`. Nothing here waits on a peer: the socket is made
non-blocking first, its credentials are the kernel's (with a group, ``/proc/<pid>/status`` is
read), and a refusal is one frame that a fresh socket's buffer takes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from typing import TYPE_CHECKING

from kvtier.node.conn import Conn
from kvtier.node.credentials import groups_of, peer_credentials
from kvtier.node.protocol import pack

if TYPE_CHECKING:
    from kvtier.node.server import NodeServer

log = logging.getLogger("kvtier.node")


def allowed(uid: int, gid: int, pid: int, group: int | None) -> bool:
    """Whether a peer of ``uid``/``gid`` (process ``pid``) is admitted by a service admitting
    ``group`` too (a gid; None: none)."""
    if uid in (0, os.getuid()):
        return True
    return group is not None and (gid == group or group in groups_of(pid))


def admit(server: NodeServer, sock: socket.socket) -> Conn | None:
    """The connection of a freshly accepted ``sock`` (made non-blocking), or None when its peer
    is refused (sent an error frame, closed, counted and logged)."""
    sock.setblocking(False)
    pid, uid, gid = peer_credentials(sock)
    options = server.options
    if not allowed(uid, gid, pid, server.gid):
        server.rejected_peers += 1
        who = f"uid {os.getuid()}" + (f" and group {options.group}" if server.gid is not None else "")
        refuse(sock, f"kvtier node at {options.socket_path} admits only {who}; this client runs as "
                     f"uid {uid} gid {gid} (start the service with --group GROUP to admit a group)")
        log.warning("refused pid %d: uid %d gid %d not admitted", pid, uid, gid)
        return None
    if len(server.conns) >= options.max_connections:
        with server.lock:
            server.refused_connections += 1
        refuse(sock, f"kvtier node at {options.socket_path} serves at most "
                     f"{options.max_connections} connections (--max-connections), all open")
        if server.refused_connections & (server.refused_connections - 1) == 0:  # 1, 2, 4, ...: not a log flood
            log.warning("refused pid %d: %d connections open (--max-connections); %d refused so far",
                        pid, len(server.conns), server.refused_connections)
        return None
    return Conn(sock, uid, pid)


def refuse(sock: socket.socket, message: str) -> None:
    """Send ``message`` as an error frame (if the socket takes it) and close ``sock``."""
    with contextlib.suppress(OSError):
        sock.send(pack({"ok": False, "error": message}))  # a fresh socket's buffer takes it
    sock.close()
