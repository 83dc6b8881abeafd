"""The node service's wire protocol: control messages only, framed and serialized by msgpack.

Every message is one msgpack map. A client sends a request ``{"op": Op, ...}`` and reads exactly
one reply (``{"ok": True, ...}`` or ``{"ok": False, "error": str}``) before its next request:
replies come back in request order on each connection, so no request ids are needed. A stream of
msgpack maps frames itself (:class:`kvtier.node.frames.FrameReader` wraps msgpack's streaming
``Unpacker``); the
only file descriptor ever passed is the pool's memfd, attached (``SCM_RIGHTS``) to the reply of
:attr:`Op.HELLO` for roles that map the pool.

Requests carry no arrays: every list is packed into one ``bin`` (``keys``: 32-byte keys end to
end; ``u32``/``u64``: native unsigned integers, both ends being one machine), so a request is one
map of scalars. That is what makes a request cheap to check and its cost bounded: see
:class:`kvtier.node.frames.FrameReader` and
:data:`kvtier.node.messages.MAX_FRAME_BYTES`.

Requests (fields beyond ``op``; [brackets]: optional, their default):

==========  =====================================================  ===============================================
op          request                                                reply
==========  =====================================================  ===============================================
hello       version (int), role (Role), [engine (str)],            pool_bytes, slot_bytes, slot_stride, num_slots,
            [slot_bytes (int)], [cap_bytes (int)], [namespace      session (int), service_pid, pool_id (str); + the
            (str, schedulers: the namespace's JSON, as its engine  memfd
            writes a disk root's config.json; for the service's
            tiers, kvtier.node.tiers)]
lookup      keys, [pin (bool): False], [width (int: slots per      hits (int: leading run READY), slots (list[int]:
            key): 1]; [parent (a key: the one before keys[0]),     width per hit, only if pin), pin (int: the
            tokens (int: of a block), [tail_tokens (int: of the    handle that pins the run; 0 if none), pending
            last key, a tail): 0]]: they name the records of the   (bool: the run continues in the service's tiers
            blocks the service promotes                            and is being promoted: ask again), below (int:
                                                                   keys after the hits the tiers hold), [sources
                                                                   (bin: one byte per hit, where the service
                                                                   promoted it from for this session:
                                                                   PROMOTED_FROM; only when some hit was)]
reserve     keys, width (int: slots per key), [tails (u32:         status (list[Reservation]), slots
            positions in keys of tails, evicted first)]            (list[list[int] | None])
commit      keys, [parents (keys), tokens (u32), [tails (u32:      unknown (int: keys not reserved by this session)
            positions)]: each key's record, for the service's
            tiers]
abort       keys                                                   unknown
unpin       pins (u64: handles from lookup)                        unknown (int: handles not held by this session)
stats       --                                                     the service's counters (a map; see server.py)
==========  =====================================================  ===============================================

Keys are raw 32-byte block keys (:data:`kvtier.core.keys.BlockKey`): namespaces are already
chained into them, so two engines share a block exactly when they share its namespace. A key may
repeat within a request (two requests of a step storing one block): a reserve answers its later
occurrences ``present``, a commit or abort counts them ``unknown``, and a lookup's run stops at
``num_slots // width`` keys, so no reply holds more slot numbers than the pool has slots. A
pinning lookup past the session's pin bounds is refused (:class:`kvtier.node.index.PinLimit`).

Every request is checked in one place before the service sees it: :mod:`kvtier.node.messages`
(:func:`~kvtier.node.messages.parse_request`).

Three modules, one job each: this one, what both ends share (the version, bounds, enums and the
packing of a request's fields); :mod:`kvtier.node.frames`, splitting a byte stream into maps within
bounds; :mod:`kvtier.node.messages`, a request's fields checked into a typed request. This one
holds no state and does no I/O: any thread of either end may call it (the client under its lock,
the service on its loop thread), and nothing here blocks.
"""

from __future__ import annotations

import array
import enum
from typing import Any

import msgpack

from kvtier.core.keys import KEY_BYTES, BlockKey
from kvtier.core.residency import Medium

PROMOTED_FROM: tuple[Medium | None, ...] = (None, Medium.DISK, Medium.REMOTE, Medium.S3)
"""A lookup reply's ``sources`` byte -> the tier the service promoted that hit from (0: it was in the pool)."""


def encode_sources(keys: list[BlockKey], promoted: dict[BlockKey, Medium]) -> bytes:
    """``sources`` of a reply whose hits are ``keys``: b"" when none was promoted."""
    if not promoted or not any(key in promoted for key in keys):
        return b""
    return bytes(PROMOTED_FROM.index(promoted.get(key)) for key in keys)


def decode_sources(raw: object, hits: int) -> tuple[Medium | None, ...]:
    """The tier each hit was promoted from (None: the pool), from a reply's ``sources``; a
    malformed value (wrong type or length, unknown code) is read as none promoted."""
    if not isinstance(raw, bytes) or len(raw) != hits or any(code >= len(PROMOTED_FROM) for code in raw):
        return ()
    return tuple(PROMOTED_FROM[code] for code in raw)

PROTOCOL_VERSION = 4
RECV_BYTES = 1 << 18
"""Bytes read per ``recv_into`` into a buffer allocated once per reader (the service's loop thread
has one; each client one, used under its lock). ``sock.recv(1 << 20)`` allocates the whole size
and shrinks it on every call: 32 us against 3.7 us per 33 KB read (a 1,000-key lookup) on a
socketpair here; end to end ~25 us per lookup round trip (docs/benchmarks.md, "Node service
lookups")."""

MAX_KEYS = 1 << 16
"""Keys one request carries (lookup, reserve, commit, abort), and pin handles one unpin releases:
65,536 blocks, a 1M-token prompt at 16 tokens per block. :class:`kvtier.node.client.NodeClient`
sends longer reserves, commits, aborts and unpins as several requests, and looks up at most this
many keys (the rest of a longer prefix is recomputed)."""
MAX_WIDTH = 1 << 12
"""Slots per block (one per stored rank)."""
MAX_SLOT_BYTES = 1 << 40
MAX_CAP_BYTES = 1 << 62
MAX_ENGINE_CHARS = 256
MAX_NAMESPACE_CHARS = 1 << 16
"""A hello's namespace JSON larger than this is not a namespace."""
MAX_TOKENS = (1 << 31) - 1
MAX_REPLY_BYTES = 64 * 2**20
"""A reply larger than this is a broken service (the client's reader; the service is checked by
its credentials before anything is sent, :mod:`kvtier.node.credentials`)."""

U32, U64 = "I", "Q"
"""``array`` type codes of the ``u32``/``u64`` fields (native unsigned integers)."""
assert array.array(U32).itemsize == 4 and array.array(U64).itemsize == 8


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


# --- packing ---------------------------------------------------------------------------------
def pack(message: dict[str, Any]) -> bytes:
    """One frame: a msgpack map (bytes stay bytes, str stays str)."""
    return msgpack.packb(message, use_bin_type=True)


def pack_keys(keys: list[BlockKey]) -> bytes:
    """``keys`` end to end, as a request carries them (each must be :data:`KEY_BYTES` long)."""
    packed = b"".join(keys)
    if len(packed) != KEY_BYTES * len(keys):
        raise ValueError(f"block keys must be {KEY_BYTES} bytes each")
    return packed


def pack_u32(values: list[int]) -> bytes:
    return array.array(U32, values).tobytes()


def pack_u64(values: list[int]) -> bytes:
    return array.array(U64, values).tobytes()
