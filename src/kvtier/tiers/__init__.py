"""The storage tiers: the host tier (:mod:`~kvtier.tiers.host` index + :mod:`~kvtier.tiers.shm`
shared-memory bytes), the disk tier (:mod:`kvtier.tiers.disk`), the contract secondary tiers
implement (:mod:`~kvtier.tiers.base`) and the block format they store (:mod:`~kvtier.tiers.blockfile`).

Indexes live in vLLM's scheduler process and are driven by the orchestrator's thread; I/O runs on
each tier's own threads. The host tier's bytes are mapped by the scheduler and every worker.
"""
