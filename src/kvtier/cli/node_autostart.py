"""``kvtier serve --node PATH`` where no node service runs yet: start one that outlives the engine.

The service started here is a separate ``kvtier node`` process in its own session (it is the
node's, not this engine's: other engines attach to it, and it keeps the pool warm across this
engine's restarts), logging to ``<socket>.log``. Two engines starting at once both try; the
service's own lock on the socket lets one run, and the other engine attaches to it.

Caller's thread, before vLLM starts; blocks for at most :data:`START_TIMEOUT_S`.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import click

from kvtier.node import NodeClient, NodeError, NodeUnavailable, Role

START_TIMEOUT_S = 60.0
"""The longest wait for a started service to answer (pre-faulting a large pool takes a while)."""


def _answers(socket_path: Path) -> bool:
    """Whether a node service answers on ``socket_path``; a service that refuses this user stops
    here with its reason (attaching would fail the same way)."""
    try:
        with NodeClient(socket_path, engine="kvtier-serve", role=Role.OBSERVER, timeout_s=2.0) as probe:
            probe.connect()
        return True
    except NodeUnavailable:
        return False
    except NodeError as exc:
        raise click.ClickException(f"--node {socket_path}: the kvtier node service there refused this user: {exc}")


def ensure_node_service(socket_path: Path, pool_bytes: int) -> int | None:
    """Start ``kvtier node --socket socket_path --pool-bytes pool_bytes`` unless a service answers
    there already; return the started service's pid (None: one was running). Raises
    ClickException with the service's own error (its log's last lines) if it does not come up."""
    if _answers(socket_path):
        return None
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    log_path = socket_path.with_name(socket_path.name + ".log")
    with open(log_path, "ab") as log:
        service = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli.main", "node", "--socket", str(socket_path),
             "--pool-bytes", str(pool_bytes)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if _answers(socket_path):
            return service.pid if service.poll() is None else None  # (None: another engine's won the race)
        if service.poll() is not None and not _answers(socket_path):
            tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
            raise click.ClickException(f"--node {socket_path}: no kvtier node service ran there and the one started "
                                       f"for it stopped (exit {service.returncode}): " + " / ".join(tail) +
                                       f" (log: {log_path}). Start one yourself: kvtier node --socket "
                                       f"{socket_path} --pool-bytes BYTES")
        time.sleep(0.05)
    service.kill()
    raise click.ClickException(f"--node {socket_path}: the kvtier node service started for it did not answer "
                               f"within {START_TIMEOUT_S:.0f} s (log: {log_path})")
