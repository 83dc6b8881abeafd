"""A hostile client of the node service, or a hostile neighbour of its socket, costs only itself.

Each attack of issue 38's node findings as a test, against a real ``kvtier node`` process (or the
real server on a thread), real sockets, a real disk tier below the pool:

- 4: malformed frames (a map as a map key before hello; ``width`` / ``cap_bytes`` / ``slot_bytes``
  of inf, NaN, negative or huge; a commit's records with a field missing or of the wrong count; a
  parent of 2**64-1; keys of the wrong length or type; more entries than a request can hold;
  unknown fields and ops): an error naming the field, the connection closed, the service alive;
  and a bounded fuzz of every op, field by field (fixed seed);
- 5: a client that ``ftruncate``s the pool's memfd gets EPERM; the next engine writes its slot
  and the service copies the block to disk (no SIGBUS);
- 6: a service of another uid (a real ``kvtier node`` run as nobody) is refused by an engine
  running as root, with an error naming its uid and the config key, unless ``node_uid`` names it;
- 7: a client that sends requests and never reads the replies (the hello's memfd last) stalls
  nobody and is disconnected, counted; a frame larger than a request can be is refused, and
  8 MiB of empty arrays (or nested array headers) cost the service a few MiB, not hundreds; a
  commit whose cascade raises leaves nothing pinned (and the slot size change that made it raise
  is handled); ``<socket>.lock`` as a symlink or a hard link is refused, its target untouched.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from support.namespaces import toy_namespace
from support.node_service import NodeThread
from test_node_service import ENV, stop

from kvtier.core.config import ConfigError
from kvtier.core.tier_config import DiskTierConfig
from kvtier.node import NodeClient, NodeError, Role
from kvtier.node import tiers as tiers_module
from kvtier.node.frames import FrameReader, ProtocolError
from kvtier.node.messages import MAX_FRAME_BYTES
from kvtier.node.protocol import MAX_KEYS, PROTOCOL_VERSION, pack, pack_keys, pack_u32, pack_u64
from kvtier.node.server import NodeConfigError, NodeOptions, NodeServer
from kvtier.runtime.node_host import connect_node
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostIndex
from kvtier.tiers.stack import BlockInfo, TierStack

SLOT = 4096
NAMESPACE = toy_namespace().config_json("toy")
NOBODY = 65534


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def hello(**fields) -> dict:
    return {"op": "hello", "version": PROTOCOL_VERSION, "engine": "hostile", "role": "scheduler", "slot_bytes": SLOT,
            "namespace": NAMESPACE, **fields}


def exchange(sock: Path, frames: list, timeout: float = 30.0, half_close: bool = False) -> tuple[list[dict], bool]:
    """Send ``frames`` (maps or raw bytes) at once (then shut the writing half with
    ``half_close``: the last frame may be unfinished); read replies until one per frame came or
    the service closed the connection. Returns (replies, closed). A service that answers neither
    within ``timeout`` fails the test (a hang)."""
    data = b"".join(f if isinstance(f, bytes) else pack(f) for f in frames)
    reader, replies, closed = FrameReader(), [], False
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(str(sock))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # closed before it read them all
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + timeout
        while len(replies) < len(frames):
            assert time.monotonic() < deadline, f"no answer within {timeout} s (a hang) after {replies}"
            try:
                got = s.recv(1 << 16)
            except ConnectionResetError:
                got = b""
            if not got:
                closed = True
                break
            replies += reader.feed(got)
        if not closed and replies and _bad(replies[-1]):  # a refusal keeps the connection, a bad request not
            s.settimeout(timeout)  # (the close follows the answer; a loaded machine may take a while)
            try:
                closed = s.recv(1) == b""
            except ConnectionResetError:  # closed with what this end sent unread
                closed = True
            except TimeoutError:
                pass
    return replies, closed


def _bad(reply: dict) -> bool:
    """An answer to a bad request or frame (not a refusal of a valid one)."""
    return not reply["ok"] and ("field" in reply or reply["error"].startswith("not this protocol"))


def rss_kib(pid: int, field: str = "VmHWM") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


def service_stats(sock: Path) -> dict:
    with NodeClient(sock, engine="probe", role=Role.OBSERVER) as probe:
        return probe.stats()


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """One ``kvtier node`` with a disk tier for the module's attacks: (socket, process)."""
    folder = tmp_path_factory.mktemp("hostile")
    sock = folder / "n.sock"
    with open(folder / "node.log", "w") as log:  # (a pipe nobody reads would stall its logging)
        proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli.main", "node", "--socket", str(sock),
                                 "--pool-bytes", str(64 * SLOT), "--slot-bytes", str(SLOT), "--disk-dir",
                                 str(folder / "disk"), "--disk-size", "1"], env=ENV, stdout=log, stderr=log)
    deadline = time.monotonic() + 60
    while not sock.exists():
        assert proc.poll() is None, (folder / "node.log").read_text()
        assert time.monotonic() < deadline, "kvtier node did not start"
        time.sleep(0.05)
    yield sock, proc
    stop(proc)
    assert "Traceback" not in (folder / "node.log").read_text()


def engine(sock: Path, name: str, **kw) -> NodeClient:
    c = NodeClient(sock, engine=name, slot_bytes=SLOT, namespace=NAMESPACE, **kw)
    c.connect()
    return c


def store(c: NodeClient, ids: list[int], byte: int = 7) -> None:
    """Reserve, write (in this process's mapping) and commit those of blocks ``ids`` the pool lacks."""
    mine = []
    for i, (_status, slots) in zip(ids, c.reserve([key(i) for i in ids])):
        if slots is not None:
            c.pool.slot(slots[0])[:] = bytes([byte]) * SLOT
            mine.append(i)
    assert c.commit([key(i) for i in mine], [(key(i - 1), 16, False) for i in mine]) == 0


# --- 4: malformed frames -------------------------------------------------------------------------
K3 = pack_keys([key(1), key(2), key(3)])
RESERVE1 = {"op": "reserve", "keys": pack_keys([key(900)]), "width": 1}
INF, NAN = math.inf, math.nan
MALFORMED = [
    ("a map as a map key, before hello", [b"\x81\x80\x01"], None),
    ("an array, not a map", [b"\x93\x01\x02\x03"], None),
    ("hello cap_bytes inf", [hello(cap_bytes=INF)], "cap_bytes"),
    ("hello cap_bytes NaN", [hello(cap_bytes=NAN)], "cap_bytes"),
    ("hello cap_bytes negative", [hello(cap_bytes=-1)], "cap_bytes"),
    ("hello slot_bytes inf", [hello(slot_bytes=INF)], "slot_bytes"),
    ("hello slot_bytes 2**64-1", [hello(slot_bytes=2**64 - 1)], "slot_bytes"),
    ("hello slot_bytes negative", [hello(slot_bytes=-SLOT)], "slot_bytes"),
    ("hello role unknown", [hello(role="root")], "role"),
    ("hello engine a map", [hello(engine={"a": 1})], "engine"),
    ("hello namespace not JSON", [hello(namespace="{")], "namespace"),
    ("hello without version", [{"op": "hello", "role": "scheduler"}], "version"),
    ("lookup width inf", [hello(), {"op": "lookup", "keys": K3, "width": INF}], "width"),
    ("lookup width NaN", [hello(), {"op": "lookup", "keys": K3, "width": NAN}], "width"),
    ("lookup width 0", [hello(), {"op": "lookup", "keys": K3, "width": 0}], "width"),
    ("lookup width 2**40", [hello(), {"op": "lookup", "keys": K3, "pin": True, "width": 2**40}], "width"),
    ("lookup pin a string", [hello(), {"op": "lookup", "keys": K3, "pin": "yes"}], "pin"),
    ("lookup parent 2**64-1", [hello(), {"op": "lookup", "keys": K3, "pin": True, "parent": 2**64 - 1,
                                         "tokens": 16}], "parent"),
    ("lookup parent without tokens", [hello(), {"op": "lookup", "keys": K3, "parent": key(0)}], "tokens"),
    ("reserve width NaN", [hello(), {"op": "reserve", "keys": K3, "width": NAN}], "width"),
    ("reserve width negative", [hello(), {"op": "reserve", "keys": K3, "width": -1}], "width"),
    ("reserve tails outside the keys", [hello(), {"op": "reserve", "keys": K3, "width": 1,
                                                  "tails": pack_u32([3])}], "tails"),
    ("commit record with a field missing", [hello(), RESERVE1, {"op": "commit", "keys": pack_keys([key(900)]),
                                                                "parents": pack_keys([key(899)])}], "tokens"),
    ("commit records not one per key", [hello(), RESERVE1, {"op": "commit", "keys": pack_keys([key(900)]),
                                                            "parents": K3, "tokens": pack_u32([16] * 3)}], "parents"),
    ("commit parent 2**64-1", [hello(), RESERVE1, {"op": "commit", "keys": pack_keys([key(900)]),
                                                   "parents": 2**64 - 1, "tokens": pack_u32([16])}], "parents"),
    ("commit tokens a float", [hello(), RESERVE1, {"op": "commit", "keys": pack_keys([key(900)]),
                                                   "parents": pack_keys([key(899)]), "tokens": 16.0}], "tokens"),
    ("keys of 31 bytes", [hello(), {"op": "reserve", "keys": b"k" * 31, "width": 1}], "keys"),
    ("keys of 33 bytes", [hello(), {"op": "commit", "keys": b"k" * 33}], "keys"),
    ("keys a list", [hello(), {"op": "lookup", "keys": [key(1), key(2)]}], "keys"),
    ("keys a map", [hello(), {"op": "abort", "keys": {"k": 1}}], "keys"),
    ("keys missing", [hello(), {"op": "reserve", "width": 1}], "keys"),
    ("more pins than a request holds", [hello(), {"op": "unpin", "pins": bytes(8 * (MAX_KEYS + 1))}], "pins"),
    ("more keys than a request holds", [hello(), {"op": "abort", "keys": bytes(32 * (MAX_KEYS + 1))}], None),
    ("pins a list of lists", [hello(), {"op": "unpin", "pins": [[1]]}], "pins"),
    ("an unknown field", [hello(), {"op": "lookup", "keys": K3, "everything": True}], "everything"),
    ("an unknown op", [{"op": "drop_everything"}], "op"),
    ("op a list", [{"op": [1]}], "op"),
    ("nested arrays past the bound", [{"op": "stats", "x": [[], [], [], [], []]}], None),
]


@pytest.mark.parametrize(("frames", "field"), [pytest.param(f, fld, id=name) for name, f, fld in MALFORMED])
def test_a_malformed_frame_is_answered_naming_its_field_and_closed(service, frames, field):
    sock, proc = service
    before = service_stats(sock)["protocol_errors"]
    replies, closed = exchange(sock, frames)
    assert closed, f"the connection stayed open after {replies}"
    assert replies and not replies[-1]["ok"], replies
    assert all(r["ok"] for r in replies[:-1]), replies  # the valid frames before it were served
    if field is not None:
        assert replies[-1]["field"] == field and repr(field) in replies[-1]["error"], replies[-1]
    assert proc.poll() is None, "the service died"
    after = service_stats(sock)
    assert after["protocol_errors"] == before + 1 and after["internal_errors"] == 0
    c = engine(sock, "after")  # and it serves the next engine
    store(c, [7000])
    assert c.lookup([key(7000)]).hits == 1
    c.close()


def test_a_bounded_fuzz_of_every_op_field_by_field_crashes_nothing(service):
    """A fixed-seed fuzz: every field of every op replaced by each of a set of type and range
    variants, dropped, joined by an unknown one; then random byte edits of valid frames. Each frame
    goes on a fresh connection after a valid hello, reserve and commit (so commits cascade to the
    disk tier). 0 crashes, 0 hangs, every valid frame before it answered, every connection that
    got an error closed, nothing left pinned, the service's peak RSS grows by less than 64 MiB."""
    sock, proc = service
    rng = random.Random(38)
    peak = rss_kib(proc.pid)
    variants = [None, True, False, 0, -1, 1, 2**31, 2**32, 2**63 - 1, 2**64 - 1, -2**63, INF, -INF, NAN, 1.5, "",
                "x" * 300, b"", b"\0" * 31, b"\0" * 32, b"\0" * 33, b"\0" * 96, b"\xff" * 8, [], [1], [b"\0" * 32],
                {}, {"a": 1}]
    prefix = [hello(engine="fuzz"), {"op": "reserve", "keys": pack_keys([key(1), key(2)]), "width": 1},
              {"op": "commit", "keys": pack_keys([key(1), key(2)]), "parents": pack_keys([key(0), key(1)]),
               "tokens": pack_u32([16, 8]), "tails": pack_u32([1])}]
    valid = {
        "hello": hello(engine="fuzz", cap_bytes=16 * SLOT),
        "lookup": {"op": "lookup", "keys": pack_keys([key(1), key(2), key(3)]), "pin": True, "width": 1,
                   "parent": key(0), "tokens": 16, "tail_tokens": 8},
        "reserve": {"op": "reserve", "keys": pack_keys([key(3), key(4)]), "width": 1, "tails": pack_u32([1])},
        "commit": {"op": "commit", "keys": pack_keys([key(1), key(2)]), "parents": pack_keys([key(0), key(1)]),
                   "tokens": pack_u32([16, 8]), "tails": pack_u32([1])},
        "abort": {"op": "abort", "keys": pack_keys([key(1)])},
        "unpin": {"op": "unpin", "pins": pack_u64([1, 2])},
        "stats": {"op": "stats"},
    }
    cases: list[list] = []
    for op, message in valid.items():
        before = [] if op == "hello" else prefix
        for field in [f for f in message if f != "op"]:
            for value in variants:
                cases.append(before + [{**message, field: value}])
            cases.append(before + [{k: v for k, v in message.items() if k != field}])
        cases.append(before + [{**message, "extra": 1}])
        cases.append(before + [{**message, "op": rng.choice(variants)}])
    for _ in range(4000 - len(cases)):  # byte edits of valid frames: flips, cuts, insertions, duplicates
        frame = bytearray(pack(rng.choice(list(valid.values()))))
        for _edit in range(rng.randint(1, 4)):
            if not frame:
                break
            at = rng.randrange(len(frame))
            kind = rng.random()
            if kind < 0.5:
                frame[at] = rng.randrange(256)
            elif kind < 0.7:
                del frame[at:]
                frame += bytes(rng.randrange(256) for _ in range(rng.randint(0, 8)))
            elif kind < 0.9:
                frame[at:at] = bytes([rng.choice((0xdc, 0xdd, 0xde, 0xdf, 0xc5, 0xc6, 0xda, 0x90, 0x80, 0xc1))])
            else:
                frame[at:at] = frame[at:at + rng.randint(1, 40)]
        cases.append(prefix + [bytes(frame)])
    started, errors = time.monotonic(), 0
    for frames in cases:
        last = frames[-1] if isinstance(frames[-1], bytes) else pack(frames[-1])
        try:  # an unfinished frame: the service waits for its rest, so the test closes its writing half
            finished = bool(FrameReader(requests=True).feed(last))
        except ProtocolError:
            finished = True
        replies, closed = exchange(sock, frames, half_close=not finished)
        served = len(frames) - 1
        assert all(r["ok"] for r in replies[:served]), (frames, replies)
        if len(replies) <= served:
            assert not finished and closed, (frames, replies)
            continue
        answer = replies[served]
        if not answer["ok"]:
            errors += 1  # a bad request or frame is closed; a refusal (no field) keeps the connection
            assert closed or not _bad(answer), (frames, replies)
    elapsed = time.monotonic() - started
    assert proc.poll() is None, "the service died"
    deadline = time.monotonic() + 30  # the last connections' pins go once the service's loop sees them closed
    while (stats := service_stats(sock))["pinned_blocks"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stats["internal_errors"] == 0 and stats["pinned_blocks"] == 0, stats
    assert errors > len(cases) // 2 and stats["protocol_errors"] > len(cases) // 2
    grew = rss_kib(proc.pid) - peak
    assert grew < 64 * 1024, f"the service's peak RSS grew by {grew} KiB over {len(cases)} frames"
    print(f"fuzz: {len(cases)} frames in {elapsed:.1f} s, {errors} errors, peak RSS +{grew} KiB")


# --- 7: frames larger than any request, memory bounded -------------------------------------------
def test_oversized_frames_and_empty_arrays_cost_the_service_little(service):
    sock, proc = service
    peak = rss_kib(proc.pid)
    empty_arrays = pack({"op": "lookup", "keys": [[]] * (8 * 2**20)})  # 8 MiB of empty arrays
    nested_headers = b"\x81\xa4keys" + b"\xdd\x00\x01\x00\x00" * 1000  # arrays of 65,536 entries, each in the last
    maps = pack({"op": "stats", **{f"m{i}": {f"k{j}": [] for j in range(15)} for i in range(14)}})
    oversized_field = pack({"op": "lookup", "keys": b"\0" * (MAX_FRAME_BYTES + 1024)})
    oversized = pack({"op": "stats", **{f"b{i}": bytes(MAX_KEYS * 32) for i in range(4)}})  # each field within bounds
    assert len(oversized) > MAX_FRAME_BYTES
    for frames in ([hello(), empty_arrays], [nested_headers], [maps], [hello(), oversized_field], [oversized]):
        replies, closed = exchange(sock, frames)
        grew = rss_kib(proc.pid) - peak
        assert grew < 32 * 1024, f"the service's peak RSS grew by {grew} KiB"
        assert closed and not replies[-1]["ok"], replies
    assert proc.poll() is None and service_stats(sock)["internal_errors"] == 0


def test_a_closed_connection_s_unfinished_frame_is_freed_at_once(service):
    """40 connections one after another, each leaving an unfinished frame of ~4.6 MiB (a commit
    of MAX_KEYS keys) and closing: the service's peak RSS stays within a few frames (each
    connection's buffer goes when it closes; a reference cycle through the frame reader's hooks
    kept each until a garbage collection: 49 -> 947 MiB over 120 such connections)."""
    sock, proc = service
    peak = rss_kib(proc.pid)
    frame = pack({"op": "commit", "keys": bytes(32 * MAX_KEYS), "parents": bytes(32 * MAX_KEYS),
                  "tokens": bytes(4 * MAX_KEYS)})
    assert len(frame) > 4 * 2**20
    for _ in range(40):
        with socket.socket(socket.AF_UNIX) as conn:
            conn.connect(str(sock))
            conn.sendall(frame[:-10])
            time.sleep(0.02)  # (read by the service before the close)
    grew = rss_kib(proc.pid) - peak
    assert grew < 64 * 1024, f"the service's peak RSS grew by {grew} KiB over 40 closed connections"
    assert proc.poll() is None and service_stats(sock)["internal_errors"] == 0


def test_a_frame_reader_is_in_no_reference_cycle_and_close_drops_its_buffer():
    import gc
    import weakref

    reader = FrameReader(requests=True)
    reader.push(pack({"op": "commit", "keys": bytes(32 * MAX_KEYS)})[:-10])
    gone = weakref.ref(reader)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del reader
        assert gone() is None, "the reader waits for a garbage collection"
    finally:
        if enabled:
            gc.enable()
    closed = FrameReader(requests=True)
    closed.push(pack({"op": "stats"})[:-1])
    closed.close()
    with pytest.raises(ProtocolError, match="closed"):
        closed.push(b"\x00")
    with pytest.raises(ProtocolError, match="closed"):
        closed.next_message()


# --- 7: a client that does not read its replies --------------------------------------------------
def test_a_client_that_never_reads_stalls_nobody_and_is_dropped_counted(service):
    sock, proc = service
    b = engine(sock, "B")
    store(b, [5000])
    slow = socket.socket(socket.AF_UNIX)
    slow.connect(str(sock))
    slow.setblocking(False)
    stats = pack({"op": "stats"})
    with contextlib.suppress(BlockingIOError):  # replies fill the socket both ways
        for _ in range(4000):
            slow.send(stats)
    time.sleep(0.3)
    with contextlib.suppress(BlockingIOError):  # its hello's reply (with the memfd) lands behind them
        slow.send(pack(hello(role="worker", engine="slow")))
    worst = 0.0
    for _ in range(20):
        t0 = time.monotonic()
        assert b.lookup([key(5000)]).hits == 1
        worst = max(worst, time.monotonic() - t0)
    assert worst < 1.0, f"a lookup took {worst:.2f} s while a client did not read"
    dropped = False
    deadline = time.monotonic() + 60
    while not dropped and time.monotonic() < deadline:  # keep asking, never read: it must be dropped
        try:
            slow.send(stats * 64)
        except BlockingIOError:
            time.sleep(0.001)
        except OSError:  # EPIPE / ECONNRESET: the service closed it
            dropped = True
    slow.close()
    assert dropped, "a client that never read 60 s of replies is still connected"
    assert service_stats(sock)["slow_readers"] >= 1
    assert b.lookup([key(5000)]).hits == 1
    b.close()


# --- 5: the pool cannot be resized by a client ----------------------------------------------------
def test_a_client_cannot_shrink_or_grow_the_pool(service):
    sock, proc = service
    with socket.socket(socket.AF_UNIX) as attacker:
        attacker.connect(str(sock))
        attacker.sendall(pack(hello(role="worker", engine="shrinker")))
        _data, fds, _flags, _addr = socket.recv_fds(attacker, 1 << 16, 4)
        assert len(fds) == 1
        try:
            size = os.fstat(fds[0]).st_size
            with pytest.raises(PermissionError):
                os.ftruncate(fds[0], 0)
            with pytest.raises(PermissionError):
                os.ftruncate(fds[0], size + 4096)
            assert os.fstat(fds[0]).st_size == size
        finally:
            os.close(fds[0])
    c = engine(sock, "next")  # writes its reserved slot, and the service copies it to disk: no SIGBUS
    written = service_stats(sock)["tiers"]["written_disk"]
    store(c, [6000], byte=9)
    deadline = time.monotonic() + 30
    while service_stats(sock)["tiers"]["written_disk"] == written:
        assert time.monotonic() < deadline, "the block never reached the service's disk"
        time.sleep(0.02)
    assert proc.poll() is None
    c.close()


# --- 6: a service of another uid ---------------------------------------------------------------------
def test_an_engine_refuses_a_service_of_another_uid(tmp_path):
    if os.getuid() != 0:
        pytest.skip("needs root to run the impostor as another user")
    folder = Path(tempfile.mkdtemp(prefix="kvtier-impostor-"))
    os.chmod(folder, 0o777)  # a directory anyone can write: the attacker binds the socket first
    sock = folder / "node.sock"
    script = ("import os, sys\n"  # the real service, imported as root (the interpreter lives in root's home)
              "from pathlib import Path\n"
              "from kvtier.node.server import NodeOptions, NodeServer\n"
              f"server = NodeServer(NodeOptions(Path({str(sock)!r}), pool_bytes={16 * SLOT}, slot_bytes={SLOT}))\n"
              f"os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})\n"
              "server.start()\n"
              "server.serve_forever()\n")
    impostor = subprocess.Popen([sys.executable, "-c", script], env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert impostor.poll() is None, f"the impostor did not start: {impostor.stderr.read()}"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert sock.stat().st_uid == NOBODY
        for role in (Role.SCHEDULER, Role.WORKER):
            c = NodeClient(sock, engine="victim", role=role, slot_bytes=SLOT, map_pool=True)
            with pytest.raises(NodeError, match=f"served by uid {NOBODY} .*node_uid = {NOBODY}"):
                c.connect()
            assert c.pool is None and not c.connected
        with pytest.raises(ConfigError, match=f"'node' = .*served by uid {NOBODY}"):
            connect_node(str(sock), engine="victim", role=Role.WORKER, slot_bytes=SLOT)
        with NodeClient(sock, engine="victim", role=Role.OBSERVER) as observer:  # sends nothing, maps nothing
            assert observer.stats()["connections"] >= 1
        trusted = NodeClient(sock, engine="victim", slot_bytes=SLOT, map_pool=True, node_uid=NOBODY)
        trusted.connect()  # named by node_uid: its service
        assert trusted.pool is not None
        trusted.close()
    finally:
        stop(impostor)
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()


# --- 7: holds released on every error path --------------------------------------------------------
def test_a_commit_after_the_slot_size_changed_is_cascaded_and_holds_nothing(tmp_path, monkeypatch):
    """A namespace's tiers opened for one slot size, the pool then cut for another (its engines
    left, engines of the other size came): the next commit's cascade wrote from slots of the new
    size into records of the old one, raised in the tier's submit_write, and left the block pinned
    for good. Tiers are per namespace and slot size now: it is cascaded, and nothing stays pinned."""
    gate = threading.Event()
    real_open = tiers_module.open_tier

    def slow_open(config, **kwargs):  # the first engine's tiers open after the pool was cut again
        assert gate.wait(60.0), "the test never opened the gate"
        return real_open(config, **kwargs)

    monkeypatch.setattr(tiers_module, "open_tier", slow_open)
    disk = DiskTierConfig(root_dir=tmp_path / "disk", capacity_bytes=64 * 2**20, n_read_threads=1, n_write_threads=1)
    svc = NodeThread(tmp_path / "n.sock", pool_bytes=16 * 2 * SLOT, tiers=(disk,))
    try:
        first = NodeClient(svc.sock, engine="A", slot_bytes=SLOT, namespace=NAMESPACE)
        first.connect()
        first.close()
        wait = time.monotonic() + 30
        while svc.stats()["connections"]:
            assert time.monotonic() < wait
            time.sleep(0.01)
        second = NodeClient(svc.sock, engine="B", slot_bytes=2 * SLOT, namespace=NAMESPACE)
        second.connect()  # the pool is cut into slots of 2 * SLOT
        gate.set()
        wait = time.monotonic() + 30
        while not all(ns["open"] for ns in svc.stats()["tiers"]["namespaces"].values()):
            assert time.monotonic() < wait
            time.sleep(0.01)
        (status, slots), = second.reserve([key(1)])
        second.pool.slot(slots[0])[:] = b"\5" * (2 * SLOT)
        assert second.commit([key(1)], [(key(0), 16, False)]) == 0
        wait = time.monotonic() + 30
        while svc.stats()["tiers"]["written_disk"] < 1:
            assert time.monotonic() < wait, svc.stats()["tiers"]
            time.sleep(0.01)
        assert svc.stats()["pinned_blocks"] == 0 and svc.stats()["internal_errors"] == 0
        second.close()
    finally:
        gate.set()
        svc.stop()


def _tier(root: Path, payload: int) -> DiskTier:
    ns = toy_namespace()
    return DiskTier(root_dir=root, model_name="toy", engine_digest=ns.engine_digest, rank_digests=ns.rank_digests(),
                    namespace_json=NAMESPACE, payload_bytes=payload, capacity_bytes=2**24, n_read_threads=1,
                    n_write_threads=1, max_pending_writes=8)


def test_a_tier_submit_that_raises_gives_back_what_it_held(tmp_path):
    """The core under both ways in: a write or a read the tier refuses by raising (here a real disk
    tier given buffers of another size) leaves no slot pinned or WRITING, and the key can be
    promoted again."""
    tier = _tier(tmp_path / "disk", SLOT)
    good = bytearray(SLOT)
    assert tier.submit_write(1, key(2), key(1), 16, [memoryview(good)])
    deadline = time.monotonic() + 30
    while not tier.poll():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    index = HostIndex(4)
    pool = bytearray(4 * 2 * SLOT)
    views = lambda slots: [memoryview(pool)[s * 2 * SLOT:(s + 1) * 2 * SLOT] for s in slots]  # noqa: E731
    stack = TierStack(index, views, [tier])
    slot, _ = index.allocate(key(1))
    index.commit(key(1))
    with pytest.raises(ValueError, match="sources"):
        stack.cascade(key(1), BlockInfo(key(0), 16))
    assert index.pinned_slots() == 0 and not stack.busy
    with pytest.raises(ValueError, match="dests"):
        stack.promote("asker", [key(2)])
    assert index.pinned_slots() == 0 and key(2) not in index and not stack.busy
    with pytest.raises(ValueError, match="dests"):  # not "being promoted" for ever
        stack.promote("asker", [key(2)])
    tier.close()


# --- 7: the lock file -----------------------------------------------------------------------------
@pytest.mark.parametrize("plant", ["symlink", "hardlink", "fifo"])
def test_a_planted_lock_file_is_refused_and_its_target_untouched(tmp_path, plant):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    sock = tmp_path / "n.sock"
    lock = tmp_path / "n.sock.lock"
    if plant == "symlink":
        lock.symlink_to(victim)
    elif plant == "hardlink":
        os.link(victim, lock)
    else:
        os.mkfifo(lock)
    server = NodeServer(NodeOptions(sock, pool_bytes=4 * SLOT, slot_bytes=SLOT, prefault=False))
    with pytest.raises(NodeConfigError, match="n.sock.lock"):
        server.start()
    assert victim.read_text() == "precious\n" and not sock.exists()
    server.close()


# --- the node audit's findings: each a test that failed before its fix -----------------------------
@pytest.fixture
def served(tmp_path):
    """``served(**options)``: a real :class:`NodeServer` (any :class:`NodeOptions`, a pool of 64
    slots unless given) with its loop on a thread (:class:`NodeThread`), stopped after the test."""
    made: list[NodeThread] = []

    def make(**options) -> NodeThread:
        options = {"pool_bytes": 64 * SLOT, "slot_bytes": SLOT, **options}
        made.append(NodeThread(tmp_path / "n.sock", **options))
        return made[-1]

    yield make
    for s in made:
        s.stop()


def _namespace_with(field: str, raw_number: str) -> str:
    """The test namespace's JSON with ``field``'s number replaced by ``raw_number`` as written."""
    data = json.loads(NAMESPACE)
    text = json.dumps(data)
    old = f'"{field}": {data[field]}'
    assert old in text
    return text.replace(old, f'"{field}": {raw_number}')


@pytest.mark.parametrize(("field", "raw"), [("block_tokens", "1e999"), ("tp_size", "1e999"), ("pp_size", "-1e999"),
                                            ("rank", "1e999"), ("tp_size", "1" + "0" * 400), ("block_tokens", "4.5")])
def test_f1_a_namespace_number_beyond_an_integer_is_refused_naming_it(service, field, raw):
    """JSON reads 1e999 as a float infinity, which int() cannot take (OverflowError): it killed the
    service. Now a bad request naming the field and the namespace's number."""
    sock, proc = service
    replies, closed = exchange(sock, [hello(namespace=_namespace_with(field, raw))])
    assert closed and not replies[-1]["ok"] and replies[-1]["field"] == "namespace", replies
    assert repr(field) in replies[-1]["error"], replies[-1]
    assert proc.poll() is None, "the service died"
    assert service_stats(sock)["internal_errors"] == 0


def test_f1_whatever_raises_while_serving_a_frame_closes_that_connection_only(served, monkeypatch):
    """A bug outside a request's handling (here: packing a lookup's reply raises) ended the loop;
    now it closes that connection (internal_errors, logged) and the loop serves the others."""
    from kvtier.node import server as server_module

    svc = served()
    real_pack = server_module.pack

    def failing_pack(message):
        if "hits" in message:
            raise RuntimeError("a bug")
        return real_pack(message)

    bystander = engine(svc.sock, "bystander")
    monkeypatch.setattr(server_module, "pack", failing_pack)
    replies, closed = exchange(svc.sock, [hello(), {"op": "lookup", "keys": K3}])
    assert closed and all(r["ok"] for r in replies), replies  # (the hello's reply, if it was written first)
    monkeypatch.setattr(server_module, "pack", real_pack)
    assert svc.thread.is_alive(), "the loop ended"
    assert svc.stats()["internal_errors"] == 1
    store(bystander, [1])
    assert bystander.lookup([key(1)]).hits == 1
    bystander.close()


def test_f2_connections_beyond_the_bound_are_closed_at_once_and_counted(served):
    from prometheus_client import generate_latest

    from kvtier.node.metrics import registry_for

    svc = served(max_connections=3)
    held = [engine(svc.sock, f"e{i}") for i in range(3)]
    with socket.socket(socket.AF_UNIX) as extra:
        extra.settimeout(30)
        extra.connect(str(svc.sock))
        refusal = FrameReader().feed(extra.recv(1 << 16))
        assert "at most 3 connections" in refusal[0]["error"] and extra.recv(1) == b""
    held.pop().close()
    deadline = time.monotonic() + 30
    while svc.stats()["connections"] > 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert service_stats(svc.sock)["refused_connections"] == 1  # (a connection is free again)
    assert "kvtier_node_refused_connections_total 1.0" in generate_latest(registry_for(svc.server)).decode()
    for c in held:
        c.close()


def test_f2_accept_failing_for_want_of_descriptors_does_not_end_the_service(tmp_path):
    """A real service at a low descriptor limit (RLIMIT_NOFILE 48) and a bound above it: accept
    raised EMFILE and the service exited. Now it pauses accepting, logs, keeps serving, and
    accepts again once descriptors are free."""
    import resource

    sock = tmp_path / "n.sock"
    log_path = tmp_path / "node.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli.main", "node", "--socket", str(sock), "--pool-bytes", str(16 * SLOT),
             "--slot-bytes", str(SLOT), "--no-prefault", "--max-connections", "1000"], env=ENV, stdout=log,
            stderr=log, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48)))
    flood: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        first = engine(sock, "first")
        store(first, [1])
        for _ in range(60):  # past the limit: the rest wait in the listen backlog
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(sock))
            flood.append(s)
        deadline = time.monotonic() + 30  # (a sleep here raced a slow service: it had not tried yet)
        while first.stats()["accept_errors"] < 1:  # it tried to accept past its descriptors
            assert proc.poll() is None, log_path.read_text()[-2000:]
            assert time.monotonic() < deadline, log_path.read_text()[-2000:]
            time.sleep(0.05)
        assert proc.poll() is None, log_path.read_text()[-2000:]
        assert first.lookup([key(1)]).hits == 1  # its connection is served meanwhile
        for s in flood:
            s.close()
        flood.clear()
        deadline = time.monotonic() + 30
        while True:  # accepting again once descriptors are free (the pause is at most 1 s)
            try:
                stats = service_stats(sock)
                break
            except (NodeError, OSError):
                assert time.monotonic() < deadline, log_path.read_text()[-2000:]
                time.sleep(0.1)
        assert stats["accept_errors"] >= 1 and stats["internal_errors"] == 0
        assert "Too many open files" in log_path.read_text()
        first.close()
    finally:
        for s in flood:
            s.close()
        stop(proc)


def test_f4_a_pipelined_burst_delays_another_client_by_one_turn_and_is_all_answered(service):
    """15,000 pipelined stats frames behind a full window of lookup times answered every frame of
    one read before anyone else (a bystander waited 10 s and more). Now each connection is answered
    a few frames per turn; the burst's frames left buffered are answered without new bytes."""
    sock, proc = service
    warm = engine(sock, "warm")
    store(warm, [3000])
    with socket.socket(socket.AF_UNIX) as w:  # 4,096 lookups: the percentiles' window full
        w.settimeout(10)
        w.connect(str(sock))
        w.sendall(pack(hello(engine="warmer")) + pack({"op": "lookup", "keys": pack_keys([key(3000)])}) * 4096)
        reader, got = FrameReader(), 0
        while got < 4097:
            got += len(reader.feed(w.recv(1 << 16)))
    burst = 5000
    with socket.socket(socket.AF_UNIX) as attacker:
        attacker.settimeout(10)
        attacker.connect(str(sock))
        attacker.sendall(pack({"op": "stats"}) * burst)  # then nothing more: the rest stays buffered there
        time.sleep(0.05)
        t0 = time.monotonic()
        assert warm.lookup([key(3000)]).hits == 1
        waited = time.monotonic() - t0
        reader, got = FrameReader(), 0
        while got < burst:
            data = attacker.recv(1 << 20)
            assert data, f"closed after {got} replies"
            got += len(reader.feed(data))
    assert waited < 0.5, f"a lookup waited {waited:.2f} s behind a pipelined burst"
    assert proc.poll() is None
    warm.close()


def test_f5_a_lookup_repeating_one_key_gets_a_reply_no_larger_than_the_pool(service):
    """One READY block named 65,536 times in a pinned lookup: its reply held 65,536 * width slot
    numbers (GiBs at width 256). Now a run stops at num_slots // width keys."""
    sock, proc = service
    c = engine(sock, "repeater")
    store(c, [4000])
    num_slots = c.attachment.num_slots
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(sock))
        s.sendall(pack(hello(engine="repeater")) + pack({"op": "lookup", "keys": pack_keys([key(4000)] * MAX_KEYS),
                                                         "pin": True}))
        reader, replies = FrameReader(), []
        while len(replies) < 2:
            replies += reader.feed(s.recv(1 << 20))
    reply = replies[1]
    assert reply["ok"] and 1 <= reply["hits"] <= num_slots and len(reply["slots"]) <= num_slots, \
        (reply["hits"], len(reply["slots"]))
    deadline = time.monotonic() + 30  # released with the connection, once the service's loop sees it closed
    while service_stats(sock)["pinned_blocks"]:
        assert time.monotonic() < deadline, "the closed connection's pins were never released"
        time.sleep(0.01)
    c.close()


def test_f6_a_session_pins_within_its_bounds_and_is_refused_beyond(served, monkeypatch):
    """Pinned lookups never unpinned piled up without limit (1,000 of 65,536 keys: +514 MiB). Now
    a session holds at most MAX_SESSION_PINS handles pinning MAX_SESSION_PINNED entries in all
    (made small here); beyond, the pinning lookup is refused, the connection kept."""
    from kvtier.node import index as index_module

    monkeypatch.setattr(index_module, "MAX_SESSION_PINS", 3)
    monkeypatch.setattr(index_module, "MAX_SESSION_PINNED", 40)
    svc = served()
    c = engine(svc.sock, "pinner")
    store(c, list(range(1, 33)))
    keys = [key(i) for i in range(1, 33)]
    first = c.lookup(keys, pin=True)  # 32 pinned
    with pytest.raises(NodeError, match="past 40 pinned blocks"):
        c.lookup(keys, pin=True)
    assert c.lookup(keys).hits == 32  # the connection is kept; a lookup that pins nothing is not bounded
    handles = [c.lookup(keys[:1], pin=True).pin, c.lookup(keys[:1], pin=True).pin]
    with pytest.raises(NodeError, match="3 pin handles"):
        c.lookup(keys[:1], pin=True)
    assert c.unpin([first.pin, *handles]) == 0
    assert c.lookup(keys, pin=True).hits == 32  # room again
    assert svc.stats()["internal_errors"] == 0
    c.close()


def test_f7_a_commit_cascades_only_what_the_session_committed_each_once(service):
    """A commit naming a block this session never reserved (another engine's, READY, not yet on
    disk), 4,096 times, with records of its own: every one was cascaded (pinned, queued, written
    with the attacker's records). Now only keys this session committed go on, each once."""
    sock, proc = service
    victim = engine(sock, "victim")
    (status, slots), = victim.reserve([key(5100)])
    victim.pool.slot(slots[0])[:] = b"\1" * SLOT
    assert victim.commit([key(5100)]) == 0  # no records: not cascaded
    before = service_stats(sock)["tiers"]
    n = 4096
    replies, closed = exchange(sock, [hello(engine="attacker"), {
        "op": "commit", "keys": pack_keys([key(5100)] * n), "parents": pack_keys([key(5099)] * n),
        "tokens": pack_u32([16] * n)}])
    assert replies[1] == {"ok": True, "unknown": n} and not closed
    time.sleep(0.5)
    after = service_stats(sock)
    assert after["tiers"]["written_disk"] == before["written_disk"], "another engine's block was cascaded"
    assert after["pinned_blocks"] == 0 and after["tiers"]["writes_in_flight"] == 0
    # ... and a commit that repeats its own key cascades it once
    c = engine(sock, "repeats")
    (status, slots), = c.reserve([key(5200)])
    c.pool.slot(slots[0])[:] = b"\2" * SLOT
    assert c.commit([key(5200)] * 3, [(key(5199), 16, False)] * 3) == 2
    deadline = time.monotonic() + 30
    while service_stats(sock)["tiers"]["written_disk"] < before["written_disk"] + 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.3)
    assert service_stats(sock)["tiers"]["written_disk"] == before["written_disk"] + 1
    victim.close()
    c.close()


def test_f10_a_hello_cannot_recut_a_pool_whose_slot_size_the_operator_set(served):
    """With --slot-bytes, a hello naming another slot size re-cut the empty pool, and engines of the
    operator's size were refused while it stayed. Now that hello is refused."""
    svc = served()
    with pytest.raises(NodeError, match=f"started with --slot-bytes {SLOT}"):
        NodeClient(svc.sock, engine="recutter", role=Role.WORKER, slot_bytes=2 * SLOT + 1).connect()
    assert svc.server.slot_bytes == SLOT
    c = engine(svc.sock, "real")
    assert c.attachment.slot_bytes == SLOT
    c.close()


def test_f11_stats_of_departed_engines_are_bounded_and_pruned(served):
    """Engines with fresh names that stored a block and left: those pushed out of the kept list
    while they held blocks were never forgotten (metric labels without bound). Now at most
    MAX_DEPARTED are known, and those beyond the last KEEP_DEPARTED go once they hold nothing."""
    from kvtier.node.roster import KEEP_DEPARTED, MAX_DEPARTED

    svc = served(pool_bytes=400 * SLOT)
    for i in range(MAX_DEPARTED + 40):
        c = NodeClient(svc.sock, engine=f"pod-{i}", slot_bytes=SLOT, map_pool=False)
        c.connect()
        c.reserve([key(i)])
        c.commit([key(i)])
        c.close()
    deadline = time.monotonic() + 30
    while svc.stats()["connections"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert len(svc.stats()["engines"]) <= MAX_DEPARTED, len(svc.stats()["engines"])
    filler = NodeClient(svc.sock, engine="filler", slot_bytes=SLOT, map_pool=False)
    filler.connect()
    filler.reserve([key(10_000 + i) for i in range(400)])  # evicts every pod's block
    filler.commit([key(10_000 + i) for i in range(400)])
    filler.close()
    deadline = time.monotonic() + 30
    while len(svc.stats()["engines"]) > KEEP_DEPARTED:  # pruned by the loop's periodic work
        assert time.monotonic() < deadline, len(svc.stats()["engines"])
        time.sleep(0.02)
    assert "filler" in svc.stats()["engines"]
