"""The ``kvtier node`` service: one process per node that owns the pool and its index.

This module is the process and its loop: start-up and shut-down, the sockets, each connection's
turns and reply queue. What each request does (to the index, the sessions and the tiers), and
what a dropped connection's session releases, is :mod:`kvtier.node.handlers`; who is admitted,
:mod:`kvtier.node.admission`: both called by the loop.

Threads: one loop thread (the caller of :meth:`NodeServer.serve_forever`) accepts connections,
reads requests and answers them from memory (:class:`kvtier.node.index.NodeIndex`); it never
waits on any one client: sockets are non-blocking, replies (the hello's, with the pool's memfd,
too) queue per connection and are written as the peer reads them, so an engine that stops reading
stalls only itself (its connection is dropped, and counted in ``slow_readers``, once more than
``NodeServer.max_queued`` bytes are waiting: :data:`MAX_QUEUED_REPLY_BYTES`, or twice the
largest reply this pool can give if more). The Prometheus exporter's thread (if any) reads
:meth:`NodeServer.snapshot` under :attr:`NodeServer.lock`, which the loop holds while it handles
a request.

The loop is fair: each turn answers at most :data:`FRAMES_PER_TURN` frames of a connection (fewer
once they carried :data:`KEYS_PER_TURN` keys); the rest stay buffered, undecoded, in its
:class:`~kvtier.node.frames.FrameReader` and are answered in the next turns (the loop does not
wait in ``select`` while any are buffered, and reads no more from that socket until they are
answered). So a client that pipelines thousands of requests delays the others by one turn, not by
all of its requests, and what the service buffers per connection stays one read beside one
unfinished frame.

A client's frames may be hostile: each is decoded within bounds
(:class:`~kvtier.node.frames.FrameReader`) and checked field by field before use
(:func:`kvtier.node.messages.parse_request`, from :func:`kvtier.node.handlers.answer`); a frame
that is not a valid request is answered with an error naming the field and its connection is
closed (``protocol_errors``), and a request whose handling raises anyway is answered, logged and
closed (``internal_errors``).
Whatever else raises while one connection is served (a bug) closes that connection, logged and
counted in ``internal_errors``: the service never dies of a client's frame. Nothing a failed
request took stays held.

Bounds: at most ``--max-connections`` connections (:attr:`NodeOptions.max_connections`); a
connection beyond them gets an error frame and is closed at once (``refused_connections``,
:mod:`kvtier.node.admission`). An ``accept`` that fails for want of descriptors or memory
(EMFILE, ENFILE, ENOBUFS, ENOMEM) pauses accepting briefly and is logged
(:class:`~kvtier.node.conn.AcceptBackoff`, ``accept_errors``); the service goes on serving the
connections it has. Per session: pins bounded
(:data:`kvtier.node.index.MAX_SESSION_PINS`, :data:`~kvtier.node.index.MAX_SESSION_PINNED`).
Per-engine stats: bounded (:mod:`kvtier.node.roster`).

Start-up refuses, with an error naming what to change:

- a second service on the same socket (an ``flock`` on ``<socket>.lock`` held while it runs:
  :class:`NodeAlreadyRunning`); a socket file nobody serves (a dead service's) is replaced; a lock
  file that is a symlink or anything but a regular file of this user's (``O_NOFOLLOW``: planted by
  someone who can write the socket's directory) is refused, never followed or truncated (the
  socket and its lock: :mod:`kvtier.node.listener`);
- a pool larger than the node's memory (:class:`kvtier.node.pool.PoolTooLargeError`).

The pool's slot size: ``--slot-bytes`` (cut at start-up), or set by the hellos
(:mod:`kvtier.node.handlers`, which calls :meth:`NodeServer.cut_pool`).

Access: the socket is owner-only, or its group's with ``--group``, and each peer's credentials
are checked at accept (:mod:`kvtier.node.admission`).

When a connection drops (close, crash, SIGKILL: the kernel closes the socket), everything its
session held is released (reservations aborted, pins dropped: :func:`kvtier.node.handlers.release`).
The pool lives as long as this process: a restarted service starts with an empty pool and engines
reattach by themselves.

Tiers below the pool (``--disk-dir``, ``--redis-url``: :attr:`NodeOptions.tiers`) are the
service's (:mod:`kvtier.node.tiers`, the same promotion and cascade as an embedded engine's):
commits cascade to them and pinning lookups promote from them; their I/O runs on their own
threads, which wake the loop through a socket pair it selects on, so the loop never waits on tier
I/O; the loop also polls them every ``poll_s`` (their periodic refresh). A disk root outlives the service: after a restart the
first lookups are disk hits, promoted into the new pool.
"""

from __future__ import annotations

import contextlib
import mmap
import logging
import os
import secrets
import selectors
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.core.config import PolicyName
from kvtier.core.tier_config import SecondaryTierConfig
from kvtier.node.admission import admit
from kvtier.node.conn import RESOURCE_ERRNOS, AcceptBackoff, Conn
from kvtier.node.frames import ProtocolError
from kvtier.node.handlers import answer, release
from kvtier.node.index import NodeIndex
from kvtier.node.listener import (NodeConfigError, clear_dead_socket, hold_socket_lock, listen,
                                  resolve_group)
from kvtier.node.pool import check_pool_size, create_pool_fd, slot_stride
from kvtier.node.protocol import MAX_KEYS, RECV_BYTES, pack
from kvtier.node.roster import Roster
from kvtier.node.snapshot import snapshot
from kvtier.node.tiers import NodeTiers

log = logging.getLogger("kvtier.node")

MAX_QUEUED_REPLY_BYTES = 16 * 2**20
"""Replies waiting for a peer that does not read; beyond this (or twice the largest reply a pool of
this many slots can give, if more: :attr:`NodeServer.max_queued`) its connection is dropped."""
MAX_CONNECTIONS = 256
"""Default of ``--max-connections``: an engine holds 1 + its tensor-parallel size connections
(its scheduler's and one per worker rank), so 256 serve some 28 engines of TP 8."""
FRAMES_PER_TURN = 8
"""Frames of one connection answered per turn of the loop (see the module docstring)."""
KEYS_PER_TURN = MAX_KEYS
"""... or fewer, once the frames answered in the turn carried this many keys (or pin handles)."""


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
    max_connections: int = MAX_CONNECTIONS  # beyond them a new connection is closed at once (counted)


class NodeServer:
    """The service. :meth:`start` binds (or raises); :meth:`serve_forever` runs the loop until
    :meth:`stop`; :meth:`close` releases the socket, its lock and the pool.

    Its state is the loop thread's: the request handlers (:mod:`kvtier.node.handlers`) read and
    change it on that thread under :attr:`lock` (the index, the tiers below, the roster, the slot
    size through :meth:`cut_pool`, :attr:`next_session`, the counters), and the metrics thread
    reads it under :attr:`lock` (:meth:`snapshot`)."""

    def __init__(self, options: NodeOptions) -> None:
        self.options = options
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._sel = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._lock_fd: int | None = None
        self.pool_fd: int | None = None
        self.conns: dict[int, Conn] = {}  # open connections by descriptor (the metrics thread reads it under lock)
        self._recv_view = memoryview(bytearray(RECV_BYTES))  # the loop thread's one read buffer
        self.next_session = 1
        self.gid = resolve_group(options.group)  # --group's gid, admitted too (None: none)
        self.slot_bytes: int | None = None
        self.stride = 0
        self.index: NodeIndex | None = None
        self.started_at = time.time()
        self.pool_id = secrets.token_hex(8)  # names this pool: a restarted service's pool is another one
        self.rejected_peers = 0
        self.protocol_errors = 0  # connections closed for a frame that is not a valid request
        self.internal_errors = 0  # requests (or connections) whose serving raised: a bug, logged; it is closed
        self.slow_readers = 0  # connections closed for not reading their replies
        self.refused_connections = 0  # connections closed at accept: --max-connections were open
        self.max_queued = MAX_QUEUED_REPLY_BYTES
        self.sessions_released = 0
        self.roster = Roster()  # engines that left, whose stats are kept a while
        self._backlog: dict[Conn, None] = {}  # connections with frames buffered, not answered yet
        self.accepting = AcceptBackoff(log)
        self.lookup_seconds: deque[float] = deque(maxlen=4096)  # the service's own time per lookup, latest
        self.percentiles: tuple[float, dict[str, float]] = (-float("inf"), {})  # (when, of lookup_seconds)
        self.below: NodeTiers | None = None  # the tiers below the pool (made at start: they map it)
        self._pool_map: mmap.mmap | None = None
        if options.slot_bytes is not None:
            self.cut_pool(options.slot_bytes)

    # --- start-up ------------------------------------------------------------------------
    def cut_pool(self, slot_bytes: int) -> None:
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
        self.max_queued = max(MAX_QUEUED_REPLY_BYTES, 2 * largest_reply)
        if self.below is not None:
            self.below.bind(self.index, stride, slot_bytes)

    def start(self) -> None:
        path = self.options.socket_path
        check_pool_size(self.options.pool_bytes)
        if self.options.max_connections < 1:
            raise NodeConfigError(f"--max-connections must be at least 1, got {self.options.max_connections}")
        if not path.parent.is_dir():
            raise NodeConfigError(f"--socket {path}: directory {path.parent} does not exist")
        self._lock_fd = hold_socket_lock(path)
        try:
            clear_dead_socket(path)
            self.pool_fd = create_pool_fd(self.options.pool_bytes, prefault=self.options.prefault)
            if self.options.tiers:
                self._pool_map = mmap.mmap(self.pool_fd, self.options.pool_bytes, mmap.MAP_SHARED,
                                           mmap.PROT_READ | mmap.PROT_WRITE)
                self.below = NodeTiers(self.options.tiers, memoryview(self._pool_map))
                if self.index is not None:
                    self.below.bind(self.index, self.stride, self.slot_bytes or 0)
                self._sel.register(self.below.bell.fd, selectors.EVENT_READ, _BELL)
            self._listener = listen(path, self.gid)
            self._sel.register(self._listener, selectors.EVENT_READ, None)
        except BaseException:
            self.close()
            raise
        log.info("kvtier node serving %s: pool %d bytes", path, self.options.pool_bytes)

    # --- the loop ------------------------------------------------------------------------
    def serve_forever(self, poll_s: float = 0.2) -> None:
        """One turn: what ``select`` reports (new connections, reads: a turn of each connection
        read, writes), then a turn of each connection with frames still buffered, then the tiers'
        outcomes and the periodic work. Nothing one connection does ends the loop."""
        next_poll = 0.0
        while not self._stop.is_set():
            rang = False
            timeout = 0.0 if self._backlog else poll_s
            if self.accepting.until:
                timeout = min(timeout, max(0.0, self.accepting.until - time.monotonic()))
            served: set[Conn] = set()
            for key, events in self._sel.select(timeout=timeout):
                if key.data is None:
                    self._accept()
                    continue
                if key.data is _BELL:  # a tier posted outcomes
                    rang = True
                    continue
                conn: Conn = key.data
                if events & selectors.EVENT_READ:  # its turn comes now
                    served.add(conn)
                self._guarded(conn, self._ready, conn, events)
            for conn in list(self._backlog):
                if conn not in served and not conn.closing:
                    self._guarded(conn, self._turn, conn)
            if self.accepting.due() and self._listener is not None:
                self._sel.register(self._listener, selectors.EVENT_READ, None)
            if rang or time.monotonic() >= next_poll:
                next_poll = time.monotonic() + poll_s
                self._periodic()

    def _periodic(self) -> None:
        """The tiers' outcomes and refresh; forgetting departed engines whose blocks are gone."""
        with self.lock:
            self.roster.prune(self.index)
            if self.below is None:
                return
            try:
                self.below.poll()
            except Exception:  # noqa: BLE001 (a tier's bug costs its outcomes, never the loop)
                self.internal_errors += 1
                log.exception("kvtier node: applying the tiers' outcomes failed")

    def _guarded(self, conn: Conn, serve, *args) -> None:  # noqa: ANN001 (one of the loop's methods)
        """``serve(*args)``; whatever it raises closes ``conn`` (logged, ``internal_errors``)."""
        try:
            serve(*args)
        except Exception:  # noqa: BLE001 (a bug must cost one connection, never the service)
            with self.lock:
                self.internal_errors += 1
            log.exception("kvtier node: serving pid %d failed; its connection is closed", conn.pid)
            try:
                self._drop(conn, "internal error")
            except Exception:  # noqa: BLE001 (releasing its session raised too: the socket is closed anyway)
                log.exception("kvtier node: releasing the session of pid %d failed", conn.pid)

    def stop(self) -> None:
        """Ask the loop to return (any thread, or a signal handler)."""
        self._stop.set()

    def close(self) -> None:
        for conn in list(self.conns.values()):
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
            with contextlib.suppress(KeyError):  # (not watched while accepting is paused)
                self._sel.unregister(self._listener)
            self._listener.close()
            self._listener = None
            try:
                self.options.socket_path.unlink()
            except FileNotFoundError:
                pass
        if self.pool_fd is not None:
            os.close(self.pool_fd)
            self.pool_fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock; the lock file stays (harmless, reused)
            self._lock_fd = None
        self._sel.close()

    def _accept(self) -> None:
        """Take one connection off the listener: refused (an error frame, then closed) if its
        peer is not admitted or ``max_connections`` are open (:func:`kvtier.node.admission.admit`).
        An accept that fails for want of resources pauses the listener (:class:`AcceptBackoff`);
        any other failure costs only that connection."""
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            if exc.errno in RESOURCE_ERRNOS:
                self.accepting.failed(exc)
                self._sel.unregister(self._listener)  # watched again once the pause is over
            else:  # ECONNABORTED and the like: that peer is gone
                log.debug("kvtier node: accept failed: %s", exc)
            return
        self.accepting.succeeded()
        try:
            conn = admit(self, sock)
            if conn is not None:
                self._sel.register(sock, selectors.EVENT_READ, conn)
                with self.lock:  # the metrics thread iterates the connections
                    self.conns[sock.fileno()] = conn
        except Exception:  # noqa: BLE001 (its peer went away during the checks, or a bug: that one only)
            log.exception("kvtier node: admitting a connection failed; it is closed")
            sock.close()

    def _ready(self, conn: Conn, events: int) -> None:
        """What ``select`` reported for ``conn``: readable, its turn (after a read, unless frames
        of it are still buffered: those are answered first); writable, a flush."""
        if events & selectors.EVENT_READ:
            if conn in self._backlog:
                self._turn(conn)
            else:
                self._receive(conn)
        if events & selectors.EVENT_WRITE and not conn.closing:
            self._flush(conn)

    def _receive(self, conn: Conn) -> None:
        """One read of ``conn`` (none of its frames buffered: what its reader holds is at most one
        unfinished frame), then its turn."""
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
            conn.reader.push(self._recv_view[:got])
        except ProtocolError as exc:  # (cannot happen: at most a frame and a read wait there)
            self._broken(conn, exc)
        self._turn(conn)

    def _broken(self, conn: Conn, exc: ProtocolError) -> None:
        """``conn``'s stream is not this protocol: answered so, then closed."""
        with self.lock:
            self.protocol_errors += 1
        conn.out += pack({"ok": False, "error": f"not this protocol: {exc}"})
        conn.hang_up = True

    def _turn(self, conn: Conn) -> None:
        """Answer ``conn``'s buffered frames: at most :data:`FRAMES_PER_TURN`, fewer once they
        carried :data:`KEYS_PER_TURN` keys or its unread replies passed :attr:`max_queued`. If
        it stopped at a bound, ``conn`` keeps a turn in the next iterations (:attr:`_backlog`)."""
        frames = keys = 0
        more = False
        while not conn.hang_up:
            try:
                message = conn.reader.next_message()
            except ProtocolError as exc:
                self._broken(conn, exc)
                break
            if message is None:
                break
            fds: list[int] = []
            with self.lock:
                reply, carried = answer(self, conn, message, fds)
            if fds:
                conn.fds, conn.fd_at = fds, len(conn.out)
            conn.out += pack(reply)
            frames, keys = frames + 1, keys + carried
            if frames >= FRAMES_PER_TURN or keys >= KEYS_PER_TURN or len(conn.out) > self.max_queued:
                more = not conn.hang_up
                break
        if more:
            self._backlog[conn] = None
        else:
            self._backlog.pop(conn, None)
        self._flush(conn)
        if conn.hang_up and not conn.closing:
            self._drop(conn, "bad request")

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
        if len(out) > self.max_queued:
            self.slow_readers += 1
            self._drop(conn, f"{len(out)} bytes of replies unread")
            return
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if out else 0)
        if want != conn.events:
            conn.events = want
            self._sel.modify(conn.sock, want, conn)

    def _drop(self, conn: Conn, why: str) -> None:
        """Close ``conn`` and release what its session held. Whatever raises on the way, the
        connection is gone from the loop and its socket closed."""
        if conn.closing:
            return
        conn.closing = True
        self._backlog.pop(conn, None)
        try:
            with self.lock:
                self.conns.pop(conn.sock.fileno(), None)
                release(self, conn, why)
        finally:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(conn.sock)
            conn.sock.close()
            conn.reader.close()  # its unfinished frame (up to MAX_FRAME_BYTES) goes now

    # --- observability -------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Counters and gauges (call with :attr:`lock` held, or from the loop thread):
        :func:`kvtier.node.snapshot.snapshot`."""
        return snapshot(self)
