"""The node service's wire protocol: control messages only, framed and serialized by msgpack.

Every message is one msgpack map. A client sends a request ``{"op": Op, ...}`` and reads exactly
one reply (``{"ok": True, ...}`` or ``{"ok": False, "error": str}``) before its next request:
replies come back in request order on each connection, so no request ids are needed. A stream of
msgpack maps frames itself (:class:`FrameReader` wraps msgpack's streaming ``Unpacker``); the
only file descriptor ever passed is the pool's memfd, attached (``SCM_RIGHTS``) to the reply of
:attr:`Op.HELLO` for roles that map the pool.

Requests carry no arrays: every list is packed into one ``bin`` (``keys``: 32-byte keys end to
end; ``u32``/``u64``: native unsigned integers, both ends being one machine), so a request is one
map of scalars. That is what makes a request cheap to check and its cost bounded: see
:class:`FrameReader` and :data:`MAX_FRAME_BYTES`.

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

Every request is checked here, in one place (:func:`parse_request`, driven by :data:`FIELDS`):
types, ranges and lengths of every field, unknown and missing fields, and the fields that must
agree (a commit's records, one per key). The service sees only the typed request it returns; a
wrong one raises :class:`BadRequest` naming the field, which the service answers with an error
and closes the connection.
"""

from __future__ import annotations

import array
import enum
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import numpy as np

from kvtier.core.keys import KEY_BYTES, BlockKey, Namespace
from kvtier.core.residency import Medium
from kvtier.tiers.stack import BlockInfo, Chain

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

_U32, _U64 = "I", "Q"
assert array.array(_U32).itemsize == 4 and array.array(_U64).itemsize == 8


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


# --- framing ---------------------------------------------------------------------------------
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
    return array.array(_U32, values).tobytes()


def pack_u64(values: list[int]) -> bytes:
    return array.array(_U64, values).tobytes()


class ProtocolError(Exception):
    """A peer sent something that is not this protocol."""


MAX_CONTAINERS = 4
"""Maps and arrays one request may hold: its own map, and up to 3 small ones (which no valid
request has, but which get as far as :func:`parse_request`, so the error names the field)."""
_MAX_SMALL_CONTAINER = 16


def _container_counter(seen: list[int]) -> Any:
    """msgpack's object and list hook for requests: counts into ``seen[0]`` (reset per frame by
    the reader) and refuses more than :data:`MAX_CONTAINERS`."""

    def count(container: Any) -> Any:
        seen[0] += 1
        if seen[0] > MAX_CONTAINERS:
            raise ProtocolError(f"more than {MAX_CONTAINERS} maps or arrays in one request")
        return container

    return count


class FrameReader:
    """Splits a byte stream into messages. Feed it what ``recv`` returned; get the maps.

    ``requests`` (the service's end): a peer may be hostile, so decoding is bounded before any
    object is built: a frame of at most :data:`MAX_FRAME_BYTES`, strings and ``bin`` no longer
    than a field can be, at most :data:`MAX_CONTAINERS` maps and arrays of at most 16 entries
    (an array or map header makes msgpack allocate its entries at once; nested, a few bytes of
    them would otherwise cost megabytes), map keys strings. So a frame's objects take at most a
    small multiple of its bytes. Replies (the client's end, from a service whose credentials it
    checked) are bounded by :data:`MAX_REPLY_BYTES` only.

    Raises :class:`ProtocolError` on a frame that breaks these bounds or is not a map; when
    messages came before it in the same data, they are returned and the error is kept in
    :attr:`error` (raised by the next :meth:`feed`). Not thread-safe: one reader per connection,
    one thread.

    A reader is in no reference cycle (its unpacker's hooks hold a counter, not the reader): the
    buffered frame, up to :data:`MAX_FRAME_BYTES`, goes with the last reference, not at a later
    collection; :meth:`close` lets it go at once.
    """

    def __init__(self, *, requests: bool = False) -> None:
        self._fed = 0
        self._containers = [0]  # this frame's maps and arrays so far (the hooks' only state)
        self.error: ProtocolError | None = None
        self._unpacker: msgpack.Unpacker | None  # None once closed
        if requests:
            self.max_frame = MAX_FRAME_BYTES
            count = _container_counter(self._containers)
            self._unpacker = msgpack.Unpacker(
                raw=False, strict_map_key=True, max_buffer_size=MAX_FRAME_BYTES + RECV_BYTES,
                max_bin_len=_MAX_BIN_BYTES, max_str_len=_MAX_STR_BYTES, max_ext_len=0,
                max_array_len=_MAX_SMALL_CONTAINER, max_map_len=_MAX_SMALL_CONTAINER,
                object_hook=count, list_hook=count)
        else:
            self.max_frame = MAX_REPLY_BYTES
            self._unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_REPLY_BYTES + RECV_BYTES,
                                              strict_map_key=False)

    def close(self) -> None:
        """Drop what is buffered (the connection is gone): every later call raises :attr:`error`."""
        self._unpacker = None
        self.error = ProtocolError("the connection is closed")

    def feed(self, data: bytes | memoryview) -> list[dict[str, Any]]:
        """Buffer ``data`` and return every message it completes (the client's end, and tests)."""
        if self.error is not None:
            raise self.error
        self.push(data)
        messages: list[dict[str, Any]] = []
        try:
            while (message := self.next_message()) is not None:
                messages.append(message)
        except ProtocolError as exc:
            if not messages:
                raise
            self.error = exc
        return messages

    def push(self, data: bytes | memoryview) -> None:
        """Buffer ``data`` without decoding it (the service's end: it then takes its frames one at
        a time with :meth:`next_message`, a few per turn, and pushes more only once none is left,
        so what waits here is at most one read beside one unfinished frame)."""
        if self._unpacker is None:
            raise self.error or ProtocolError("the connection is closed")
        try:
            self._unpacker.feed(data)
        except Exception as exc:  # noqa: BLE001 (BufferFull: more than a frame and a read)
            raise ProtocolError(f"malformed stream: {type(exc).__name__}: {exc}") from None
        self._fed += len(data)

    def next_message(self) -> dict[str, Any] | None:
        """The next complete message buffered, or None when none is (what is left, if anything,
        is one unfinished frame, checked against :attr:`max_frame`). Raises :class:`ProtocolError`."""
        unpacker = self._unpacker
        if unpacker is None:
            raise self.error or ProtocolError("the connection is closed")
        try:
            self._containers[0] = 0
            try:
                message = next(unpacker)
            except StopIteration:
                if self._fed - unpacker.tell() > self.max_frame:  # what is left is one frame, unfinished
                    raise ProtocolError(f"a frame larger than {self.max_frame} bytes") from None
                return None
            if not isinstance(message, dict):
                raise ProtocolError(f"a frame must be a map, got {type(message).__name__}")
            return message
        except Exception as exc:  # noqa: BLE001 (whatever msgpack raises on a frame it cannot decode)
            raise (exc if isinstance(exc, ProtocolError) else ProtocolError(
                f"malformed frame: {type(exc).__name__}: {exc}")) from None


# --- requests --------------------------------------------------------------------------------
class BadRequest(ValueError):
    """A request that is not one: ``field`` names what is wrong (``op`` when the op itself is)."""

    def __init__(self, op: str, field: str, why: str) -> None:
        super().__init__(f"{op!r} request: field {field!r} {why}")
        self.field = field


class Hello(NamedTuple):
    version: int
    role: Role
    engine: str | None = None
    slot_bytes: int | None = None
    cap_bytes: int | None = None
    namespace: tuple[Namespace, str, str] | None = None  # (namespace, model name, its JSON)


class Lookup(NamedTuple):
    keys: list[BlockKey]
    pin: bool = False
    width: int = 1
    parent: BlockKey | None = None
    tokens: int | None = None
    tail_tokens: int = 0

    @property
    def chain(self) -> Chain:
        """What names the records of the blocks promoted (an unnamed chain without ``parent``)."""
        return Chain() if self.parent is None else Chain(self.parent, self.tokens or 0, self.tail_tokens)


class Reserve(NamedTuple):
    keys: list[BlockKey]
    width: int
    tails: frozenset[int] = frozenset()


class Commit(NamedTuple):
    keys: list[BlockKey]
    parents: list[BlockKey] | None = None
    tokens: list[int] | None = None
    tails: frozenset[int] = frozenset()

    @property
    def blocks(self) -> list[BlockInfo] | None:
        """Each key's record (None: not given)."""
        return None if self.parents is None else self.records(range(len(self.keys)))

    def records(self, positions: list[int] | range) -> list[BlockInfo] | None:
        """The records of the keys at ``positions`` (None: not given)."""
        if self.parents is None or self.tokens is None:
            return None
        parents, tokens, tails = self.parents, self.tokens, self.tails
        return [BlockInfo(parents[p], tokens[p], p in tails) for p in positions]


class Abort(NamedTuple):
    keys: list[BlockKey]


class Unpin(NamedTuple):
    pins: list[int]


class Stats(NamedTuple):
    pass


Request = Hello | Lookup | Reserve | Commit | Abort | Unpin | Stats


class _Wrong(Exception):
    """Raised by a field's parser: why the value is wrong (the caller names the field)."""


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a request: how its value is checked and converted, and how large its
    encoding may be (:data:`MAX_FRAME_BYTES` is derived from these)."""

    parse: Callable[[Any], Any]
    max_bytes: int
    required: bool = False


def _int(low: int, high: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if type(value) is not int:
            raise _Wrong(f"must be an integer, got {type(value).__name__}")
        if not low <= value <= high:
            raise _Wrong(f"must be in {low}..{high}, got {value}")
        return value
    return parse


def _optional(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else parse(value)


def _bool(value: Any) -> bool:
    if type(value) is not bool:
        raise _Wrong(f"must be true or false, got {type(value).__name__}")
    return value


def _text(max_chars: int) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if type(value) is not str:
            raise _Wrong(f"must be a string, got {type(value).__name__}")
        if len(value) > max_chars:
            raise _Wrong(f"must be at most {max_chars} characters, got {len(value)}")
        return value
    return parse


def _role(value: Any) -> Role:
    try:
        return Role(value)
    except (ValueError, TypeError):
        raise _Wrong(f"must be one of {[r.value for r in Role]}, got {value!r:.40}") from None


def _bin(value: Any, unit: int, what: str) -> bytes:
    if type(value) is not bytes:
        raise _Wrong(f"must be bin ({what}), got {type(value).__name__}")
    if len(value) % unit:
        raise _Wrong(f"must be {what}: a multiple of {unit} bytes, got {len(value)}")
    if len(value) > MAX_KEYS * unit:
        raise _Wrong(f"must hold at most {MAX_KEYS} entries, got {len(value) // unit}")
    return value


def _keys(value: Any) -> list[BlockKey]:
    """Keys end to end -> a list of bytes objects (numpy splits them in one C loop)."""
    return np.frombuffer(_bin(value, KEY_BYTES, f"{KEY_BYTES}-byte keys end to end"), f"V{KEY_BYTES}").tolist()


def _key(value: Any) -> BlockKey:
    if type(value) is not bytes or len(value) != KEY_BYTES:
        raise _Wrong(f"must be a {KEY_BYTES}-byte key (bin)")
    return value


def _u32s(value: Any) -> list[int]:
    return array.array(_U32, _bin(value, 4, "native u32 values")).tolist()


def _u64s(value: Any) -> list[int]:
    return array.array(_U64, _bin(value, 8, "native u64 values")).tolist()


def _positions(value: Any) -> frozenset[int]:
    return frozenset(_u32s(value))


def _namespace(value: Any) -> tuple[Namespace, str, str]:
    """A scheduler's namespace: (the namespace, its model's display name, its JSON as the
    service's disk root keeps it). The digests are the service's own, computed from it.
    :meth:`Namespace.from_dict` checks every number before anything computes with it (JSON reads
    ``1e999`` as a float infinity), naming it; whatever else a wrong namespace raises, this raises
    only :class:`_Wrong`: a bad request, never a crash of the service."""
    raw = _text(MAX_NAMESPACE_CHARS)(value)
    try:
        data = json.loads(raw)
        model = data["model_name"]
        if not isinstance(model, str):
            raise TypeError("model_name must be a string")
        return Namespace.from_dict(data), model, raw
    except Exception as exc:  # noqa: BLE001 (any value of any type: a wrong namespace, never a crash)
        raise _Wrong(f"is not a namespace description: {type(exc).__name__}: {exc}") from None


def _encoded(n: int, small: int = 31) -> int:
    """Bytes of a msgpack str/bin header and body of ``n`` bytes (an upper bound)."""
    return n + (1 if n <= small else 2 if n < 1 << 8 else 3 if n < 1 << 16 else 5)


_INT, _BOOL = 9, 1
_KEYS = _encoded(MAX_KEYS * KEY_BYTES)
_U32S = _encoded(MAX_KEYS * 4)
_U64S = _encoded(MAX_KEYS * 8)

FIELDS: dict[Op, dict[str, Field]] = {
    Op.HELLO: {
        "version": Field(_int(0, 2**32), _INT, required=True),
        "role": Field(_role, _encoded(16), required=True),
        "engine": Field(_optional(_text(MAX_ENGINE_CHARS)), _encoded(4 * MAX_ENGINE_CHARS)),
        "slot_bytes": Field(_optional(_int(1, MAX_SLOT_BYTES)), _INT),
        "cap_bytes": Field(_optional(_int(0, MAX_CAP_BYTES)), _INT),
        "namespace": Field(_optional(_namespace), _encoded(4 * MAX_NAMESPACE_CHARS)),
    },
    Op.LOOKUP: {
        "keys": Field(_keys, _KEYS, required=True),
        "pin": Field(_bool, _BOOL),
        "width": Field(_int(1, MAX_WIDTH), _INT),
        "parent": Field(_optional(_key), _encoded(KEY_BYTES)),
        "tokens": Field(_optional(_int(0, MAX_TOKENS)), _INT),
        "tail_tokens": Field(_int(0, MAX_TOKENS), _INT),
    },
    Op.RESERVE: {
        "keys": Field(_keys, _KEYS, required=True),
        "width": Field(_int(1, MAX_WIDTH), _INT, required=True),
        "tails": Field(_positions, _U32S),
    },
    Op.COMMIT: {
        "keys": Field(_keys, _KEYS, required=True),
        "parents": Field(_optional(_keys), _KEYS),
        "tokens": Field(_optional(_u32s), _U32S),
        "tails": Field(_positions, _U32S),
    },
    Op.ABORT: {"keys": Field(_keys, _KEYS, required=True)},
    Op.UNPIN: {"pins": Field(_u64s, _U64S, required=True)},
    Op.STATS: {},
}
_TYPES: dict[Op, type] = {Op.HELLO: Hello, Op.LOOKUP: Lookup, Op.RESERVE: Reserve, Op.COMMIT: Commit,
                          Op.ABORT: Abort, Op.UNPIN: Unpin, Op.STATS: Stats}
_OPS = {op.value: op for op in Op}
_MAX_BIN_BYTES = MAX_KEYS * KEY_BYTES  # the longest bin a field takes (keys; pins are 8 bytes each)
_MAX_STR_BYTES = 4 * MAX_NAMESPACE_CHARS  # UTF-8: at most 4 bytes a character

MAX_FRAME_BYTES = max(1 + _encoded(2) + _encoded(7) + sum(_encoded(len(name)) + field.max_bytes
                                                          for name, field in fields.items())
                      for fields in FIELDS.values())
"""The largest frame a valid request can be (a commit of :data:`MAX_KEYS` keys with their records:
~4.5 MiB), derived from :data:`FIELDS`; a frame larger than this is a broken or hostile peer."""


def parse_request(message: dict[str, Any]) -> Request:
    """The typed request ``message`` is, every field checked (see the module docstring).
    Raises :class:`BadRequest` naming the field."""
    name = message.get("op")
    op = _OPS.get(name) if type(name) is str else None
    if op is None:
        raise BadRequest(str(name)[:40], "op", f"must be one of {sorted(_OPS)}")
    fields = FIELDS[op]
    values = {}
    for field, value in message.items():
        if field == "op":
            continue
        spec = fields.get(field)
        if spec is None:
            raise BadRequest(op.value, str(field)[:40], f"is not a field of {op.value!r} (fields: {sorted(fields)})")
        try:
            values[field] = spec.parse(value)
        except _Wrong as exc:
            raise BadRequest(op.value, field, str(exc)) from None
    for field, spec in fields.items():
        if spec.required and field not in values:
            raise BadRequest(op.value, field, "is required")
    request = _TYPES[op](**values)
    _agree(op, request)
    return request


def _agree(op: Op, request: Request) -> None:
    """Checks across fields."""
    if isinstance(request, Lookup):
        if request.parent is not None and request.tokens is None:
            raise BadRequest(op.value, "tokens", "is required with 'parent'")
    elif isinstance(request, Reserve | Commit):
        if request.tails and max(request.tails) >= len(request.keys):
            raise BadRequest(op.value, "tails", f"must be positions in 'keys' (0..{len(request.keys) - 1})")
        if isinstance(request, Commit):
            given = (request.parents is not None) + (request.tokens is not None)
            if given == 1:
                raise BadRequest(op.value, "parents" if request.parents is None else "tokens",
                                 "is required with the other ('parents' and 'tokens' name each key's record)")
            if given == 2 and not len(request.parents) == len(request.tokens) == len(request.keys):
                raise BadRequest(op.value, "parents", f"and 'tokens' must name one record per key "
                                 f"({len(request.keys)}), got {len(request.parents)} and {len(request.tokens)}")
            if request.tails and given == 0:
                raise BadRequest(op.value, "tails", "needs 'parents' and 'tokens'")
