"""The node service's requests: each field of a request map checked, and the typed request it is.

Every request is checked here, in one place (:func:`parse_request`, driven by :data:`FIELDS`):
types, ranges and lengths of every field, unknown and missing fields, and the fields that must
agree (a commit's records, one per key). The service sees only the typed request it returns; a
wrong one raises :class:`BadRequest` naming the field, which the service answers with an error
and closes the connection.

:data:`FIELDS` also bounds a frame: :data:`MAX_FRAME_BYTES` (and the longest ``bin`` and string
a field takes) are derived from it, the bounds :class:`kvtier.node.frames.FrameReader` decodes
a request's frame within. The fields of each request, and its reply: the table in
:mod:`kvtier.node.protocol`.

Who calls what: the service's loop thread, on each map its frame reader returns
(:func:`kvtier.node.handlers.answer`, under :attr:`kvtier.node.server.NodeServer.lock`); a client
sends maps and builds none of these types. Pure functions of their argument and immutable values:
no state, no I/O, nothing here blocks.
"""

from __future__ import annotations

import array
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kvtier.core.keys import KEY_BYTES, BlockKey, Namespace
from kvtier.node.protocol import (MAX_CAP_BYTES, MAX_ENGINE_CHARS, MAX_KEYS, MAX_NAMESPACE_CHARS,
                                  MAX_SLOT_BYTES, MAX_TOKENS, MAX_WIDTH, U32, U64, Op, Role)
from kvtier.tiers.stack import BlockInfo, Chain


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
    return array.array(U32, _bin(value, 4, "native u32 values")).tolist()


def _u64s(value: Any) -> list[int]:
    return array.array(U64, _bin(value, 8, "native u64 values")).tolist()


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
MAX_BIN_BYTES = MAX_KEYS * KEY_BYTES  # the longest bin a field takes (keys; pins are 8 bytes each)
MAX_STR_BYTES = 4 * MAX_NAMESPACE_CHARS  # UTF-8: at most 4 bytes a character

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
