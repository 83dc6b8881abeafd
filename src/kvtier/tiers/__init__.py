"""The storage tiers and the one core that runs them: :mod:`~kvtier.tiers.stack` (lookup across
tiers, promotion, cascade, over a slot index), the host tier (:mod:`~kvtier.tiers.host` index +
:mod:`~kvtier.tiers.shm` shared-memory bytes), the disk tier (:mod:`kvtier.tiers.disk`), the Redis
tier (:mod:`kvtier.tiers.redis`), the contract secondary tiers implement (:mod:`~kvtier.tiers.base`)
and the block format they store (:mod:`~kvtier.tiers.blockfile`).

Indexes are driven by one thread each (vLLM's scheduler thread; the node service's loop); I/O runs
on each tier's own threads. The host tier's bytes are mapped by the scheduler and every worker.
"""
