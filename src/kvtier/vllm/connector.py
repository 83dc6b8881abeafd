"""``KVTierConnector``: the vLLM KV connector (both roles), loaded with
``kv_connector_module_path: "kvtier.vllm"``.

vLLM builds one instance per process and role: in the scheduler process with
``KVConnectorRole.SCHEDULER`` (hooks delegate to :class:`KVTierScheduler`) and in each worker with
``KVConnectorRole.WORKER`` (hooks delegate to :class:`KVTierWorker`). The configuration is
validated in both, so a bad key fails at start-up with a message naming it.

An engine kvtier must not touch (:mod:`kvtier.vllm.inactive`: it cannot resume from external
KV, or it has a KV cache group kvtier does not offload, such as Mamba state) gets an INACTIVE connector: no host region, no
tiers, no loads, no stores; every hook answers "nothing" and the scheduler logs why once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.core.config import KVTierConfig
from kvtier.vllm.geometry import EngineGeometry, model_name
from kvtier.vllm.identity import model_identity
from kvtier.vllm.inactive import inactive_reason
from kvtier.vllm.logs import share_vllm_log_handlers
from kvtier.vllm.metadata import KVTierConnectorMetadata, KVTierConnectorStats
from kvtier.vllm.native.plugin import register_connector_name
from kvtier.vllm.runner import hook_order
from kvtier.vllm.scheduler_side import KVTierScheduler
from kvtier.vllm.worker_side import KVTierWorker

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config, role, kv_cache_config)
        share_vllm_log_handlers()
        config = KVTierConfig.from_extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        self._scheduler: KVTierScheduler | None = None
        self._worker: KVTierWorker | None = None
        reason = inactive_reason(vllm_config, kv_cache_config)
        if reason is not None:  # fail closed: both halves stay None, every hook answers "nothing"
            if role is KVConnectorRole.SCHEDULER:
                logging.getLogger(__name__).warning("%s", reason.message(model_name(vllm_config), kv_cache_config))
            return
        geometry = EngineGeometry.from_vllm(vllm_config, kv_cache_config, config)
        if role is KVConnectorRole.SCHEDULER:
            _recompute_failed_loads(vllm_config)
            events = vllm_config.kv_events_config
            publish = events is not None and events.enable_kv_cache_events
            model = model_identity(vllm_config, config)
            self._scheduler = KVTierScheduler(geometry, config, model, publish_kv_events=publish,
                                              hook_order=hook_order(vllm_config))
        else:
            self._worker = KVTierWorker(vllm_config, geometry, kv_cache_config, node=config.node,
                                        node_uid=config.node_uid)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is only a future miss

    # --- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._worker is not None:
            self._worker.register_kv_caches(kv_caches)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return True  # vLLM 0.33's sleep mode: unregister_kv_caches / restore_kv_caches below

    def unregister_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.restore_kv_caches()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None:
            assert isinstance(kv_connector_metadata, KVTierConnectorMetadata)
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if self._worker is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierConnectorMetadata)
        self._worker.start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv already copied every layer of this step's hits

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata", **kwargs: Any
    ) -> None:
        return  # stores copy whole blocks after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        if self._worker is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierConnectorMetadata)
        self._worker.start_stores(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        return self._worker.take_transfer_results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)  # vLLM calls the method above; this for others
        return results.finished_sending or None, results.finished_recving or None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.take_worker_meta() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # --- scheduler side --------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._scheduler is None:
            return 0, False
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if self._scheduler is None:
            return
        block_ids = blocks.get_block_ids() if num_external_tokens else ()
        self._scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: "Request", num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        return self._scheduler.hit_sources(request, num_external_tokens) if self._scheduler is not None else {}

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        if self._scheduler is None:
            return KVTierConnectorMetadata()
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is None:
            return False, None
        return self._scheduler.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_jobs()

    def get_kv_connector_stats(self) -> "KVConnectorStats | None":
        return self._scheduler.take_stats() if self._scheduler is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> "KVConnectorStats | None":
        return KVTierConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: "VllmConfig",
        metric_types: dict[type["PromMetric"], type["PromMetricT"]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> "KVConnectorPromMetrics | None":
        from kvtier.vllm.prom import KVTierPromMetrics

        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def take_events(self) -> "Iterable[KVCacheEvent]":
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def reset_cache(self) -> bool | None:
        return self._scheduler.reset_cache() if self._scheduler is not None else None


def _recompute_failed_loads(vllm_config: "VllmConfig") -> None:
    """A block kvtier fails to load is a cache miss: vLLM must recompute it, not fail the request
    (vLLM 0.32's default ``kv_load_failure_policy`` is "fail"). vLLM's scheduler reads the policy
    right after it builds this connector, so setting it here takes effect, except inside vLLM's
    MultiConnector: this connector then gets a copy of the engine's config with its own child
    kv-transfer config, and vLLM reads the MultiConnector's (``kvtier doctor`` flags it)."""
    transfer = vllm_config.kv_transfer_config
    if transfer.kv_load_failure_policy != "recompute":
        logging.getLogger(__name__).info(
            "kvtier: kv_load_failure_policy %r -> 'recompute' (a block kvtier fails to load is recomputed; inside "
            "vLLM's MultiConnector set it on the MultiConnector, where vLLM reads it)",
            transfer.kv_load_failure_policy,
        )
        transfer.kv_load_failure_policy = "recompute"


register_connector_name()  # vLLM's MultiConnector looks its children's stats classes up by name (native/plugin.py)
