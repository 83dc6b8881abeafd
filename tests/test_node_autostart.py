"""``kvtier serve --node PATH`` where no service runs: kvtier starts a real ``kvtier node`` process
that outlives the command, attaches to one that runs, and says why when one cannot start."""

from __future__ import annotations

import os
import signal
import time

import click
import pytest
from click.testing import CliRunner

from kvtier.cli.main import main
from kvtier.cli.node_autostart import ensure_node_service
from kvtier.node import NodeClient, Role


def service_pid(sock) -> int:
    with NodeClient(sock, engine="test", role=Role.OBSERVER) as observer:
        return observer.connect().service_pid


def test_a_service_is_started_where_none_runs_and_reused_after(tmp_path):
    sock = tmp_path / "run" / "node.sock"
    pid = ensure_node_service(sock, 8 << 20)
    try:
        assert pid is not None and service_pid(sock) == pid
        with NodeClient(sock, engine="test", role=Role.OBSERVER) as observer:
            assert observer.connect().pool_bytes == 8 << 20
        assert os.getsid(pid) == pid, "the service runs in its own session (it outlives the engine)"
        assert ensure_node_service(sock, 16 << 20) is None and service_pid(sock) == pid  # the running one
    finally:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while sock.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_service_that_cannot_start_says_why(tmp_path):
    with pytest.raises(click.ClickException, match="more than this node can hold") as failed:
        ensure_node_service(tmp_path / "node.sock", 1 << 60)
    assert "kvtier node --socket" in failed.value.message


def test_node_pool_size_needs_node():
    result = CliRunner().invoke(main, ["serve", "--node-pool-size", "2"])
    assert result.exit_code == 2 and "--node-pool-size" in result.output and "give --node" in result.output, \
        result.output
