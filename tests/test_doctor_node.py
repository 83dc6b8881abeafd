"""``kvtier doctor`` on lines that attach to a ``kvtier node`` service (``kvtier serve --node``, the
connector's ``node`` key, a ``kvtier_node`` entry behind vLLM's offloading), against a real service:
none running (a warning for vllm serve, which starts none; information for kvtier serve, which
starts one), one running (its pool; an engine cap above it), one of a user the engine would refuse
(an error) unless node_uid names it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from test_node_service import ENV, accepts, start_node, stop

from kvtier.doctor.audit import audit

KVTIER = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.vllm", "kv_role": "kv_both"}
NATIVE = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier.vllm.native",
                                        "cpu_bytes_to_use": 2**30}}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))


def found(argv) -> dict[str, tuple[str, str, str]]:
    """code -> (severity, title, why) of the node findings."""
    return {f.code: (f.severity, f.title, f.why) for f in audit(argv) if f.code.startswith("node-")}


def vllm_line(sock: Path, **extra) -> list[str]:
    config = {**KVTIER, "kv_connector_extra_config": {"node": str(sock), "cpu_bytes_to_use": 2**30, **extra}}
    return ["vllm", "serve", "some/model", "--kv-transfer-config", json.dumps(config)]


def native_line(sock: Path) -> list[str]:
    config = json.loads(json.dumps(NATIVE))
    config["kv_connector_extra_config"]["secondary_tiers"] = [{"type": "kvtier_node", "socket": str(sock)}]
    return ["vllm", "serve", "some/model", "--kv-transfer-config", json.dumps(config)]


def test_no_service_warns_for_vllm_serve_and_informs_for_kvtier_serve(tmp_path):
    sock = tmp_path / "node.sock"
    for line in (vllm_line(sock), native_line(sock)):
        assert found(line)["node-not-running"][0] == "warning"
    serve = found(["kvtier", "serve", "--node", str(sock), "--max-model-len", "4096"])
    assert set(serve) == {"node-started-by-serve"} and serve["node-started-by-serve"][0] == "info"
    assert not sock.exists()  # the doctor starts nothing


def test_a_running_service_is_described_and_a_cap_above_its_pool_said(tmp_path):
    sock = tmp_path / "node.sock"
    proc = start_node(sock, "--pool-bytes", "64MiB", "--slot-bytes", str(2**20))
    try:
        for line in (vllm_line(sock), native_line(sock)):
            got = found(line)
            assert got["node-ok"][0] == "info" and "64.0 MiB in 64 slots" in got["node-ok"][2], got
        assert found(vllm_line(sock))["node-cap-above-pool"][0] == "info"  # 1 GiB cap, 64 MiB pool
        assert "node-cap-above-pool" not in found(vllm_line(sock, cpu_bytes_to_use=32 * 2**20))
        assert set(found(["kvtier", "serve", "--node", str(sock), "--kv-offloading-size", "0.01"])) == {"node-ok"}
    finally:
        stop(proc)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run the service as another user")
def test_a_service_of_another_user_is_an_error_unless_node_uid_names_it():
    folder = Path(tempfile.mkdtemp(prefix="kvtier-doctor-node-"))
    os.chmod(folder, 0o777)
    sock = folder / "node.sock"
    # everything the service imports, imported as root (the interpreter's files may be root's alone)
    code = ("import importlib, os, pkgutil, sys, kvtier.node, kvtier.cli.main as cli\n"
            "for m in pkgutil.walk_packages(kvtier.node.__path__, 'kvtier.node.'): importlib.import_module(m.name)\n"
            "import kvtier.cli.node, kvtier.tiers.factory\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "cli.main(['node', '--socket', sys.argv[1], '--pool-bytes', '8MiB', '--slot-bytes', '1MiB'])\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(sock)], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        import time
        deadline = time.monotonic() + 30
        while not accepts(sock):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the service did not start"
            time.sleep(0.05)
        refused = found(vllm_line(sock))
        assert refused["node-refused"][0] == "error" and "uid 65534" in refused["node-refused"][2], refused
        assert "node-ok" in found(vllm_line(sock, node_uid=65534))
    finally:
        stop(proc)
        for leftover in folder.iterdir():
            leftover.unlink()
        folder.rmdir()
