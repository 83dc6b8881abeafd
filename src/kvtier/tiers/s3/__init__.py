"""The S3 tier: blocks as objects in an S3-compatible store (AWS S3, GCS's S3 API, MinIO, Ceph RGW,
SeaweedFS) shared by the fleet (medium S3).

Lives in vLLM's scheduler process (or the node service), driven by the orchestrator's thread; all
requests run on the tier's own threads. :mod:`~kvtier.tiers.s3.tier` is the tier (:class:`S3Tier`;
read its docstring for threading, presence and failures), :mod:`~kvtier.tiers.s3.keys` the object
key layout (docs/object-store.md), :mod:`~kvtier.tiers.s3.client` the obstore client and where its
credentials come from, :mod:`~kvtier.tiers.s3.jobs` the requests, :mod:`~kvtier.tiers.s3.monitor`
the listing, the capacity sweep and recovery, :mod:`~kvtier.tiers.s3.stats` the counters. The
value of a block is the Redis tier's (:mod:`kvtier.tiers.value`). ``obstore`` is imported when a
store is made, not when this package is.
"""

from kvtier.tiers.s3.keys import ObjectKeys
from kvtier.tiers.s3.stats import S3TierStats
from kvtier.tiers.s3.tier import S3Tier

__all__ = ["ObjectKeys", "S3Tier", "S3TierStats"]
