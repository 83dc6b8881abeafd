"""Managing a disk tier root from outside the engine: ``kvtier inspect``, ``verify`` and ``purge``.

The core of those commands, without click or rich (``kvtier.cli.cache`` renders them): plain
functions returning dataclasses with a ``to_json()``. They reuse the disk tier's own layout,
file format and quarantine code (:mod:`kvtier.tiers.disk.layout`, :mod:`kvtier.tiers.disk.files`)
and are safe to run while engines use the same root. Nothing here imports vLLM or torch.
"""

from kvtier.cachetools.inventory import AGE_BUCKETS, Inventory, NamespaceInventory, inspect_cache
from kvtier.cachetools.purge import NamespacePurge, PurgeReport, PurgeSelection, parse_duration, purge_cache
from kvtier.cachetools.selection import SelectionError
from kvtier.cachetools.verify import Problem, VerifyReport, verify_cache

__all__ = [
    "AGE_BUCKETS", "Inventory", "NamespaceInventory", "inspect_cache",
    "NamespacePurge", "PurgeReport", "PurgeSelection", "parse_duration", "purge_cache",
    "SelectionError", "Problem", "VerifyReport", "verify_cache",
]
