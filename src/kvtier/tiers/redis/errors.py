"""What a Redis failure means, and how it is said in a log: :func:`is_connection_failure` (the
server could not be reached or did not answer in time: a circuit-breaker failure) against an
answer that was an error reply (:func:`error_code`: ``OOM``, ``NOPERM``, ``WRONGTYPE``,
``MOVED``...), and :func:`safe_text` / :func:`describe`, the only way the Redis tier puts an
error's message in a log or an error of its own.

Invariants: the text these give never holds a value byte, whatever the message (redis-py quotes
byte reprs and a failed pipeline's command, Redis echoes the arguments of a refused command:
all are cut or replaced), and is at most ``limit`` characters (200) after the class name. Pure
functions of their argument: no state, no I/O; any thread calls them.
"""

from __future__ import annotations

import re

import redis

from kvtier.core.text import printable


def is_connection_failure(exc: BaseException) -> bool:
    """Whether ``exc`` means the server could not be reached or did not answer in time (a
    circuit-breaker failure), as opposed to an answer that was an error."""
    if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)):
        return True  # includes AuthenticationError (a server that refuses us is unusable)
    return isinstance(exc, (redis.exceptions.ClusterError, redis.exceptions.RedisClusterException))


def error_code(exc: BaseException) -> str:
    """The code of an error reply (``OOM``, ``NOPERM``, ``WRONGTYPE``, ``MOVED``, ``ERR``...): the
    one redis-py recognised (it strips it from the message), else the message's first word."""
    code = getattr(exc, "status_code", None)
    if code:
        return str(code)
    text = str(exc)
    return text.split(" ", 1)[0] if text else type(exc).__name__


_BYTES_REPR = re.compile(r"b'(?:[^'\\]|\\.)*'|b\"(?:[^\"\\]|\\.)*\"")
_PIPELINE_COMMAND = re.compile(r"(Command # \d+) \(.*\)(?= of pipeline caused error)", re.S)


def safe_text(text: str, limit: int = 200) -> str:
    """``text`` fit for a log: byte reprs (``b'...'``, e.g. a bad magic) replaced by ``<bytes>``,
    cut where Redis starts echoing arguments (``... with args beginning with: 'key' 'value'``),
    the command redis-py quotes in a pipeline's error (``Command # 1 (SET key value) of
    pipeline caused error: ...``, the arguments decoded as text) removed, newlines removed, at
    most ``limit`` characters before other control characters are escaped
    (:func:`~kvtier.core.text.printable`: a hostile server's message holds no terminal command).
    Never a value byte, whatever the message."""
    text = _PIPELINE_COMMAND.sub(r"\1", text.replace("\n", " "))
    text = _BYTES_REPR.sub("<bytes>", text)
    cut = text.find("args beginning with")
    if cut >= 0:
        text = text[:cut] + "args ..."
    return printable(text[:limit])


def describe(exc: BaseException) -> str:
    """A short, safe description of ``exc`` for logs: its class and :func:`safe_text` of its message."""
    text = safe_text(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

