"""Worker-side page copies (kvtier.copy): bit-exact round trips for the CPU layout and a FlashAttention-like one."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.copy import BlockCopier, Direction, HostSlots, PageCopy, PagedKV, make_copy_engine
from kvtier.copy.pages import find_block_dim
from kvtier.core.slots import HostSlotLayout
from kvtier.tiers.shm import SharedRegion

NUM_BLOCKS = 9


def cpu_layers(num_layers=3):  # vLLM-CPU: [blocks, kv_heads, block_size, 2*head]
    return [torch.randn(NUM_BLOCKS, 2, 4, 8) for _ in range(num_layers)]


def flash_layers(num_layers=3):  # FlashAttention: [2, blocks, block_size, kv_heads, head] (block dim 1)
    return [torch.randn(2, NUM_BLOCKS, 4, 2, 4) for _ in range(num_layers)]


def make_copier(layers, num_slots=4, pages_per_block=2):
    kv = PagedKV(layers, NUM_BLOCKS)
    layout = HostSlotLayout(len(layers), pages_per_block, kv.page_bytes, 1, num_slots)
    host = HostSlots(torch.zeros(layout.region_bytes, dtype=torch.uint8), layout)
    return BlockCopier(kv, host)


def block(layers, block_id):
    dim = find_block_dim(layers[0].shape, NUM_BLOCKS)
    return [layer.select(dim, block_id).clone() for layer in layers]


@pytest.mark.parametrize("make_layers", [cpu_layers, flash_layers])
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_store_then_load_into_other_blocks_is_bit_exact(make_layers, data):
    layers = make_layers()
    copier = make_copier(layers)
    sources = data.draw(st.lists(st.integers(1, NUM_BLOCKS - 1), min_size=1, max_size=8, unique=True))
    pages = [PageCopy(slot=i // 2, sub=i % 2, block_id=b) for i, b in enumerate(sources)]
    originals = {b: block(layers, b) for b in sources}
    assert copier.copy(Direction.STORE, pages) == len(pages) * len(layers) * copier.kv.page_bytes
    for layer in layers:  # wipe the engine, then load every page into a (possibly) different block
        layer.zero_()
    targets = data.draw(st.permutations(sources))
    copier.copy(Direction.LOAD, [PageCopy(p.slot, p.sub, t) for p, t in zip(pages, targets)])
    for source, target in zip(sources, targets):
        for got, want in zip(block(layers, target), originals[source]):
            assert torch.equal(got, want)


def test_layout_mismatch_is_rejected():
    kv = PagedKV(cpu_layers(), NUM_BLOCKS)
    layout = HostSlotLayout(2, 1, kv.page_bytes, 1, 1)  # wrong layer count
    with pytest.raises(ValueError, match="does not match"):
        BlockCopier(kv, HostSlots(torch.zeros(layout.region_bytes, dtype=torch.uint8), layout))


def test_cpu_engine_over_shared_memory_reports_and_waits():
    layers = cpu_layers()
    kv = PagedKV(layers, NUM_BLOCKS)
    layout = HostSlotLayout(len(layers), 1, kv.page_bytes, 1, 4)
    region = SharedRegion.create(f"kvtier-test-{os.getpid()}", layout.region_bytes)
    try:
        engine = make_copy_engine(kv, HostSlots(torch.frombuffer(region.view, dtype=torch.uint8), layout))
        engine.start_store(1, [PageCopy(0, 0, 3)])
        engine.start_store(2, [PageCopy(99, 0, 3)])  # bad slot: reported as failed, never raised
        engine.wait([1, 2])
        done = {d.job_id: d for d in engine.poll()}
        assert done[1].ok and done[1].num_bytes == len(layers) * kv.page_bytes
        assert not done[2].ok
        # a second mapping of the same region (the scheduler's) sees the bytes
        region.publish(b"{}")  # the worker publishes its page description before anyone attaches
        other = SharedRegion.attach(region.path.name, layout.region_bytes)
        slot0 = torch.frombuffer(other.view, dtype=torch.uint8)[: layout.slot_bytes]
        assert torch.equal(slot0[: kv.page_bytes], layers[0][3].view(torch.uint8).reshape(-1))
        engine.close()
    finally:
        region.unlink()
