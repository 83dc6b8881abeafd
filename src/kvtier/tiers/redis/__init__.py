"""The Redis tier: blocks in a Redis / Valkey server or cluster shared by engines (medium REMOTE).

Lives in vLLM's scheduler process, driven by the orchestrator's thread; network I/O runs on the
tier's own threads. :mod:`~kvtier.tiers.redis.tier` is the tier (:class:`RedisTier`; read its
docstring for threading, batching and failures), :mod:`~kvtier.tiers.redis.codec` the key names
and the value format (one self-describing, checksummed value per block: the disk tier's block
file bytes, rank by rank), :mod:`~kvtier.tiers.presence` (shared with the node pool's tier) what the tier
answers without asking the server, :mod:`~kvtier.tiers.redis.client` the connections (redis-py pools and
connections: all Redis traffic goes through redis-py), :mod:`~kvtier.tiers.redis.pipeline` one server's
pipelined exchange, :mod:`~kvtier.tiers.redis.errors` what a failure means and how it is logged,
:mod:`~kvtier.tiers.redis.jobs` the data path (:mod:`~kvtier.tiers.redis.reads` how values are read into
the callers' buffers), :mod:`~kvtier.tiers.breaker` and
:mod:`~kvtier.tiers.redis.monitor` what happens when the server does not answer,
:mod:`~kvtier.tiers.redis.stats` the counters.
"""

from kvtier.tiers.redis.codec import KeySpace, decode_value, encode_value, verify_value
from kvtier.tiers.redis.stats import RedisTierStats
from kvtier.tiers.redis.tier import RedisTier

__all__ = ["KeySpace", "RedisTier", "RedisTierStats", "decode_value", "encode_value", "verify_value"]
