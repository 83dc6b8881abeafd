"""``KVTierOffloadingSpec``: vLLM's ``TieringOffloadingSpec`` that also runs on vLLM's CPU backend.

    "kv_connector": "OffloadingConnector",
    "kv_connector_extra_config": {"spec_name": "KVTierOffloadingSpec",
                                  "spec_module_path": "kvtier.vllm.native",
                                  "cpu_bytes_to_use": ..., "secondary_tiers": [...]}

vLLM's CPU spec refuses to build a worker off CUDA and XPU (``CPUOffloadingSpec.get_worker``), so
its native offloading fails at start-up on vLLM-CPU. This spec is vLLM's tiering spec unchanged
(scheduler side: vLLM's CPU tier and secondary tiers, vLLM's fs tier included), except that on the
CPU platform its workers are :class:`~kvtier.vllm.native.worker.KVTierCpuWorker`, writing the same
shared region vLLM's own tiering spec maps (same file, rows, slots: ``create_worker`` of 0.32 and
0.33). On GPUs and XPUs it builds vLLM's own worker (keep ``TieringOffloadingSpec`` there).
"""

from __future__ import annotations

from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvtier.vllm.logs import share_vllm_log_handlers
from kvtier.vllm.native.worker import KVTierCpuWorker


class KVTierOffloadingSpec(TieringOffloadingSpec):
    """vLLM's tiering spec with a worker for vLLM's CPU backend (see the module docstring)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        share_vllm_log_handlers()
        if not current_platform.is_cpu():
            return super().get_worker(kv_caches)
        if self._worker is None:
            self._worker = self._cpu_worker(kv_caches)  # type: ignore[assignment]
        return self._worker

    def _cpu_worker(self, kv_caches: CanonicalKVCaches) -> KVTierCpuWorker:
        if self.config.canonical_layout:
            raise ValueError("canonical_layout is not supported on vLLM-CPU by KVTierOffloadingSpec; remove "
                             "it from kv_connector_extra_config.")
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=0 if self.replicated_layout else self.config.parallel.rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            views = [region.create_next_worker_view(t.page_size_bytes * self.blocks_per_chunk)
                     for t in kv_caches.tensors]
            return KVTierCpuWorker(kv_caches, self.blocks_per_chunk, views, on_shutdown=region.cleanup)
        except Exception:
            region.cleanup()
            raise
