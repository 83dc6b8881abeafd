"""A real ``kvtier node`` service in this process (its loop on a thread) for unit tests: the same
server, index, pool and socket as ``kvtier node``; :meth:`NodeThread.stop` drops every connection
as a dying service would (SIGKILL-like: clients see their connections close)."""

from __future__ import annotations

import threading
from pathlib import Path

from kvtier.node.server import NodeOptions, NodeServer


class NodeThread:
    def __init__(self, sock: Path, pool_bytes: int, slot_bytes: int | None = None, tiers: tuple = (), **options):
        """``options``: any other :class:`NodeOptions` field (``max_connections``...)."""
        self.sock = sock
        self.server = NodeServer(NodeOptions(sock, pool_bytes=pool_bytes, slot_bytes=slot_bytes, prefault=False,
                                             tiers=tiers, **options))
        self.server.start()
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_s": 0.02}, daemon=True)
        self.thread.start()

    def stats(self) -> dict:
        with self.server.lock:
            return self.server.snapshot()

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(timeout=10)
        self.server.close()
