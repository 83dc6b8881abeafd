"""The node service with real processes and sockets: engines share the pool through their own
mappings, a SIGKILLed engine's pins and reservations are released, one stalled engine stalls no
other, engines reattach after a restart, and the service's bad inputs fail with clear errors."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvtier.node import NodeClient, NodeError, NodeUnavailable, Role
from kvtier.node.protocol import PROTOCOL_VERSION, Reservation, pack

SRC = Path(__file__).resolve().parents[1] / "src"
ENV = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
SLOT = 10_000


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def start_node(sock: Path, *args: str, wait: bool = True) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli.main", "node", "--socket", str(sock), *args],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if wait:
        deadline = time.monotonic() + 60
        while not accepts(sock):
            if proc.poll() is not None:
                raise AssertionError(f"kvtier node exited: {proc.stderr.read()}")
            assert time.monotonic() < deadline, "kvtier node did not start"
            time.sleep(0.05)
    return proc


def accepts(sock: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(sock))
        except OSError:
            return False
    return True


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.fixture
def node(tmp_path):
    sock = tmp_path / "node.sock"
    proc = start_node(sock, "--pool-bytes", "1MiB", "--slot-bytes", str(SLOT))
    yield sock
    stop(proc)


def client(sock: Path, engine: str, **kw) -> NodeClient:
    c = NodeClient(sock, engine=engine, slot_bytes=SLOT, **kw)
    c.connect()
    return c


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_an_engine_reads_from_its_own_mapping_what_another_engine_wrote(node):
    a, b = client(node, "A"), client(node, "B")
    payloads = {key(i): os.urandom(SLOT) for i in range(3)}
    reserved = a.reserve(list(payloads), width=2)
    for (status, slots), data in zip(reserved, payloads.values()):
        assert status is Reservation.RESERVED and len(slots) == 2
        for s in slots:
            a.pool.slot(s)[:] = data
    assert b.lookup(list(payloads), width=2) == (0, [], 0, False, 0, ())  # WRITING: not a hit yet
    assert a.commit(list(payloads)) == 0
    hits, slots, pin, _, _, _ = b.lookup([*payloads, key(99)], pin=True, width=2)
    assert hits == 3 and len(slots) == 6 and pin
    for i, data in enumerate(payloads.values()):
        assert all(bytes(b.pool.slot(s)) == data for s in slots[2 * i:2 * i + 2])
    # stored twice, kept once
    assert [st for st, _ in b.reserve(list(payloads), width=2)] == [Reservation.PRESENT] * 3
    stats = b.stats()
    assert stats["blocks"] == 3 and stats["used_slots"] == 6 and stats["pinned_blocks"] == 3
    assert stats["engines"]["B"]["duplicate_blocks"] == 3 and stats["engines"]["B"]["hit_blocks"] == 3
    assert b.unpin([pin]) == 0 and b.stats()["pinned_blocks"] == 0
    a.close(), b.close()


def test_a_killed_engine_releases_its_pins_and_reservations(node):
    a = client(node, "A")
    a.reserve([key(1)])
    a.commit([key(1)])
    code = (f"from kvtier.node import NodeClient\n"
            f"c = NodeClient({str(node)!r}, engine='victim', slot_bytes={SLOT}); c.connect()\n"
            "assert c.lookup([(1).to_bytes(32, 'little')], pin=True)[0] == 1\n"
            "c.reserve([(2).to_bytes(32, 'little'), (3).to_bytes(32, 'little')])\n"
            "print('held', flush=True)\n"
            "import time; time.sleep(60)\n")
    victim = subprocess.Popen([sys.executable, "-c", code], env=ENV, stdout=subprocess.PIPE, text=True)
    assert victim.stdout.readline().strip() == "held"
    stats = a.stats()
    assert stats["pinned_blocks"] == 3 and stats["engines"]["victim"]["sessions"] == 1
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    wait_for(lambda: a.stats()["pinned_blocks"] == 0)
    stats = a.stats()
    assert stats["blocks"] == 1 and stats["used_slots"] == 1 and stats["attached_engines"] == 1
    # the aborted reservations are gone: another engine may store those blocks now
    assert [st for st, _ in a.reserve([key(2), key(3)])] == [Reservation.RESERVED] * 2


def test_an_engine_that_stops_reading_stalls_no_other(node):
    stalled = socket.socket(socket.AF_UNIX)
    stalled.connect(str(node))
    stalled.sendall(pack({"op": "hello", "version": PROTOCOL_VERSION, "engine": "stalled", "role": "observer"}))
    request = pack({"op": "stats"})
    stalled.setblocking(False)
    sent = 0
    try:
        for _ in range(200_000):  # never reads a reply: its socket buffers fill up
            sent += stalled.send(request)
    except BlockingIOError:
        pass
    b = client(node, "B")
    start = time.perf_counter()
    for _ in range(50):
        b.lookup([key(i) for i in range(100)])
    assert time.perf_counter() - start < 5.0
    stalled.close()
    b.close()


def test_engines_miss_while_the_service_is_down_and_reattach_after_a_restart(tmp_path):
    sock = tmp_path / "node.sock"
    proc = start_node(sock, "--pool-bytes", "1MiB", "--slot-bytes", str(SLOT))
    a = NodeClient(sock, engine="A", slot_bytes=SLOT, retry_interval_s=0.1)
    a.connect()
    a.reserve([key(1)]), a.commit([key(1)])
    assert a.generation == 1 and a.lookup([key(1)])[0] == 1
    first_pool = a.attachment.pool_id
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with pytest.raises(NodeUnavailable):
        a.lookup([key(1)])
    with pytest.raises(NodeUnavailable):
        a.lookup([key(1)])  # within retry_interval_s, or the socket is gone: no hang, an error at once
    proc = start_node(sock, "--pool-bytes", "1MiB", "--slot-bytes", str(SLOT))  # replaces the dead socket
    time.sleep(0.15)
    assert a.lookup([key(1)]) == (0, [], 0, False, 0, ())  # a fresh, empty pool: reattached by itself
    assert a.generation == 2 and a.pool is not None and a.attachment.pool_id != first_pool
    a.close()
    stop(proc)


def test_a_second_service_on_the_same_socket_is_refused(node):
    second = start_node(node, "--pool-bytes", "1MiB", wait=False)
    _, err = second.communicate(timeout=30)
    assert second.returncode != 0
    assert "another kvtier node" in err and "already serves" in err and str(node) in err


def test_a_pool_larger_than_the_node_is_refused(tmp_path):
    proc = start_node(tmp_path / "n.sock", "--pool-bytes", "1000TiB", wait=False)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and "--pool-bytes" in err and "more than this node can hold" in err
    assert not (tmp_path / "n.sock").exists()


@pytest.mark.parametrize("flag, value", [("--pool-bytes", "0"), ("--pool-bytes", "0.4"), ("--slot-bytes", "0")])
def test_a_size_of_no_bytes_is_a_usage_error(tmp_path, flag, value):
    """Like every other bad value of these flags (rc 2, the flag named), not a failure of the service (rc 1)."""
    args = {"--pool-bytes": "1MiB", "--slot-bytes": "10000", flag: value}
    proc = start_node(tmp_path / "n.sock", *[a for pair in args.items() for a in pair], wait=False)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and f"Invalid value for '{flag}'" in err and "at least one byte" in err, err
    assert not (tmp_path / "n.sock").exists()


def test_the_disk_dir_the_service_creates_is_owner_only(tmp_path):
    """docs/security.md: directories kvtier creates are 0700 (and their missing parents)."""
    root = tmp_path / "new" / "kv"
    old = os.umask(0o022)
    try:
        proc = start_node(tmp_path / "n.sock", "--pool-bytes", "1MiB", "--no-prefault", "--disk-dir", str(root),
                          "--disk-size", "0.01")
    finally:
        os.umask(old)
    try:
        for made in (tmp_path / "new", root):
            assert stat.S_IMODE(made.stat().st_mode) == 0o700, (made, oct(made.stat().st_mode))
    finally:
        stop(proc)


def test_socket_is_owner_only_and_other_users_are_refused_by_credentials(tmp_path_factory):
    if os.getuid() != 0:
        pytest.skip("needs root to run a client as another user")
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="kvtier-node-"))  # reachable by others: only the socket's mode counts
    os.chmod(folder, 0o755)
    sock = folder / "node.sock"
    proc = start_node(sock, "--pool-bytes", "1MiB", "--slot-bytes", str(SLOT))
    try:
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        nobody = ("import os\n"
                  "from kvtier.node import NodeClient, NodeError\n"
                  "os.setgid(65534); os.setuid(65534)\n"
                  f"c = NodeClient({str(sock)!r}, engine='x', slot_bytes={SLOT})\n"
                  "try:\n    c.connect()\nexcept NodeError as e:\n    print(e)\n")
        out = subprocess.run([sys.executable, "-c", nobody], env=ENV, capture_output=True, text=True, timeout=60)
        assert "permission denied" in out.stdout, out.stderr
        os.chmod(sock, 0o666)  # a socket opened up by mistake: the credentials check still refuses
        out = subprocess.run([sys.executable, "-c", nobody], env=ENV, capture_output=True, text=True, timeout=60)
        assert "admits only uid 0" in out.stdout and "runs as uid 65534" in out.stdout, out.stderr
        assert client(sock, "A").stats()["rejected_peers"] == 1
    finally:
        stop(proc)
        sock.with_name("node.sock.lock").unlink()
        folder.rmdir()


def test_another_block_size_is_refused_while_engines_use_the_pool(node):
    a = client(node, "A")
    with pytest.raises(NodeError, match="slots of 10000 bytes; this engine's blocks are 20000"):
        NodeClient(node, engine="B", slot_bytes=20_000).connect()
    a.close()


def test_inspect_and_prometheus_metrics_of_a_running_service(tmp_path):
    sock = tmp_path / "node.sock"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start_node(sock, "--pool-bytes", "1MiB", "--slot-bytes", str(SLOT), "--metrics-port", str(port))
    try:
        a = client(sock, "A")
        a.reserve([key(1)]), a.commit([key(1)])
        a.lookup([key(1), key(2)], pin=True)
        hostile = client(sock, "evil\x1b]0;pwned\x07\x1b[2J[red]x")  # an admitted peer names itself
        hostile.lookup([key(9)])
        out = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "inspect", str(sock), "--json"], env=ENV,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)
        assert data["blocks"] == 1 and data["pinned_blocks"] == 1 and data["engines"]["A"]["hit_blocks"] == 1
        text = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "inspect", str(sock)],
                              env={**ENV, "COLUMNS": "1000"},  # one table row a line, whatever the caller's
                              capture_output=True, text=True, timeout=60).stdout
        assert "pool" in text and "A" in text
        assert r"evil\x1b]0;pwned\x07\x1b[2J[red]x" in text and "\x1b" not in text  # shown, never sent raw
        hostile.close()
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'kvtier_node_hit_blocks_total{engine="A"} 1.0' in metrics
        assert "kvtier_node_pinned_blocks 1.0" in metrics and "kvtier_node_attached_engines 1.0" in metrics
        assert f"kvtier_node_pool_used_bytes {float(a.attachment.slot_stride)}" in metrics
        assert "kvtier_node_protocol_errors_total 0.0" in metrics and "kvtier_node_slow_readers_total 0.0" in metrics
        assert "kvtier_node_internal_errors_total 0.0" in metrics
        # a full pool: the first victim by LRU, then the runs of slots continue over cold blocks
        for i in range(100, 100 + data["num_slots"] + 2):
            assert a.reserve([key(i)]) is not None
            a.commit([key(i)])
        after = json.loads(subprocess.run([sys.executable, "-m", "kvtier.cli.main", "inspect", str(sock), "--json"],
                                          env=ENV, capture_output=True, text=True, timeout=60).stdout)
        assert (after["evictions"], after["run_evictions"]) == (3, 2)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "kvtier_node_evictions_total 3.0" in metrics and "kvtier_node_run_evictions_total 2.0" in metrics
        a.close()
    finally:
        stop(proc)


def test_a_group_is_admitted_with_group(tmp_path):
    if os.getuid() != 0:
        pytest.skip("needs root to run a client as another user")
    import grp
    import tempfile

    group = grp.getgrgid(65534).gr_name  # nogroup: the group of nobody
    folder = Path(tempfile.mkdtemp(prefix="kvtier-node-"))
    os.chmod(folder, 0o755)
    sock = folder / "node.sock"
    proc = start_node(sock, "--pool-bytes", "1MiB", "--slot-bytes", str(SLOT), "--group", group)
    try:
        assert stat.S_IMODE(sock.stat().st_mode) == 0o660 and sock.stat().st_gid == 65534
        member = ("import os\n"
                  "from kvtier.node import NodeClient\n"
                  "os.setgid(65534); os.setuid(65534)\n"
                  f"c = NodeClient({str(sock)!r}, engine='member', slot_bytes={SLOT}); c.connect()\n"
                  "c.reserve([bytes(32)]); c.commit([bytes(32)]); print('hits', c.lookup([bytes(32)]).hits)\n")
        out = subprocess.run([sys.executable, "-c", member], env=ENV, capture_output=True, text=True, timeout=60)
        assert "hits 1" in out.stdout, out.stderr
    finally:
        stop(proc)
        sock.with_name("node.sock.lock").unlink()
        folder.rmdir()


def test_a_malformed_peer_is_dropped_alone_and_versions_must_match(node):
    a = client(node, "A")
    a.reserve([key(1)]), a.commit([key(1)])
    with socket.socket(socket.AF_UNIX) as bad:
        bad.connect(str(node))
        bad.sendall(b"\x93\x01\x02\x03")  # a msgpack array, not a map
        from kvtier.node.frames import FrameReader

        refusal = FrameReader().feed(bad.recv(4096))[0]
        assert not refusal["ok"] and "must be a map" in refusal["error"]
        assert bad.recv(100) == b""  # dropped
    wait_for(lambda: a.stats()["protocol_errors"] == 1)
    assert a.lookup([key(1)]).hits == 1
    with socket.socket(socket.AF_UNIX) as old:
        old.connect(str(node))
        old.sendall(pack({"op": "hello", "version": 0, "engine": "old", "role": "scheduler"}))
        from kvtier.node.frames import FrameReader

        reply = FrameReader().feed(old.recv(4096))[0]
    assert not reply["ok"] and "protocol version 0" in reply["error"] and "same kvtier version" in reply["error"]
    a.close()


def test_the_first_engine_sets_the_slot_size_when_none_was_given(tmp_path):
    sock = tmp_path / "node.sock"
    proc = start_node(sock, "--pool-bytes", "1MiB")
    try:
        with NodeClient(sock, engine="inspect", role=Role.OBSERVER) as observer:
            assert observer.stats()["slot_bytes"] is None
        with pytest.raises(NodeError, match="first engine to attach must give slot_bytes"):
            NodeClient(sock, engine="W", role=Role.WORKER).connect()
        a = NodeClient(sock, engine="A", slot_bytes=5000)
        assert a.connect().slot_stride == 8192 and a.attachment.num_slots == 128
        with pytest.raises(NodeError, match="cpu_bytes_to_use 100 is less than one slot"):
            NodeClient(sock, engine="tiny", slot_bytes=5000, cap_bytes=100).connect()
        worker = NodeClient(sock, engine="A", role=Role.WORKER)  # a worker needs no size: it gets the pool's
        assert worker.connect().slot_bytes == 5000 and worker.pool.num_slots == 128
        a.close(), worker.close()
    finally:
        stop(proc)


def test_byte_sizes_and_help():
    from click.testing import CliRunner

    from kvtier.cli.main import main
    from kvtier.cli.node import ByteSize

    assert [ByteSize().convert(v, None, None) for v in ("8000000000", "8G", "8GiB", "1.5 MiB")] == \
        [8_000_000_000, 8_000_000_000, 8 * 2**30, 3 * 2**19]
    out = CliRunner().invoke(main, ["node", "--help"]).output
    for words in ("--socket", "--pool-bytes", "--slot-bytes", "--group", "--metrics-port", "SIGKILL",
                  "cpu_bytes_to_use", "kvtier inspect PATH", "--disk-dir", "--disk-size", "--redis-url", "restart"):
        assert words in out
    bad = CliRunner().invoke(main, ["node", "--socket", "/tmp/x.sock", "--pool-bytes", "lots"])
    assert bad.exit_code == 2 and "not a byte count" in bad.output


def test_stats_of_departed_engines_are_bounded(node):
    keeper = client(node, "keeper")
    keeper.reserve([key(1)]), keeper.commit([key(1)])
    keeper.close()  # left, but holds a block: its stats stay
    for i in range(70):
        with NodeClient(node, engine=f"gone-{i}", slot_bytes=SLOT) as c:
            c.connect()
            c.lookup([key(1)])
    observer = NodeClient(node, engine="inspect", role=Role.OBSERVER)
    wait_for(lambda: observer.stats()["connections"] == 1)
    engines = observer.stats()["engines"]
    assert "keeper" in engines and engines["keeper"]["held_slots"] == 1
    assert "gone-69" in engines and "gone-0" not in engines
    assert len(engines) <= 64 + 1
    observer.close()
