"""kvtier: tiered KV-cache offloading (host DRAM, local disk, Redis / Valkey) for vLLM.

The package map (one direction of dependency, top to bottom; ``tests/test_architecture.py``
enforces it):

Runs inside the serving engine (vLLM's scheduler and worker processes):

- :mod:`kvtier.vllm` -- the connector ``KVTierConnector``, and (``kvtier.vllm.native``) kvtier's tiers
  behind vLLM's own OffloadingConnector; the only code that imports vLLM.
- :mod:`kvtier.runtime` -- what vLLM's scheduler talks to: the engine's own host tier and tiers, or a node
  service's pool (scheduler process); ``kvtier.runtime.chunks``: one tier behind an engine's own offloading.
- :mod:`kvtier.node` -- one cache per node: the ``kvtier node`` service (its own process: the pool, its
  index and policy, its tiers) and the clients engines attach with.
- :mod:`kvtier.copy` -- worker-side page copies engine <-> host slots (worker processes).
- :mod:`kvtier.tiers` -- the one core (lookup across tiers, promotion, cascade), the host, disk, Redis
  and S3 tiers and their contract.
- :mod:`kvtier.policy` -- eviction (LRU, ARC) and store admission.
- :mod:`kvtier.core` -- the shared vocabulary: keys, config, slot layout, stats, residency, thread priority.

Operator tools (never imported by the engine side):

- :mod:`kvtier.launch` -- the ``vllm serve`` command with kvtier configured (``kvtier serve``).
- :mod:`kvtier.planning` -- ``kvtier plan``'s arithmetic from a model's config.json.
- :mod:`kvtier.replay` -- ``kvtier plan --trace``: a request log replayed through the runtime's own
  policy and admission code, behind a model of vLLM's prefix cache.
- :mod:`kvtier.doctor` -- ``kvtier doctor``'s audit, probes and measurements.
- :mod:`kvtier.cachetools` -- ``kvtier inspect / verify / purge`` on a disk root.
- :mod:`kvtier.bench` -- ``kvtier bench``: vLLM alone vs ExampleConnector vs kvtier (and vLLM's own offloading).
- :mod:`kvtier.models` -- the embedded default model, converted from its pip package.
- :mod:`kvtier.cli` -- the ``kvtier`` command: argument parsing and output only.
"""
