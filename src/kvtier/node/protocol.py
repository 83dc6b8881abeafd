"""The node service's wire protocol: control messages only, framed and serialized by msgpack.

Every message is one msgpack map. A client sends a request ``{"op": Op, ...}`` and reads exactly
one reply (``{"ok": True, ...}`` or ``{"ok": False, "error": str}``) before its next request:
replies come back in request order on each connection, so no request ids are needed. A stream of
msgpack maps frames itself (:class:`FrameReader` wraps msgpack's streaming ``Unpacker``); the
only file descriptor ever passed is the pool's memfd, attached (``SCM_RIGHTS``) to the reply of
:attr:`Op.HELLO` for roles that map the pool.

Messages (fields beyond ``op``):

==========  =====================================================  ===============================================
op          request                                                reply
==========  =====================================================  ===============================================
hello       version, engine (str), role (Role), slot_bytes         pool_bytes, slot_bytes, slot_stride, num_slots,
            (int|None), cap_bytes (int|None), namespace (a         session (int), service_pid, pool_id (str); + the
            map, schedulers: digest, ranks, json, model; for       memfd
            the service's tiers, kvtier.node.below)
lookup      keys (list[bytes]), pin (bool), width (int: slots      hits (int: leading run READY), slots (list[int]:
            per key)                                               width per hit, only if pin), pin (int: the
                                                                   handle that pins the run; 0 if none), pending
                                                                   (bool: the run continues in the service's tiers
                                                                   and is being promoted: ask again), below (int:
                                                                   keys after the hits the tiers hold)
reserve     keys (list[bytes]), width (int: slots per key),        status (list[Reservation]), slots
            tails (list[int]: positions of tails, evicted first)
                                                                   (list[list[int] | None])
commit      keys, blocks (optional: [parent, num_tokens, tail]    unknown (int: keys not reserved by this session)
            per key, for the service's tiers)
abort       keys                                                   unknown
unpin       pins (list[int]: handles from lookup)                  unknown (int: handles not held by this session)
stats       --                                                     the service's counters (a map; see server.py)
==========  =====================================================  ===============================================

Keys are raw 32-byte block keys (:data:`kvtier.core.keys.BlockKey`): namespaces are already
chained into them, so two engines share a block exactly when they share its namespace.
"""

from __future__ import annotations

import enum
from typing import Any

import msgpack

PROTOCOL_VERSION = 2
MAX_FRAME_BYTES = 64 * 2**20
"""A single message larger than this is a broken or hostile peer: its connection is dropped."""
RECV_BYTES = 1 << 18
"""Bytes read per ``recv_into`` into a buffer allocated once per reader (the service's loop thread
has one; each client one, used under its lock). ``sock.recv(1 << 20)`` allocates the whole size
and shrinks it on every call: 32 us against 3.7 us per 33 KB read (a 1,000-key lookup) on a
socketpair here; end to end ~25 us per lookup round trip (docs/benchmarks.md, "Node service
lookups")."""


class Op(str, enum.Enum):
    """A request's operation."""

    HELLO = "hello"
    LOOKUP = "lookup"
    RESERVE = "reserve"
    COMMIT = "commit"
    ABORT = "abort"
    UNPIN = "unpin"
    STATS = "stats"


class Role(str, enum.Enum):
    """Who is attaching: decides whether the pool's memfd is passed and whether pins may be held."""

    SCHEDULER = "scheduler"  # looks up, reserves, commits, pins; maps the pool if it copies
    WORKER = "worker"  # maps the pool and copies engine pages <-> slots; holds nothing
    OBSERVER = "observer"  # `kvtier inspect`, metrics probes: stats only, no memfd

    @property
    def maps_pool(self) -> bool:
        return self is not Role.OBSERVER


class Reservation(str, enum.Enum):
    """What :attr:`Op.RESERVE` did with one key."""

    RESERVED = "reserved"  # slots handed out, WRITING, owned by this session until commit/abort
    PRESENT = "present"  # the node already holds (or is writing) the block: stored once, nothing to copy
    FULL = "full"  # every slot is pinned or reserved: the store is dropped
    CAPPED = "capped"  # this engine holds its cap_bytes and none of its blocks can be evicted


def pack(message: dict[str, Any]) -> bytes:
    """One frame: a msgpack map (bytes stay bytes, str stays str)."""
    return msgpack.packb(message, use_bin_type=True)


class FrameReader:
    """Splits a byte stream into messages. Feed it what ``recv`` returned; iterate the maps.

    Raises :class:`ProtocolError` on a frame that is not a map or is larger than
    :data:`MAX_FRAME_BYTES`. Not thread-safe: one reader per connection, one thread.
    """

    def __init__(self) -> None:
        self._unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_FRAME_BYTES,
                                          strict_map_key=False)

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        try:
            self._unpacker.feed(data)
            messages = list(self._unpacker)
        except (msgpack.BufferFull, msgpack.ExtraData, ValueError) as exc:
            raise ProtocolError(f"malformed frame: {exc}") from None
        for message in messages:
            if not isinstance(message, dict):
                raise ProtocolError(f"a frame must be a map, got {type(message).__name__}")
        return messages


class ProtocolError(Exception):
    """A peer sent something that is not this protocol."""
