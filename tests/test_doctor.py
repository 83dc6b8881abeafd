"""``kvtier doctor``: every finding with a positive and a negative command line, the command-line
parser, the exit code, and the measurements (small sizes)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from rich.console import Console

from kvtier.cli.doctor import render_measurements
from kvtier.cli.main import main
from kvtier.doctor.audit import audit
from kvtier.doctor.measure import Bandwidth, compare, cuda_available, cuda_copies, disk_write_read, dram_copy
from kvtier.doctor.probes import filesystem_type, namespaces_under
from kvtier.launch.cmdline import parse_serve_line

FIXTURES = Path(__file__).parent / "fixtures" / "model_configs"
L70 = str(FIXTURES / "llama-3.1-70b.json")
DSV3 = str(FIXTURES / "deepseek-v3.json")
KVTIER = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.vllm", "kv_role": "kv_both"}


@pytest.fixture(autouse=True)
def gpu_semantics(tmp_path, monkeypatch):
    """kvtier serve lines as on a GPU machine (no VLLM_CPU_KVCACHE_SPACE default); the default disk
    dir in a temp cache."""
    monkeypatch.setattr("kvtier.launch.command.vllm_runs_on_cpu", lambda environ=None: False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))


def kvtier_tc(extra: dict, **top) -> str:
    return json.dumps({**KVTIER, **top, "kv_connector_extra_config": extra})


def codes(argv, **kwargs) -> dict[str, str]:
    """code -> severity (the most severe when a code repeats)."""
    found: dict[str, str] = {}
    for f in reversed(audit(argv, **kwargs)):
        found[f.code] = f.severity
    return found


def vllm70(*args: str) -> list[str]:
    return ["vllm", "serve", L70, "-tp", "4", "--max-model-len", "32768", *args]


# -- parser -----------------------------------------------------------------------------------------

def test_parse_forms():
    line = parse_serve_line([
        "VLLM_CPU_KVCACHE_SPACE=8", "vllm", "serve", "M", "--tensor_parallel_size=4", "--enforce-eager",
        "--max-model-len", "4096", "--kv-transfer-config.kv_connector", "KVTierConnector",
        "--kv-transfer-config.kv_connector_extra_config.cpu_bytes_to_use", "1000"])
    assert (line.model, line.tp, line.number("--max-model-len")) == ("M", 4, 4096)
    assert line.env == {"VLLM_CPU_KVCACHE_SPACE": "8"}
    assert line.transfer_config == {"kv_connector": "KVTierConnector",
                                    "kv_connector_extra_config": {"cpu_bytes_to_use": 1000}}
    assert parse_serve_line(["vllm", "serve", "M", "-tp=2"]).tp == 2
    late = parse_serve_line(["vllm", "serve", "--port", "8000", "--trust-remote-code", "M", "-tp", "2"])
    assert (late.model, late.tp, late.value("--port")) == ("M", 2, "8000")
    assert parse_serve_line(["vllm", "serve", "M", "--tensor-parallel", "8"]).tp == 8  # unique prefix
    api = parse_serve_line(["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "X",
                            "-tp", "2"])
    assert (api.program, api.model, api.tp) == ("vllm", "X", 2)
    kv = parse_serve_line(["kvtier", "serve", "M", "--kv-offloading-size", "8", "-tp", "2", "--",
                           "--kv-offloading-size", "3"])
    assert kv.kvtier_flags == {"--kv-offloading-size": "8"} and kv.value("--kv-offloading-size") == "3"
    assert parse_serve_line(["vllm", "serve", "M", "--no-enable-prefix-caching"]).prefix_caching is False
    assert parse_serve_line(["vllm", "serve", "M", "--no-enable-prefix-caching",
                             "--enable-prefix-caching"]).prefix_caching is True


def test_not_a_serve_line():
    assert codes(["ls", "-l"]) == {"command-line": "error"}


# -- findings: positive and negative ---------------------------------------------------------------

def test_host_size_total_explained_when_tp_above_1():
    assert codes(vllm70("--kv-offloading-size", "256"))["host-size-total"] == "info"
    assert "host-size-total" not in codes(["vllm", "serve", L70, "--kv-offloading-size", "256",
                                           "--max-model-len", "8192"])


def test_host_size_that_looks_per_gpu():
    found = codes(vllm70("--kv-offloading-size", "64"))  # 16 GiB per rank < 37 GiB of KV per rank < 4 x 64
    assert found["host-size-per-gpu"] == "warning" and "host-size-total" not in found
    assert "host-size-per-gpu" not in codes(vllm70("--kv-offloading-size", "256"))
    between = codes(vllm70("--kv-offloading-size", "120"))  # too small, but not one device's worth
    assert "host-size-per-gpu" not in between and between["host-smaller-than-gpu-kv"] == "warning"
    fix = next(f.fix for f in audit(vllm70("--kv-offloading-size", "64")) if f.code == "host-size-per-gpu")
    assert "--kv-offloading-size 256" in fix


def test_host_smaller_than_accelerator_kv():
    assert codes(vllm70("--kv-offloading-size", "64"))["host-smaller-than-gpu-kv"] == "warning"
    assert "host-smaller-than-gpu-kv" not in codes(vllm70("--kv-offloading-size", "256"))
    # with 40 GiB devices the KV cache is 4 x 1.15 GiB: 64 GiB is plenty
    small = vllm70("--kv-offloading-size", "64", "--max-model-len", "1024")
    assert "host-smaller-than-gpu-kv" not in codes(small, gpu_memory_gib=40)
    # kvtier connector: cpu_bytes_to_use from the transfer config
    tc = kvtier_tc({"cpu_bytes_to_use": 10 * 2**30})
    found = audit(vllm70("--kv-transfer-config", tc))
    finding = next(f for f in found if f.code == "host-smaller-than-gpu-kv")
    assert "cpu_bytes_to_use" in finding.fix and "80 GiB per device (assumed" in finding.why


def test_cpu_offload_gb():
    assert codes(vllm70("--cpu-offload-gb", "10"))["cpu-offload-gb"] == "warning"
    assert "cpu-offload-gb" not in codes(vllm70("--cpu-offload-gb", "0"))
    assert "cpu-offload-gb" not in codes(vllm70())


def test_prefix_caching_disabled():
    assert codes(vllm70("--kv-offloading-size", "256", "--no-enable-prefix-caching"))[
        "prefix-caching-disabled"] == "warning"
    assert codes(vllm70("--no-enable-prefix-caching"))["prefix-caching-disabled"] == "info"  # no offloading
    assert "prefix-caching-disabled" not in codes(vllm70("--kv-offloading-size", "256"))


def test_kv_events_config():
    on = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"})
    self_describing = kvtier_tc({"cpu_bytes_to_use": 2**40, "self_describing_kv_events": True})
    assert codes(vllm70("--kv-transfer-config", self_describing))["kv-events-off"] == "info"
    found = codes(vllm70("--kv-transfer-config", self_describing, "--kv-events-config", on))
    assert "kv-events-off" not in found and "kv-events-endpoint" not in found
    pinned = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://10.0.0.5:5557"})
    assert codes(vllm70("--kv-events-config", pinned))["kv-events-endpoint"] == "info"
    assert codes(vllm70("--kv-events-config", "{nope"))["kv-events-config"] == "error"


def test_mla_with_kvtier(monkeypatch):
    from kvtier.doctor import probes

    monkeypatch.setattr(probes, "vllm_cpu_mla_without_prefix_caching", lambda: False)  # a GPU build of vLLM
    big = {"gpu_memory_gib": 141}
    tc = kvtier_tc({"cpu_bytes_to_use": 2**40})
    line = ["vllm", "serve", DSV3, "--max-model-len", "8192", "--kv-transfer-config", tc]
    assert codes([*line, "-tp", "8"], **big)["mla-kvtier"] == "info"  # stored once, not once per rank
    assert codes([*line, "-tp", "1"], **big)["mla-kvtier"] == "info"
    assert "mla-kvtier" not in codes(vllm70("--kv-transfer-config", tc))  # GQA model
    native = ["vllm", "serve", DSV3, "-tp", "8", "--max-model-len", "8192", "--kv-offloading-size", "1000"]
    assert not {"mla-kvtier", "mla-connector"} & set(codes(native, **big))  # vLLM's own connector dedups MLA
    lmcache = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
    other = codes(["vllm", "serve", DSV3, "-tp", "8", "--kv-transfer-config", lmcache], **big)
    assert other["mla-connector"] == "info"


def test_kvtier_inactive_without_prefix_caching(monkeypatch, tmp_path):
    from kvtier.doctor import probes

    tc = kvtier_tc({"cpu_bytes_to_use": 2**40})
    found = codes(vllm70("--kv-transfer-config", tc, "--no-enable-prefix-caching"))
    assert found["kvtier-inactive"] == "error" and "prefix-caching-disabled" not in found
    # MLA on vLLM's CPU build without AMX: vLLM forces prefix caching off, kvtier stays inactive
    line = ["vllm", "serve", DSV3, "--max-model-len", "8192", "--kv-transfer-config", tc]
    monkeypatch.setattr(probes, "vllm_cpu_mla_without_prefix_caching", lambda: True)
    assert codes(line, gpu_memory_gib=141)["kvtier-inactive"] == "error"
    monkeypatch.undo()
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu sse avx2 amx_bf16 amx_tile amx_int8\n")
    import importlib.metadata

    try:
        importlib.metadata.version("vllm-cpu")
        cpu_build = True
    except importlib.metadata.PackageNotFoundError:
        cpu_build = False
    assert probes.vllm_cpu_mla_without_prefix_caching(str(cpuinfo)) is False  # AMX MLA kernels run
    cpuinfo.write_text("flags\t\t: fpu sse avx2\n")
    assert probes.vllm_cpu_mla_without_prefix_caching(str(cpuinfo)) is cpu_build


def test_hybrid_and_sliding_models_with_kvtier(monkeypatch):
    from kvtier.doctor import probes

    tc = kvtier_tc({"cpu_bytes_to_use": 2**40})
    jamba = str(FIXTURES / "jamba-v0.1.json")
    found = codes(["vllm", "serve", jamba, "-tp", "2", "--kv-transfer-config", tc])
    assert found["mamba-kvtier"] == "info" and "kvtier-inactive" not in found
    assert "mamba-kvtier" not in codes(["vllm", "serve", jamba, "-tp", "2", "--kv-offloading-size", "100"])
    gemma = ["vllm", "serve", str(FIXTURES / "gemma-2-9b.json"), "--kv-transfer-config", tc]
    mistral = ["vllm", "serve", str(FIXTURES / "mistral-7b-v0.1.json"), "--kv-transfer-config", tc]
    for cpu_build in (True, False):
        monkeypatch.setattr(probes, "vllm_cpu_build", lambda cpu_build=cpu_build: cpu_build)
        for line in (gemma, mistral):  # sliding + global layers, every layer sliding: offloaded, CPU or GPU
            found = codes(line)
            assert (found.get("kvtier-inactive"), found.get("sliding-kvtier")) == (None, "info")


def test_fp8_kv_without_calibrated_scales(tmp_path):
    cfg = json.loads(Path(L70).read_text())
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(cfg))
    assert codes(["vllm", "serve", str(plain), "--kv-cache-dtype", "fp8", "--max-model-len", "8192"])[
        "fp8-kv-scales"] == "warning"
    assert codes(["vllm", "serve", str(plain), "--kv-cache-dtype", "fp8_e4m3", "--calculate-kv-scales",
                  "--max-model-len", "8192"])["fp8-kv-scales"] == "info"
    assert "fp8-kv-scales" not in codes(["vllm", "serve", str(plain), "--max-model-len", "8192"])
    scheme = tmp_path / "scheme"
    scheme.mkdir()
    (scheme / "config.json").write_text(json.dumps({**cfg, "quantization_config": {
        "quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8, "type": "float"}}}))
    assert "fp8-kv-scales" not in codes(["vllm", "serve", str(scheme), "--kv-cache-dtype", "fp8"])
    index = tmp_path / "index"
    index.mkdir()
    (index / "config.json").write_text(json.dumps(cfg))
    (index / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.layers.0.self_attn.k_scale": "a.safetensors"}}))
    assert "fp8-kv-scales" not in codes(["vllm", "serve", str(index), "--kv-cache-dtype", "fp8"])


def test_max_model_len():
    over = ["vllm", "serve", L70, "-tp", "4", "--max-model-len", "200000"]
    assert codes(over)["max-model-len"] == "error"  # above max_position_embeddings 131072
    assert codes(["VLLM_ALLOW_LONG_MAX_MODEL_LEN=1", *over])["max-model-len"] == "warning"
    assert codes(["vllm", "serve", L70, "-tp", "4"])["max-model-len"] == "warning"  # default 131072: 3 fit
    assert "max-model-len" not in codes(vllm70())  # 32768: 14 fit
    # 40 GiB devices: 1.15 GiB of KV per rank < 2.5 GiB for one 32k sequence
    assert codes(vllm70(), gpu_memory_gib=40)["max-model-len"] == "error"


def test_weights_do_not_fit():
    assert codes(["vllm", "serve", str(FIXTURES / "llama-3.1-405b.json")])["weights-do-not-fit"] == "error"
    h200x8 = ["vllm", "serve", str(FIXTURES / "llama-3.1-405b.json"), "-tp", "8", "--max-model-len", "8192"]
    assert "weights-do-not-fit" not in codes(h200x8, gpu_memory_gib=141)


def test_tp_must_split_kv_heads():
    qwen = str(FIXTURES / "qwen3-30b-a3b.json")
    assert codes(["vllm", "serve", qwen, "-tp", "3"])["tp-kv-heads"] == "error"  # 4 KV heads
    assert "tp-kv-heads" not in codes(["vllm", "serve", qwen, "-tp", "8"])  # replicated: allowed


def test_disk_tier_on_tmpfs():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    shm_dir = f"/dev/shm/kvtier-doctor-test-{uuid.uuid4().hex[:8]}"
    found = codes(["kvtier", "serve", "--disk-dir", shm_dir, "--max-model-len", "4096"])
    assert found["disk-on-tmpfs"] == "warning" and found["root-dir-missing"] == "info"
    assert not os.path.exists(shm_dir)  # doctor creates nothing


def test_a_missing_disk_dir_below_a_world_writable_folder_is_to_be_made_first(tmp_path):
    """A chmod cannot run on a path that does not exist: the finding says another user could create
    it first, and the fix is the mkdir that makes it the operator's (nothing is created by doctor)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp
    root = shared / "newparent" / "kv"
    line = ["kvtier", "serve", "--disk-dir", str(root), "--max-model-len", "4096"]
    finding = next(f for f in audit(line) if f.code == "disk-world-writable")
    assert finding.title == f"Disk tier {root} does not exist yet, and {shared} is writable by every user"
    assert f"create {shared / 'newparent'} before kvtier does" in finding.why
    command = f"(umask 077 && mkdir -p {root})"
    assert finding.fix.startswith(f"Create it yourself before starting, owner-only: {command}")
    assert "chmod" not in finding.fix and not (shared / "newparent").exists()
    subprocess.run(["bash", "-c", f"umask 022; {command}"], check=True)  # the fix, as an operator runs it
    assert all((p.stat().st_mode & 0o777) == 0o700 for p in (shared / "newparent", root))  # parents too
    shutil.rmtree(shared / "newparent")
    root.mkdir(parents=True)
    root.chmod(0o777)
    finding = next(f for f in audit(line) if f.code == "disk-world-writable")
    assert finding.title == f"Disk tier {root} is writable by every user" and finding.fix.startswith(f"chmod 700 {root}")
    root.chmod(0o700)
    assert "disk-world-writable" not in codes(line)


def test_disk_tier_on_a_real_disk(tmp_path):
    here = Path(__file__).parent
    if (filesystem_type(here) or ("tmpfs",))[0] in ("tmpfs", "ramfs"):
        pytest.skip("the test tree is on tmpfs")
    line = ["kvtier", "serve", "--disk-dir", str(here), "--max-model-len", "4096"]
    assert "disk-on-tmpfs" not in codes(line)


def test_filesystem_type_longest_mount(tmp_path):
    disk = tmp_path / "my disk"
    disk.mkdir()
    escaped = str(disk.resolve()).replace(" ", "\\040")  # /proc/mounts escapes spaces
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\nnvme {escaped} xfs rw 0 0\n")
    assert filesystem_type(Path("/dev/shm/not/yet/there"), str(mounts)) == ("tmpfs", "/dev/shm")
    assert filesystem_type(disk / "kv", str(mounts)) == ("xfs", str(disk.resolve()))
    assert filesystem_type(tmp_path, str(mounts))[0] == "ext4"


def test_shared_root_lists_other_namespaces(tmp_path):
    root = tmp_path / "kv"
    root.mkdir()
    line = ["kvtier", "serve", "--disk-dir", str(root), "--max-model-len", "4096"]
    assert "shared-root" not in codes(line)
    for name, tp in (("llama_0123456789abcdef", 1), ("llama_fedcba9876543210", 2)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps({"model_name": "llama", "tp_size": tp,
                                                             "kv_dtype": "bfloat16", "block_tokens": 16}))
    (root / "llama_0123456789abcdef_r0").mkdir()  # rank dirs are not namespaces
    assert len(namespaces_under(root)) == 2
    finding = next(f for f in audit(line) if f.code == "shared-root")
    assert finding.severity == "info" and "tp=2" in finding.why


def test_invalid_kvtier_config(tmp_path):
    bad = vllm70("--kv-transfer-config", kvtier_tc({"cpu_bytes_to_use": 2**40, "evicton_policy": "arc"}))
    assert codes(bad)["kvtier-config"] == "error"
    missing = vllm70("--kv-transfer-config", kvtier_tc({}))
    assert "cpu_bytes_to_use" in next(f.why for f in audit(missing) if f.code == "kvtier-config")
    good = vllm70("--kv-transfer-config", kvtier_tc({"cpu_bytes_to_use": 2**40, "secondary_tiers": [
        {"type": "fs", "root_dir": str(tmp_path / "new" / "kv"), "capacity_bytes": 2**30}]}))
    found = codes(good)
    assert "kvtier-config" not in found and found["root-dir-missing"] == "info"
    assert not (tmp_path / "new").exists()
    assert codes(["kvtier", "serve", "--kv-config", "{not json", "--max-model-len", "4096"])[
        "kvtier-serve-flag"] == "error"
    assert "kvtier-serve-flag" not in codes(["kvtier", "serve", "--kv-config", '{"store_threshold": 2}'])


def test_kvtier_serve_lines_are_read_with_serve_s_own_rules(tmp_path):
    """Every flag of kvtier serve counts as kvtier serve counts it: --s3-* make an S3 tier (audited;
    a refused port answers at once), --node attaches to a node (no tier of the engine's own), and
    a line serve refuses (--node with a tier of its own, --s3-size without --s3-url, ...) is the
    same refusal here."""
    from kvtier.doctor.setup import resolve_setup

    def extra(*flags: str):
        setup = resolve_setup(["kvtier", "serve", *flags, "--max-model-len", "4096"])
        return setup.extra, setup.extra_error

    s3 = ["--s3-url", "s3://kv-bucket/prod", "--s3-endpoint", "http://127.0.0.1:1", "--s3-size", "2"]
    config, error = extra("--no-disk", *s3)
    assert error is None and config["secondary_tiers"] == [
        {"type": "s3", "url": "s3://kv-bucket/prod", "endpoint": "http://127.0.0.1:1", "capacity_bytes": 2 * 2**30}]
    # audited: refused where no credentials are found, unreachable where they are (port 1 answers nothing)
    assert {"s3-refused", "s3-unreachable"} & set(codes(["kvtier", "serve", "--no-disk", *s3]))
    config, error = extra("--node", str(tmp_path / "node.sock"), "--node-uid", "1234")
    assert error is None and config["node"] == str(tmp_path / "node.sock") and config["node_uid"] == 1234
    assert "secondary_tiers" not in config
    for flags, refusal in ((["--node", "n.sock", "--redis-url", "redis://h"], "--node conflicts with --redis-url"),
                           (["--node", "n.sock", *s3], "--node conflicts with --s3-url"),
                           (["--s3-size", "2"], "describe --s3-url"),
                           (["--node-pool-size", "8"], "give --node"),
                           (["--node-uid", "7"], "give --node"),
                           (["--redis-password-env", "PW"], "needs --redis-url"),
                           (["--no-disk", "--disk-size", "3"], "--no-disk conflicts with --disk-size")):
        assert refusal in (extra(*flags)[1] or ""), flags
        assert codes(["kvtier", "serve", *flags])["kvtier-serve-flag"] == "error", flags


def test_small_redis_values_advise_a_bigger_block_size():
    """Llama-3.1-8B in bf16 on a GPU: 128 KiB of KV per token, so a 16-token block is a 2 MiB Redis
    value; doctor advises 32-token blocks (4 MiB). A refused port: the server is not needed."""
    l8 = str(FIXTURES / "llama-3.1-8b.json")
    remote = {"type": "redis", "url": "redis://127.0.0.1:1/0"}

    def line(**extra):
        config = {"cpu_bytes_to_use": 2**36, "secondary_tiers": [remote], **extra}
        return ["vllm", "serve", l8, "--max-model-len", "8192", "--kv-transfer-config", kvtier_tc(config)]

    (small,) = [f for f in audit(line()) if f.code == "remote-small-values"]
    assert small.severity == "info" and "2.00 MiB" in small.title and "16-token" in small.title
    assert '"block_size": 32' in small.fix and "4.0 MiB" in small.fix
    assert "remote-small-values" not in codes(line(block_size=32))
    no_remote = ["vllm", "serve", l8, "--kv-transfer-config", kvtier_tc({"cpu_bytes_to_use": 2**36})]
    assert "remote-small-values" not in codes(no_remote)


def test_connector_conflicts():
    tc = kvtier_tc({"cpu_bytes_to_use": 2**40})
    both = vllm70("--kv-transfer-config", tc, "--kv-offloading-size", "64")
    assert codes(both)["offloading-size-replaces-connector"] == "error"
    assert "offloading-size-replaces-connector" not in codes(vllm70("--kv-offloading-size", "256"))
    assert codes(["kvtier", "serve", "--", "--kv-offloading-size", "4"])["kvtier-serve-flag"] == "error"
    assert "kvtier-serve-flag" not in codes(["kvtier", "serve", "--kv-offloading-size", "4"])
    no_path = json.dumps({"kv_connector": "KVTierConnector", "kv_role": "kv_both",
                          "kv_connector_extra_config": {"cpu_bytes_to_use": 2**40}})
    found = codes(vllm70("--kv-transfer-config", no_path))
    assert found["kvtier-module-path"] == "error" and "kv-role" not in found
    producer = kvtier_tc({"cpu_bytes_to_use": 2**40}, kv_role="kv_producer")
    assert codes(vllm70("--kv-transfer-config", producer))["kv-role"] == "error"
    assert codes(vllm70("--kv-transfer-config", "{oops"))["kv-transfer-config"] == "error"
    assert codes(vllm70())["no-offloading"] == "info"
    assert codes(["kvtier", "serve", "-pp", "2"])["pipeline-parallel"] == "error"


def test_unknown_model_is_info_only():
    assert codes(["vllm", "serve", "nobody/nothing"]) == {"model-config": "info", "no-offloading": "info"}


# -- the command ------------------------------------------------------------------------------------

def test_cli_exit_codes_and_json():
    runner = CliRunner()
    bad = runner.invoke(main, ["doctor", "--", "vllm", "serve", L70, "-tp", "4", "--max-model-len", "200000"])
    assert bad.exit_code == 1 and "ERROR" in bad.output and "fix:" in bad.output
    ok = runner.invoke(main, ["doctor", "--json", "--", *vllm70("--kv-offloading-size", "256")])
    assert ok.exit_code == 0, ok.output
    data = json.loads(ok.output)
    assert {f["code"] for f in data["findings"]} == {"host-size-total"}
    assert runner.invoke(main, ["doctor"]).exit_code == 2  # nothing to do


def test_measure_small(tmp_path):
    copy = dram_copy(8 * 2**20, repeats=2)
    assert copy.bytes == 8 * 2**20 and copy.gbps > 0
    write, read = disk_write_read(tmp_path / "kv", 4 * 2**20)
    assert write.bytes == read.bytes == 4 * 2**20 and write.gbps > 0 and read.gbps > 0
    assert list((tmp_path / "kv").iterdir()) == []  # the test file is removed
    if not cuda_available():
        assert cuda_copies() == []


def test_cli_measure_compares_with_the_model(tmp_path):
    result = CliRunner().invoke(main, ["doctor", "--measure", "--dir", str(tmp_path), "--dram-mib", "8",
                                       "--disk-mib", "4", "--json", "--model", L70, "--context", "32768"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    names = {m["name"] for m in data["measurements"]}
    assert names >= {"DRAM copy (memcpy)", "disk write (fsync)", "disk read"}
    comparison = data["comparison"]
    assert comparison["context_bytes_total"] == 32768 * 327680  # 10 GiB for Llama-3.1-70B bf16
    assert comparison["disk_load_s"] > comparison["host_load_s"] > 0
    text = CliRunner().invoke(main, ["doctor", "--measure", "--dir", str(tmp_path), "--dram-mib", "8",
                                     "--disk-mib", "4", "--", "kvtier", "serve", "-tp", "1"])
    assert text.exit_code == 0, text.output
    assert "DRAM copy" in text.output and "SmolLM2-135M-Instruct" in text.output


def doctor_process(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``kvtier doctor ARGS`` in a process of its own (what an operator runs)."""
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", "doctor", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_every_bad_measure_dir_is_a_usage_error_naming_the_path_and_why(tmp_path):
    """A file on the way, a missing path under /proc or /sys (which refuse mkdir), a folder that
    cannot hold a file: rc 2 and one line, never a traceback, and nothing measured or printed first."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cases = {str(blocker / "sub"): f"{blocker / 'sub'} cannot be created: {blocker} is not a directory",
             str(blocker): "is a file", "/proc/kvtier-walk": "/proc/kvtier-walk cannot be created: ",
             "/sys/kvtier-walk": "/sys/kvtier-walk cannot be created: ",
             "/proc": "/proc cannot hold a file: " if os.geteuid() == 0 else "/proc is not a writable directory"}
    for directory, why in cases.items():
        done = doctor_process("--measure", "--dir", directory, "--dram-mib", "1", "--disk-mib", "1",
                              "--", "kvtier", "serve", "-tp", "1")
        assert done.returncode == 2 and "Traceback" not in done.stderr, (directory, done.stderr)
        assert "Invalid value for '--dir'" in done.stderr and why in done.stderr, done.stderr
        assert done.stdout == ""  # checked before the audit and the measurements
    assert not os.path.exists("/proc/kvtier-walk") and not os.path.exists("/sys/kvtier-walk")


def test_a_missing_measure_dir_is_created_owner_only(tmp_path):
    target = tmp_path / "new" / "m"
    done = doctor_process("--measure", "--dir", str(target), "--dram-mib", "1", "--disk-mib", "1",
                          env={"KVTIER_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    for made in (tmp_path / "new", target):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert list(target.iterdir()) == []  # the measurement's file is removed


DOCS = Path(__file__).resolve().parents[1] / "docs" / "operators.md"


@pytest.mark.parametrize("env", [(), ("VLLM_TARGET_DEVICE=cuda",)])
def test_the_operators_guide_example_on_this_machine(tmp_path, env):
    """docs/operators.md's Llama-3.1-70B example, run as an operator runs it: its findings and its
    "0 errors, 3 warnings" whatever vLLM is installed here (vllm-cpu included; its platform once
    made this GPU line 'native-offloading-on-cpu', 1 error), since a vllm serve line's own
    environment decides the backend (the guide's Limits)."""
    text = DOCS.read_text()
    start = text.index("    $ kvtier doctor -- vllm serve /models/Llama-3.1-70B-Instruct")
    block = text[start:text.index("0 errors, 3 warnings, 0 info", start) + len("0 errors, 3 warnings, 0 info")]
    expected = [line.strip() for line in block.splitlines()
                if line.strip().startswith(("ERROR", "WARNING", "INFO")) or "errors," in line]
    folder = tmp_path / "models" / "Llama-3.1-70B-Instruct"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(Path(L70).read_text())
    environ = {k: v for k, v in os.environ.items() if k not in ("VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE")}
    done = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "doctor", "--", *env, "vllm", "serve", str(folder),
                           "-tp", "4", "--kv-offloading-size", "64", "--cpu-offload-gb", "8", "--max-model-len", "32768"],
                          capture_output=True, text=True, timeout=120, env=environ)
    got = [line.strip() for line in done.stdout.splitlines()
           if line.strip().startswith(("ERROR", "WARNING", "INFO")) or "errors," in line]
    assert done.returncode == 0 and got == expected, done.stdout + done.stderr


def test_a_measure_model_that_names_nothing_is_a_usage_error(tmp_path):
    done = doctor_process("--measure", "--dir", str(tmp_path), "--model", "/nonexistent", "--dram-mib", "1",
                          "--disk-mib", "1")
    assert done.returncode == 2 and "Invalid value for '--model'" in done.stderr, done.stderr
    assert "model '/nonexistent': not a folder with config.json" in done.stderr and done.stdout == ""


def test_measure_says_when_recomputing_beats_even_the_host():
    """A small model recomputes faster than a slow host link loads its KV: no disk bandwidth is
    "needed" then (not a figure from dividing by nothing)."""
    slow = [Bandwidth("DRAM copy (memcpy)", 2**20, 1.0), Bandwidth("disk read", 2**20, 1.0)]  # ~1 MB/s
    comparison = compare(slow, "default", 1, 8192)
    assert comparison["recompute_s"] < comparison["host_load_s"]
    assert comparison["disk_bw_needed_gbps"] is None and comparison["recompute_faster"]
    console = Console(record=True, width=200)
    render_measurements(slow, comparison, console)
    text = console.export_text()
    assert "recomputing is faster on this machine than loading from host memory" in text and "needs" not in text
    fast = [Bandwidth("DRAM copy (memcpy)", 10**10, 1.0), Bandwidth("disk read", 10**10, 1.0)]
    comparison = compare(fast, L70, 1, 32768)
    assert comparison["disk_bw_needed_gbps"] > 0 and not comparison["recompute_faster"]
