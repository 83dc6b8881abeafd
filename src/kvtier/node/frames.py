"""Frames of the node service's protocol (:mod:`kvtier.node.protocol`): a byte stream split into
msgpack maps, decoded within bounds.

A stream of msgpack maps frames itself: :class:`FrameReader` wraps msgpack's streaming
``Unpacker``. At the service's end (``requests=True``) a peer may be hostile, so what one frame
may cost is bounded before any object is built; the bounds are derived from the fields a request
can have (:data:`kvtier.node.messages.MAX_FRAME_BYTES`), whose checks come after (a frame is a map
here, a request only once :func:`kvtier.node.messages.parse_request` took it).

Who owns what: one reader per connection, used by one thread: the service's loop thread owns each
connection's (:class:`kvtier.node.conn.Conn`), a client owns its own and uses it under its lock
(:class:`kvtier.node.client.NodeClient`). A reader only buffers and decodes what it is given: it
never reads a socket, and nothing here blocks.
"""

from __future__ import annotations

from typing import Any

import msgpack

from kvtier.node.messages import MAX_BIN_BYTES, MAX_FRAME_BYTES, MAX_STR_BYTES
from kvtier.node.protocol import MAX_REPLY_BYTES, RECV_BYTES


class ProtocolError(Exception):
    """A peer sent something that is not this protocol."""


MAX_CONTAINERS = 4
"""Maps and arrays one request may hold: its own map, and up to 3 small ones (which no valid
request has, but which get as far as :func:`kvtier.node.messages.parse_request`, so the error
names the field)."""
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
    object is built: a frame of at most :data:`~kvtier.node.messages.MAX_FRAME_BYTES`, strings
    and ``bin`` no longer than a field can be, at most :data:`MAX_CONTAINERS` maps and arrays of
    at most 16 entries (an array or map header makes msgpack allocate its entries at once;
    nested, a few bytes of them would otherwise cost megabytes), map keys strings. So a frame's
    objects take at most a small multiple of its bytes. Replies (the client's end, from a
    service whose credentials it checked) are bounded by
    :data:`~kvtier.node.protocol.MAX_REPLY_BYTES` only.

    Raises :class:`ProtocolError` on a frame that breaks these bounds or is not a map; when
    messages came before it in the same data, they are returned and the error is kept in
    :attr:`error` (raised by the next :meth:`feed`). Not thread-safe: one reader per connection,
    one thread.

    A reader is in no reference cycle (its unpacker's hooks hold a counter, not the reader): the
    buffered frame, up to :data:`~kvtier.node.messages.MAX_FRAME_BYTES`, goes with the last
    reference, not at a later collection; :meth:`close` lets it go at once.
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
                max_bin_len=MAX_BIN_BYTES, max_str_len=MAX_STR_BYTES, max_ext_len=0,
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
