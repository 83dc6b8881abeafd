"""The engine's end of the node service: one connection, one request at a time.

Who calls what: the scheduler process holds one :class:`NodeClient` with ``Role.SCHEDULER`` (it
looks up, reserves, commits and pins for its engine); each worker rank holds one with
``Role.WORKER`` only to receive and map the pool (:attr:`NodeClient.pool`). Calls are
synchronous request/reply, serialized by a lock (any thread may call; one waits for another's
reply). A call blocks at most ``timeout_s`` (memory-only work on the service: microseconds).

Failure is only ever a miss for the caller: a service that is gone, or stops answering, raises
:class:`NodeUnavailable` (the connection is dropped and everything it held is released by the
service); the next call after ``retry_interval_s`` reconnects by itself (a fresh hello, maybe a
new pool: :attr:`NodeClient.generation` counts attachments, so callers drop slot numbers of an
older one). A call that finds its connection closed by the service (restarted since) is tried
once more at once, on a fresh attachment. A request the service refuses raises
:class:`NodeError` with its message.

Before it sends anything, a scheduler's or worker's client checks who serves the socket
(:func:`kvtier.node.credentials.check_service`: root, this process's user, or ``node_uid``), and
before it maps the pool, that the memfd is sealed against resizing and as large as announced: a
service of another user, or a pool that could shrink under it, is refused (:class:`NodeError`).
Requests longer than :data:`~kvtier.node.protocol.MAX_KEYS` keys are sent as several (a lookup
asks for its first ``MAX_KEYS`` keys).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from kvtier.core.keys import BlockKey
from kvtier.core.residency import Medium
from kvtier.node.credentials import UntrustedService, check_service
from kvtier.node.frames import FrameReader, ProtocolError
from kvtier.node.pool import PoolMapping, PoolSealError
from kvtier.node.protocol import (MAX_KEYS, PROTOCOL_VERSION, RECV_BYTES, Op, Reservation, Role, decode_sources, pack,
                                  pack_keys, pack_u32, pack_u64)


class NodeUnavailable(ConnectionError):
    """The node service cannot be reached now (not running, restarting, or not answering)."""


class NodeError(RuntimeError):
    """The node service refused a request; the message says why and what to change."""


class _Closed(NodeUnavailable):
    """The service closed this connection (it stopped or restarted): a fresh one may be served."""


@dataclass(frozen=True)
class Attachment:
    """What the service told this client at hello."""

    pool_bytes: int
    slot_bytes: int | None
    slot_stride: int
    num_slots: int
    session: int
    service_pid: int
    pool_id: str  # a restarted service has another pool: slot numbers of an older pool_id mean nothing


class Hit(NamedTuple):
    """A lookup's answer: ``hits`` leading keys READY; with a pin, their slots (flat, ``width`` per
    key) and the handle that pins them (0: nothing pinned)."""

    hits: int
    slots: list[int]
    pin: int
    pending: bool = False  # the run continues in the service's tiers, being promoted: ask again
    below: int = 0  # keys after the hits the service's tiers hold
    sources: tuple[Medium | None, ...] = ()  # per hit, the tier the service promoted it from (None: the pool)


class NodeClient:
    """A connection to ``kvtier node`` at ``socket_path``. See the module docstring."""

    def __init__(self, socket_path: str | os.PathLike[str], *, engine: str, role: Role = Role.SCHEDULER,
                 slot_bytes: int | None = None, cap_bytes: int | None = None, map_pool: bool | None = None,
                 timeout_s: float = 5.0, retry_interval_s: float = 1.0, namespace: str | None = None,
                 node_uid: int | None = None) -> None:
        self.socket_path = Path(socket_path)
        self.engine = engine
        self.role = role
        self.slot_bytes = slot_bytes
        self.cap_bytes = cap_bytes
        self.map_pool = role.maps_pool if map_pool is None else map_pool
        self.timeout_s = timeout_s
        self.retry_interval_s = retry_interval_s
        self.namespace = namespace  # sent at hello (Namespace.config_json): the service's tiers store its blocks under it
        self.node_uid = node_uid  # a service's uid trusted besides root and this process's (config key node_uid)
        self.generation = 0
        self.attachment: Attachment | None = None
        self.pool: PoolMapping | None = None
        self._sock: socket.socket | None = None
        self._reader = FrameReader()
        self._pending: list[dict[str, Any]] = []
        self._recv_view = memoryview(bytearray(RECV_BYTES))  # read buffer, used under _lock
        self._lock = threading.RLock()
        self._last_attempt = -float("inf")

    # --- connection ----------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._sock is not None

    def connect(self) -> Attachment:
        """Connect and say hello now (raises :class:`NodeUnavailable` / :class:`NodeError`)."""
        with self._lock:
            self._disconnect()
            self._last_attempt = time.monotonic()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(str(self.socket_path))
            except FileNotFoundError:
                sock.close()
                raise NodeUnavailable(f"no kvtier node at {self.socket_path} (start one: kvtier node --socket "
                                      f"{self.socket_path} --pool-bytes BYTES)") from None
            except PermissionError:
                sock.close()
                raise NodeError(f"permission denied on {self.socket_path}: the kvtier node there admits another "
                                f"user (this process is uid {os.getuid()}); run as its user or start it with "
                                "--group GROUP") from None
            except OSError as exc:
                sock.close()
                raise NodeUnavailable(f"kvtier node at {self.socket_path}: {exc}") from None
            if self.role is not Role.OBSERVER:  # an observer sends nothing and maps nothing
                try:
                    check_service(sock, self.socket_path, self.node_uid)
                except UntrustedService as exc:
                    sock.close()
                    raise NodeError(str(exc)) from None
            self._sock = sock
            self._reader = FrameReader()
            self._pending = []
            reply, fds = self._roundtrip({"op": Op.HELLO.value, "version": PROTOCOL_VERSION, "engine": self.engine,
                                          "role": self.role.value, "slot_bytes": self.slot_bytes,
                                          "cap_bytes": self.cap_bytes, "namespace": self.namespace},
                                         want_fds=True)
            try:
                attachment = Attachment(reply["pool_bytes"], reply["slot_bytes"], reply["slot_stride"],
                                        reply["num_slots"], reply["session"], reply["service_pid"],
                                        reply["pool_id"])
                if self.map_pool and fds:
                    self.pool = PoolMapping(fds[0], attachment.pool_bytes, attachment.slot_bytes or 0,
                                            attachment.slot_stride)
            except PoolSealError as exc:
                self._disconnect()
                raise NodeError(f"kvtier node at {self.socket_path}: {exc}") from None
            finally:
                for fd in fds:
                    os.close(fd)
            self.attachment = attachment
            self.generation += 1
            return attachment

    def take_pool(self) -> PoolMapping | None:
        """The mapping of the pool this client attached to, handed to the caller, who then owns it
        (the client no longer closes it when it disconnects or reattaches): for a worker whose
        tensors view the pool and must outlive a service restart until its copies finish."""
        with self._lock:
            pool, self.pool = self.pool, None
            return pool

    def close(self) -> None:
        with self._lock:
            self._disconnect()

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self.attachment = None

    def _ensure(self) -> None:
        if self._sock is not None:
            return
        if time.monotonic() - self._last_attempt < self.retry_interval_s:
            raise NodeUnavailable(f"kvtier node at {self.socket_path} is unavailable (retrying every "
                                  f"{self.retry_interval_s:g} s)")
        self.connect()

    # --- one request ---------------------------------------------------------------------
    def _roundtrip(self, request: dict[str, Any], want_fds: bool = False) -> tuple[dict[str, Any], list[int]]:
        sock = self._sock
        assert sock is not None
        fds: list[int] = []
        try:
            try:
                sock.sendall(pack(request))
            except OSError:
                self._read_refusal(sock)  # a service that refused us wrote why before closing
                raise
            while not self._pending:
                if want_fds:
                    data, got, _flags, _addr = socket.recv_fds(sock, 1 << 16, 4)
                    fds.extend(got)
                else:
                    data = self._recv_view[:sock.recv_into(self._recv_view)]
                if not data:
                    raise _Closed(f"kvtier node at {self.socket_path} closed the connection")
                self._pending.extend(self._reader.feed(data))
        except (OSError, ProtocolError) as exc:
            for fd in fds:
                os.close(fd)
            self._disconnect()
            if isinstance(exc, NodeUnavailable):
                raise
            gone = _Closed if isinstance(exc, BrokenPipeError | ConnectionResetError) else NodeUnavailable
            raise gone(f"kvtier node at {self.socket_path}: {exc}") from None
        reply = self._pending.pop(0)
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            if request["op"] == Op.HELLO.value:
                self._disconnect()
            raise NodeError(reply.get("error", "request refused"))
        return reply, fds

    def _read_refusal(self, sock: socket.socket) -> None:
        """Raise the service's error frame if one is waiting on a connection it closed."""
        try:
            sock.settimeout(0.5)
            messages = self._reader.feed(sock.recv(1 << 16))
        except (OSError, ProtocolError):
            return
        for message in messages:
            if not message.get("ok", True):
                self._disconnect()
                raise NodeError(message.get("error", "refused"))

    def _call(self, op: Op, **fields: Any) -> dict[str, Any]:
        """One request; on a connection the service closed since (it restarted), one fresh attempt
        at once, in a new attachment (a timeout is not retried: a hung service blocks one call)."""
        with self._lock:
            self._ensure()
            try:
                reply, _ = self._roundtrip({"op": op.value, **fields})
            except _Closed:
                self.connect()
                reply, _ = self._roundtrip({"op": op.value, **fields})
            return reply

    # --- operations ----------------------------------------------------------------------
    def lookup(self, keys: Sequence[BlockKey], *, pin: bool = False, width: int = 1, parent: BlockKey | None = None,
               block_tokens: int = 0, tail_tokens: int = 0) -> Hit:
        """Leading run of ``keys`` (at most the first :data:`MAX_KEYS`) the pool holds READY with
        ``width`` slots each (one round trip for all of them). With ``pin`` the run is pinned for
        this engine under ``Hit.pin`` (release it with :meth:`unpin`) and its slots are returned,
        ``width`` per key, in key order. ``parent`` (the key before ``keys[0]``), ``block_tokens``
        and ``tail_tokens`` (> 0: the last key is a tail) name the records of blocks the service
        promotes (kept on its faster tiers)."""
        if len(keys) > MAX_KEYS:
            keys, tail_tokens = keys[:MAX_KEYS], 0  # (the tail was the last key)
        chain = {"parent": parent, "tokens": block_tokens, "tail_tokens": tail_tokens} if parent is not None else {}
        reply = self._call(Op.LOOKUP, keys=pack_keys(list(keys)), pin=pin, width=width, **chain)
        return Hit(reply["hits"], reply["slots"], reply["pin"], bool(reply.get("pending")), int(reply.get("below", 0)),
                   decode_sources(reply.get("sources"), reply["hits"]))

    def reserve(self, keys: Sequence[BlockKey], width: int = 1, tails: Sequence[int] = ()
                ) -> list[tuple[Reservation, list[int] | None]]:
        """Reserve ``width`` slots per key to write; each key's outcome and slots (RESERVED only).
        ``tails``: positions in ``keys`` of tails (partial blocks: the pool evicts them first)."""
        keys, answers = list(keys), []
        for start in _chunks(len(keys)):
            part = keys[start:start + MAX_KEYS]
            fields: dict[str, Any] = {"keys": pack_keys(part), "width": width}
            mine = [p - start for p in tails if start <= p < start + len(part)]
            if mine:
                fields["tails"] = pack_u32(mine)
            reply = self._call(Op.RESERVE, **fields)
            answers += [(Reservation(s), slots) for s, slots in zip(reply["status"], reply["slots"])]
        return answers

    def commit(self, keys: Sequence[BlockKey], blocks: Sequence[tuple[BlockKey, int, bool]] | None = None) -> int:
        """The reserved slots of ``keys`` are written on every rank: they become hits for everyone.
        ``blocks``: each key's ``(parent, num_tokens, tail)``, which the service's tiers store with it."""
        keys, unknown = list(keys), 0
        blocks = None if blocks is None else list(blocks)
        for start in _chunks(len(keys)):
            fields: dict[str, Any] = {"keys": pack_keys(keys[start:start + MAX_KEYS])}
            if blocks is not None:
                part = blocks[start:start + MAX_KEYS]
                fields["parents"] = pack_keys([b[0] for b in part])
                fields["tokens"] = pack_u32([b[1] for b in part])
                tails = [p for p, b in enumerate(part) if b[2]]
                if tails:
                    fields["tails"] = pack_u32(tails)
            unknown += self._call(Op.COMMIT, **fields)["unknown"]
        return unknown

    def abort(self, keys: Sequence[BlockKey]) -> int:
        keys = list(keys)
        return sum(self._call(Op.ABORT, keys=pack_keys(keys[start:start + MAX_KEYS]))["unknown"]
                   for start in _chunks(len(keys)))

    def unpin(self, pins: Sequence[int]) -> int:
        """Release pin handles (from :meth:`lookup`); returns how many this session did not hold."""
        pins = list(pins)
        return sum(self._call(Op.UNPIN, pins=pack_u64(pins[start:start + MAX_KEYS]))["unknown"]
                   for start in _chunks(len(pins)))

    def stats(self) -> dict[str, Any]:
        reply = dict(self._call(Op.STATS))
        reply.pop("ok", None)
        return reply

    def __enter__(self) -> NodeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _chunks(count: int) -> range:
    """Starts of the requests that carry ``count`` keys (one request for none)."""
    return range(0, max(count, 1), MAX_KEYS)
