"""ROCm's shuffled KV cache layout, as vLLM decides it (``VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT``).

On ROCm, vLLM's AITER attention backends can keep each KV page in a shuffled order for their
assembly kernels: the page keeps its size, its bytes move. vLLM reads the variable once, when
``vllm._aiter_ops`` is imported (``envs.py``: "true" or "1", any case), into
``rocm_aiter_ops``; its backends ask ``rocm_aiter_ops.is_shuffle_kv_cache_enabled()``
(``v1/attention/backends/rocm_aiter_fa.py``, vLLM 0.32). :func:`rocm_shuffled_kv_cache` asks the
same thing, so a namespace says "shuffled" exactly where vLLM's pages may be. Off ROCm vLLM never
shuffles, whatever the variable says. Any thread; reads process state only.
"""

from __future__ import annotations


def rocm_shuffled_kv_cache() -> bool:
    """Whether vLLM in this process keeps KV pages in ROCm AITER's shuffled layout."""
    from vllm.platforms import current_platform

    if not current_platform.is_rocm():
        return False
    from vllm._aiter_ops import rocm_aiter_ops

    return bool(rocm_aiter_ops.is_shuffle_kv_cache_enabled())
