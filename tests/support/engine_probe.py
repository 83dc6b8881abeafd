"""Test and research harness, not shipped: start ONE vLLM engine in one process on a model folder,
report what vLLM made of it (KV cache groups and specs, prefix caching, Mamba cache mode) and the
greedy outputs of a few prompts, as JSON on the LAST stdout line.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python tests/support/engine_probe.py SPEC_JSON

SPEC keys: model, prompts (list of str), max_tokens, kv_cache_memory_bytes, max_model_len;
optional: connector ("example": vLLM's ExampleConnector, which is not SupportsHMA, so vLLM turns
its hybrid KV cache manager off; absent: no connector), connector_dir (ExampleConnector's storage),
enable_prefix_caching (default true), block_size, rounds (default 2: the second pass shows whether
vLLM's own prefix cache hits), dtype (default float32).
The result: startup_seconds, config (what vLLM resolved), kv_cache_config (groups, specs, block
sizes), rounds ([[{token_ids, text, prompt_tokens, num_cached_tokens, seconds}]]).
Needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (it reads the scheduler's KVCacheConfig in-process).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time


def describe_spec(spec) -> dict:
    """The facts of one KVCacheSpec that matter to a connector."""
    out = {"class": type(spec).__name__}
    for name in ("block_size", "num_kv_heads", "head_size", "head_size_v", "sliding_window", "attention_chunk_size",
                 "mamba_cache_mode", "page_size_padded", "num_speculative_blocks", "tokens_per_state",
                 "num_heads", "prefix_cacheable"):
        value = getattr(spec, name, None)
        if value is not None:
            out[name] = value if isinstance(value, (int, float, str, bool)) else str(value)
    for name in ("dtype", "mamba_type"):
        if getattr(spec, name, None) is not None:
            out[name] = str(getattr(spec, name))
    if hasattr(spec, "shapes"):
        out["shapes"] = [list(s) for s in spec.shapes]
        out["dtypes"] = [str(d) for d in spec.dtypes]
    for name in ("page_size_bytes", "real_page_size_bytes"):
        with contextlib.suppress(Exception):  # some specs do not define it
            out[name] = int(getattr(spec, name))
    return out


def describe_kv_cache_config(kv_cache_config) -> dict:
    groups = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        entry = {"num_layers": len(group.layer_names), "layers": list(group.layer_names)}
        if hasattr(spec, "kv_cache_specs"):  # UniformTypeKVCacheSpecs: per-layer specs of one type
            entry["spec"] = {"class": type(spec).__name__, "block_size": spec.block_size,
                             "per_layer": sorted({json.dumps(describe_spec(s), sort_keys=True)
                                                  for s in spec.kv_cache_specs.values()})}
        else:
            entry["spec"] = describe_spec(spec)
        groups.append(entry)
    out = {"num_blocks": kv_cache_config.num_blocks, "groups": groups}
    for name in ("kv_cache_layout", "hash_block_size", "cache_hit_alignment_tokens", "kv_tp_replicas"):
        out[name] = getattr(kv_cache_config, name, None)
    with contextlib.suppress(Exception):
        out["prefix_cacheable_group_ids"] = list(kv_cache_config.prefix_cacheable_group_ids)
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    kwargs = {}
    if spec.get("connector") == "example":
        kwargs["kv_transfer_config"] = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": spec["connector_dir"]},
        }
    if spec.get("block_size"):
        kwargs["block_size"] = spec["block_size"]
    started = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        enforce_eager=True,
        enable_prefix_caching=spec.get("enable_prefix_caching", True),
        kv_cache_memory_bytes=spec["kv_cache_memory_bytes"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec.get("max_num_seqs", 4),
        seed=0,
        **kwargs,
    )
    startup_seconds = time.perf_counter() - started
    engine = llm.llm_engine
    vllm_config = engine.vllm_config
    core = engine.engine_core.engine_core
    cache, sched = vllm_config.cache_config, vllm_config.scheduler_config
    config = {
        "enable_prefix_caching": cache.enable_prefix_caching,
        "block_size": cache.block_size,
        "mamba_cache_mode": getattr(cache, "mamba_cache_mode", None),
        "mamba_block_size": getattr(cache, "mamba_block_size", None),
        "mamba_ssm_cache_dtype": str(getattr(cache, "mamba_ssm_cache_dtype", None)),
        "disable_hybrid_kv_cache_manager": sched.disable_hybrid_kv_cache_manager,
        "enable_chunked_prefill": sched.enable_chunked_prefill,
        "use_mla": vllm_config.model_config.use_mla,
        "is_hybrid": getattr(vllm_config.model_config, "is_hybrid", None),
        "architecture": vllm_config.model_config.architecture,
        "scheduler_block_size": getattr(core.scheduler, "block_size", None),
    }
    kv_cache_config = describe_kv_cache_config(core.scheduler.kv_cache_config)

    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    rounds = []
    for _ in range(spec.get("rounds", 2)):
        results = []
        for prompt in spec["prompts"]:
            start = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            results.append({
                "token_ids": list(out.outputs[0].token_ids),
                "text": out.outputs[0].text,
                "prompt_tokens": len(out.prompt_token_ids),
                "num_cached_tokens": out.num_cached_tokens or 0,
                "seconds": round(time.perf_counter() - start, 3),
            })
        rounds.append(results)
    del llm
    print(json.dumps({"startup_seconds": round(startup_seconds, 2), "config": config,
                      "kv_cache_config": kv_cache_config, "rounds": rounds}), flush=True)


if __name__ == "__main__":
    main()
