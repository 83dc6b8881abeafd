"""Connections of the Redis tier: a redis-py client (one server, or a Redis Cluster) built from a
:class:`~kvtier.core.tier_config.RedisTierConfig`, and the one primitive the tier's data path
uses, :meth:`RedisClient.run`: a batch of single-key commands pipelined on one pooled connection
per server (all sent in one write, then every reply read), i.e. one round trip per server. One
server's exchange is :func:`~kvtier.tiers.redis.pipeline.run_pipeline`; what a failure means and
how it is logged, :mod:`~kvtier.tiers.redis.errors`. This module owns the redis-py client (its
pools, the cluster's topology, the threads that run other nodes' pipelines).

Everything goes through redis-py: its connection pools and ``Connection`` methods
(``pack_commands``, ``send_packed_command``, ``read_response``: what its ``Pipeline`` runs on the
wire, without the pipeline object's bookkeeping), ``ping``, ``info``, ``scan_iter``; replies are
parsed by redis-py (with hiredis when it is installed). redis-py settings, and why (measured on
redis-py 8.1 + hiredis 3.5, see the tier's notes):

- ``command_packer``: :data:`~kvtier.tiers.redis.wire.COMMAND_PACKER`, redis-py's pure-Python
  RESP serializer extended to send a value given as parts (a block's headers and its host slots)
  uncopied (:mod:`~kvtier.tiers.redis.wire`), not redis-py's default. The default packer
  (hiredis ``pack_command``) copies every argument into one packed command: SET of a 5.9 MB
  value reached 330-400 MB/s.
- ``parser_class``: hiredis with a reader that keeps a value-sized buffer between replies
  (:func:`~kvtier.tiers.redis.wire.reply_parser`, when the client knows the tier's value size).
- A standalone pool gets both as connection arguments; a cluster's node pools are made by
  :class:`WirePool` (``connection_pool_class``: RedisCluster forwards only some connection
  arguments, neither of these).
- ``socket_connect_timeout`` / ``socket_timeout`` from the config, and ``Retry(NoBackoff(), 0)``:
  redis-py's defaults (5 s timeout, 10 retries with back-off) block ~60 s on a paused server. A
  server that stops answering costs a batch about ``timeout_s``; the tier's circuit breaker
  decides what next. redis-py still reconnects by itself: a pooled connection whose server died
  is replaced when it is checked out, so a restarted server is used again without restarting
  anything.
- Deadlines (:mod:`~kvtier.tiers.redis.deadline`): ``socket_timeout`` is an idle timeout (it
  starts again with every byte), so every exchange also has a deadline: one server's pipeline of
  a batch (check-out, send, every reply), each PING, ``INFO``, ``SCAN`` page and cluster slot-map
  load ends within ``connect_timeout_s + timeout_s + bytes / 4 MiB/s`` of its check-out (bytes:
  ``SET`` values sent and ``GETRANGE`` ranges asked for, plus
  :data:`~kvtier.tiers.redis.pipeline.COMMAND_BYTES` per command), else it fails as
  a connection failure (``ExchangeTimeout``) and its connection is disconnected. Both pools'
  connections are :func:`~kvtier.tiers.redis.deadline.guarded` classes.
- ``rediss://`` to a server that speaks plain RESP: the TLS handshake can only time out; a failed
  :meth:`RedisClient.connect` then asks the server a plaintext PING and, if it answers, raises a
  ConfigError saying so.
- ``protocol=2`` (RESP2) and ``health_check_interval=0`` (no PING before a batch).
- Standalone: one ``BlockingConnectionPool`` of ``max_connections`` (a thread waits up to
  ``timeout_s`` for a connection instead of failing). Cluster (``cluster`` or ``nodes``):
  ``RedisCluster`` for the topology (slot map, one pool per node); keys have no hash tags, so a
  batch is split per node (``get_node_from_key``) and each node gets its part pipelined on
  a connection of that node's pool, all nodes concurrently (the first on the calling thread, the others on
  ``kvtier-redis-node`` threads). Not redis-py's ``ClusterPipeline``: after a connection error it
  re-sends the failed commands one by one, each costing up to ``timeout_s`` on a paused node; a
  MOVED/ASK reply here fails its command and reloads the slot map instead.
- Credentials: from the URL, overridden by ``username`` and the password in ``password_env``.
  A refused login or an ACL refusal at start-up is a :class:`~kvtier.core.values.ConfigError`
  naming the URL (password redacted), the user and the fix; the password is never printed.

Replies come back as redis-py's ``read_response`` gives them (:mod:`~kvtier.tiers.redis.pipeline`:
a command's error reply is its exception, in its place, so one bad command does not fail the
batch); a node whose exchange failed (refused, reset, timed out: that connection is then
disconnected) gives that exception for each of its commands. Error messages are logged only
through :func:`~kvtier.tiers.redis.errors.describe` (never value bytes: byte reprs and echoed
arguments are cut).

Threading: thread-safe; used by the tier's worker and monitor threads (and by the tier's
constructor, which connects). Never by the caller's thread after start-up.
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.connection import BlockingConnectionPool, Connection, ConnectionPool, parse_url
from redis.exceptions import (
    AskError,
    AuthenticationError,
    NoPermissionError,
    RedisError,
)
from redis.retry import Retry

from kvtier.core.tier_config import RedisTierConfig
from kvtier.core.values import PREFIX, ConfigError
from kvtier.tiers.redis.deadline import budget, exchange, guarded
from kvtier.tiers.redis.errors import describe, is_connection_failure, safe_text
from kvtier.tiers.redis.errors import error_code  # noqa: F401 - re-exported (imported from here)
from kvtier.tiers.redis.heap import READER_SLACK
from kvtier.tiers.redis.pipeline import Reply
from kvtier.tiers.redis.pipeline import run_pipeline as _pipeline  # run() calls it by this name
from kvtier.tiers.redis.wire import COMMAND_PACKER, reply_parser

logger = logging.getLogger(__name__)

# URL options that only make sense for one server (a cluster has db 0 and per-node pools).
_NOT_FOR_CLUSTER = ("db", "connection_class", "path", "host", "port", "max_connections", "timeout")


class WirePool(ConnectionPool):
    """A cluster node's ``ConnectionPool`` with the tier's wire hooks (:mod:`~kvtier.tiers.redis.wire`):
    :data:`COMMAND_PACKER` and, given as ``wire_parser``, the reply parser. RedisCluster forwards
    neither ``command_packer`` nor ``parser_class`` to the pools it builds. Its connections are
    :func:`~kvtier.tiers.redis.deadline.guarded` (exchanges have deadlines)."""

    def __init__(self, *, wire_parser: type | None = None, **kwargs) -> None:
        kwargs.setdefault("command_packer", COMMAND_PACKER)
        if wire_parser is not None:
            kwargs.setdefault("parser_class", wire_parser)
        kwargs["connection_class"] = guarded(kwargs.get("connection_class", Connection))
        super().__init__(**kwargs)


class Replies(list):
    """The replies of one :meth:`RedisClient.run`, in command order (see :data:`~kvtier.tiers.redis.pipeline.Reply`), and its
    ``round_trips`` (pipelines run: one per server the batch went to)."""

    round_trips: int = 0


MIN_READ_SIZE = 64 << 10
MAX_READ_SIZE = 4 << 20
"""Bounds of a connection's receive buffer (``socket_read_size``): a value's size, within these."""


class RedisClient:
    """redis-py connections of one tier, and batches of data commands on them."""

    def __init__(self, config: RedisTierConfig, *, reply_bytes: int = 0) -> None:
        """``reply_bytes``: the size of the replies the tier reads (one value); each connection's
        reader keeps a buffer that size plus slack between replies (:func:`reply_parser`)."""
        self.config = config
        self._parser = reply_parser(reply_bytes + READER_SLACK) if reply_bytes > 0 else None
        # One recv per this many bytes: each needs the GIL again, and in an engine whose scheduler
        # thread spins (vLLM's one-process mode, a step that schedules nothing) every GIL hand-over
        # can wait the 5 ms switch interval; 64 KiB (redis-py's default) made a 5.9 MB value ~90.
        self._read_size = min(max(reply_bytes, MIN_READ_SIZE), MAX_READ_SIZE)
        self.cluster = bool(config.cluster or config.nodes)
        self._lock = threading.Lock()
        self._client: redis.Redis | redis.cluster.RedisCluster | None = None
        self._nodes_pool: ThreadPoolExecutor | None = None  # cluster: other nodes' pipelines
        self._nodes_lock = threading.Lock()
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
            for name in _NOT_FOR_CLUSTER:
                options.pop(name, None)
            options.pop("health_check_interval", None)  # not forwarded by RedisCluster (0 anyway)
            options["max_connections"] = config.max_connections
        else:
            options["timeout"] = config.timeout_s  # BlockingConnectionPool: wait for a free connection
            options["connection_class"] = guarded(options.get("connection_class", Connection))
            options["command_packer"] = COMMAND_PACKER
            if self._parser is not None:
                options["parser_class"] = self._parser
                options["socket_read_size"] = self._read_size
        return options

    def _build(self) -> redis.Redis | redis.cluster.RedisCluster:
        if not self.cluster:
            pool = BlockingConnectionPool(**self._options)
            return redis.Redis(connection_pool=pool, retry=Retry(NoBackoff(), 0))
        from redis.cluster import ClusterNode, RedisCluster

        parts = urlsplit(self.config.url)
        if self.config.nodes:
            hosts = [n.rsplit(":", 1) for n in self.config.nodes]
        else:
            hosts = [[parts.hostname or "127.0.0.1", str(parts.port or 6379)]]
        startup = [ClusterNode(host, int(port)) for host, port in hosts]
        # ``url`` (a startup node, no credentials: those are in the options) makes RedisCluster
        # build every node's pool with ``connection_pool_class`` (a rediss URL: TLS connections).
        scheme = "rediss" if parts.scheme == "rediss" else "redis"
        return RedisCluster(
            url=f"{scheme}://{hosts[0][0]}:{hosts[0][1]}/0",
            startup_nodes=startup,
            require_full_coverage=False,
            connection_pool_class=functools.partial(WirePool, wire_parser=self._parser),
            **self._options,
        )

    def connect(self) -> None:
        """Build the client if needed (a cluster: discover its topology) and PING every node, each
        one exchange (:meth:`budget`).

        Raises :class:`ConfigError` if the server refuses the credentials or the ACL user may
        not run PING, or if a ``rediss://`` server speaks plain RESP; any other failure
        (unreachable, timed out) propagates as redis-py (or the deadline) raised it.
        """
        try:
            with self._lock:
                if self._client is None:
                    with exchange(self.budget()):  # a cluster: its slot map
                        self._client = self._build()
                elif self.cluster:
                    with exchange(self.budget()):
                        self._client.nodes_manager.initialize()
            self.ping()
        except (AuthenticationError, NoPermissionError) as exc:
            raise self.config_error(exc) from None
        except redis.exceptions.RedisClusterException as exc:
            if "invalid username-password" in str(exc) or "NOAUTH" in str(exc):
                raise self.config_error(exc) from None
            self._check_tls(exc)
            raise
        except Exception as exc:
            self._check_tls(exc)
            raise

    def budget(self, nbytes: int = 0) -> float:
        """Seconds one exchange of ``nbytes`` (sent and asked for) may take from its check-out:
        :func:`~kvtier.tiers.redis.deadline.budget` of this tier's timeouts."""
        return budget(self.config.connect_timeout_s, self.config.timeout_s, nbytes)

    def _check_tls(self, exc: BaseException) -> None:
        """A ``rediss://`` URL whose connect failed: raise ConfigError if the server speaks plain
        RESP (it answers a plaintext PING), whose TLS handshake can only time out."""
        if urlsplit(self.config.url).scheme != "rediss" or not is_connection_failure(exc):
            return
        if self.config.nodes:
            host, port = self.config.nodes[0].rsplit(":", 1)
        else:
            parts = urlsplit(self.config.url)
            host, port = parts.hostname or "127.0.0.1", parts.port or 6379
        if _speaks_plain_resp(host, int(port), self.config.connect_timeout_s, self.config.timeout_s):
            raise ConfigError(
                f"{PREFIX}: Redis tier {self.config.redacted_url()}: the server at {host}:{port} "
                "speaks plain RESP, not TLS (it answered a plaintext PING; the TLS handshake of "
                "'rediss://' cannot complete). Fix: use 'redis://' in the URL, or enable TLS on the "
                "server (tls-port)."
            )

    def config_error(self, exc: BaseException, what: str = "") -> ConfigError:
        """The start-up error for a refused login or ACL check: URL (redacted), user, fix."""
        config = self.config
        where = f"{PREFIX}: Redis tier {config.redacted_url()} (user {self.user!r})"
        secret = f"the environment variable {config.password_env}" if config.password_env else "the URL"
        if isinstance(exc, NoPermissionError):
            return ConfigError(
                f"{where}: the server's ACL refused {what or 'a command'}: {safe_text(str(exc))}. Fix: "
                f"allow this user the keys '{config.key_prefix}:*' and the commands GETRANGE SET EXISTS "
                "UNLINK EXPIRE SCAN INFO PING "
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
        self, commands: Sequence[Sequence[object]], *, on_reply: Callable[[int, Reply], Reply] | None = None
    ) -> Replies:
        """Run single-key ``commands`` (argument tuples, ``args[1]`` is the key): one pipeline,
        so one round trip, per server. Returns one :data:`Reply` per command, in order. Never
        raises for a failure of the server or the network (the failure is the reply).

        ``on_reply(i, reply)``, if given, is called with command ``i``'s reply as soon as it is
        read, before the next one is, and what it returns is kept instead: the read path copies a
        value into its destination while the server is already sending the next one, and holds
        one reply at a time. It runs on the thread reading that server's replies (a cluster batch
        reads its servers concurrently, so calls for different servers may overlap). A node whose
        exchange fails later still gives its failure for every command, including those already
        passed to ``on_reply``."""
        replies = Replies([None] * len(commands))
        try:
            groups = self._groups(commands)
        except Exception as exc:  # no topology (cluster down), not connected
            replies[:] = [exc] * len(commands)
            return replies
        replies.round_trips = len(groups)
        limits = (self.config.connect_timeout_s, self.config.timeout_s)
        if len(groups) == 1:
            node, indexes = groups[0]
            outcomes = [_pipeline(node, commands, indexes, on_reply, limits=limits)]
        else:
            executor = self._executor()
            futures = [
                executor.submit(_pipeline, node, commands, indexes, on_reply, limits=limits)
                for node, indexes in groups[1:]
            ]
            node, indexes = groups[0]
            outcomes = [_pipeline(node, commands, indexes, on_reply, limits=limits)]
            outcomes += [_outcome(future) for future in futures]
        redirected = False
        for (_node, indexes), outcome in zip(groups, outcomes):
            if isinstance(outcome, BaseException):
                for i in indexes:
                    replies[i] = outcome
                continue
            for i, reply in zip(indexes, outcome):
                replies[i] = reply
                redirected |= isinstance(reply, AskError)  # MOVED (a subclass) or ASK
        if redirected:
            self._refresh_topology()
        return replies

    def _groups(self, commands: Sequence[Sequence[object]]) -> list[tuple[redis.Redis, list[int]]]:
        client = self._require()
        if not self.cluster:
            return [(client, list(range(len(commands))))]
        groups: dict[str, tuple[redis.Redis, list[int]]] = {}
        for index, args in enumerate(commands):
            node = client.get_node_from_key(args[1])
            group = groups.get(node.name)
            if group is None:
                group = groups[node.name] = (client.get_redis_connection(node), [])
            group[1].append(index)
        return list(groups.values())

    def _executor(self) -> ThreadPoolExecutor:
        with self._nodes_lock:
            if self._nodes_pool is None:
                self._nodes_pool = ThreadPoolExecutor(
                    max_workers=max(2, self.config.max_connections), thread_name_prefix="kvtier-redis-node"
                )
            return self._nodes_pool

    def _refresh_topology(self) -> None:
        """A key moved (resharding, failover): reload the slot map (the batch's moved keys failed)."""
        try:
            with self._lock, exchange(self.budget()):
                self._client.nodes_manager.initialize()
        except Exception as exc:
            logger.warning("kvtier redis: reloading the cluster topology failed: %s", describe(exc))

    # ------------------------------------------------------------------ other commands

    def ping(self) -> None:
        """PING every server (raises on failure), one exchange each."""
        for node in self.node_clients():
            with exchange(self.budget()):
                node.ping()

    def info_memory(self) -> tuple[int, int]:
        """``(used_memory, maxmemory)`` summed over the servers (maxmemory 0: unlimited)."""
        used = limit = 0
        unlimited = False
        for node in self.node_clients():
            with exchange(self.budget()):
                info = node.info("memory")
            used += int(info.get("used_memory", 0))
            node_limit = int(info.get("maxmemory", 0))
            unlimited |= node_limit == 0
            limit += node_limit
        return used, 0 if unlimited else limit

    def scan(self, pattern: bytes, count: int = 1000) -> Iterator[bytes]:
        """Every key matching ``pattern`` on every server (SCAN: never blocks the server), each
        page one exchange (the consumer's work between pages is not part of it)."""
        for node in self.node_clients():
            cursor = None
            while cursor != 0:
                with exchange(self.budget()):
                    cursor, names = node.scan(cursor or 0, match=pattern, count=count)
                yield from names

    def close(self) -> None:
        """Disconnect every connection (in use ones too: their exchanges fail). Idempotent; never
        waits for the network (a cluster's node threads end with their exchanges)."""
        with self._lock:
            client, self._client = self._client, None
        with self._nodes_lock:
            executor, self._nodes_pool = self._nodes_pool, None
        if executor is not None:
            executor.shutdown(wait=False)
        if client is None:
            return
        try:
            client.close()
            if not self.cluster:
                client.connection_pool.disconnect()
        except RedisError as exc:
            logger.debug("kvtier redis: closing: %s", describe(exc))


def _outcome(future) -> list[Reply] | BaseException:
    """A node thread's :func:`~kvtier.tiers.redis.pipeline.run_pipeline` outcome (its failure if the
    executor dropped it at close)."""
    try:
        return future.result()
    except BaseException as exc:  # CancelledError, RuntimeError: the client closed meanwhile
        return exc


def _speaks_plain_resp(host: str, port: int, connect_timeout_s: float, timeout_s: float) -> bool:
    """Whether ``host:port`` answers a plaintext ``PING`` with a RESP reply (``+PONG``, or an error
    such as ``-NOAUTH``): a plain Redis, not a TLS one. At most ``connect_timeout_s`` to connect
    and one ``recv`` of ``timeout_s``."""
    try:
        with socket.create_connection((host, port), timeout=connect_timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(b"PING\r\n")
            answer = sock.recv(64)
    except OSError:
        return False
    return answer[:1] in (b"+", b"-") and answer.endswith(b"\r\n")
