"""One server's part of a Redis tier batch: :func:`run_pipeline` sends its commands pipelined on
one pooled connection of that server (all in one write, then every reply read, in order), i.e. one
round trip. :meth:`~kvtier.tiers.redis.client.RedisClient.run` splits a batch per server and runs
one of these per server (a cluster: concurrently, on ``kvtier-redis-node`` threads).

Replies come back as redis-py's ``read_response`` gives them (no response callbacks: ``SET``
gives ``b"OK"``; parsed by redis-py, with hiredis when it is installed): a command's error reply
is its exception (a ``ResponseError``: ``OutOfMemoryError``, ``NoPermissionError``,
``MovedError``... or a plain ``ResponseError`` whose message starts with the code, e.g.
``WRONGTYPE``) in its place, so one bad command does not fail the others; an exchange that failed
(refused, reset, timed out, past its deadline) gives that exception instead of the replies.

Invariants:

- The whole exchange (check-out, send, every reply) has one deadline
  (:mod:`~kvtier.tiers.redis.deadline`): ``connect_timeout_s + timeout_s`` plus
  :func:`exchange_bytes` at the floor rate; past it the exchange fails as a connection failure.
- A connection whose exchange failed is disconnected before it goes back to its pool (the pool
  reconnects it on its next check-out), and no reply of a failed exchange is ever used.
- Each reply is passed to ``on_reply`` as soon as it is read, and this function holds no reference
  to it while the next one is read: with an ``on_reply`` that keeps only a marker, a batch holds
  one value at a time.
- Never raises an ``Exception``: a failure (of the server, the network, or ``on_reply``) is the
  outcome.

Threading: any thread; one call uses one connection, which it alone holds until it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import redis
from redis.exceptions import ResponseError

from kvtier.tiers.redis.deadline import budget, exchange

Reply = object
"""One command's reply: what redis-py returns for it (``bytes``, ``int``, ``bool``, ``None``), or
an exception: the command's error reply, or the failure of its node's pipeline."""



COMMAND_BYTES = 256
"""What an exchange's deadline allows each command for its name, key and framing, each way."""


def exchange_bytes(commands: Sequence[Sequence[object]]) -> int:
    """About the bytes a pipeline of ``commands`` moves: :data:`COMMAND_BYTES` each, plus every
    ``SET``'s value and every ``GETRANGE``'s range (the tier's only big arguments and replies)."""
    nbytes = COMMAND_BYTES * len(commands)
    for args in commands:
        name = args[0]
        if name == b"GETRANGE":
            nbytes += max(0, int(args[3]) - int(args[2]) + 1)
        elif name == b"SET":
            value = args[2]
            nbytes += value.nbytes if isinstance(value, memoryview) else len(value)
    return nbytes


def run_pipeline(
    node: redis.Redis,
    commands: Sequence[Sequence[object]],
    indexes: Sequence[int],
    on_reply: Callable[[int, Reply], Reply] | None = None,
    *,
    limits: tuple[float, float] = (1.0, 2.0),
) -> list[Reply] | Exception:
    """``commands[i]`` for ``i`` in ``indexes`` pipelined on one of ``node``'s pooled connections:
    all sent in one write, then every reply read in order (each passed through ``on_reply(i,
    reply)`` as soon as it is read, see :meth:`~kvtier.tiers.redis.client.RedisClient.run`).
    Returns the raw replies (no response callbacks: ``SET`` gives ``b"OK"``), an error reply as
    its exception in its command's place, or the exception that failed the exchange (refused,
    reset, timed out, or past its deadline: the connection is then disconnected, so the pool
    reconnects it on its next use, and no reply of a failed exchange is ever used).

    The whole exchange (check-out, send, every reply) is one
    :func:`~kvtier.tiers.redis.deadline.exchange` of
    :func:`~kvtier.tiers.redis.deadline.budget` ``(*limits,`` :func:`exchange_bytes` ``)``;
    ``limits``: the tier's ``(connect_timeout_s, timeout_s)``.

    This is what ``Pipeline.execute(raise_on_error=False)`` does on the wire, through the same
    redis-py ``Connection`` methods (``pack_commands``, ``send_packed_command``, ``read_response``)
    without the pipeline object's per-batch bookkeeping: ~0.05 ms less per batch, 10-15% of a
    1 MiB request (docs/benchmarks.md)."""
    pool = node.connection_pool
    selected = [commands[i] for i in indexes]
    connection = None
    try:
        with exchange(budget(*limits, exchange_bytes(selected))):
            connection = pool.get_connection()  # a free one within timeout_s, (re)connected
            connection.send_packed_command(connection.pack_commands(selected))
            replies: list[Reply] = []
            for index in indexes:
                try:
                    reply = connection.read_response()
                except ResponseError as exc:  # the command's error reply; the connection is fine
                    reply = exc
                replies.append(reply if on_reply is None else on_reply(index, reply))
                del reply  # not alive while the next reply is read
        return replies
    except Exception as exc:  # the check-out failed (no free connection, no connect), or the exchange
        if connection is not None:
            connection.disconnect()
        return exc
    finally:
        if connection is not None:
            pool.release(connection)
