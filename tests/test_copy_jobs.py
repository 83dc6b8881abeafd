"""What crosses from kvtier's scheduler to the workers each step: copy jobs whose pages are one
int64 page table (kvtier.copy.page_table), or for a job of one host run a SlotRun (first slot,
engine blocks), not PageCopy tuples. vLLM pickles the connector metadata to every worker each
step; the engines take every form and copy the same bytes."""

from __future__ import annotations

import pickle

import numpy as np
import torch

from kvtier.copy import BlockCopier, Direction, HostSlots, PageCopy, PagedKV, SlotRun, page_list, page_table, slot_run_of
from kvtier.copy.cpu import CpuCopyEngine
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


LAYERS, BLOCKS, PAGE = 3, 8, 64


def two_hosts():
    """Random engine pages (3 layers x 8 blocks of 64 B) and two empty host regions of 6 slots."""
    kv = [torch.randint(0, 255, (BLOCKS, PAGE), dtype=torch.uint8) for _ in range(LAYERS)]
    layout = HostSlotLayout(LAYERS, 1, PAGE, 1, 6)
    return PagedKV(kv, BLOCKS), layout, [torch.zeros(layout.region_bytes, dtype=torch.uint8) for _ in range(2)]


def test_the_cpu_copier_moves_the_same_bytes_from_a_table_as_from_tuples():
    paged, layout, hosts = two_hosts()
    blocks, layers, page = BLOCKS, LAYERS, PAGE
    pages = [PageCopy(slot, 0, (5 * slot) % blocks) for slot in range(6)]
    for host, job in zip(hosts, (pages, page_table(pages))):
        assert BlockCopier(paged, HostSlots(host, layout)).copy(Direction.STORE, job) == 6 * layers * page
    assert torch.equal(hosts[0], hosts[1]) and hosts[0].any()


def test_a_job_of_one_host_run_is_sent_as_a_slot_run_and_stands_for_its_table():
    """slot_run_of: consecutive slots from the first, every page 0 of group 0 (one kvtier block
    per engine block, one KV cache group); anything else stays a table. A SlotRun pickles with
    the metadata and gives back its table and its pages."""
    one_run = page_table([PageCopy(7 + i, 0, block) for i, block in enumerate([4, 9, 1, 30])])
    run = slot_run_of(one_run)
    assert isinstance(run, SlotRun) and run.first_slot == 7 and run.blocks.tolist() == [4, 9, 1, 30]
    assert run.blocks.flags.c_contiguous and run.blocks.dtype == np.int64 and len(run) == 4
    assert np.array_equal(page_table(run), one_run) and page_list(run) == page_list(one_run)
    meta = pickle.loads(pickle.dumps(KVTierConnectorMetadata(stores=[CopyJob(1, "r", run)])))
    assert np.array_equal(page_table(meta.stores[0].pages), one_run)
    assert slot_run_of(page_table([PageCopy(5, 0, 2)])).first_slot == 5
    for other in ([PageCopy(0, 0, 1), PageCopy(2, 0, 2)],  # a gap
                  [PageCopy(1, 0, 1), PageCopy(0, 0, 2)],  # not in slot order
                  [PageCopy(0, 0, 1), PageCopy(1, 0, 2), PageCopy(1, 0, 3)],  # a slot twice (last - first fits)
                  [PageCopy(0, 0, 1), PageCopy(1, 1, 2)],  # a second page of a kvtier block
                  [PageCopy(0, 0, 1, 1), PageCopy(1, 0, 2, 1)]):  # another KV cache group
        assert slot_run_of(page_table(other)) is None, other


def test_each_rank_remaps_a_slot_run_too():
    run = SlotRun(2, np.array([8, 3], dtype=np.int64))
    job = CopyJob(1, "r", run, pool_id="pool", rank_slots={2: (2, 40), 3: (3, 41)})
    assert rank_pages(job, 1).tolist() == [[40, 0, 8, 0], [41, 0, 3, 0]]
    assert rank_pages(job, 0).tolist() == [[2, 0, 8, 0], [3, 0, 3, 0]] and job.pages is run


def test_the_cpu_engine_moves_the_same_bytes_from_a_slot_run_as_from_its_table():
    paged, layout, hosts = two_hosts()
    blocks, layers, page = BLOCKS, LAYERS, PAGE
    table = page_table([PageCopy(1 + i, 0, (5 * i) % blocks) for i in range(5)])
    for host, job in zip(hosts, (table, slot_run_of(table))):
        engine = CpuCopyEngine(BlockCopier(paged, HostSlots(host, layout)))
        engine.start_store(1, job)
        engine.wait()
        [done] = engine.poll()
        assert done.ok and done.num_bytes == 5 * layers * page
        engine.close()
    assert torch.equal(hosts[0], hosts[1]) and hosts[0].any()
