"""The ``kvtier node`` service: one process per node that owns the pool and its index.

Threads: one loop thread (the caller of :meth:`NodeServer.serve_forever`) accepts connections,
reads requests and answers them from memory (:class:`kvtier.node.index.NodeIndex`); it never
waits on any one client: sockets are non-blocking, replies (the hello's, with the pool's memfd,
too) queue per connection and are written as the peer reads them, so an engine that stops reading
stalls only itself (its connection is dropped, and counted in ``slow_readers``, once more than
:data:`MAX_QUEUED_REPLY_BYTES` are waiting). The Prometheus exporter's thread (if
any) reads :meth:`NodeServer.snapshot` under :attr:`NodeServer.lock`, which the loop holds while
it handles a request.

A client's frames may be hostile: each is decoded within bounds and checked field by field
before use (:func:`kvtier.node.protocol.parse_request`); a frame that is not a valid request is
answered with an error naming the field and its connection is closed (``protocol_errors``), and
a request whose handling raises anyway is answered, logged and closed (``internal_errors``): the
service never dies of a client's frame. Nothing a failed request took stays held.

Start-up refuses, with an error naming what to change:

- a second service on the same socket (an ``flock`` on ``<socket>.lock`` held while it runs:
  :class:`NodeAlreadyRunning`); a socket file nobody serves (a dead service's) is replaced; a lock
  file that is a symlink or anything but a regular file of this user's (``O_NOFOLLOW``: planted by
  someone who can write the socket's directory) is refused, never followed or truncated (the
  socket and its lock: :mod:`kvtier.node.listener`);
- a pool larger than the node's memory (:class:`kvtier.node.pool.PoolTooLargeError`).

Access: the socket is created owner-only (0600), or 0660 and owned by ``group`` when one is
given; each peer's credentials (``SO_PEERCRED``) are checked at accept: root, the service's own
uid, or (with a group) a member of it. Any other peer gets an error frame naming its uid and is
disconnected.

When a connection drops (close, crash, SIGKILL: the kernel closes the socket), everything its
session held is released (reservations aborted, pins dropped). The pool lives as long as this
process: a restarted service starts with an empty pool and engines reattach by themselves.

Tiers below the pool (``--disk-dir``, ``--redis-url``: :attr:`NodeOptions.tiers`) are the
service's (:mod:`kvtier.node.tiers`, the same promotion and cascade as an embedded engine's):
commits cascade to them and pinning lookups promote from them; their I/O runs on their own
threads, which wake the loop through a socket pair it selects on, so the loop never waits on tier
I/O; the loop also polls them every ``poll_s`` (their periodic refresh). A disk root outlives the service: after a restart the
first lookups are disk hits, promoted into the new pool.
"""

from __future__ import annotations

import mmap
import logging
import os
import secrets
import selectors
import socket
import threading
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvtier.core.config import PolicyName
from kvtier.core.tier_config import SecondaryTierConfig
from kvtier.node.conn import Conn, percentiles
from kvtier.node.credentials import groups_of, peer_credentials
from kvtier.node.index import NodeIndex, Session
from kvtier.node.listener import (NodeConfigError, clear_dead_socket, hold_socket_lock, listen,
                                  resolve_group)
from kvtier.node.pool import check_pool_size, create_pool_fd, slot_stride
from kvtier.node.protocol import (MAX_KEYS, PROTOCOL_VERSION, RECV_BYTES, Abort, BadRequest, Commit, Hello, Lookup,
                                  ProtocolError, Request, Reserve, Role, Stats, Unpin, pack, parse_request)
from kvtier.node.tiers import NodeTiers

log = logging.getLogger("kvtier.node")

MAX_QUEUED_REPLY_BYTES = 16 * 2**20
"""Replies waiting for a peer that does not read; beyond this (or twice the largest reply a pool of
this many slots can give, if more) its connection is dropped."""
KEEP_DETACHED_ENGINES = 64
"""Stats of this many engines that left are kept (for inspect and metrics); older ones holding
nothing in the pool are forgotten."""


_BELL = object()
"""The selector's data for the tiers' bell (the listener's is None, a connection's its Conn)."""


@dataclass(frozen=True)
class NodeOptions:
    """What ``kvtier node`` was started with."""

    socket_path: Path
    pool_bytes: int
    slot_bytes: int | None = None  # fixed up front, or by the first engine that attaches
    policy: PolicyName = PolicyName.LRU
    group: str | None = None  # admit this group's members too (socket 0660 owned by it)
    prefault: bool = True
    tiers: tuple[SecondaryTierConfig, ...] = ()  # owned below the pool, cascade order (disk, then Redis)


class NodeServer:
    """The service. :meth:`start` binds (or raises); :meth:`serve_forever` runs the loop until
    :meth:`stop`; :meth:`close` releases the socket, its lock and the pool."""

    def __init__(self, options: NodeOptions) -> None:
        self.options = options
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._sel = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._lock_fd: int | None = None
        self._pool_fd: int | None = None
        self._conns: dict[int, Conn] = {}
        self._recv_view = memoryview(bytearray(RECV_BYTES))  # the loop thread's one read buffer
        self._next_session = 1
        self._gid = resolve_group(options.group)
        self.slot_bytes: int | None = None
        self.stride = 0
        self.index: NodeIndex | None = None
        self.started_at = time.time()
        self.pool_id = secrets.token_hex(8)  # names this pool: a restarted service's pool is another one
        self.rejected_peers = 0
        self.protocol_errors = 0  # connections closed for a frame that is not a valid request
        self.internal_errors = 0  # requests whose handling raised (logged; the connection closed)
        self.slow_readers = 0  # connections closed for not reading their replies
        self._max_queued = MAX_QUEUED_REPLY_BYTES
        self.sessions_released = 0
        self._detached: OrderedDict[str, None] = OrderedDict()  # engines with no session, last to leave last
        self.lookup_seconds: deque[float] = deque(maxlen=4096)  # the service's own time per lookup, latest
        self.below: NodeTiers | None = None  # the tiers below the pool (made at start: they map it)
        self._pool_map: mmap.mmap | None = None
        if options.slot_bytes is not None:
            self._cut(options.slot_bytes)

    # --- start-up ------------------------------------------------------------------------
    def _cut(self, slot_bytes: int) -> None:
        """Cut the pool into slots of ``slot_bytes`` (only while it holds nothing)."""
        if slot_bytes <= 0:
            raise NodeConfigError(f"slot size must be positive, got {slot_bytes}")
        stride = slot_stride(slot_bytes)
        if stride > self.options.pool_bytes:
            raise NodeConfigError(
                f"--pool-bytes {self.options.pool_bytes} is smaller than one slot ({stride} bytes for blocks "
                f"of {slot_bytes} bytes): give a larger --pool-bytes")
        self.slot_bytes, self.stride = slot_bytes, stride
        self.index = NodeIndex(self.options.pool_bytes // stride, self.options.policy)
        largest_reply = MAX_KEYS * 16 + self.index.num_slots * 5  # statuses, and every slot's number
        self._max_queued = max(MAX_QUEUED_REPLY_BYTES, 2 * largest_reply)
        if self.below is not None:
            self.below.bind(self.index, stride, slot_bytes)

    def start(self) -> None:
        path = self.options.socket_path
        check_pool_size(self.options.pool_bytes)
        if not path.parent.is_dir():
            raise NodeConfigError(f"--socket {path}: directory {path.parent} does not exist")
        self._lock_fd = hold_socket_lock(path)
        try:
            clear_dead_socket(path)
            self._pool_fd = create_pool_fd(self.options.pool_bytes, prefault=self.options.prefault)
            if self.options.tiers:
                self._pool_map = mmap.mmap(self._pool_fd, self.options.pool_bytes, mmap.MAP_SHARED,
                                           mmap.PROT_READ | mmap.PROT_WRITE)
                self.below = NodeTiers(self.options.tiers, memoryview(self._pool_map))
                if self.index is not None:
                    self.below.bind(self.index, self.stride, self.slot_bytes or 0)
                self._sel.register(self.below.bell.fd, selectors.EVENT_READ, _BELL)
            self._listener = listen(path, self._gid)
            self._sel.register(self._listener, selectors.EVENT_READ, None)
        except BaseException:
            self.close()
            raise
        log.info("kvtier node serving %s: pool %d bytes", path, self.options.pool_bytes)

    # --- the loop ------------------------------------------------------------------------
    def serve_forever(self, poll_s: float = 0.2) -> None:
        next_poll = 0.0
        while not self._stop.is_set():
            rang = False
            for key, events in self._sel.select(timeout=poll_s):
                if key.data is None:
                    self._accept()
                    continue
                if key.data is _BELL:  # a tier posted outcomes
                    rang = True
                    continue
                conn: Conn = key.data
                if events & selectors.EVENT_READ:
                    self._read(conn)
                if events & selectors.EVENT_WRITE and not conn.closing:
                    self._flush(conn)
            if self.below is not None and (rang or time.monotonic() >= next_poll):
                next_poll = time.monotonic() + poll_s
                with self.lock:
                    try:
                        self.below.poll()
                    except Exception:  # noqa: BLE001 (a tier's bug costs its outcomes, never the loop)
                        self.internal_errors += 1
                        log.exception("kvtier node: applying the tiers' outcomes failed")

    def stop(self) -> None:
        """Ask the loop to return (any thread, or a signal handler)."""
        self._stop.set()

    def close(self) -> None:
        for conn in list(self._conns.values()):
            self._drop(conn, "service stopping")
        if self.below is not None:
            self._sel.unregister(self.below.bell.fd)
            self.below.close()
            self.below = None
        if self._pool_map is not None:
            try:
                self._pool_map.close()
            except BufferError:  # a tier's finished job still views a slot: unmapped when collected
                pass
            self._pool_map = None
        if self._listener is not None:
            self._sel.unregister(self._listener)
            self._listener.close()
            self._listener = None
            try:
                self.options.socket_path.unlink()
            except FileNotFoundError:
                pass
        if self._pool_fd is not None:
            os.close(self._pool_fd)
            self._pool_fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock; the lock file stays (harmless, reused)
            self._lock_fd = None
        self._sel.close()

    def _allowed(self, uid: int, gid: int, pid: int) -> bool:
        if uid in (0, os.getuid()):
            return True
        return self._gid is not None and (gid == self._gid or self._gid in groups_of(pid))

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(False)
        pid, uid, gid = peer_credentials(sock)
        if not self._allowed(uid, gid, pid):
            self.rejected_peers += 1
            who = f"uid {os.getuid()}" + (f" and group {self.options.group}" if self._gid is not None else "")
            message = (f"kvtier node at {self.options.socket_path} admits only {who}; this client runs as "
                       f"uid {uid} gid {gid} (start the service with --group GROUP to admit a group)")
            log.warning("refused pid %d: %s", pid, message)
            try:
                sock.send(pack({"ok": False, "error": message}))  # a fresh socket's buffer takes it
            except OSError:
                pass
            sock.close()
            return
        conn = Conn(sock, uid, pid)
        with self.lock:  # the metrics thread iterates the connections
            self._conns[sock.fileno()] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: Conn) -> None:
        try:
            got = conn.sock.recv_into(self._recv_view)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(conn, f"read failed: {exc}")
            return
        if not got:
            self._drop(conn, "closed by peer")
            return
        try:
            messages = conn.reader.feed(self._recv_view[:got])
        except ProtocolError as exc:
            self.protocol_errors += 1
            conn.out += pack({"ok": False, "error": f"not this protocol: {exc}"})
            conn.hang_up = True
            messages = []
        for message in messages:
            fds: list[int] = []
            with self.lock:
                start = time.perf_counter()
                reply, lookup = self._answer(conn, message, fds)
                if lookup:
                    self.lookup_seconds.append(time.perf_counter() - start)
            if fds:
                conn.fds, conn.fd_at = fds, len(conn.out)
            conn.out += pack(reply)
            if conn.hang_up:
                break
        else:
            if conn.reader.error is not None:  # the stream broke after these messages
                self.protocol_errors += 1
                conn.out += pack({"ok": False, "error": f"not this protocol: {conn.reader.error}"})
                conn.hang_up = True
        self._flush(conn)
        if conn.hang_up and not conn.closing:
            self._drop(conn, "bad request")

    def _answer(self, conn: Conn, message: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], bool]:
        """The reply to one message, and whether it was a lookup. Never raises: a message that is
        not a valid request, or whose handling raised, is answered with an error and its
        connection marked to close (:attr:`Conn.hang_up`)."""
        try:
            request = parse_request(message)
        except BadRequest as exc:
            self.protocol_errors += 1
            conn.hang_up = True
            return {"ok": False, "error": f"bad request: {exc}", "field": exc.field}, False
        try:
            return self._handle(conn, request, fds), type(request) is Lookup
        except Exception:  # noqa: BLE001 (a bug must cost one connection, never the service)
            self.internal_errors += 1
            conn.hang_up = True
            fds.clear()
            log.exception("kvtier node: a %s request of pid %d failed; its connection is closed",
                          type(request).__name__.lower(), conn.pid)
            return {"ok": False, "error": f"the service failed on this {type(request).__name__.lower()} request "
                                          "(a bug: see the service's log)"}, False

    def _flush(self, conn: Conn) -> None:
        """Write what the peer's socket takes now (never waits); drop a peer with too much unread."""
        out = conn.out
        try:
            while out:
                if not conn.fds:
                    sent = conn.sock.send(out)
                elif conn.fd_at:  # replies before the hello's
                    sent = conn.sock.send(out[:conn.fd_at])
                    conn.fd_at -= sent
                else:
                    sent = socket.send_fds(conn.sock, [out], conn.fds)
                    conn.fds = []  # sent with its first byte
                del out[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            self._drop(conn, f"write failed: {exc}")
            return
        if len(out) > self._max_queued:
            self.slow_readers += 1
            self._drop(conn, f"{len(out)} bytes of replies unread")
            return
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if out else 0)
        if want != conn.events:
            conn.events = want
            self._sel.modify(conn.sock, want, conn)

    def _drop(self, conn: Conn, why: str) -> None:
        if conn.closing:
            return
        conn.closing = True
        with self.lock:
            if conn.session is not None and self.below is not None:
                self.below.release(conn.session)
            if conn.session is not None and self.index is not None:
                aborted, unpinned = self.index.release_session(conn.session)
                self.sessions_released += 1
                log.info("engine %s (pid %d) detached (%s): %d reservations aborted, %d pins released",
                         conn.session.engine, conn.pid, why, aborted, unpinned)
            self._conns.pop(conn.sock.fileno(), None)
            if conn.session is not None:
                self._note_detached(conn.session.engine)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    # --- requests ------------------------------------------------------------------------
    def _handle(self, conn: Conn, request: Request, fds: list[int]) -> dict[str, Any]:
        """The reply to a checked request (a refusal is an error reply, the connection kept)."""
        if type(request) is Hello:
            return self._hello(conn, request, fds)
        if type(request) is Stats:
            return {"ok": True, **self.snapshot()}
        session = conn.session
        if session is None or conn.role is not Role.SCHEDULER or self.index is None:
            return {"ok": False, "error": f"{type(request).__name__.lower()!r} needs a hello as role 'scheduler' first"}
        if type(request) is Lookup:
            keys, width, pin = request.keys, request.width, request.pin
            hits, slots, handle = self.index.lookup(session, keys, pin, width)
            pending, below = (self.below.after_lookup(session, keys, hits, width, pin, request.chain)
                              if self.below else (False, 0))
            return {"ok": True, "hits": hits, "slots": slots, "pin": handle, "pending": pending, "below": below}
        if type(request) is Unpin:
            return {"ok": True, "unknown": self.index.unpin(session, request.pins)}
        if type(request) is Reserve:
            if request.width > self.index.num_slots:
                return {"ok": False, "error": f"width {request.width} is more than this pool's "
                                              f"{self.index.num_slots} slots"}
            status, slots = self.index.reserve(session, request.keys, request.width, request.tails)
            return {"ok": True, "status": [s.value for s in status], "slots": slots}
        if type(request) is Commit:
            unknown = self.index.commit(session, request.keys)
            infos = request.blocks
            if self.below is not None and infos:
                self.below.committed(session, request.keys, infos)
            return {"ok": True, "unknown": unknown}
        assert type(request) is Abort
        return {"ok": True, "unknown": self.index.abort(session, request.keys)}

    def _hello(self, conn: Conn, hello: Hello, fds: list[int]) -> dict[str, Any]:
        engine = hello.engine or f"pid-{conn.pid}"
        self._detached.pop(engine, None)  # (re)attached: not among the departed
        if conn.role is not None:
            return {"ok": False, "error": "hello sent twice on one connection"}
        if hello.version != PROTOCOL_VERSION:
            return {"ok": False, "error": f"protocol version {hello.version} is not this service's "
                                          f"({PROTOCOL_VERSION}): run the same kvtier version in engines and node"}
        role, slot_bytes = hello.role, hello.slot_bytes
        if role.maps_pool:
            if slot_bytes is None and self.slot_bytes is None:
                return {"ok": False, "error": "this service's slot size is not set yet: the first engine to "
                                              "attach must give slot_bytes (or start it with --slot-bytes)"}
            if slot_bytes is not None and slot_bytes != self.slot_bytes:
                if self.index is not None and (self.index.blocks or self._engines_attached()):
                    return {"ok": False, "error":
                            f"this node's pool is cut into slots of {self.slot_bytes} bytes; this engine's "
                            f"blocks are {slot_bytes} bytes. One service serves one block size: run another "
                            "kvtier node (another --socket) for this model, or give the engines the same "
                            "block size"}
                try:
                    self._cut(slot_bytes)
                except NodeConfigError as exc:
                    return {"ok": False, "error": str(exc)}
        if role is Role.SCHEDULER:
            cap = None if hello.cap_bytes is None else hello.cap_bytes // self.stride
            if cap is not None and cap < 1:
                return {"ok": False, "error": f"cpu_bytes_to_use {hello.cap_bytes} is less than one slot of this "
                                              f"node's pool ({self.stride} bytes)"}
            conn.session = Session(self._next_session, engine, cap)
            self._next_session += 1
            if hello.namespace is not None and self.below is not None:
                self.below.attach(conn.session, *hello.namespace)
        conn.role = role
        if role.maps_pool:
            assert self._pool_fd is not None
            fds.append(self._pool_fd)
        return {"ok": True, "pool_bytes": self.options.pool_bytes, "slot_bytes": self.slot_bytes,
                "slot_stride": self.stride, "num_slots": self.index.num_slots if self.index else 0,
                "session": conn.session.id if conn.session else 0, "service_pid": os.getpid(),
                "pool_id": self.pool_id}

    def _note_detached(self, engine: str) -> None:
        """Keep the stats of the last :data:`KEEP_DETACHED_ENGINES` engines that left; forget older
        ones that hold nothing (engines come and go with fresh names: bounded memory and labels)."""
        if any(c.session is not None and c.session.engine == engine for c in self._conns.values()):
            return
        self._detached[engine] = None
        self._detached.move_to_end(engine)
        while len(self._detached) > KEEP_DETACHED_ENGINES:
            old, _ = self._detached.popitem(last=False)
            if self.index is not None and not self.index.charged.get(old):
                self.index.engines.pop(old, None)

    def _engines_attached(self) -> bool:
        return any(c.role is not None and c.role.maps_pool for c in self._conns.values())

    # --- observability -------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Counters and gauges (call with :attr:`lock` held, or from the loop thread)."""
        index = self.index
        attached: dict[str, int] = {}
        for conn in self._conns.values():
            if conn.session is not None:
                attached[conn.session.engine] = attached.get(conn.session.engine, 0) + 1
        engines = {}
        if index is not None:
            for name, stats in index.engines.items():
                engines[name] = {**asdict(stats), "held_slots": index.charged.get(name, 0),
                                 "sessions": attached.get(name, 0)}
        return {
            "socket": str(self.options.socket_path),
            "service_pid": os.getpid(),
            "pool_id": self.pool_id,
            "uptime_s": round(time.time() - self.started_at, 3),
            "policy": self.options.policy.value,
            "pool_bytes": self.options.pool_bytes,
            "slot_bytes": self.slot_bytes,
            "slot_stride": self.stride,
            "num_slots": index.num_slots if index else 0,
            "used_slots": index.used_slots if index else 0,
            "blocks": index.blocks if index else 0,
            "pinned_blocks": index.pinned_entries if index else 0,
            "evictions": index.evictions if index else 0,
            "run_evictions": index.run_evictions if index else 0,
            "connections": len(self._conns),
            "attached_engines": len(attached),
            "sessions_released": self.sessions_released,
            "lookup_service_us": percentiles(self.lookup_seconds),
            "rejected_peers": self.rejected_peers,
            "protocol_errors": self.protocol_errors,
            "internal_errors": self.internal_errors,
            "slow_readers": self.slow_readers,
            "engines": engines,
            "tiers": self.below.snapshot() if self.below is not None else None,
        }
