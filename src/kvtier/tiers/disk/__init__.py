"""The disk tier: blocks as checksummed files under a root directory (local NVMe or a shared filesystem).

Lives in vLLM's scheduler process, driven by the orchestrator's thread; file I/O runs on the tier's
own thread pools. :mod:`~kvtier.tiers.disk.tier` is the tier (:class:`DiskTier`),
:mod:`~kvtier.tiers.disk.index` its in-memory index, :mod:`~kvtier.tiers.disk.writer` and
:mod:`~kvtier.tiers.disk.files` the file I/O its threads run (:mod:`~kvtier.tiers.disk.jobs`: one
job each), :mod:`~kvtier.tiers.disk.refused` what it does with writes the usage ledger refused,
:mod:`~kvtier.tiers.disk.ledger` the
usage ledger that bounds a namespace on disk across the processes sharing a root,
:mod:`~kvtier.tiers.disk.layout` the directory layout and the scan. The operator
tools (:mod:`kvtier.cachetools`) reuse the layout and file code on a root from outside the engine.
"""

from kvtier.tiers.disk.index import DiskTierStats
from kvtier.tiers.disk.layout import ORPHAN_SECONDS, QUARANTINE_DIR, STALE_TMP_SECONDS, sanitize_model_name
from kvtier.tiers.disk.tier import DiskTier

__all__ = ["DiskTier", "DiskTierStats", "ORPHAN_SECONDS", "QUARANTINE_DIR", "STALE_TMP_SECONDS", "sanitize_model_name"]
