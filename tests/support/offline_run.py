"""Test and benchmark harness, not shipped: run one offline vLLM engine (optionally with kvtier)
over rounds of prompts; print JSON.

Used by the end-to-end tests and benchmarks, each engine in its own process so every run starts
clean (vLLM logs to stdout too; the result is the LAST stdout line):

    python tests/support/offline_run.py SPEC_JSON   ->   {"startup_seconds": ..., "rounds": [...]}

SPEC keys: model, prompts (list of str), rounds (list of {"reset_prefix_cache": bool}),
max_tokens, kv_cache_memory_bytes, max_model_len, kv_connector_extra_config (absent = no connector).
Multiprocess mode is vLLM's default; the caller sets VLLM_ENABLE_V1_MULTIPROCESSING=0 for one process.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    kwargs = {}
    if spec.get("kv_connector_extra_config") is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": spec["kv_connector_extra_config"],
        }
    started = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=spec["kv_cache_memory_bytes"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec.get("max_num_seqs", 4),
        seed=0,
        **kwargs,
    )
    startup_seconds = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    rounds = []
    for round_spec in spec["rounds"]:
        if round_spec.get("reset_prefix_cache"):
            reset_prefix_cache(llm)
        results = []
        batch = round_spec.get("batch", False)
        prompts = spec["prompts"]
        groups = [prompts] if batch else [[p] for p in prompts]
        for group in groups:
            start = time.perf_counter()
            outputs = llm.generate(group, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            for out in outputs:
                results.append(
                    {
                        "token_ids": list(out.outputs[0].token_ids),
                        "text": out.outputs[0].text,
                        "prompt_tokens": len(out.prompt_token_ids),
                        "num_cached_tokens": out.num_cached_tokens or 0,
                        "seconds": seconds,
                    }
                )
        rounds.append(results)
    del llm
    print(json.dumps({"startup_seconds": startup_seconds, "rounds": rounds}), flush=True)


def reset_prefix_cache(llm, attempts: int = 200) -> None:
    """Reset vLLM's own prefix cache. vLLM refuses while blocks are still held, which is the case
    for a few milliseconds after a request finished with kvtier stores in flight (its blocks are
    freed once the stores are done), so step the engine and retry."""
    for _ in range(attempts):
        if llm.reset_prefix_cache():
            return
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            llm.llm_engine.step()  # one process: the engine only advances when we step it
        else:
            time.sleep(0.01)  # the engine core process keeps stepping by itself
    raise RuntimeError("vLLM refused to reset its prefix cache: blocks are still held")


if __name__ == "__main__":
    main()
