"""What names the bytes behind vLLM's own offloading (issue 31, item 9): the namespace of kvtier's
native tiers reads no dead variable and keeps old digests; ROCm's shuffled KV layout enters it (and
kvtier's own connector's page description) exactly where vLLM shuffles; ``kvtier doctor`` warns
that LoRA adapters retrained in place must be purged; kvtier_redis reports its own medium, checked
through vLLM's real TieringOffloadingManager and a real redis-server."""

from __future__ import annotations

import time

from types import SimpleNamespace

import pytest
import torch
from support.native_rig import NativeRig, native_env, offloading_config  # noqa: F401  (pytest fixture)
from support.redis_server import redis_factory  # noqa: F401  (pytest fixture)
from test_doctor_native import codes, disk, line
from test_native_chunks import MODEL, run
from vllm import envs
from vllm._aiter_ops import rocm_aiter_ops
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    ReqContext,
    ScheduleEndContext,
    TierFilter,
    TierMatcher,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.doctor.audit import audit
from kvtier.runtime.chunks.identity import HashSeed, SeedKind
from kvtier.runtime.chunks.run import namespace
from kvtier.vllm.native.run_facts import engine_run
from kvtier.vllm.native.tiers import KVTierDiskTier, KVTierRedisTier
from kvtier.vllm.page_format import describe_pages
from kvtier.vllm.rocm_layout import rocm_shuffled_kv_cache

SEED = HashSeed.of("sha256", SeedKind.FIXED, b"\x02" * 32)


# ------------------------------------------------------------------ the namespace


def test_old_namespaces_keep_their_digests():
    """Pinned before the change (main at 8b4acbd): every native namespace written so far."""
    assert namespace(run(), MODEL, SEED).engine_digest.hex() == (
        "f523c51b6672cf5cd67cd30b2e141df42a49aed3b70bbfb38e1b3ebae85e84b3")
    assert namespace(run(device="cuda"), MODEL, SEED).engine_digest.hex() == (
        "cc4db2b48989ec23436745e827e28dc008a7b8c2220bf19fc4967826632bd366")


def spec(tmp_path):
    """What engine_run reads of vLLM's offloading spec: its config and replicated layout."""
    config = offloading_config(tmp_path / "model", [], engine_id="e", world_size=2)
    return SimpleNamespace(config=config, replicated_layout=False)


def test_vllm_attention_backend_is_not_read(tmp_path, monkeypatch):
    """vLLM 0.32 never reads VLLM_ATTENTION_BACKEND (--attention-backend picks the backend, in the
    workers): it must not split namespaces of engines whose bytes are the same."""
    monkeypatch.delenv("VLLM_ATTENTION_BACKEND", raising=False)
    plain = namespace(engine_run(spec(tmp_path)), MODEL, SEED)
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "FLASHINFER")
    assert namespace(engine_run(spec(tmp_path)), MODEL, SEED).engine_digest == plain.engine_digest


@pytest.fixture
def rocm(monkeypatch):
    """This process as vLLM on ROCm with AITER (gfx9): vLLM's own flag parsing and accessor run."""
    monkeypatch.setattr(current_platform, "is_rocm", lambda: True)
    monkeypatch.setattr("vllm._aiter_ops.is_aiter_found_and_supported", lambda: True)

    def shuffle(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv("VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT", raising=False)
        else:
            monkeypatch.setenv("VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT", value)
        # what vLLM does when vllm._aiter_ops is imported (its refresh_env_variables does the same)
        monkeypatch.setattr(rocm_aiter_ops, "_SHUFFLE_KV_CACHE_ENABLED", envs.VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT)
    return shuffle


def test_rocm_shuffled_layout_is_read_as_vllm_reads_it(rocm, monkeypatch):
    for value, shuffled in ((None, False), ("0", False), ("false", False), ("1", True), ("TRUE", True)):
        rocm(value)
        assert rocm_shuffled_kv_cache() is shuffled, value
    monkeypatch.setattr(current_platform, "is_rocm", lambda: False)  # vLLM shuffles only on ROCm
    assert rocm_shuffled_kv_cache() is False


def test_rocm_shuffled_layout_splits_the_native_namespace(tmp_path, rocm):
    rocm(None)
    plain = engine_run(spec(tmp_path))
    rocm("1")
    shuffled = engine_run(spec(tmp_path))
    assert shuffled.rocm_shuffled_kv and not plain.rocm_shuffled_kv
    assert namespace(shuffled, MODEL, SEED).engine_digest != namespace(plain, MODEL, SEED).engine_digest
    assert set(namespace(shuffled, MODEL, SEED).rank_digests()).isdisjoint(namespace(plain, MODEL, SEED).rank_digests())


def test_rocm_shuffled_layout_enters_kvtiers_own_page_description():
    """kvtier's own connector: the worker's page description (folded into the namespace) says so,
    only when on (every other description, and the namespaces on disk, unchanged)."""
    views = {"l0": torch.zeros(4, 2, 16, 8)}
    plain = describe_pages(views, ["l0"], 4, {"l0": "ROCM_AITER_FA"}, None)
    shuffled = describe_pages(views, ["l0"], 4, {"l0": "ROCM_AITER_FA"}, None, rocm_shuffled=True)
    assert "rocm_shuffled_kv_cache" not in plain and shuffled["rocm_shuffled_kv_cache"] is True
    assert {k: v for k, v in shuffled.items() if k != "rocm_shuffled_kv_cache"} == plain


# ------------------------------------------------------------------ LoRA


def test_doctor_warns_that_lora_adapters_retrained_in_place_must_be_purged(tmp_path):
    tiers = [disk(tmp_path), {"type": "kvtier_redis", "url": "redis://127.0.0.1:9/0"}]
    (finding,) = [f for f in audit(line(tiers, "--enable-lora", "--lora-modules", "a=/adapters/a"))
                  if f.code == "native-lora-retrained"]
    assert finding.severity == "warning" and "secondary_tiers[0] (kvtier_disk)" in finding.title
    assert "secondary_tiers[1] (kvtier_redis)" in finding.title
    assert "name and path" in finding.why and "kvtier purge DIR / URL --model some/model" in finding.fix
    assert "native-lora-retrained" not in codes(line(tiers))  # no LoRA
    assert "native-lora-retrained" not in codes(line(tiers, "--enable-lora", "--no-enable-lora"))
    assert "native-lora-retrained" not in codes(line([{"type": "example"}], "--enable-lora"))  # not kvtier's


# ------------------------------------------------------------------ kvtier_redis's medium


def test_redis_tier_reports_its_own_medium():
    assert KVTierRedisTier.medium is Medium.STORAGE and KVTierRedisTier.default_locality is Locality.REMOTE
    assert KVTierRedisTier.cache_hit_source is CacheHitSource.EXTERNAL_UNSPECIFIED  # not DISK
    assert KVTierDiskTier.cache_hit_source is CacheHitSource.DISK


def lookup(rig: NativeRig, keys: list[bytes], tier_filter: TierFilter) -> tuple[list[LookupResult], list]:
    """vLLM's lookups of one request with a tier filter (its ``kv_load_tiers``), step after step until
    settled; the results and, for the HITs, where vLLM says their KV came from."""
    context = ReqContext(req_id=f"filtered{id(tier_filter)}", load_tier_filter=tier_filter)
    rig.manager.on_new_request(context)
    for _ in range(2000):
        results = [rig.manager.lookup(key, context) for key in keys]
        rig.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        if all(r in (LookupResult.HIT, LookupResult.MISS) for r in results):
            break
        time.sleep(0.002)  # a promotion from Redis takes wall time (a loaded machine: longer)
    else:
        raise AssertionError(f"lookups never settled: {results}")
    sources = [rig.manager.get_load_source(k, context) for k, r in zip(keys, results) if r is LookupResult.HIT]
    rig.manager.on_request_finished(context)
    rig.settle()
    return results, sources


def test_tier_filters_select_redis_by_its_medium_and_locality(native_env, redis_factory, tmp_path):  # noqa: F811
    """Through vLLM's real manager: a filter for memory, or for local tiers, skips kvtier_redis (it
    matched every filter while it had no medium); one for remote storage loads from it."""
    server = redis_factory()
    rig = NativeRig(native_env, [{"type": "kvtier_redis", "url": server.url()}])
    keys, _ = rig.store_prompt(7, 2)
    for matcher in (TierMatcher(medium=Medium.CPU), TierMatcher(locality=Locality.LOCAL)):
        rig.forget_cpu_tier()
        results, _ = lookup(rig, keys, TierFilter(matchers=(matcher,)))
        assert results == [LookupResult.MISS] * 2, matcher
    rig.forget_cpu_tier()
    results, sources = lookup(rig, keys, TierFilter(matchers=(TierMatcher(medium=Medium.STORAGE,
                                                                          locality=Locality.REMOTE),)))
    assert results == [LookupResult.HIT] * 2 and sources == [CacheHitSource.EXTERNAL_UNSPECIFIED] * 2
    rig.close()
