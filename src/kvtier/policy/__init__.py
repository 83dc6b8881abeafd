"""Eviction and admission policies: which block leaves a full tier first, which block is worth storing.

Used by the tier indexes in vLLM's scheduler process, on the orchestrator's thread only; a policy
orders keys and owns no data. :func:`make_policy` builds the policy a config names.
"""

from kvtier.policy.arc import ARCPolicy
from kvtier.policy.base import EvictionPolicy, PolicyName
from kvtier.policy.lru import LRUPolicy

__all__ = ["ARCPolicy", "EvictionPolicy", "LRUPolicy", "PolicyName", "make_policy"]


def make_policy(name: PolicyName, capacity: int) -> EvictionPolicy:
    """Build the policy ``name`` for a tier of ``capacity`` blocks."""
    if name is PolicyName.LRU:
        return LRUPolicy()
    return ARCPolicy(capacity)
