"""kvtier's disk and Redis tiers behind an engine's own offloading stack (the part that needs no vLLM).

vLLM's native OffloadingConnector keeps its own CPU tier (one row per offloaded chunk in a shared
memory region, every rank's pages side by side) and asks secondary tiers to copy rows to and from
storage by opaque keys (its block hashes plus a group index). This package maps that onto kvtier's
tiers, unchanged:

- :mod:`~kvtier.runtime.chunks.identity` -- what names a run's bytes: the model (weights
  fingerprint, config), the engine's hash seed (a digest, never the seed) and whether it is shared;
- :mod:`~kvtier.runtime.chunks.run` -- the run's page layout and parallelism as vLLM states it,
  and the kvtier :class:`~kvtier.core.keys.Namespace` built from all of it;
- :mod:`~kvtier.runtime.chunks.rows` -- one row of the shared region as one payload per rank;
- :mod:`~kvtier.runtime.chunks.store` -- :class:`~kvtier.runtime.chunks.store.ChunkStore`: one
  kvtier tier answering lookups, and running an engine job of several chunks as tier jobs.

:mod:`kvtier.vllm.native` turns vLLM's calls into calls of these classes. Records keep kvtier's
formats (headers, checksums, namespace digests), so every operator tool works on them.
"""
