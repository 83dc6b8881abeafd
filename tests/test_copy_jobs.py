"""What crosses from kvtier's scheduler to the workers each step: copy jobs whose pages are one
int64 page table (kvtier.copy.page_table), not PageCopy tuples. vLLM pickles the connector
metadata to every worker each step; the engines take either form and copy the same bytes."""

from __future__ import annotations

import pickle

import numpy as np
import torch

from kvtier.copy import BlockCopier, Direction, HostSlots, PageCopy, PagedKV, page_list, page_table
from kvtier.core.slots import HostSlotLayout
from kvtier.vllm.metadata import CopyJob, KVTierConnectorMetadata
from kvtier.vllm.worker_side import rank_pages


def pages_of(count: int) -> list[PageCopy]:
    return [PageCopy(slot, slot % 2, 3 * slot + 1, slot % 3) for slot in range(count)]


def test_a_page_table_holds_every_page_and_gives_them_back():
    pages = pages_of(37)
    table = page_table(pages)
    assert table.dtype == np.int64 and table.shape == (37, 4)
    assert page_list(table) == pages and page_table(table) is table


def test_the_metadata_pickles_a_512_page_job_as_one_array():
    pages = pages_of(512)
    meta = KVTierConnectorMetadata(stores=[CopyJob(1, "r", page_table(pages))])
    wire = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
    [job] = pickle.loads(wire).stores
    assert isinstance(job.pages, np.ndarray) and page_list(job.pages) == pages


def test_each_rank_copies_its_own_slots_and_the_job_keeps_rank_zeros():
    pages = page_table(pages_of(4))
    job = CopyJob(1, "r", pages, pool_id="pool", rank_slots={s: (s, 100 + s, 200 + s) for s in range(4)})
    assert rank_pages(job, 2)[:, 0].tolist() == [200, 201, 202, 203]
    assert np.array_equal(rank_pages(job, 2)[:, 1:], pages[:, 1:])
    assert np.array_equal(rank_pages(job, 0), pages) and job.pages[:, 0].tolist() == [0, 1, 2, 3]


def test_the_cpu_copier_moves_the_same_bytes_from_a_table_as_from_tuples():
    layers, blocks, page = 3, 8, 64
    kv = [torch.randint(0, 255, (blocks, page), dtype=torch.uint8) for _ in range(layers)]
    paged = PagedKV(kv, blocks)
    layout = HostSlotLayout(layers, 1, page, 1, 6)
    hosts = [torch.zeros(layout.region_bytes, dtype=torch.uint8) for _ in range(2)]
    pages = [PageCopy(slot, 0, (5 * slot) % blocks) for slot in range(6)]
    for host, job in zip(hosts, (pages, page_table(pages))):
        assert BlockCopier(paged, HostSlots(host, layout)).copy(Direction.STORE, job) == 6 * layers * page
    assert torch.equal(hosts[0], hosts[1]) and hosts[0].any()
