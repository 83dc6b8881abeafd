"""The worker of vLLM's native offloading on vLLM's CPU backend: engine pages <-> the shared region.

vLLM's own worker (``CPUOffloadingWorker``) copies with CUDA streams and refuses the CPU platform.
:class:`KVTierCpuWorker` implements vLLM's ``OffloadingWorker`` for KV in host memory with kvtier's
CPU copy engine (:mod:`kvtier.copy.cpu`): loads are copied at once on the worker's thread (before
the forward that needs them), stores on kvtier's background copy thread, each job one batched
copy of whole pages (:class:`~kvtier.copy.pages.BlockCopier`).

Which page goes where is vLLM's own rule (``SingleDirectionOffloadingHandler.transfer_async``,
0.32 and 0.33): the engine blocks of each KV cache group, in order, fill the chunks of the CPU spec
from sub-block ``block_index % blocks_per_chunk`` of the first chunk on (:func:`page_copies`).

Threading: vLLM calls every method from the worker's main thread. Ordering on CPU: vLLM submits a
store at the start of the step after the forward that wrote its pages, and waits for it
(``wait``) before it reuses those blocks; a load's bytes are in place when ``submit_load`` returns.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvtier.copy import PageCopy, PagedKV, make_copy_engine
from kvtier.vllm.native.region_slots import RegionSlots


def page_copies(engine: GPULoadStoreSpec, chunks: BlockIDsLoadStoreSpec, blocks_per_chunk: int) -> list[PageCopy]:
    """The page pairs of one job: engine block ``i`` of group ``g`` <-> (chunk, sub-block)."""
    blocks, rows = engine.block_ids, chunks.block_ids
    pages: list[PageCopy] = []
    block_at = row_at = 0
    for group, (size, first) in enumerate(zip(engine.group_sizes, engine.block_indices)):
        if size == 0:
            continue
        skip = first % blocks_per_chunk
        for i in range(size):
            position = skip + i
            pages.append(PageCopy(slot=int(rows[row_at + position // blocks_per_chunk]),
                                  sub=position % blocks_per_chunk, block_id=int(blocks[block_at + i]), group=group))
        block_at += size
        row_at += -(-(size + skip) // blocks_per_chunk)
    if block_at != len(blocks) or row_at != len(rows):
        raise ValueError(f"job of {len(blocks)} engine blocks and {len(rows)} chunks does not match its "
                         f"group sizes {list(engine.group_sizes)}")
    return pages


class KVTierCpuWorker(OffloadingWorker):
    """vLLM's ``OffloadingWorker`` for KV in host memory, over this rank's slots of ``region_views``
    (one view per canonical tensor, from ``SharedOffloadRegion.create_next_worker_view``)."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int,
                 region_views: Sequence, on_shutdown=None):
        tensors = kv_caches.tensors
        page_sizes = {t.page_size_bytes for t in tensors}
        refs = [(group, ref) for group, group_refs in enumerate(kv_caches.group_data_refs) for ref in group_refs]
        if len(page_sizes) != 1 or any(ref.page_size_bytes != tensors[ref.tensor_idx].page_size_bytes
                                       for _, ref in refs):
            raise ValueError(
                "KVTierOffloadingSpec's CPU worker copies whole pages of one size, but this model's KV "
                f"pages are of several sizes ({sorted(page_sizes)} bytes, or padded). Use kvtier's own "
                "connector (kv_connector KVTierConnector) for this model on vLLM-CPU.")
        page_bytes = page_sizes.pop()
        num_blocks = tensors[0].tensor.shape[0]
        layer_groups = [[i for i, (g, _) in enumerate(refs) if g == group]
                        for group in range(len(kv_caches.group_data_refs))]
        kv = PagedKV([tensors[ref.tensor_idx].tensor for _, ref in refs], num_blocks, layer_groups)
        host = RegionSlots(region_views, [ref.tensor_idx for _, ref in refs], blocks_per_chunk, page_bytes)
        self._engine = make_copy_engine(kv, host)
        self._blocks_per_chunk = blocks_per_chunk
        self._on_shutdown = on_shutdown

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        self._engine.start_store(job_id, page_copies(src_spec, dst_spec, self._blocks_per_chunk))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        self._engine.start_load(job_id, page_copies(dst_spec, src_spec, self._blocks_per_chunk))
        return True

    def get_finished(self) -> list[TransferResult]:
        return [TransferResult(job_id=done.job_id, success=done.ok, transfer_size=done.num_bytes,
                               transfer_time=done.seconds) for done in self._engine.poll()]

    def wait(self, job_ids: set[int]) -> None:
        self._engine.wait(job_ids)

    def shutdown(self) -> None:
        self._engine.close()
        if self._on_shutdown is not None:
            self._on_shutdown()
            self._on_shutdown = None
