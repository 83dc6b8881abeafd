"""One cache per node: the ``kvtier node`` service and its client.

One process per machine (:mod:`kvtier.node.server`) owns a pool of fixed-size slots in shared
memory (:mod:`kvtier.node.pool`, a memfd handed to every client over the Unix socket) and the
pool's index and eviction policy (:mod:`kvtier.node.index`). Engines attach with
:class:`kvtier.node.client.NodeClient`: they look keys up, reserve, commit and release slots over
the socket (:mod:`kvtier.node.protocol`, msgpack frames; control only) and copy the bytes into
and out of the mapped pool themselves. Bytes never cross the socket.

This package imports no vLLM and no torch; the service runs without an engine.
"""

from kvtier.node.client import NodeClient, NodeError, NodeUnavailable
from kvtier.node.protocol import Op, Role

__all__ = ["NodeClient", "NodeError", "NodeUnavailable", "Op", "Role"]
