"""The storage tiers and the one core that runs them: :mod:`~kvtier.tiers.stack` (lookup across
tiers, promotion, cascade, over a slot index), the host tier (:mod:`~kvtier.tiers.host` index +
:mod:`~kvtier.tiers.shm` shared-memory bytes), the disk tier (:mod:`kvtier.tiers.disk`), the Redis
tier (:mod:`kvtier.tiers.redis`), the S3 tier (:mod:`kvtier.tiers.s3`), the contract secondary
tiers implement (:mod:`~kvtier.tiers.base`) and the block format they store
(:mod:`~kvtier.tiers.blockfile`; a block as one Redis value or S3 object: :mod:`~kvtier.tiers.value`).
The tiers behind a shared server share their caller side (:mod:`~kvtier.tiers.remote`), presence
cache (:mod:`~kvtier.tiers.presence`), circuit breaker (:mod:`~kvtier.tiers.breaker`) and worker
threads (:mod:`~kvtier.tiers.workers`).

Indexes are driven by one thread each (vLLM's scheduler thread; the node service's loop); I/O runs
on each tier's own threads. The host tier's bytes are mapped by the scheduler and every worker.
"""
