"""Deadlines of the Redis tier's exchanges with its servers, so that nothing waits for a server forever.

redis-py's ``socket_timeout`` (the tier's ``timeout_s``) bounds each ``recv`` and ``send`` on its
own: an idle timeout that starts again with every byte, so a server that sends one byte every
``timeout_s / 2`` keeps a reply being read forever (and a server that reads one byte at a time
keeps a write being sent). This module bounds a whole *exchange*: what one thread does with one
connection between checking it out of a pool and having every answer (a batch's pipeline on one
server: connecting if needed, every command sent, every reply read; a PING; an ``INFO``; one
``SCAN`` page; a cluster's ``CLUSTER SLOTS``). Use::

    with exchange(seconds):
        ...  # redis-py calls on this thread, on connections of guarded() classes

(the tier's clients), or :func:`bounded_client`, a plain client whose every call is an exchange
(the operator tools, ``kvtier doctor``).

Every connection the thread checks out of a pool inside the block (the pool calls its
``connect()``) is *armed*: the exchange's deadline becomes ``seconds`` after that check-out (the
wait for a free connection before it is the pool's own, bounded by its ``timeout``; checking the
same connection out again keeps the deadline, another connection gets its own). When the
deadline passes, the watchdog thread marks the exchange expired and shuts the connection's
socket down (``socket.shutdown(SHUT_RDWR)``; during a TLS handshake, the plain socket under
it): the blocked ``recv`` / ``sendall`` returns at once, redis-py raises (and disconnects the
connection), and the ``with`` block raises :class:`ExchangeTimeout` (a redis-py
``TimeoutError``: a connection failure, as a server that does not answer) in place of what the
block raised, or even returned: an exchange that passed its deadline fails, whatever it read.
A check-out inside an expired exchange raises :class:`ExchangeTimeout` at once.

:func:`budget` is what the tier allows an exchange: ``connect_timeout_s + timeout_s`` plus its
bytes at :data:`FLOOR_BYTES_PER_S` (4 MiB/s), so that a big batch over a slow link is not cut.

Threads. One watchdog thread per process (``kvtier-redis-watchdog``, a daemon, started by the
first exchange that arms a connection; started again in a forked child). It sleeps until the
earliest deadline of the exchanges in flight, and is woken only when an exchange gets an earlier
deadline than that: an exchange that ends costs it nothing. :func:`exchange` runs on any thread
(one exchange per thread at a time; a nested one replaces the outer one until it ends).

Ownership (why the watchdog can never break a connection another thread uses). A connection's
socket belongs to the thread that checked the connection out. The watchdog never closes a
socket, never touches a connection's parser or buffers and never calls redis-py: it only calls
``shutdown`` on the socket of the connection its expired exchange armed last, and only while
that connection is still armed by it. Arming (at every check-out, by any thread: a check-out
outside an exchange disarms), expiring and leaving an exchange all happen under one lock, so a
connection checked out since by another thread is never touched, and neither is any connection
once its exchange has ended. A connection given back to its pool while its exchange is still
open may be shut down while idle: harmless, the pool's next check-out finds it readable and
reconnects. The thread that owns a connection whose exchange expired disconnects it (redis-py
does when its ``recv`` / ``send`` fails; the tier's pipelines do on any failure), so a half-read
connection never goes back to a pool as usable.

Not covered: the TCP connect itself is bounded by ``socket_connect_timeout``, not by the
deadline (the watchdog looks again every :data:`RETRY_S` until the connection has a socket); a
TLS handshake is covered where redis-py wraps the socket in ``SSLConnection._wrap_socket_with_ssl``
(as redis-py 8 does), else only by ``socket_timeout`` per ``recv``.
"""

from __future__ import annotations

import functools
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis
import redis.client
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

FLOOR_BYTES_PER_S = 4 << 20
"""The slowest transfer an exchange is allowed, in bytes per second of what it sends and asks
for (4 MiB/s, 32 Mbit/s): :func:`budget` gives each byte 1 / this many seconds. A batch of the
tier's at most 64 MiB gets 16 s on top of the timeouts, enough for about eight such batches at
once on a 1 Gbit/s link, where a hung or trickling server is found within that time."""


def budget(connect_timeout_s: float, timeout_s: float, nbytes: int = 0) -> float:
    """Seconds one exchange may take from its check-out: ``connect_timeout_s`` (a reconnect at
    check-out) + ``timeout_s`` + ``nbytes`` (sent, and asked for in replies) at
    :data:`FLOOR_BYTES_PER_S`."""
    return connect_timeout_s + timeout_s + max(0, nbytes) / FLOOR_BYTES_PER_S


class ExchangeTimeout(RedisTimeoutError):
    """An exchange passed its deadline (see the module docstring): a connection failure."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"no complete answer within {seconds:.3g} s (the exchange's deadline)")


class Exchange:
    """One thread's exchange: its deadline (None until a connection is armed), the connection
    armed last, and whether the watchdog expired it. Fields change under the watchdog's lock."""

    __slots__ = ("seconds", "deadline", "connection", "expired", "active")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline: float | None = None
        self.connection = None
        self.expired = False
        self.active = True


THREAD_NAME = "kvtier-redis-watchdog"
RETRY_S = 0.05
"""An expired exchange whose connection has no socket yet is looked at again this often."""

_current = threading.local()  # .exchange: this thread's Exchange, or None


class _Watchdog:
    """The process's watchdog (see the module docstring)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._armed: set[Exchange] = set()
        self._wake_at = math.inf  # when the thread wakes next (inf: only when notified)
        self._thread: threading.Thread | None = None

    def arm(self, connection) -> None:
        """A pool checks ``connection`` out (its ``connect()``) on this thread."""
        ex = getattr(_current, "exchange", None)
        with self._cond:
            connection._kvtier_exchange = ex
            if ex is None or not ex.active:
                return
            if ex.expired:
                raise ExchangeTimeout(ex.seconds)
            if ex.connection is not connection or ex.deadline is None:
                ex.connection = connection
                ex.deadline = time.monotonic() + ex.seconds
                self._armed.add(ex)
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
                    self._thread.start()
                if ex.deadline < self._wake_at:
                    self._cond.notify()

    def leave(self, ex: Exchange) -> bool:
        """End ``ex`` (its thread leaves the block); True if it expired. From here on the
        watchdog never touches its connection."""
        with self._cond:
            ex.active = False
            self._armed.discard(ex)
            return ex.expired

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                wake_at = math.inf
                for ex in list(self._armed):
                    if ex.deadline <= now and self._expire(ex):
                        self._armed.discard(ex)
                    else:
                        wake_at = min(wake_at, ex.deadline)
                self._wake_at = wake_at
                self._cond.wait(None if wake_at == math.inf else wake_at - now)

    def _expire(self, ex: Exchange) -> bool:
        """Under the lock: mark ``ex`` expired and shut its connection's socket down. False if it
        has no socket yet (a TCP connect under way): tried again in :data:`RETRY_S`."""
        ex.expired = True
        connection = ex.connection
        if connection is None or getattr(connection, "_kvtier_exchange", None) is not ex:
            return True
        sock = getattr(connection, "_sock", None) or getattr(connection, "_kvtier_raw", None)
        if sock is None:
            ex.deadline = time.monotonic() + RETRY_S
            return False
        try:
            socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the base method: never the TLS layer's state
        except (OSError, TypeError, ValueError):
            pass  # closed meanwhile by its owner: nothing to wake
        return True


_WATCHDOG = _Watchdog()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WATCHDOG._reset)


@contextmanager
def exchange(seconds: float) -> Iterator[Exchange]:
    """Bound what this thread does on guarded connections inside the block: ``seconds`` from each
    check-out (see the module docstring). Raises :class:`ExchangeTimeout` if the deadline passed
    and the block raised a connection failure, or returned."""
    outer = getattr(_current, "exchange", None)
    ex = Exchange(seconds)
    _current.exchange = ex
    try:
        yield ex
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        if _WATCHDOG.leave(ex) and not isinstance(exc, ExchangeTimeout):
            raise ExchangeTimeout(seconds) from exc
        raise
    except BaseException:
        _WATCHDOG.leave(ex)
        raise
    else:
        if _WATCHDOG.leave(ex):
            raise ExchangeTimeout(seconds)
    finally:
        _current.exchange = outer


class _Guarded:
    """Mixin of the tier's connection classes: arms the check-out (see the module docstring)."""

    _kvtier_exchange: Exchange | None = None
    _kvtier_raw: socket.socket | None = None

    def connect(self, *args, **kwargs):
        _WATCHDOG.arm(self)
        return super().connect(*args, **kwargs)

    def _wrap_socket_with_ssl(self, sock, *args, **kwargs):  # SSL connections (redis-py >= 6)
        self._kvtier_raw = sock  # the watchdog's way in while the handshake runs
        try:
            return super()._wrap_socket_with_ssl(sock, *args, **kwargs)
        finally:
            self._kvtier_raw = None


@functools.cache
def guarded(connection_class: type) -> type:
    """``connection_class`` (redis-py's ``Connection``, ``SSLConnection``...) whose check-outs are
    armed by the thread's :func:`exchange`. Idempotent."""
    if issubclass(connection_class, _Guarded):
        return connection_class
    return type(f"Guarded{connection_class.__name__}", (_Guarded, connection_class), {})


TOOL_REPLY_BYTES = 64 << 20
"""What one pipeline of :func:`bounded_client` may ask for by default (the operator tools read at
most 64 MiB of values per round trip): its share of the pipeline's :func:`budget`."""
COMMAND_REPLY_BYTES = 1 << 20
"""A single command's share (PING, INFO, one SCAN page, a GETRANGE of a config key)."""


def bounded_client(url: str, *, connect_timeout_s: float, timeout_s: float, reply_bytes: int = TOOL_REPLY_BYTES,
                   no_touch: bool = False, **kwargs) -> _BoundedRedis:
    """A redis-py client for one-off callers (``kvtier inspect / verify / purge`` on a URL, ``kvtier
    doctor``) in which every command (each ``SCAN`` page too) and every pipeline's ``execute`` is one
    exchange on a guarded connection, bounded by ``budget(connect_timeout_s, timeout_s, n)``, ``n``
    :data:`COMMAND_REPLY_BYTES` for a command and ``reply_bytes`` (the most a pipeline asks for) for
    a pipeline: a hung or trickling server fails the call with :class:`ExchangeTimeout` (a redis-py
    ``TimeoutError``) instead of holding the operator's command forever. No retries (a failure is
    the caller's answer). ``kwargs``: redis-py's (username, password...); the URL's scheme picks the
    connection (``rediss://``: TLS, ``unix://``). Not for clusters.

    ``no_touch``: every connection the client opens (a reconnection too) sends ``CLIENT NO-TOUCH
    ON`` right after redis-py's own handshake (AUTH, SELECT), so that what the caller reads
    (``STRLEN``, ``GETRANGE``...) leaves each key's LRU clock and LFU counter as they were: an
    observer does not reorder the server's evictions, nor reset the idle times ``OBJECT IDLETIME``
    reports. Redis and Valkey have it from 7.2 on; an older server (or an ACL user without that
    subcommand) refuses it, which is not an error: :meth:`_BoundedRedis.reads_touch` then says
    that reads do touch, for the caller to avoid those it can."""
    state = _NoTouch() if no_touch else None
    if state is not None:
        kwargs["redis_connect_func"] = state.on_connect  # redis-py calls it instead of on_connect()
    client = _BoundedRedis.from_url(url, socket_connect_timeout=connect_timeout_s, socket_timeout=timeout_s,
                                    retry=Retry(NoBackoff(), 0), protocol=2, **kwargs)  # RESP2, as the tier
    pool = client.connection_pool
    pool.connection_class = guarded(pool.connection_class)
    client.command_s = budget(connect_timeout_s, timeout_s, COMMAND_REPLY_BYTES)
    client.pipeline_s = budget(connect_timeout_s, timeout_s, reply_bytes)
    client.no_touch_state = state
    return client


class _NoTouch:
    """What ``CLIENT NO-TOUCH ON`` got on the connections of one :func:`bounded_client`: ``accepted``
    is None before the first connection, then True while every connection had it accepted, False
    from the first that had it refused on (one refusal is enough: the same server refuses it again)."""

    def __init__(self) -> None:
        self.accepted: bool | None = None

    def on_connect(self, connection) -> None:
        """redis-py's ``redis_connect_func``: its own handshake, then ``CLIENT NO-TOUCH ON``."""
        connection.on_connect()
        connection.send_command("CLIENT", "NO-TOUCH", "ON")
        try:
            connection.read_response()
        except redis.ResponseError:  # unknown subcommand (< 7.2) or NOPERM: reads touch
            self.accepted = False
            return
        if self.accepted is None:
            self.accepted = True


class _BoundedRedis(redis.Redis):
    """:func:`bounded_client`'s client: each command is an exchange of ``command_s`` seconds, each
    pipeline's execute one of ``pipeline_s``."""

    command_s: float = 0.0
    pipeline_s: float = 0.0
    no_touch_state: _NoTouch | None = None

    def reads_touch(self) -> bool:
        """Whether this client's reads of a key count as a use of it on the server (its LRU clock
        or LFU counter): True unless it was made with ``no_touch`` and the server accepted
        ``CLIENT NO-TOUCH`` (connects now, with a ``PING``, if it has not connected yet)."""
        if self.no_touch_state is None:
            return True
        if self.no_touch_state.accepted is None:
            self.ping()
        return not self.no_touch_state.accepted

    def execute_command(self, *args, **options):
        with exchange(self.command_s):
            return super().execute_command(*args, **options)

    def pipeline(self, transaction=True, shard_hint=None) -> redis.client.Pipeline:
        pipe = _BoundedPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.exchange_s = self.pipeline_s
        return pipe


class _BoundedPipeline(redis.client.Pipeline):
    """A pipeline of :class:`_BoundedRedis`: its ``execute`` is one exchange."""

    exchange_s: float = 0.0

    def execute(self, raise_on_error: bool = True):
        with exchange(self.exchange_s):
            return super().execute(raise_on_error)
