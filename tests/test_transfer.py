"""Worker-side page copies (kvtier.copy): the batched copy is bit-exact and byte-for-byte the old
per-page copy, for vLLM-CPU's layout, pages spread over memory (heads outside blocks), MLA's and
dense pages in another physical order (LBNHC-like); the CPU engine; which engine serves which device.
The layouts vLLM itself builds are in tests/test_vllm_layouts.py."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.copy import BlockCopier, Direction, HostSlots, PageCopy, PagedKV, make_copy_engine
from kvtier.copy.cpu import CpuCopyEngine
from kvtier.core.slots import HostSlotLayout
from kvtier.tiers.shm import SharedRegion

NUM_BLOCKS = 9


def cpu_layers(num_layers=3):  # vLLM-CPU: [blocks, kv_heads, block_size, 2*head]
    return [torch.randn(NUM_BLOCKS, 2, 4, 8) for _ in range(num_layers)]


def head_major_layers(num_layers=3):  # LHBNC-like: [heads, blocks, ...] in memory, a page spread over it
    return [torch.randn(2, NUM_BLOCKS, 4, 8).transpose(0, 1) for _ in range(num_layers)]


def mla_layers(num_layers=3):  # MLA: [blocks, block_size, latent], one tensor per layer, 2-byte dtype
    return [torch.randn(NUM_BLOCKS, 4, 12).to(torch.bfloat16) for _ in range(num_layers)]


def permuted_layers(num_layers=3):  # LBNHC-like: [blocks, kv_heads, block_size, head], tokens outside heads
    return [torch.randn(NUM_BLOCKS, 4, 2, 8).transpose(1, 2) for _ in range(num_layers)]


def odd_layers(num_layers=3):  # rows of 5 bytes (say an fp8 cache): pages cannot be viewed as int64
    return [torch.randint(0, 256, (NUM_BLOCKS, 4, 5), dtype=torch.uint8) for _ in range(num_layers)]


LAYOUTS = [cpu_layers, head_major_layers, mla_layers, permuted_layers, odd_layers]


def make_copier(layers, num_slots=4, pages_per_block=2):
    kv = PagedKV(layers, NUM_BLOCKS)
    layout = HostSlotLayout(len(layers), pages_per_block, kv.page_bytes, 1, num_slots)
    host = HostSlots(torch.zeros(layout.region_bytes, dtype=torch.uint8), layout)
    return BlockCopier(kv, host)


def block(layers, block_id):
    return [layer[block_id].clone() for layer in layers]


def as_bytes(tensor):
    return tensor.view(torch.uint8)


def page_bytes_of(layer, block_id):
    """Independent oracle: the page as the host stores it. A page whose elements fill one run of
    memory (dense): that run, in memory order (its dimensions by decreasing stride); else the
    row-major order of the engine page."""
    page = layer[block_id]
    by_stride = sorted(range(page.dim()), key=lambda d: -page.stride(d))
    in_memory_order = page.permute(*by_stride)
    dense = in_memory_order.is_contiguous()
    return (in_memory_order if dense else page).contiguous().view(torch.uint8).reshape(-1)


def per_page_copy(copier, direction, pages):
    """The pre-batching ``BlockCopier.copy``, kept as the reference: one ``copy_`` per (layer, page)."""
    shape = None if copier.kv.flat else copier.kv.page_shape
    for layer in range(copier.kv.num_layers):
        for p in pages:
            host_page = copier.host.page(p.slot, layer, p.sub)
            if shape is not None:
                host_page = host_page.view(shape)
            engine_page = copier.kv.page(layer, p.block_id)
            if direction is Direction.STORE:
                host_page.copy_(engine_page)
            else:
                engine_page.copy_(host_page)
    return len(pages) * copier.kv.num_layers * copier.kv.page_bytes


def test_layouts_cover_strided_and_contiguous_pages_words_and_bytes():
    seen = {}
    for make in LAYOUTS:
        copier = make_copier(make())
        seen[make.__name__] = (copier.kv.flat, copier.word)
    assert seen == {
        "cpu_layers": (True, torch.int64), "head_major_layers": (False, torch.int64), "mla_layers": (True, torch.int64),
        "permuted_layers": (True, torch.int64), "odd_layers": (True, torch.uint8),
    }


def test_a_misaligned_host_buffer_is_copied_as_bytes():
    layers = cpu_layers()
    kv = PagedKV(layers, NUM_BLOCKS)
    layout = HostSlotLayout(len(layers), 1, kv.page_bytes, 1, 2)
    buffer = torch.zeros(layout.region_bytes + 1, dtype=torch.uint8)[1:]  # base address odd
    copier = BlockCopier(kv, HostSlots(buffer, layout))
    assert copier.word == torch.uint8
    copier.copy(Direction.STORE, [PageCopy(1, 0, 4)])
    assert torch.equal(copier.host.tensor[1].reshape(-1), torch.cat([page_bytes_of(layer, 4) for layer in layers]))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_batched_copy_matches_the_per_page_copy(data):
    make_layers = data.draw(st.sampled_from(LAYOUTS), label="layout")
    layers = make_layers(data.draw(st.integers(1, 3), label="layers"))
    twins = [layer.clone() for layer in layers]
    assert [t.stride() for t in twins] == [layer.stride() for layer in layers]
    num_slots, pages_per_block = 3, data.draw(st.integers(1, 2))
    blocks = data.draw(st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=6, unique=True), label="blocks")
    places = data.draw(
        st.lists(
            st.tuples(st.integers(0, num_slots - 1), st.integers(0, pages_per_block - 1)),
            min_size=len(blocks), max_size=len(blocks), unique=True,
        ),
        label="host pages",
    )
    pages = [PageCopy(slot, sub, b) for (slot, sub), b in zip(places, blocks)]
    batched = make_copier(layers, num_slots, pages_per_block)
    reference = make_copier(twins, num_slots, pages_per_block)
    expected_bytes = len(pages) * len(layers) * batched.kv.page_bytes

    assert batched.copy(Direction.STORE, pages) == per_page_copy(reference, Direction.STORE, pages) == expected_bytes
    assert torch.equal(batched.host.tensor, reference.host.tensor)
    for p in pages:
        for layer_index, layer in enumerate(layers):
            assert torch.equal(batched.host.page(p.slot, layer_index, p.sub), page_bytes_of(layer, p.block_id))

    noise = torch.randint(0, 256, batched.host.tensor.shape, dtype=torch.uint8)
    batched.host.tensor.copy_(noise)
    reference.host.tensor.copy_(noise)
    targets = data.draw(st.permutations(blocks), label="load targets")
    loads = [PageCopy(p.slot, p.sub, t) for p, t in zip(pages, targets)]
    assert batched.copy(Direction.LOAD, loads) == per_page_copy(reference, Direction.LOAD, loads)
    for got, want in zip(layers, twins):
        assert torch.equal(as_bytes(got), as_bytes(want))
    for p in loads:
        for layer_index, layer in enumerate(layers):
            assert torch.equal(page_bytes_of(layer, p.block_id), noise[p.slot, layer_index, p.sub])


def test_plan_is_one_list_of_page_pairs_per_job():
    copier = make_copier(head_major_layers(), pages_per_block=2)
    pages = [PageCopy(0, 1, 4), PageCopy(2, 0, 7)]
    plan = copier.plan(Direction.STORE, pages)
    assert len(plan.dsts) == len(plan.srcs) == 2 * 3 and plan.num_bytes == 6 * copier.kv.page_bytes
    assert all(d.shape == s.shape for d, s in zip(plan.dsts, plan.srcs))
    assert not plan.srcs[0].is_contiguous()  # heads outside blocks: a page is spread over memory
    load = copier.plan(Direction.LOAD, pages)
    assert all(d.data_ptr() == s.data_ptr() for d, s in zip(load.dsts, plan.srcs))  # same views, swapped


@pytest.mark.parametrize("bad", [PageCopy(4, 0, 1), PageCopy(-1, 0, 1), PageCopy(0, 2, 1), PageCopy(0, 0, 9),
                                 PageCopy(0, 0, -1)])
def test_pages_out_of_range_are_rejected_before_any_copy(bad):
    copier = make_copier(cpu_layers(), num_slots=4, pages_per_block=2)
    before = copier.host.tensor.clone()
    with pytest.raises(IndexError, match="out of range"):
        copier.copy(Direction.STORE, [PageCopy(1, 0, 2), bad])
    assert torch.equal(copier.host.tensor, before)  # not even the valid page was copied


def test_empty_job_moves_nothing():
    assert make_copier(cpu_layers()).copy(Direction.LOAD, []) == 0


@pytest.mark.parametrize("make_layers", LAYOUTS)
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


def host_for(kv, num_slots=2):
    layout = HostSlotLayout(kv.num_layers, 1, kv.page_bytes, 1, num_slots)
    return HostSlots(torch.zeros(layout.region_bytes, dtype=torch.uint8), layout)


def test_make_copy_engine_picks_the_engine_for_the_kv_device():
    from sim_device import SimDevice

    from kvtier.copy.cuda import CudaCopyEngine

    kv = PagedKV(cpu_layers(), NUM_BLOCKS)
    engine = make_copy_engine(kv, host_for(kv))
    assert isinstance(engine, CpuCopyEngine)
    engine.close()
    kv.device = torch.device("cuda", 0)  # as vLLM's CUDA KV would be (the copies go to the simulated device)
    assert isinstance(make_copy_engine(kv, host_for(kv), device=SimDevice()), CudaCopyEngine)


def test_make_copy_engine_names_an_unsupported_device():
    kv = PagedKV([torch.empty(NUM_BLOCKS, 2, 4, 8, device="meta") for _ in range(2)], NUM_BLOCKS)
    with pytest.raises(ValueError, match="kvtier: no copy engine for device type 'meta'"):
        make_copy_engine(kv, host_for(kv))


def test_cpu_engine_refuses_device_kv():
    kv = PagedKV(cpu_layers(), NUM_BLOCKS)
    kv.device = torch.device("cuda", 0)
    with pytest.raises(ValueError, match="needs KV in host memory"):
        CpuCopyEngine(BlockCopier(kv, host_for(kv)))
