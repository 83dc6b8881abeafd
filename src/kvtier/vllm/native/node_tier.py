"""``kvtier_node``: the pool of a ``kvtier node`` service as a secondary tier of vLLM's own offloading.

Configured like ``kvtier_disk`` / ``kvtier_redis``, in the ``secondary_tiers`` of kvtier's CPU spec::

    {"type": "kvtier_node", "socket": "/run/kvtier/node.sock"}

(optional: ``cap_bytes``, this engine's most in the pool; ``timeout_s``; ``retry_interval_s``;
``max_pending_writes``; and the native keys ``locality``, ``model_identity``). Engines that keep
vLLM's own GPU path then share one copy of each block in the node's DRAM: a block any of them
stored is a hit for all (same namespace: the same seeded keys as ``kvtier_disk``), held once.

The same adapter as the disk and Redis tiers (:class:`~kvtier.vllm.native.tiers.VllmTierAdapter`) over
:class:`~kvtier.node.pool_tier.NodeTier`; what this class adds, all on vLLM's scheduler thread:

- start-up: one hello to the service with this engine's chunk size. A service that refuses it
  (another block size, another user) stops vLLM with the key ``socket`` named; one that is not
  running is only logged: the tier starts with misses and attaches once the service answers;
- ``lookup`` names the request its probes belong to, so that one round trip asks the service for
  all the chunks of a request's lookup pass (a chunk not known yet answers RETRY: vLLM asks again
  next step; see the measured costs in docs/node.md);
- ``on_schedule_end`` sends what the step buffered (probes, reads, writes) as one batch; in vLLM's
  one-process engine it then waits for the next answer, at most ``ONE_PROCESS_WAIT_S``, while a
  probe or load is out (that engine's idle steps hold the GIL otherwise).
"""

from __future__ import annotations

from typing import Any, ClassVar

from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, ReqContext

from kvtier.core.keys import Namespace
from kvtier.core.tier_config import NodeTierConfig, TierType
from kvtier.core.values import ConfigError
from kvtier.node import NodeClient, NodeError, NodeUnavailable
from kvtier.node.protocol import Role
from kvtier.runtime.chunks.identity import HashSeed
from kvtier.node.pool_tier import NodeTier
from kvtier.tiers.base import SecondaryTier
from kvtier.vllm.native.tiers import ONE_PROCESS_WAIT_S, VllmTierAdapter, logger


class KVTierNodeTier(VllmTierAdapter):
    """The node service's pool (DRAM shared by every engine of the machine): medium CPU, local."""

    medium: ClassVar[Medium] = Medium.CPU
    kind = TierType.NODE
    default_locality = Locality.LOCAL
    config: NodeTierConfig

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, **tier_keys: Any) -> None:
        self._node: NodeTier | None = None
        self.engine = str(offloading_spec.config.engine_id)  # its name in the service's stats
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector, **tier_keys)
        self._check_service()

    def _check_service(self) -> None:
        """One hello with this engine's chunk size: a refusal is a configuration error."""
        where = f"secondary_tiers[{self.tier_type}].socket"
        client = NodeClient(self.config.socket, engine=self.engine, role=Role.SCHEDULER,
                            slot_bytes=self.run.payload_bytes, cap_bytes=self.config.cap_bytes, map_pool=False,
                            timeout_s=self.config.timeout_s, node_uid=self.config.node_uid)
        try:
            client.connect()
        except NodeError as exc:
            raise ConfigError(f"kvtier: '{where}' = {str(self.config.socket)!r}: the kvtier node service refused this "
                              f"engine: {exc}") from None
        except NodeUnavailable as exc:
            logger.warning("kvtier %s: %s; the tier starts with misses and attaches when the service answers",
                           self.tier_type, exc)
        finally:
            client.close()

    def _make_tier(self, config: Any, ns: Namespace, seed: HashSeed) -> SecondaryTier:
        self._node = NodeTier(config, engine=self.engine, payload_bytes=self.run.payload_bytes,
                              width=self.run.copies)
        return self._node

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        node = self._node
        if node is not None:
            node.group = req_context.req_id  # one lookup round trip per request
        return self._lookup(key, req_context)

    def on_schedule_end(self, context: Any) -> None:
        store, node = self._store, self._node
        if store is None or node is None:
            return
        store.flush()
        if self._one_process and (store.reading or node.probing):
            store.wait_for_outcome(ONE_PROCESS_WAIT_S)

    def describe(self) -> str:
        return f"kvtier node at {self.config.socket}"

    def location(self) -> str:
        return str(self.config.socket)

    def capacity(self) -> int:
        return self.config.cap_bytes or 0
