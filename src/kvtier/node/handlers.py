"""What the node service answers to each request: a frame's map checked into a request
(:func:`kvtier.node.messages.parse_request`) and applied to the pool's index and the tiers below
it; the reply is returned to the loop, which queues and writes it (:mod:`kvtier.node.server`).
A scheduler's session begins with its hello and ends when its connection drops
(:func:`release`: what it held is released).

Who calls what: the service's loop thread only (:func:`answer`, from
:meth:`kvtier.node.server.NodeServer._turn`; :func:`release`, from its ``_drop``), holding
:attr:`NodeServer.lock` (which the metrics thread takes to read the same state). Its functions
read and change the server's state (the index, sessions, the roster, the pool's cut) but own none
of it. Memory work only: the tiers' I/O is queued to their own threads
(:class:`kvtier.node.tiers.NodeTiers`), so nothing here blocks or waits on a client.

:func:`answer` never raises: a map that is not a valid request is answered with an error naming
the field (``protocol_errors``), and a request whose checks or handling raise anyway (a bug) with
an error, logged (``internal_errors``); either marks its connection to close
(:attr:`kvtier.node.conn.Conn.hang_up`). A request refused (a pin limit, a hello of another block
size, a width larger than the pool) is an error reply and its connection is kept.

With ``--slot-bytes`` the pool's slot size is the operator's: a hello that names another is
refused (without it the first engine to attach sets it, and the pool is cut again for another
size only while it holds nothing and no engine maps it). A hello of a role that maps the pool
appends the pool's memfd to ``fds``: the loop passes it with the first byte of that reply.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from kvtier.node.conn import Conn
from kvtier.node.index import PinLimit, Session
from kvtier.node.listener import NodeConfigError
from kvtier.node.messages import (Abort, BadRequest, Commit, Hello, Lookup, Request, Reserve, Stats, Unpin,
                                  parse_request)
from kvtier.node.protocol import PROTOCOL_VERSION, Role, encode_sources

if TYPE_CHECKING:
    from kvtier.node.server import NodeServer

log = logging.getLogger("kvtier.node")


def answer(server: NodeServer, conn: Conn, message: dict[str, Any],
           fds: list[int]) -> tuple[dict[str, Any], int]:
    """The reply to one message, and the keys (or pin handles) it carried. Never raises: a
    message that is not a valid request, or whose checks or handling raised, is answered
    with an error and its connection marked to close (:attr:`Conn.hang_up`)."""
    try:
        request = parse_request(message)
    except BadRequest as exc:
        server.protocol_errors += 1
        conn.hang_up = True
        return {"ok": False, "error": f"bad request: {exc}", "field": exc.field}, 0
    except Exception:  # noqa: BLE001 (a check that raised: a bug, that connection only)
        server.internal_errors += 1
        conn.hang_up = True
        log.exception("kvtier node: checking a request of pid %d failed; its connection is closed", conn.pid)
        return {"ok": False, "error": "the service failed to check this request (a bug: see its log)"}, 0
    carried = len(request.pins) if type(request) is Unpin else len(getattr(request, "keys", ()))
    try:
        return _handle(server, conn, request, fds), carried
    except Exception:  # noqa: BLE001 (a bug must cost one connection, never the service)
        server.internal_errors += 1
        conn.hang_up = True
        fds.clear()
        log.exception("kvtier node: a %s request of pid %d failed; its connection is closed",
                      type(request).__name__.lower(), conn.pid)
        return {"ok": False, "error": f"the service failed on this {type(request).__name__.lower()} request "
                                      "(a bug: see the service's log)"}, carried


def _handle(server: NodeServer, conn: Conn, request: Request, fds: list[int]) -> dict[str, Any]:
    """The reply to a checked request (a refusal is an error reply, the connection kept)."""
    if type(request) is Hello:
        return _hello(server, conn, request, fds)
    if type(request) is Stats:
        return {"ok": True, **server.snapshot()}  # O(engines): bounded (kvtier.node.roster)
    session = conn.session
    if session is None or conn.role is not Role.SCHEDULER or server.index is None:
        return {"ok": False, "error": f"{type(request).__name__.lower()!r} needs a hello as role 'scheduler' first"}
    if type(request) is Lookup:
        start = time.perf_counter()
        keys, width, pin = request.keys, request.width, request.pin
        try:
            hits, slots, handle = server.index.lookup(session, keys, pin, width)
        except PinLimit as exc:
            return {"ok": False, "error": f"lookup refused: {exc}"}
        pending, below, promoted = (server.below.after_lookup(session, keys, hits, width, pin, request.chain)
                                    if server.below else (False, 0, {}))
        server.lookup_seconds.append(time.perf_counter() - start)
        reply = {"ok": True, "hits": hits, "slots": slots, "pin": handle, "pending": pending, "below": below}
        sources = encode_sources(keys[:hits], promoted)
        if sources:
            reply["sources"] = sources
        return reply
    if type(request) is Unpin:
        return {"ok": True, "unknown": server.index.unpin(session, request.pins)}
    if type(request) is Reserve:
        if request.width > server.index.num_slots:
            return {"ok": False, "error": f"width {request.width} is more than this pool's "
                                          f"{server.index.num_slots} slots"}
        status, slots = server.index.reserve(session, request.keys, request.width, request.tails)
        return {"ok": True, "status": [s.value for s in status], "slots": slots}
    if type(request) is Commit:  # only keys this session committed now go to the tiers, each once
        committed: list[int] = []
        unknown = server.index.commit(session, request.keys, committed)
        infos = request.records(committed) if server.below is not None and committed else None
        if infos:
            server.below.committed(session, [request.keys[p] for p in committed], infos)
        return {"ok": True, "unknown": unknown}
    assert type(request) is Abort
    return {"ok": True, "unknown": server.index.abort(session, request.keys)}


def _hello(server: NodeServer, conn: Conn, hello: Hello, fds: list[int]) -> dict[str, Any]:
    engine = hello.engine or f"pid-{conn.pid}"
    if conn.role is not None:
        return {"ok": False, "error": "hello sent twice on one connection"}
    if hello.version != PROTOCOL_VERSION:
        return {"ok": False, "error": f"protocol version {hello.version} is not this service's "
                                      f"({PROTOCOL_VERSION}): run the same kvtier version in engines and node"}
    role, slot_bytes = hello.role, hello.slot_bytes
    fixed = server.options.slot_bytes
    if fixed is not None and slot_bytes is not None and slot_bytes != fixed:
        return {"ok": False, "error":
                f"this node's pool is cut into slots of {fixed} bytes; this engine's blocks are {slot_bytes} "
                f"bytes, and the service was started with --slot-bytes {fixed}. One service serves one block "
                "size: run another kvtier node (another --socket) for this model, or give the engines the same "
                "block size"}
    if role.maps_pool:
        if slot_bytes is None and server.slot_bytes is None:
            return {"ok": False, "error": "this service's slot size is not set yet: the first engine to "
                                          "attach must give slot_bytes (or start it with --slot-bytes)"}
        if slot_bytes is not None and slot_bytes != server.slot_bytes:
            if server.index is not None and (server.index.blocks or _engines_attached(server)):
                return {"ok": False, "error":
                        f"this node's pool is cut into slots of {server.slot_bytes} bytes; this engine's "
                        f"blocks are {slot_bytes} bytes. One service serves one block size: run another "
                        "kvtier node (another --socket) for this model, or give the engines the same "
                        "block size"}
            try:
                server.cut_pool(slot_bytes)
            except NodeConfigError as exc:
                return {"ok": False, "error": str(exc)}
    if role is Role.SCHEDULER:
        cap = None if hello.cap_bytes is None else hello.cap_bytes // server.stride
        if cap is not None and cap < 1:
            return {"ok": False, "error": f"cpu_bytes_to_use {hello.cap_bytes} is less than one slot of this "
                                          f"node's pool ({server.stride} bytes)"}
        conn.session = Session(server.next_session, engine, cap)
        server.next_session += 1
        server.roster.attached(engine)  # (re)attached: not among the departed
        if hello.namespace is not None and server.below is not None:
            server.below.attach(conn.session, *hello.namespace)
    conn.role = role
    if role.maps_pool:
        assert server.pool_fd is not None
        fds.append(server.pool_fd)
    return {"ok": True, "pool_bytes": server.options.pool_bytes, "slot_bytes": server.slot_bytes,
            "slot_stride": server.stride, "num_slots": server.index.num_slots if server.index else 0,
            "session": conn.session.id if conn.session else 0, "service_pid": os.getpid(),
            "pool_id": server.pool_id}


def _engines_attached(server: NodeServer) -> bool:
    return any(c.role is not None and c.role.maps_pool for c in server.conns.values())


def release(server: NodeServer, conn: Conn, why: str) -> None:
    """Release what ``conn``'s session held, its connection dropped (``why``): called with
    ``conn`` already gone from :attr:`NodeServer.conns`, under :attr:`NodeServer.lock`. Its
    tiers' bookkeeping, its reservations (aborted) and pins; an engine none of whose sessions is
    left goes among the departed (:mod:`kvtier.node.roster`)."""
    session = conn.session
    if session is not None and server.below is not None:
        server.below.release(session)
    if session is not None and server.index is not None:
        aborted, unpinned = server.index.release_session(session)
        server.sessions_released += 1
        log.info("engine %r (pid %d) detached (%s): %d reservations aborted, %d pins released",  # (%r: a peer names itself)
                 session.engine, conn.pid, why, aborted, unpinned)
    if session is not None and not any(c.session is not None and c.session.engine == session.engine
                                       for c in server.conns.values()):
        server.roster.left(session.engine, server.index)
