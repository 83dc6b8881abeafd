"""A Redis server or S3 store that does not answer at start-up costs its timeout once, in every way in.

Behind vLLM's offloading (tests/support/native_rig.py: vLLM's real manager builds the tiers) and in
the node service, a tier's entry is checked first (``check_tier``: refused credentials stop start-up)
and the tier is opened later, once its namespace is known; kvtier's connector opens its tiers with
no check. The check's finding is handed to the tier (kvtier.tiers.factory), so a server it found
unreachable is not asked again while the tier opens: the tier starts off and its monitor connects in
the background. Before, the tier's constructor asked again: two connections and two timeouts (20 s
behind vLLM's offloading with the S3 tier's default ``timeout_s``).

The server that never answers is :class:`Silent`: a real listening socket that accepts connections
(counting them) and never sends a byte; a paused real redis-server shows the tier coming back once
its server answers.
"""

from __future__ import annotations

import os
import socket
import stat
import threading

import pytest
from support.namespaces import toy_namespace
from support.native_rig import NativeRig, native_env  # noqa: F401  (pytest fixture)
from support.node_service import NodeThread
from support.redis_server import redis_factory  # noqa: F401  (pytest fixture)
from test_node_tiers import engine, tiers_open, wait_for

from kvtier.core.tier_config import RedisTierConfig, S3TierConfig, TierType, parse_tier
from kvtier.tiers.factory import check_tier, open_tier

SLOT = 4096
NS = toy_namespace()
TIMEOUTS = {"connect_timeout_s": 0.3, "timeout_s": 0.5}


class Silent:
    """A TCP listener on 127.0.0.1 that accepts every connection and never answers; counts them."""

    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self._sock.getsockname()[1]
        self._accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            self._accepted.append(conn)

    @property
    def connections(self) -> int:
        return len(self._accepted)

    def close(self) -> None:
        self._sock.close()
        for conn in self._accepted:
            conn.close()


@pytest.fixture
def silent():
    server = Silent()
    yield server
    server.close()


@pytest.fixture
def aws_keys(monkeypatch):
    """Static credentials in the environment (the S3 client then asks no metadata endpoint)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "kvtier-test-access")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "kvtier-test-secret")


def entry(kind: str, port: int) -> dict:
    """A tier entry (kvtier's keys, no ``type``) for a server at 127.0.0.1:``port``, short timeouts."""
    if kind == "redis":
        return {"url": f"redis://127.0.0.1:{port}/0", **TIMEOUTS}
    return {"url": "s3://kvtier-test/probes", "endpoint": f"http://127.0.0.1:{port}", "region": "us-east-1",
            **TIMEOUTS}


def config(kind: str, port: int) -> RedisTierConfig | S3TierConfig:
    parsed = parse_tier(entry(kind, port), TierType.REDIS if kind == "redis" else TierType.S3, "secondary_tiers[0]")
    assert isinstance(parsed, RedisTierConfig | S3TierConfig)
    return parsed


def tier_is_off(tier) -> bool:
    return not tier._breaker.closed


@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_behind_vllms_offloading_a_silent_server_is_asked_once_at_start_up(native_env, silent, aws_keys, kind):  # noqa: F811
    """vLLM builds the tier (its entry checked: one connection, a timeout), then the tier opens once
    vLLM set its seed, from what the check found: no second connection, no second timeout. (The
    monitor's first try comes a second after the tier opened: not counted here.)"""
    rig = NativeRig(native_env, [{"type": f"kvtier_{kind}", **entry(kind, silent.port)}])  # returns once open
    assert silent.connections == 1
    (adapter,) = rig.tiers
    assert tier_is_off(adapter._store.tier)
    rig.close()


@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_the_node_service_opens_a_namespace_from_its_start_up_check(tmp_path, silent, aws_keys, kind):
    """``kvtier node`` checks its tiers' entries when it starts (``_tier_configs``: check_tier), then
    opens them per namespace when an engine says hello: from the check's finding, without asking the
    silent server again."""
    tier = config(kind, silent.port)
    assert check_tier(tier, where="--redis-url" if kind == "redis" else "s3") is False
    assert silent.connections == 1
    svc = NodeThread(tmp_path / "n.sock", pool_bytes=8 * SLOT, slot_bytes=SLOT, tiers=(tier,))
    try:
        a = engine(svc.sock)
        wait_for(lambda: tiers_open(a), timeout=30.0, what="the namespace's tiers to open")
        assert silent.connections == 1
        a.close()
    finally:
        svc.stop()


@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_kvtiers_connector_opens_its_tiers_without_a_check_asking_once(silent, aws_keys, kind):
    """kvtier's own connector (runtime/host_factory.py) opens its tiers with no check first: the
    tier's constructor asks, once."""
    tier = open_tier(config(kind, silent.port), model_name="toy", namespace=NS, namespace_json=NS.config_json("toy"),
                     payload_bytes=SLOT)
    assert silent.connections == 1 and tier_is_off(tier)
    tier.close()


def test_a_finding_is_taken_once(silent):
    """The finding goes to the one tier opened after the check; a tier opened later asks for itself."""
    tier = config("redis", silent.port)
    check_tier(tier, where="secondary_tiers[0]")
    for connections in (1, 2):
        opened = open_tier(tier, model_name="toy", namespace=NS, namespace_json=NS.config_json("toy"),
                           payload_bytes=SLOT)
        opened.close()  # before its monitor's first try
        assert silent.connections == connections


def test_a_stale_finding_is_not_used(silent, monkeypatch):
    """A finding older than FINDING_FRESH_S (the node service's first namespace opening long after
    its start-up check) is dropped: the tier asks the server itself."""
    from kvtier.tiers import factory

    tier = config("redis", silent.port)
    check_tier(tier, where="secondary_tiers[0]")
    monkeypatch.setattr(factory, "FINDING_FRESH_S", -1.0)  # every finding is older than that
    opened = open_tier(tier, model_name="toy", namespace=NS, namespace_json=NS.config_json("toy"), payload_bytes=SLOT)
    opened.close()
    assert silent.connections == 2


def test_a_redis_tier_started_off_by_the_check_comes_back_when_its_server_answers(redis_factory):  # noqa: F811
    """Found unreachable (a paused server) by the check, the tier neither connects nor stores its
    namespace key when it opens; once the server answers, its monitor connects, stores the key and
    the tier serves."""
    server = redis_factory()
    tier_config = RedisTierConfig(url=server.url(), **TIMEOUTS)
    server.pause()
    try:
        assert check_tier(tier_config, where="secondary_tiers[0]") is False
        tier = open_tier(tier_config, model_name="toy", namespace=NS, namespace_json=NS.config_json("toy"),
                         payload_bytes=SLOT)
        assert tier_is_off(tier)
    finally:
        server.resume()
    wait_for(lambda: not tier_is_off(tier), timeout=30.0, what="the tier to come back")
    assert server.client().get(tier.keys.config) == NS.config_json("toy").encode()
    block = (7).to_bytes(32, "little")
    assert tier.submit_write(1, block, (6).to_bytes(32, "little"), 16, [memoryview(bytes(SLOT))])
    wait_for(lambda: any(r.ok for r in tier.poll()), what="the write")
    tier.close()


@pytest.mark.parametrize("group_access, mode", [(False, 0o700), (True, 0o2770)])
def test_a_checked_disk_root_is_created_owner_only_or_group_shared_whatever_the_umask(tmp_path, group_access, mode):
    """check_tier of a disk entry whose root is missing (behind vLLM's offloading, the node
    service) creates it and its missing parents with the tier's mode, as the connector does
    (docs/security.md), not the umask's 0755."""
    from kvtier.core.tier_config import parse_secondary_tiers

    root = tmp_path / "new" / "kv"
    [config] = parse_secondary_tiers([{"type": "fs", "root_dir": str(root), "group_access": group_access}],
                                     create_dirs=False)
    assert not (tmp_path / "new").exists()
    old = os.umask(0o022)
    try:
        assert check_tier(config, where="secondary_tiers[0]") is True
    finally:
        os.umask(old)
    for made in (tmp_path / "new", root):
        assert stat.S_IMODE(made.stat().st_mode) == mode, (made, oct(made.stat().st_mode))
