"""Run a node service in this process until SIGTERM / SIGINT (what ``kvtier node`` calls).

The loop runs on the calling (main) thread; the signal handlers only ask it to stop, and it
closes the socket, its lock and the pool on the way out. With ``metrics_port`` the Prometheus
exporter serves ``/metrics`` on its own thread.
"""

from __future__ import annotations

import signal

from prometheus_client import start_http_server

from kvtier.node.metrics import registry_for
from kvtier.node.server import NodeOptions, NodeServer


def run(options: NodeOptions, *, metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
        ready=None) -> None:
    """Start (raising on a refused start-up), serve until a signal, then shut down."""
    server = NodeServer(options)
    server.start()
    try:
        if metrics_port is not None:
            start_http_server(metrics_port, addr=metrics_host, registry=registry_for(server))
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: server.stop())
        if ready is not None:
            ready(server)
        server.serve_forever()
    finally:
        server.close()
