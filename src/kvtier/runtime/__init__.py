"""The scheduler-side runtime: the orchestrator that looks blocks up across tiers, promotes them
into host slots and cascades stores down the tiers. Knows no engine: :mod:`kvtier.vllm` drives it
from vLLM's scheduler thread; tests drive it with plain byte buffers. :mod:`kvtier.runtime.chunks`
puts one tier behind an engine's own offloading stack (vLLM's OffloadingConnector).
"""
