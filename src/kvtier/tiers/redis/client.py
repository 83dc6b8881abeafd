"""Connections of the Redis tier: a redis-py client (one server, or a Redis Cluster) built from a
:class:`~kvtier.core.tier_config.RedisTierConfig`, and the one primitive the tier's data path
uses, :meth:`RedisClient.run`: a batch of single-key commands in ONE round trip per server.

redis-py settings, and why (facts measured on redis-py 8.1, see the tier's notes):

- ``socket_connect_timeout`` / ``socket_timeout`` from the config, and ``Retry(NoBackoff(), 0)``:
  redis-py's defaults (5 s timeout, 10 retries with back-off) block ~60 s on a paused server. A
  failed batch costs at most about ``timeout_s``; the tier's circuit breaker decides what next.
  redis-py still reconnects by itself: a pooled connection whose server died is replaced when it
  is checked out, so a restarted server is used again without restarting anything.
- ``protocol=2`` (RESP2) on every connection: :mod:`~kvtier.tiers.redis.wire` reads the replies.
- Standalone: one ``BlockingConnectionPool`` of ``max_connections`` (a thread waits up to
  ``timeout_s`` for a connection instead of failing). Cluster (``cluster`` or ``nodes``):
  ``RedisCluster`` for the topology (slot map, one pool per node); keys have no hash tags, so a
  batch is split per node: each node gets its part of the batch in one round trip, all nodes
  concurrently (send to every node, then read every node).
- Credentials: from the URL, overridden by ``username`` and the password in ``password_env``.
  A refused login or an ACL refusal at start-up is a :class:`~kvtier.core.values.ConfigError`
  naming the URL (password redacted), the user and the fix; the password is never printed.

:meth:`RedisClient.run` checks a connection out of a redis-py pool, sends the packed commands
(:func:`~kvtier.tiers.redis.wire.pack`, payloads sent from the caller's buffers) and reads the
replies with a :class:`~kvtier.tiers.redis.wire.ReplyReader` (GET replies land in the caller's
buffers). A connection that failed mid-batch is disconnected before it goes back to its pool.
Every other command (PING, INFO, SCAN) goes through redis-py's API, per node.

Threading: thread-safe; used by the tier's worker and monitor threads (and by the tier's
constructor, which connects). Never by the caller's thread after start-up.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator, Sequence
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.connection import BlockingConnectionPool, parse_url
from redis.exceptions import AuthenticationError, NoPermissionError, RedisError
from redis.retry import Retry

from kvtier.core.tier_config import RedisTierConfig
from kvtier.core.values import PREFIX, ConfigError
from kvtier.tiers.redis import wire

logger = logging.getLogger(__name__)

# URL options that only make sense for one server (a cluster has db 0 and per-node pools).
_NOT_FOR_CLUSTER = ("db", "connection_class", "path", "host", "port", "max_connections", "timeout")


def is_connection_failure(exc: BaseException) -> bool:
    """Whether ``exc`` means the server could not be reached or did not answer in time (a
    circuit-breaker failure), as opposed to an answer that was an error."""
    if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)):
        return True  # includes AuthenticationError (a server that refuses us is unusable) and wire errors
    return isinstance(exc, (redis.exceptions.ClusterError, redis.exceptions.RedisClusterException))


_BYTES_REPR = re.compile(r"b'(?:[^'\\]|\\.)*'|b\"(?:[^\"\\]|\\.)*\"")


def safe_text(text: str, limit: int = 200) -> str:
    """``text`` fit for a log: byte reprs (``b'...'``, e.g. a bad magic) replaced by ``<bytes>``,
    cut where Redis starts echoing arguments (``... with args beginning with: 'key' 'value'``),
    newlines removed, at most ``limit`` characters. Never a value byte, whatever the message."""
    text = _BYTES_REPR.sub("<bytes>", text.replace("\n", " "))
    cut = text.find("args beginning with")
    if cut >= 0:
        text = text[:cut] + "args ..."
    return text[:limit]


def describe(exc: BaseException) -> str:
    """A short, safe description of ``exc`` for logs: its class and :func:`safe_text` of its message."""
    text = safe_text(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Replies(list):
    """The replies of one :meth:`RedisClient.run`, in command order, and its ``round_trips``
    (servers the batch was sent to)."""

    round_trips: int = 0


class RedisClient:
    """redis-py connections of one tier, and batches of data commands on them."""

    def __init__(self, config: RedisTierConfig) -> None:
        self.config = config
        self.cluster = bool(config.cluster or config.nodes)
        self._lock = threading.Lock()
        self._client: redis.Redis | redis.cluster.RedisCluster | None = None
        url_options = parse_url(config.url)
        self.user = config.username or url_options.get("username") or "default"
        self._options = self._redis_options(url_options)  # reads password_env: ConfigError if unset

    # ------------------------------------------------------------------ set-up

    def _redis_options(self, url_options: dict) -> dict:
        config = self.config
        options = dict(url_options)
        options.update(
            socket_timeout=config.timeout_s,
            socket_connect_timeout=config.connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
            protocol=2,
            health_check_interval=0,
            max_connections=config.max_connections,
        )
        if config.username:
            options["username"] = config.username
        password = config.password()
        if password is not None:
            options["password"] = password
        if self.cluster:
            if urlsplit(config.url).scheme == "rediss":
                options["ssl"] = True
            for name in _NOT_FOR_CLUSTER:
                options.pop(name, None)
            options["max_connections"] = config.max_connections
        else:
            options["timeout"] = config.timeout_s  # BlockingConnectionPool: wait for a free connection
        return options

    def _build(self) -> redis.Redis | redis.cluster.RedisCluster:
        if not self.cluster:
            pool = BlockingConnectionPool(**self._options)
            return redis.Redis(connection_pool=pool, retry=Retry(NoBackoff(), 0))
        from redis.cluster import ClusterNode, RedisCluster

        if self.config.nodes:
            hosts = [n.rsplit(":", 1) for n in self.config.nodes]
        else:
            parts = urlsplit(self.config.url)
            hosts = [[parts.hostname or "127.0.0.1", str(parts.port or 6379)]]
        startup = [ClusterNode(host, int(port)) for host, port in hosts]
        return RedisCluster(
            startup_nodes=startup,
            require_full_coverage=False,
            **self._options,
        )

    def connect(self) -> None:
        """Build the client if needed (a cluster: discover its topology) and PING every node.

        Raises :class:`ConfigError` if the server refuses the credentials or the ACL user may
        not run PING; any other failure (unreachable, timed out) propagates as redis-py raised it.
        """
        try:
            with self._lock:
                if self._client is None:
                    self._client = self._build()
                elif self.cluster:
                    self._client.nodes_manager.initialize()
            for node in self.node_clients():
                node.ping()
        except (AuthenticationError, NoPermissionError) as exc:
            raise self.config_error(exc) from None
        except redis.exceptions.RedisClusterException as exc:
            if "invalid username-password" in str(exc) or "NOAUTH" in str(exc):
                raise self.config_error(exc) from None
            raise

    def config_error(self, exc: BaseException, what: str = "") -> ConfigError:
        """The start-up error for a refused login or ACL check: URL (redacted), user, fix."""
        config = self.config
        where = f"{PREFIX}: Redis tier {config.redacted_url()} (user {self.user!r})"
        secret = f"the environment variable {config.password_env}" if config.password_env else "the URL"
        if isinstance(exc, NoPermissionError) or (isinstance(exc, wire.ReplyError) and exc.code == "NOPERM"):
            message = exc.message if isinstance(exc, wire.ReplyError) else str(exc)
            return ConfigError(
                f"{where}: the server's ACL refused {what or 'a command'}: {message}. Fix: allow this user "
                f"the keys '{config.key_prefix}:*' and the commands GET SET EXISTS UNLINK EXPIRE SCAN INFO "
                "PING "
                f"(e.g. ACL SETUSER {self.user} on ~{config.key_prefix}:* +@all), or set 'key_prefix' to a "
                "prefix it may use."
            )
        return ConfigError(
            f"{where}: the server refused the login ({describe(exc)}). Fix: check the password "
            f"(taken from {secret}) and that the ACL user {self.user!r} exists and is enabled "
            "('username' in the tier config, or user:password@ in the URL)."
        )

    def node_clients(self) -> list[redis.Redis]:
        """One redis-py client per server: the server itself, or every primary of the cluster."""
        client = self._require()
        if not self.cluster:
            return [client]
        return [client.get_redis_connection(node) for node in client.get_primaries()]

    def _require(self):
        client = self._client
        if client is None:
            raise redis.exceptions.ConnectionError("not connected yet")
        return client

    # ------------------------------------------------------------------ data path

    def run(
        self,
        commands: Sequence[Sequence[wire.Arg]],
        landings: Sequence[wire.Landing | None] | None = None,
    ) -> Replies:
        """Run single-key ``commands`` (``args[1]`` is the key): one round trip per server.

        Returns one reply per command (see :meth:`wire.ReplyReader.read`; GET ``i`` lands in
        ``landings[i]`` when given), or the exception that failed its server's part of the batch.
        Never raises for a failure of the server or the network.
        """
        replies = Replies([None] * len(commands))
        try:
            groups = self._groups(commands)
        except Exception as exc:  # no topology (cluster down), not connected
            replies[:] = [exc] * len(commands)
            return replies
        sent = []
        for pool, indexes in groups:
            conn = None
            try:
                conn = _checkout(pool)
                conn.send_packed_command(wire.pack([commands[i] for i in indexes]), check_health=False)
                sent.append((pool, conn, indexes))
            except Exception as exc:
                if conn is not None:
                    _drop(pool, conn)
                for i in indexes:
                    replies[i] = exc
        replies.round_trips = len(sent)
        redirected = False
        for pool, conn, indexes in sent:
            done = 0
            try:
                reader = wire.ReplyReader(conn._sock)
                for i in indexes:
                    reply = reader.read(landings[i] if landings is not None else None)
                    replies[i] = reply
                    done += 1
                    if isinstance(reply, wire.ReplyError) and reply.code in ("MOVED", "ASK"):
                        redirected = True
                reader.finish()
            except Exception as exc:
                _drop(pool, conn)
                for i in indexes[done:]:
                    replies[i] = exc
                if done == len(indexes):  # all replies were read, then junk followed: still a failure
                    for i in indexes:
                        replies[i] = exc
            else:
                pool.release(conn)
        if redirected:
            self._refresh_topology()
        return replies

    def _groups(self, commands: Sequence[Sequence[wire.Arg]]) -> list[tuple[object, list[int]]]:
        client = self._require()
        if not self.cluster:
            return [(client.connection_pool, list(range(len(commands))))]
        groups: dict[str, tuple[object, list[int]]] = {}
        for index, args in enumerate(commands):
            node = client.get_node_from_key(args[1])
            group = groups.get(node.name)
            if group is None:
                group = groups[node.name] = (client.get_redis_connection(node).connection_pool, [])
            group[1].append(index)
        return list(groups.values())

    def _refresh_topology(self) -> None:
        """A key moved (resharding, failover): reload the slot map (the batch's moved keys failed)."""
        try:
            with self._lock:
                self._client.nodes_manager.initialize()
        except Exception as exc:
            logger.warning("kvtier redis: reloading the cluster topology failed: %s", describe(exc))

    # ------------------------------------------------------------------ other commands

    def ping(self) -> None:
        """PING every server (raises on failure)."""
        for node in self.node_clients():
            node.ping()

    def info_memory(self) -> tuple[int, int]:
        """``(used_memory, maxmemory)`` summed over the servers (maxmemory 0: unlimited)."""
        used = limit = 0
        unlimited = False
        for node in self.node_clients():
            info = node.info("memory")
            used += int(info.get("used_memory", 0))
            node_limit = int(info.get("maxmemory", 0))
            unlimited |= node_limit == 0
            limit += node_limit
        return used, 0 if unlimited else limit

    def scan(self, pattern: bytes, count: int = 1000) -> Iterator[bytes]:
        """Every key matching ``pattern`` on every server (SCAN: never blocks the server)."""
        for node in self.node_clients():
            yield from node.scan_iter(match=pattern, count=count)

    def close(self) -> None:
        """Disconnect every connection. Idempotent."""
        with self._lock:
            client, self._client = self._client, None
        if client is None:
            return
        try:
            client.close()
            if not self.cluster:
                client.connection_pool.disconnect()
        except RedisError as exc:
            logger.debug("kvtier redis: closing: %s", describe(exc))


def _checkout(pool):
    try:
        return pool.get_connection()
    except TypeError:  # redis-py < 5.3 requires a command name
        return pool.get_connection("GET")


def _drop(pool, conn) -> None:
    """A connection whose stream position is unknown: disconnect it, then return it to its pool."""
    try:
        conn.disconnect()
    finally:
        pool.release(conn)
