"""A tiny hostile RESP server for the Redis tier's deadline tests (not shipped).

:class:`TricklingRedis` listens on 127.0.0.1 (a free port), answers what the tier sends at once
(``CLIENT SETINFO``, ``SELECT``, ``SET``: ``+OK``; ``PING``: ``+PONG``; ``INFO``; ``EXISTS``: 1)
except, by :attr:`TricklingRedis.mode`, one kind of reply that it trickles, one byte every
``drip_s`` and never finishing: ``"ping"`` (a PING's reply), ``"getrange"`` (a GETRANGE's bulk
string, ``$<len>`` then zero bytes), ``"scan"`` (a SCAN's reply). ``"none"``: no trickle. Each
connection counts the commands it got in :attr:`TricklingRedis.seen`. An idle timeout (redis-py's
``socket_timeout``) never fires on a trickle faster than it: only a deadline of the whole exchange
ends it.

Threading: one accept thread and one thread per connection (daemons); :meth:`stop` closes the
listener and every connection (a trickle then ends with a reset), so a test leaves nothing running.
"""

from __future__ import annotations

import socket
import threading


class TricklingRedis:
    def __init__(self, mode: str = "none", drip_s: float = 0.1) -> None:
        self.mode = mode
        self.drip_s = drip_s
        self.seen: dict[bytes, int] = {}
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, name="fake-redis-accept", daemon=True).start()

    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self._stopped.set()
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def __enter__(self) -> TricklingRedis:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name="fake-redis-conn", daemon=True).start()

    def _trickle(self, conn: socket.socket, head: bytes) -> None:
        conn.sendall(head)
        while not self._stopped.wait(self.drip_s):
            conn.sendall(b"\0" if head.startswith(b"$") else b"P")

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        try:
            while True:
                args = _read_command(reader)
                if args is None:
                    return
                name = args[0].upper()
                with self._lock:
                    self.seen[name] = self.seen.get(name, 0) + 1
                if name == b"PING":
                    if self.mode == "ping":
                        self._trickle(conn, b"+")
                        return
                    conn.sendall(b"+PONG\r\n")
                elif name == b"GETRANGE":
                    want = int(args[3]) - int(args[2]) + 1
                    if self.mode == "getrange":
                        self._trickle(conn, b"$%d\r\n" % want)
                        return
                    conn.sendall(b"$0\r\n\r\n")
                elif name == b"SCAN" and self.mode == "scan":
                    self._trickle(conn, b"*")
                    return
                elif name == b"INFO":
                    body = b"used_memory:0\r\nmaxmemory:0\r\n"
                    conn.sendall(b"$%d\r\n%s\r\n" % (len(body), body))
                elif name == b"EXISTS":
                    conn.sendall(b":1\r\n")
                elif name in (b"UNLINK", b"EXPIRE", b"TOUCH"):
                    conn.sendall(b":0\r\n")
                else:
                    conn.sendall(b"+OK\r\n")
        except OSError:
            pass
        finally:
            try:
                conn.close()
            except OSError:
                pass


def _read_command(reader) -> list[bytes] | None:
    line = reader.readline()
    if not line:
        return None
    if not line.startswith(b"*"):
        return line.split() or [b""]
    args = []
    for _ in range(int(line[1:])):
        length = int(reader.readline()[1:])
        args.append(reader.read(length + 2)[:-2])
    return args
