"""kvtier's tiers behind vLLM's own offloading (the ``OffloadingConnector``), and a spec that runs it
on vLLM's CPU backend.

- :mod:`~kvtier.vllm.native.tiers` -- ``KVTierDiskTier``, ``KVTierRedisTier`` and ``KVTierS3Tier``,
  vLLM secondary tiers (types ``kvtier_disk`` / ``kvtier_redis`` / ``kvtier_s3``) over kvtier's disk,
  Redis and S3 tiers;
- :mod:`~kvtier.vllm.native.node_tier` -- ``KVTierNodeTier`` (type ``kvtier_node``): the same
  adapter over the pool of a ``kvtier node`` service;
- :mod:`~kvtier.vllm.native.spec` -- ``KVTierOffloadingSpec``: vLLM's ``TieringOffloadingSpec`` with
  a CPU worker (:mod:`~kvtier.vllm.native.worker`, :mod:`~kvtier.vllm.native.region_slots`);
- :mod:`~kvtier.vllm.native.plugin` -- the ``vllm.general_plugins`` entry point registering them;
- :mod:`~kvtier.vllm.native.run_facts`, :mod:`~kvtier.vllm.native.seed`,
  :mod:`~kvtier.vllm.native.metrics` -- what a tier reads of vLLM, and its metrics.

The logic that needs no vLLM is :mod:`kvtier.runtime.chunks`. Names are imported on first access
(vLLM imports this module by ``spec_module_path`` / ``module_path`` and looks names up with
``getattr``), so the plugin module loads without vLLM's offloading modules. ``kvtier_disk`` and
``kvtier_redis``, ``kvtier_s3`` (and ``kvtier_node``) are aliases, so ``{"type": "kvtier_disk", "module_path": "kvtier.vllm.native"}``
works where plugins are not loaded.
"""

from typing import Any

__all__ = ["KVTierDiskTier", "KVTierNodeTier", "KVTierOffloadingSpec", "KVTierRedisTier", "KVTierS3Tier",
           "kvtier_disk", "kvtier_node", "kvtier_redis", "kvtier_s3"]

_NAMES = {
    "KVTierOffloadingSpec": ("kvtier.vllm.native.spec", "KVTierOffloadingSpec"),
    "KVTierDiskTier": ("kvtier.vllm.native.tiers", "KVTierDiskTier"),
    "KVTierRedisTier": ("kvtier.vllm.native.tiers", "KVTierRedisTier"),
    "kvtier_disk": ("kvtier.vllm.native.tiers", "KVTierDiskTier"),
    "kvtier_redis": ("kvtier.vllm.native.tiers", "KVTierRedisTier"),
    "KVTierS3Tier": ("kvtier.vllm.native.tiers", "KVTierS3Tier"),
    "kvtier_s3": ("kvtier.vllm.native.tiers", "KVTierS3Tier"),
    "KVTierNodeTier": ("kvtier.vllm.native.node_tier", "KVTierNodeTier"),
    "kvtier_node": ("kvtier.vllm.native.node_tier", "KVTierNodeTier"),
}


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        import importlib

        module, attribute = _NAMES[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
