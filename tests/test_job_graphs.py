"""Staged jobs as dependency graphs (kvtier.copy.jobgraph), run on CPU tensors: a recorded graph
lands the bytes of the CPU engine whatever order its edges allow (random orders, transfers
first, kernels first), for every layout the GPU kit covers and chunkings that split blocks and
reuse buffers; without the edges between its two lanes it does not. And the cache of graphs by
shape: built at a shape's second job, least recently used retired, nothing built for jobs that
cannot be graphs."""

from __future__ import annotations

import random

import pytest
import torch
from test_staged_copies import STAGED_CASES, _page, expected_host, job, rig

from kvtier.copy import Direction
from kvtier.copy.jobgraph import GraphCache, GraphNode, JobGraph, graph_key, graph_pages

SLOTS = list(range(8))  # consecutive slots: one host run per chunk (the jobs that become graphs)
BLOCKS, LOAD_BLOCKS = [3, 11, 1, 8, 9, 2, 13, 5], [12, 0, 4, 6, 7, 10, 3, 2]


def staged_plan(engine, direction, pages):
    plan, _ = engine._plan(direction, pages)  # noqa: SLF001 - the plan start_store / start_load issue
    assert type(plan).__name__ == "StagedRuns"
    return plan


def run_graph(graph: JobGraph, plan, uploaded: torch.Tensor, order) -> None:
    """Run every node once its ``after`` nodes ran, picking among the ready ones with ``order``."""
    done: set[int] = set()
    while len(done) < len(graph.nodes):
        ready = [i for i, node in enumerate(graph.nodes) if i not in done and done.issuperset(node.after)]
        assert ready, "a cycle"
        index = order(ready, graph.nodes)
        node = graph.nodes[index]
        if node.op == "gather":
            plan.torch_gather(uploaded, node.first, node.pages, node.buffer)
        elif node.op == "scatter":
            plan.torch_scatter(uploaded, node.first, node.pages, node.buffer)
        else:
            for dst, src in zip(*plan.chunk_runs(node.chunk).views()):
                dst.copy_(src)
        done.add(index)


def randomly(seed):
    rng = random.Random(seed)
    return lambda ready, nodes: rng.choice(ready)


def preferring(op):
    """An adversary: nodes of ``op`` ("transfer", or a kernel's) whenever one is ready, latest chunk first."""
    return lambda ready, nodes: max(ready, key=lambda i: ((nodes[i].op == "transfer") == (op == "transfer"), i))


ORDERS = [randomly(1), randomly(2), randomly(3), preferring("transfer"), preferring("kernel")]


def lane_order_only(nodes: list[GraphNode]) -> list[GraphNode]:
    """``nodes`` without the edges between the two lanes (kernels, transfers)."""
    def lane(node):
        return node.op == "transfer"

    return [GraphNode(n.op, tuple(a for a in n.after if lane(nodes[a]) == lane(n)), n.first, n.pages, n.buffer, n.chunk)
            for n in nodes]


def round_trip(case_name, chunk_pages, buffers, order, strip_cross_lane=False) -> tuple[bool, bool]:
    """A store then a load as graphs run in ``order``: (stored exactly, loaded exactly)."""
    engine, device, paged, host, kv = rig(case_name, chunk_pages=chunk_pages, buffers=buffers)
    store = job(kv, SLOTS, BLOCKS)
    plan = staged_plan(engine, Direction.STORE, store)
    uploaded = torch.from_numpy(plan.row_index().copy())
    graph = JobGraph.record(plan, uploaded)
    if strip_cross_lane:
        graph.nodes = lane_order_only(graph.nodes)
    run_graph(graph, plan, uploaded, order)
    stored = torch.equal(host.buffer, expected_host(paged, host, store))
    saved = kv.raw.clone()
    kv.raw.zero_()
    if strip_cross_lane:
        host.buffer.copy_(expected_host(paged, host, store))
    plan = staged_plan(engine, Direction.LOAD, job(kv, SLOTS, LOAD_BLOCKS))
    uploaded = torch.from_numpy(plan.row_index().copy())
    load = JobGraph.record(plan, uploaded)
    if strip_cross_lane:
        load.nodes = lane_order_only(load.nodes)
    run_graph(load, plan, uploaded, order)
    loaded = all(torch.equal(paged.page(layer, dst), _page(saved, kv, paged, layer, src))
                 for layers in kv.layer_groups for layer in layers for src, dst in zip(BLOCKS, LOAD_BLOCKS))
    return stored, loaded


@pytest.mark.parametrize("case_name", STAGED_CASES)
@pytest.mark.parametrize("chunk_pages, buffers", [(3, 2), (5, 3), (1, 1), (1000, 2)])
def test_a_job_graph_is_bit_exact_in_every_order_its_edges_allow(case_name, chunk_pages, buffers):
    for order in ORDERS:
        assert round_trip(case_name, chunk_pages, buffers, order) == (True, True)


@pytest.mark.parametrize("chunk_pages, buffers", [(3, 2), (5, 3)])
def test_without_the_edges_between_its_lanes_a_job_graph_copies_wrong_bytes(chunk_pages, buffers):
    """The same graphs with only each lane's own order kept: run transfers first (a store copies
    buffers not yet gathered) or kernels first (a load scatters chunks not yet arrived)."""
    results = [round_trip("LBNHC-attention", chunk_pages, buffers, order, strip_cross_lane=True) for order in ORDERS]
    assert not all(stored for stored, _ in results)
    assert not all(loaded for _, loaded in results)


def test_a_store_graph_pipelines_gathers_with_transfers_through_its_buffers():
    """Five chunks through two buffers: each transfer after its gather and the previous transfer;
    each gather after the previous gather, and after the transfer out of its buffer once reused."""
    engine, device, paged, host, kv = rig("LBNHC-attention", chunk_pages=3, buffers=2)
    plan = staged_plan(engine, Direction.STORE, job(kv, SLOTS[:5], BLOCKS[:5]))
    assert plan.num_chunks == 5
    graph = JobGraph.record(plan, torch.zeros(1, dtype=torch.int64))
    names = [f"{n.op[0]}{n.chunk if n.op == 'transfer' else n.first // 3}" for n in graph.nodes]
    after = {names[i]: sorted(names[a] for a in n.after) for i, n in enumerate(graph.nodes)}
    assert after == {"g0": [], "t0": ["g0"], "g1": ["g0"], "t1": ["g1", "t0"], "g2": ["g1", "t0"],
                     "t2": ["g2", "t1"], "g3": ["g2", "t1"], "t3": ["g3", "t2"], "g4": ["g3", "t2"],
                     "t4": ["g4", "t3"]}
    assert [n.buffer for n in graph.nodes if n.op == "gather"] == [0, 1, 0, 1, 0]


def test_only_jobs_of_one_host_run_per_chunk_have_a_graph_key():
    engine, device, paged, host, kv = rig("LBNHC-attention", num_slots=12, chunk_pages=5, buffers=2)
    consecutive = staged_plan(engine, Direction.STORE, job(kv, [6, 0, 1, 2, 4, 5, 3, 7], BLOCKS))  # host order
    scattered = staged_plan(engine, Direction.STORE, job(kv, [0, 1, 2, 4, 5, 6, 9, 11], BLOCKS))
    assert consecutive.num_pages == 24 and consecutive.num_chunks == 5  # a last chunk of 4 pages
    assert graph_key(consecutive) == (Direction.STORE, 5, True, 5)
    assert graph_key(scattered) is None
    with pytest.raises(ValueError, match="one host run per chunk"):
        JobGraph.record(scattered, torch.zeros(1, dtype=torch.int64))


def test_jobs_share_a_graph_key_by_chunks_and_a_one_chunk_jobs_pages_rounded_up_to_a_power_of_two():
    assert [graph_pages(p, 4096, 1) for p in (1, 2, 3, 4, 5, 1000, 1024, 1025, 4095, 4096)] == \
        [1, 2, 4, 4, 8, 1024, 1024, 2048, 4096, 4096]
    assert [graph_pages(p, 5, 1) for p in (1, 3, 4, 5)] == [1, 4, 4, 5]  # never past a whole chunk
    assert [graph_pages(p, 4096, 2) for p in (1, 3, 4096)] == [4096] * 3  # several chunks: one shape per count
    engine, device, paged, host, kv = rig("LBNHC-attention", num_slots=12, chunk_pages=8, buffers=2)
    layers = paged.num_layers
    keys = {blocks: graph_key(staged_plan(engine, Direction.LOAD, job(kv, list(range(blocks)), BLOCKS[:blocks])))
            for blocks in range(1, 9)}
    for blocks, key in keys.items():
        pages = blocks * layers
        chunks = -(-pages // 8)
        assert key == (Direction.LOAD, chunks, True, graph_pages(pages, 8, 1) if chunks == 1 else 8)


def test_the_cache_builds_at_a_shapes_second_job_and_retires_the_least_recently_used():
    built, retired = [], []
    cache = GraphCache(retired.append, capacity=2, build_at=2, remember=3)

    def find(key):
        return cache.find(key, lambda: built.append(key) or f"graph {key}")

    assert find("a") is None and built == []
    assert find("a") == "graph a" and find("a") == "graph a" and built == ["a"]
    for key in ("b", "b", "c", "c"):
        find(key)
    assert built == ["a", "b", "c"] and retired == ["graph a"] and len(cache) == 2
    find("b")  # b is now the most recently used: c goes next
    find("d"), find("d")
    assert retired == ["graph a", "graph c"]
    for key in ("e", "f", "g", "h"):  # only the last 3 keys seen once are remembered
        find(key)
    assert find("e") is None and built[-1] == "d"
    cache.clear()
    assert sorted(retired) == ["graph a", "graph b", "graph c", "graph d"] and len(cache) == 0
    assert find("b") == "graph b" and built[-1] == "b"  # a cleared key builds again at its next job


def test_a_graph_that_cannot_be_built_is_not_kept():
    def fail():
        raise RuntimeError("no graphs here")

    cache = GraphCache(lambda graph: None)
    assert cache.find("a", fail) is None
    with pytest.raises(RuntimeError):
        cache.find("a", fail)
    assert len(cache) == 0
