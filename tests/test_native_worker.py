"""KVTierOffloadingSpec's CPU worker puts every engine page where vLLM's own CUDA worker would.

The oracle is vLLM's own pointer arithmetic (``compute_sub_block_ptrs`` of vLLM's CPU offloading
worker, the code its CUDA copies are fed from), run on CPU tensors: for every page of a job, the
bytes at vLLM's destination address in vLLM's shared region (a real ``SharedOffloadRegion``) must
be the engine page's. Jobs cover unaligned first chunks (``block_indices % blocks_per_chunk``),
several KV cache groups, groups sharing tensors (vLLM's hybrid allocator) and two ranks' slots.
"""

from __future__ import annotations

import ctypes
import secrets

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from kvtier.vllm.native.worker import KVTierCpuWorker, page_copies

PAGE = 512
NUM_BLOCKS = 24
NUM_CHUNKS = 8


def make_caches(groups: list[list[int]], num_tensors: int) -> CanonicalKVCaches:
    tensors = [CanonicalKVCacheTensor(torch.randint(-128, 127, (NUM_BLOCKS, PAGE), dtype=torch.int8), PAGE)
               for _ in range(num_tensors)]
    return CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(t, PAGE) for t in group] for group in groups])


def make_worker(caches: CanonicalKVCaches, bpc: int, *, rank: int = 0, world: int = 1):
    slot = len(caches.tensors) * PAGE * bpc
    row = slot * world
    row += -row % 4096
    region = SharedOffloadRegion(engine_id=f"test{secrets.token_hex(4)}", num_chunks=NUM_CHUNKS, rank=rank,
                                 kv_bytes_per_chunk=row, cpu_page_size=slot)
    views = [region.create_next_worker_view(PAGE * bpc) for _ in caches.tensors]
    try:
        return KVTierCpuWorker(caches, bpc, views, on_shutdown=region.cleanup), views
    except Exception:
        views.clear()
        region.cleanup()  # the region's /dev/shm file goes with it (its creator)
        raise


def vllm_addresses(caches, views, spec: GPULoadStoreSpec, chunks: np.ndarray, bpc: int) -> list[tuple[int, int]]:
    """(engine page address, region address) of every page, by vLLM's own arithmetic."""
    pairs, block_at, row_at = [], 0, 0
    for group, (size, first) in enumerate(zip(spec.group_sizes, spec.block_indices)):
        if size == 0:
            continue
        skip = first % bpc
        n_rows = -(-(size + skip) // bpc)
        for ref in caches.group_data_refs[group]:
            src, dst = np.empty(size, np.uint64), np.empty(size, np.uint64)
            compute_sub_block_ptrs(spec.block_ids[block_at:block_at + size], 1, src,
                                   caches.tensors[ref.tensor_idx].tensor)
            compute_sub_block_ptrs(chunks[row_at:row_at + n_rows], bpc, dst, views[ref.tensor_idx], skip_count=skip)
            pairs += list(zip(src.tolist(), dst.tolist()))
        block_at += size
        row_at += n_rows
    return pairs


@pytest.mark.parametrize(("groups", "num_tensors", "bpc", "rank", "world"), [
    ([[0, 1, 2]], 3, 4, 0, 1),  # one group, 3 layers
    ([[0, 1], [2]], 3, 2, 0, 1),  # two groups of their own layers
    ([[0, 1], [0, 1]], 2, 2, 0, 1),  # two groups over the same tensors (hybrid allocator)
    ([[0, 1]], 2, 3, 1, 2),  # rank 1's slot of a two-rank row
])
def test_pages_land_where_vllms_worker_puts_them_and_load_back(groups, num_tensors, bpc, rank, world):
    caches = make_caches(groups, num_tensors)
    worker, views = make_worker(caches, bpc, rank=rank, world=world)
    try:
        check_round_trip(worker, views, caches, groups, bpc)
    finally:
        views.clear()
        worker.shutdown()  # unmaps and removes the region's /dev/shm file


def check_round_trip(worker, views, caches, groups, bpc) -> None:
    rng = np.random.default_rng(0)
    sizes = [int(rng.integers(3, 7)) for _ in groups]
    firsts = [int(rng.integers(0, 2 * bpc)) for _ in groups]  # unaligned first chunks
    blocks = rng.choice(np.arange(1, NUM_BLOCKS), size=sum(sizes), replace=False).tolist()
    n_rows = sum(-(-(s + f % bpc) // bpc) for s, f in zip(sizes, firsts))
    chunks = rng.choice(NUM_CHUNKS, size=n_rows, replace=False).astype(np.int64)
    engine = GPULoadStoreSpec(blocks, group_sizes=sizes, block_indices=firsts)
    cpu = CPULoadStoreSpec(chunks.tolist())

    assert worker.submit_store(1, engine, cpu)
    worker.wait({1})
    (done,) = worker.get_finished()
    assert done.job_id == 1 and done.success and done.transfer_size == sum(
        size * len(group) * PAGE for size, group in zip(sizes, caches.group_data_refs))
    pairs = vllm_addresses(caches, views, engine, cpu.block_ids, bpc)
    assert len(pairs) == sum(size * len(group) for size, group in zip(sizes, caches.group_data_refs))
    assert len(page_copies(engine, cpu, bpc)) == sum(sizes)
    for src, dst in pairs:
        assert ctypes.string_at(dst, PAGE) == ctypes.string_at(src, PAGE)

    originals = [t.tensor.clone() for t in caches.tensors]
    start = 0
    for size, group in zip(sizes, caches.group_data_refs):  # erase exactly the pages the job stored
        for ref in group:
            caches.tensors[ref.tensor_idx].tensor[blocks[start:start + size]] = 0
        start += size
    assert worker.submit_load(2, cpu, engine)  # bytes in place on return
    for t, original in zip(caches.tensors, originals):
        assert torch.equal(t.tensor, original)
    assert [d.job_id for d in worker.get_finished()] == [2]


def test_pages_of_several_sizes_are_refused_with_the_alternative():
    caches = make_caches([[0]], 1)
    caches.tensors.append(CanonicalKVCacheTensor(torch.zeros((NUM_BLOCKS, 2 * PAGE), dtype=torch.int8), 2 * PAGE))
    caches.group_data_refs[0].append(CanonicalKVCacheRef(1, 2 * PAGE))
    with pytest.raises(ValueError, match="KVTierConnector"):
        make_worker(caches, 2)
