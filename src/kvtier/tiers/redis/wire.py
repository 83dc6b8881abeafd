"""RESP2 framing of the Redis tier's data commands: payloads sent from, and replies read straight
into, the caller's buffers.

Why not redis-py's own path: measured here (5.9 MB values, loopback), redis-py's GET through
the hiredis parser reaches 200-340 MB/s (the reply is copied socket -> parser buffer -> bytes,
then the tier would copy it again into the host slot), and its SET with the hiredis packer
260-280 MB/s (the value is copied into one packed command). Reading the reply with
``recv_into`` straight into the host slot and sending the payload from the host slot reach
1.1-1.8 GB/s, above redis-benchmark. So the tier keeps redis-py for everything it is good at
(connection pools, AUTH/HELLO, TLS, reconnects, cluster topology) and, on a connection it
checked out of a redis-py pool, writes the packed commands itself (:func:`pack`) and reads the
replies itself (:class:`ReplyReader`).

- :func:`pack`: RESP arrays of bulk strings; a :class:`Gather` argument (a value made of several
  buffers, e.g. header + payload per rank) is framed as ONE bulk string whose parts are sent
  as they are (large parts as memoryviews, never copied).
- :class:`ReplyReader`: parses one reply at a time from the socket with a small carry buffer.
  For a reply to a GET it is given a :class:`Landing`: if the bulk string has exactly the
  landing's length, its bytes go straight into the landing's segments (the caller's buffers,
  via ``recv_into``) and the landing is returned; any other length is read and discarded
  (:class:`WrongLength`). Errors come back as :class:`ReplyError` values (the server's message:
  it never contains value bytes). Once every reply of a batch is read, :meth:`ReplyReader.finish`
  checks that nothing is left over, so the connection goes back to its pool at a reply boundary.

Failures: a socket timeout raises ``TimeoutError`` (the socket's timeout, set by redis-py from
``timeout_s``), a closed connection ``ConnectionError``, a reply that is not RESP
:class:`ProtocolError` (a ``ConnectionError``). After any of them the caller must drop the
connection (its position in the stream is unknown).

Threading: used by the tier's worker threads, one reader per connection and batch. Stdlib only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

CHUNK = 64 * 1024
"""Small pieces are merged into send chunks of up to this size; also the carry buffer's size."""
MAX_LINE = 1 << 20
"""A reply line (error message, integer, bulk length) longer than this is a protocol error."""
MAX_PLAIN_BULK = 16 << 20
"""A bulk reply read without a landing that is larger than this is discarded (WrongLength)."""


class ProtocolError(ConnectionError):
    """The bytes from the server are not the RESP reply expected; drop the connection."""


class Gather:
    """One bulk-string argument made of several buffers, sent in order without copying them."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, parts: Iterable[bytes | bytearray | memoryview]) -> None:
        self.parts = tuple(memoryview(p).cast("B") for p in parts)
        self.nbytes = sum(p.nbytes for p in self.parts)

    def __repr__(self) -> str:  # never the bytes (they end up in error messages otherwise)
        return f"<value of {self.nbytes} bytes>"


class Landing:
    """Where the bulk reply of one GET goes when it is exactly ``nbytes`` long: its bytes fill
    ``segments`` in order (e.g. header scratch of rank 0, payload buffer of rank 0, ...)."""

    __slots__ = ("nbytes", "segments")

    def __init__(self, segments: Sequence[memoryview]) -> None:
        self.segments = tuple(segments)
        self.nbytes = sum(s.nbytes for s in self.segments)


class ReplyError:
    """An error reply (``-CODE message``) to one command; other commands of the batch are fine."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message

    @property
    def code(self) -> str:
        """The error code: the first word (``OOM``, ``NOPERM``, ``MOVED``, ``WRONGTYPE``, ``ERR``...)."""
        return self.message.split(" ", 1)[0]

    def __repr__(self) -> str:
        return f"ReplyError({self.message!r})"


class WrongLength:
    """A bulk reply whose length did not match its landing (discarded unread)."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __repr__(self) -> str:
        return f"WrongLength({self.nbytes})"


Arg = bytes | bytearray | memoryview | str | int | Gather


def pack(commands: Iterable[Sequence[Arg]]) -> list[bytes | memoryview]:
    """The RESP encoding of ``commands`` (one arg sequence each), as chunks to send in order."""
    out: list[bytes | memoryview] = []
    small = bytearray()

    def flush() -> None:
        if small:
            out.append(bytes(small))
            small.clear()

    for args in commands:
        small += b"*%d\r\n" % len(args)
        for arg in args:
            if isinstance(arg, Gather):
                small += b"$%d\r\n" % arg.nbytes
                for part in arg.parts:
                    if part.nbytes < CHUNK:
                        small += part
                    else:
                        flush()
                        out.append(part)
                small += b"\r\n"
            else:
                if isinstance(arg, str):
                    data: bytes | bytearray | memoryview = arg.encode()
                elif isinstance(arg, int):
                    data = b"%d" % arg
                else:
                    data = arg
                small += b"$%d\r\n" % len(data)
                small += data
                small += b"\r\n"
            if len(small) >= CHUNK:
                flush()
    flush()
    return out


class ReplyReader:
    """Reads RESP2 (and RESP3 null) replies from one socket, one :meth:`read` per reply."""

    def __init__(self, sock) -> None:
        self._sock = sock
        self._buf = bytearray(CHUNK)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    # ------------------------------------------------------------------ replies

    def read(self, landing: Landing | None = None):
        """The next reply: ``None`` (nil), ``int``, ``bytes`` (status or bulk), ``list``,
        :class:`ReplyError`, the ``landing`` (filled) or :class:`WrongLength`."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            n = self._int(rest)
            if n < 0:
                return None
            if landing is not None or n > MAX_PLAIN_BULK:
                if landing is not None and n == landing.nbytes:
                    for segment in landing.segments:
                        self._read_into(segment)
                    self._crlf()
                    return landing
                self._skip(n + 2)
                return WrongLength(n)
            data = bytearray(n)
            self._read_into(memoryview(data))
            self._crlf()
            return bytes(data)
        if kind == b"+":
            return bytes(rest)
        if kind == b":":
            return self._int(rest)
        if kind == b"-":
            return ReplyError(rest.decode("utf-8", "replace"))
        if kind == b"_":  # RESP3 null
            return None
        if kind == b"*":
            n = self._int(rest)
            return None if n < 0 else [self.read() for _ in range(n)]
        raise ProtocolError(f"unexpected reply type {bytes(kind)!r}")

    def finish(self) -> None:
        """Every reply of the batch was read: nothing may be left over."""
        if self._end != self._start:
            raise ProtocolError(f"{self._end - self._start} unexpected bytes after the last reply")

    # ------------------------------------------------------------------ bytes

    @staticmethod
    def _int(text: bytes | bytearray) -> int:
        try:
            return int(text)
        except ValueError:
            raise ProtocolError(f"not an integer: {bytes(text[:32])!r}") from None

    def _fill(self) -> None:
        """Read more bytes from the socket into the carry buffer (compacting it first)."""
        if self._start:
            size = self._end - self._start
            self._buf[:size] = self._buf[self._start : self._end]
            self._start, self._end = 0, size
        if self._end == len(self._buf):
            if len(self._buf) >= MAX_LINE:
                raise ProtocolError(f"reply line longer than {MAX_LINE} bytes")
            self._view.release()
            self._buf.extend(bytes(len(self._buf)))
            self._view = memoryview(self._buf)
        n = self._sock.recv_into(self._view[self._end :])
        if not n:
            raise ConnectionError("connection closed by the server")
        self._end += n

    def _line(self) -> bytes:
        while True:
            index = self._buf.find(b"\r\n", self._start, self._end)
            if index >= 0:
                line = bytes(self._view[self._start : index])
                self._start = index + 2
                return line
            self._fill()

    def _crlf(self) -> None:
        while self._end - self._start < 2:
            self._fill()
        if self._view[self._start : self._start + 2] != b"\r\n":
            raise ProtocolError("bulk string not terminated by CRLF")
        self._start += 2

    def _read_into(self, dest: memoryview) -> None:
        """Fill ``dest`` exactly: first from the carry buffer, then straight from the socket."""
        need = dest.nbytes
        take = min(need, self._end - self._start)
        if take:
            dest[:take] = self._view[self._start : self._start + take]
            self._start += take
        pos = take
        recv_into = self._sock.recv_into
        while pos < need:
            n = recv_into(dest[pos:])
            if not n:
                raise ConnectionError("connection closed by the server")
            pos += n

    def _skip(self, count: int) -> None:
        """Discard ``count`` bytes."""
        take = min(count, self._end - self._start)
        self._start += take
        count -= take
        while count:
            if self._start == self._end:
                self._start = self._end = 0
            n = self._sock.recv_into(self._view[: min(count, len(self._buf))])
            if not n:
                raise ConnectionError("connection closed by the server")
            count -= n
