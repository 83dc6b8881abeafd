"""Who is at the other end of the node service's socket (``SO_PEERCRED``), checked at both ends.

The service admits a client by its credentials (:func:`kvtier.node.admission.allowed`);
a client trusts a service only if it runs as root, as the client's own user, or as the one user
its configuration names (``node_uid``, :func:`check_service`): a service of anyone else could hand
the engine memory that user reads and writes, and would receive the engine's KV. Memory only.
"""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

_UCRED = struct.Struct("3i")


class UntrustedService(PermissionError):
    """The process serving the socket runs as a user this client does not trust."""


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket (SO_PEERCRED): the
    one that connected, or the one that listened."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


def groups_of(pid: int) -> set[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()


def check_service(sock: socket.socket, path: str | os.PathLike[str], node_uid: int | None) -> None:
    """Raise :class:`UntrustedService` unless the service at the other end of ``sock`` runs as
    root, as this process's effective user, or as ``node_uid``."""
    pid, uid, _gid = peer_credentials(sock)
    me = os.geteuid()
    trusted = {0, me} | ({node_uid} if node_uid is not None else set())
    if uid in trusted:
        return
    named = f", or uid {node_uid} (node_uid)" if node_uid is not None else ""
    raise UntrustedService(
        f"the kvtier node at {path} is served by uid {uid} (pid {pid}); this engine trusts only root, its own uid "
        f"{me}{named}: a service of another user would read and could change this engine's KV. If that user runs "
        f"your kvtier node, name it: node_uid = {uid} (kvtier serve --node-uid {uid}); otherwise remove the "
        "socket and find out who created it")
