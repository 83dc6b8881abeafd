"""redis-py hooks for the Redis tier's traffic: how commands are framed (a ``command_packer`` that
sends big values without copying them) and how replies are read (a hiredis ``parser_class`` whose
buffer outlives one reply).

Framing. :class:`ValueParts` is ONE bulk-string argument given as several buffers, in order (a
block's value is ``[header 0, payload 0, header 1, payload 1, ...]``: the payloads are the host
tier's slots). :class:`PartsPacker` is redis-py's pure-Python RESP serializer with one addition:
it frames a :class:`ValueParts` as one bulk string of the parts' total length and hands every part
larger than :data:`BUFFER_CUTOFF` to redis-py as a buffer of its own, so the connection
``sendall``s the slot itself; small parts (the headers) ride in the packed command text. No part
is copied into a joined value. Every other argument is packed exactly as redis-py packs it.
Measured (redis-py 8.1, loopback, 5.9 MB values): joining the value first cost 0.2-0.4 ms per
block, about 15% of a depth-1 SET.

Reading. hiredis parses a reply in its own buffer, fed in ``socket_read_size`` chunks. By default
it frees that buffer whenever it is empty and holds more than 16 KiB, so every block-sized reply
regrows it from nothing (a realloc, often a copy, at each doubling). :func:`reply_parser` gives a
parser whose reader keeps up to ``keep_bytes`` (one value plus slack) between replies: 1 MiB gets
rose from 1,285-1,322 to 1,600-1,630 MB/s at depth 1 (same run, interleaved); 5.9 MB gets did not
change. A reply bigger than that (not a block of this tier) still frees the buffer afterwards.

Buffer ownership: the parts are borrowed, never copied or kept: the caller must keep them
unchanged until the command's reply has been read (the tier's write job holds the host slots
pinned until its result is polled). Each connection's reader buffer is its own (up to
``keep_bytes`` per connection). Threading: the packer is stateless, one shared by every
connection; a parser belongs to one connection, used by one thread at a time (redis-py's pools).
"""

from __future__ import annotations

from collections.abc import Sequence

from redis._parsers import _HiredisParser
from redis.connection import Encoder, PythonRespSerializer

BUFFER_CUTOFF = 6000
"""Parts and arguments longer than this are sent as buffers of their own (redis-py's own cutoff)."""

_CRLF = b"\r\n"


class ValueParts:
    """One command argument (a bulk string) made of ``parts`` sent back to back, uncopied.

    ``len()`` is the value's length in bytes. Its ``str()`` names only the length (redis-py quotes a
    pipeline command's arguments in error messages; a value's bytes must never reach a log).
    """

    __slots__ = ("parts", "nbytes")

    def __init__(self, parts: Sequence[bytes | bytearray | memoryview]) -> None:
        self.parts = tuple(memoryview(part).cast("B") for part in parts)
        self.nbytes = sum(part.nbytes for part in self.parts)

    def __len__(self) -> int:
        return self.nbytes

    def __str__(self) -> str:
        return f"<value of {self.nbytes} bytes>"

    __repr__ = __str__


class PartsPacker(PythonRespSerializer):
    """redis-py's ``PythonRespSerializer`` that also packs :class:`ValueParts` arguments (above)."""

    def __init__(self) -> None:
        super().__init__(BUFFER_CUTOFF, Encoder("utf-8", "strict", False).encode)

    def pack(self, *args):
        if not any(isinstance(arg, ValueParts) for arg in args):
            return super().pack(*args)
        if isinstance(args[0], ValueParts):
            raise TypeError("a command name cannot be a ValueParts")
        # The command name may hold literal arguments ("CONFIG GET"): split it as redis-py does.
        name = args[0].encode() if isinstance(args[0], str) else args[0]
        args = tuple(name.split()) + args[1:]
        output: list[bytes | memoryview] = []
        buff = b"*%d\r\n" % len(args)
        for arg in args:
            if isinstance(arg, ValueParts):
                buff += b"$%d\r\n" % arg.nbytes
                for part in arg.parts:
                    if part.nbytes > BUFFER_CUTOFF:
                        output.append(buff)
                        output.append(part)
                        buff = b""
                    else:
                        buff += part
                buff += _CRLF
                continue
            arg = self.encode(arg)
            if len(arg) > BUFFER_CUTOFF or isinstance(arg, memoryview):
                output.append(buff + b"$%d\r\n" % len(arg))
                output.append(arg)
                buff = _CRLF
            else:
                buff += b"$%d\r\n" % len(arg) + arg + _CRLF
        output.append(buff)
        return output


COMMAND_PACKER = PartsPacker()
"""The packer of every connection of the tier (stateless, shared)."""


READER_DEFAULT_MAXBUF = 16 * 1024
"""What hiredis keeps of an empty reader buffer by default (``REDIS_READER_MAX_BUF``)."""


def reply_parser(keep_bytes: int) -> type[_HiredisParser]:
    """A redis-py ``parser_class``: hiredis, its reader keeping up to ``keep_bytes`` of buffer
    between replies (``Reader.setmaxbuf``) instead of 16 KiB. (``_HiredisParser`` is redis-py's
    own hiredis parser, in ``redis._parsers`` since redis-py 5.0; should a release rename its
    reader, the parser stays hiredis's default and only the speed-up is lost.)"""
    keep = max(READER_DEFAULT_MAXBUF, int(keep_bytes))

    class RetainingHiredisParser(_HiredisParser):
        def on_connect(self, connection, **kwargs) -> None:
            super().on_connect(connection, **kwargs)
            reader = getattr(self, "_reader", None)
            if reader is not None and hasattr(reader, "setmaxbuf"):
                reader.setmaxbuf(keep)

    RetainingHiredisParser.keep_bytes = keep
    return RetainingHiredisParser
