"""A real ``kvtier node`` service PROCESS (``python -m kvtier.cli.main node``) that a test can
start, SIGKILL and start again on the same socket; :meth:`NodeProcess.stats` asks it as an observer."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvtier.node import NodeClient, Role

SRC = Path(__file__).resolve().parents[2] / "src"


class NodeProcess:
    def __init__(self, sock: Path, pool_bytes: str = "64MiB", *more: str):
        self.sock = sock
        self.args = ["--pool-bytes", pool_bytes, *more]
        self.proc: subprocess.Popen | None = None

    def start(self) -> NodeProcess:
        env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        log = open(self.sock.with_suffix(".log"), "a")  # noqa: SIM115  (the child writes it)
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli.main", "node", "--socket", str(self.sock),
                                      *self.args], env=env, stdout=subprocess.DEVNULL, stderr=log)
        log.close()
        deadline = time.monotonic() + 60
        while True:
            with socket.socket(socket.AF_UNIX) as probe:
                try:
                    probe.connect(str(self.sock))
                    return self
                except OSError:
                    pass
            assert self.proc.poll() is None, self.sock.with_suffix(".log").read_text()
            assert time.monotonic() < deadline, "kvtier node did not start"
            time.sleep(0.05)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)

    def stats(self) -> dict:
        with NodeClient(self.sock, engine="test", role=Role.OBSERVER) as observer:
            observer.connect()
            return observer.stats()
