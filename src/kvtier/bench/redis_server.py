"""A throwaway redis-server on 127.0.0.1 for ``kvtier bench``'s ``kvtier-redis`` mode (the shared
tier of a fleet of two engines, started and stopped by the benchmark).

The server comes from the OS package (``apt-get install -y redis-server``); it listens on loopback
only, persists nothing (``--save ""``, no AOF) and holds at most ``maxmemory_bytes`` with
``allkeys-lru`` (the setting docs/distributed.md recommends for a server dedicated to kvtier).
Used in the ``kvtier bench`` process only; the server is a subprocess in its own process group.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from kvtier.bench.servers import ServerError, free_port

INSTALL_HINT = "install it (Debian/Ubuntu: apt-get install -y redis-server) or leave kvtier-redis out of --modes"


@dataclass
class LocalRedis:
    """A running redis-server (see the module docstring); :meth:`stop` ends it."""

    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @classmethod
    def start(cls, workdir: Path, maxmemory_bytes: int, timeout_s: float = 15.0) -> LocalRedis:
        """Start the server in ``workdir`` and wait until it answers PING (ServerError if it does not)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise ServerError(f"the kvtier-redis mode needs redis-server on PATH: {INSTALL_HINT}")
        workdir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        log_path = workdir / "redis.log"
        argv = [binary, "--bind", "127.0.0.1", "--port", str(port), "--protected-mode", "yes",
                "--save", "", "--appendonly", "no", "--dir", str(workdir), "--logfile", str(log_path),
                "--maxmemory", str(maxmemory_bytes), "--maxmemory-policy", "allkeys-lru"]
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        server = cls(process, port, log_path)
        server._wait_ready(timeout_s)
        return server

    def _wait_ready(self, timeout_s: float) -> None:
        import redis

        deadline = time.monotonic() + timeout_s
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            while True:
                if self.process.poll() is not None:
                    raise ServerError(f"redis-server exited with code {self.process.returncode}; log: "
                                      f"{self.log_path}\n{self._tail()}")
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise ServerError(f"redis-server did not answer within {timeout_s:.0f} s; log: {self.log_path}")
                time.sleep(0.05)
        finally:
            client.close()

    def _tail(self, nbytes: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-nbytes:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s. Idempotent."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
            except ProcessLookupError:
                pass
