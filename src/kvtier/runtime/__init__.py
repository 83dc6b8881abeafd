"""The scheduler-side runtime: what vLLM's scheduler talks to (:mod:`~kvtier.runtime.host_side`,
chosen by :mod:`~kvtier.runtime.host_factory`): the engine's own host tier and tiers
(:mod:`~kvtier.runtime.orchestrator`) or a ``kvtier node`` service's pool
(:mod:`~kvtier.runtime.node_host`). Knows no engine: :mod:`kvtier.vllm` drives it from vLLM's
scheduler thread; tests drive it with plain byte buffers. :mod:`kvtier.runtime.chunks` puts one tier
behind an engine's own offloading stack (vLLM's OffloadingConnector).
"""
