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
            (int|None), cap_bytes (int|None), namespace (str,      session (int), service_pid, pool_id (str); + the
            schedulers: the namespace's JSON, as its engine        memfd
            writes a disk root's config.json; for the service's
            tiers, kvtier.node.tiers)
lookup      keys (list[bytes]), pin (bool), width (int: slots      hits (int: leading run READY), slots (list[int]:
            per key); optional: parent (bytes: the key before      width per hit, only if pin), pin (int: the
            keys[0]), tokens (int: of a block), tail_tokens        handle that pins the run; 0 if none), pending
            (int: of the last key, a tail; 0: none): they name     (bool: the run continues in the service's tiers
            the records of the blocks the service promotes         and is being promoted: ask again), below (int:
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

Fields a request's handler uses beyond keys and flags are read and checked here, in one place
(:func:`namespace_of`, :func:`chain_of`, :func:`blocks_of`): a wrong one raises ValueError naming
it, which the service answers as a refused request.
"""

from __future__ import annotations

import enum
import json
from typing import Any

import msgpack

from kvtier.core.keys import KEY_BYTES, BlockKey, Namespace
from kvtier.tiers.stack import BlockInfo, Chain

PROTOCOL_VERSION = 3
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


MAX_NAMESPACE_CHARS = 1 << 16
"""A hello's namespace JSON larger than this is not a namespace."""


def namespace_of(message: dict[str, Any]) -> tuple[Namespace, str, str] | None:
    """A scheduler's hello ``namespace``: (the namespace, its model's display name, its JSON as the
    service's disk root keeps it), or None if it sent none. The digests are the service's own,
    computed from it. Raises ValueError naming the field."""
    raw = message.get("namespace")
    if raw is None:
        return None
    try:
        if not isinstance(raw, str) or len(raw) > MAX_NAMESPACE_CHARS:
            raise TypeError(f"a JSON string of at most {MAX_NAMESPACE_CHARS} characters expected")
        data = json.loads(raw)
        model = data["model_name"]
        if not isinstance(model, str):
            raise TypeError("model_name must be a string")
        return Namespace.from_dict(data), model, raw
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"hello 'namespace' is not a namespace description: {exc}") from None


def chain_of(message: dict[str, Any]) -> Chain:
    """A lookup's ``parent``, ``tokens`` and ``tail_tokens`` (absent: an unnamed chain)."""
    parent = message.get("parent")
    if parent is None:
        return Chain()
    return Chain(_key(parent, "lookup 'parent'"), _count(message.get("tokens"), "lookup 'tokens'"),
                 _count(message.get("tail_tokens", 0), "lookup 'tail_tokens'"))


def blocks_of(message: dict[str, Any], keys: list[BlockKey]) -> list[BlockInfo] | None:
    """A commit's ``blocks``: one ``[parent, num_tokens, tail]`` per key (absent: None)."""
    raw = message.get("blocks")
    if not raw:
        return None
    if not isinstance(raw, list) or len(raw) != len(keys):
        raise ValueError(f"commit 'blocks' must list one [parent, num_tokens, tail] per key ({len(keys)})")
    infos = []
    for block in raw:
        if not isinstance(block, list | tuple) or len(block) != 3:
            raise ValueError("commit 'blocks': each must be [parent, num_tokens, tail]")
        infos.append(BlockInfo(_key(block[0], "commit 'blocks' parent"), _count(block[1], "commit 'blocks' num_tokens"),
                               bool(block[2])))
    return infos


def _key(value: Any, what: str) -> BlockKey:
    if not isinstance(value, bytes) or len(value) != KEY_BYTES:
        raise ValueError(f"{what} must be a {KEY_BYTES}-byte key")
    return value


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 31:
        raise ValueError(f"{what} must be a token count")
    return value
