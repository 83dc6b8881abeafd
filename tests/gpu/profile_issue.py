"""Where the host time to issue a copy job goes, on a real CUDA device: the cost of each device call
the engine makes (microseconds, median of many, the device kept busy so nothing waits for it), then
a profile of whole ``start_store`` / ``start_load`` calls at the kit's shape (512 blocks x 32
layers, scattered engine blocks), per method and layout. Prints one JSON.

``jobs``' staged jobs repeat one shape, so from the second on they go as CUDA graphs
(``kvtier.copy.cudagraph``; ``graph_launches`` counts them); ``jobs_without_graphs``: the 16 KiB
staged jobs again issued op by op, and ``jobs_torch_ops`` with torch's gather/scatter ops instead
of kvtier's kernels, in the same run (a lent GPU's host differs in call costs from loan to loan).

Per job shape: ``phases_us``, medians of the host time inside chosen methods (``runtime.*``: each
CUDA runtime call the engine makes; the rest of ``total`` is kvtier's Python), and the start
call's median given the job as the scheduler sends it (a ``SlotRun``: one host run;
``issue_ms_median``), given its page table (``issue_ms_median_table``), given 512 ``PageCopy``
tuples, and issued back to back without waiting for the device between calls (a
warm host: each job of the others is issued right after the host waited for the device, as the
kit issues them). ``cold_calls``: the runtime calls of a 16 KiB-page graph job and a whole start
call, each right after the host's caches were evicted and warm (:func:`cold_calls`).

Usage (GPU machine, as scripts/gpu-check.sh sets PYTHONPATH): python tests/gpu/profile_issue.py
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import itertools
import json
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_copies as kit  # noqa: E402
from gpu_layouts import Case, build  # noqa: E402

from kvtier.copy import BlockCopier, Direction, HostSlots, PageCopy, PagedKV, page_table, slot_run_of  # noqa: E402
from kvtier.copy.cudart import SourceOrder  # noqa: E402
from kvtier.copy.cuda import CudaCopyEngine  # noqa: E402
from kvtier.copy.kernels import RowKernels  # noqa: E402
from kvtier.copy.staging import CopyMethod  # noqa: E402
from kvtier.copy.streams import TorchCudaStreams  # noqa: E402
from kvtier.core.slots import HostSlotLayout  # noqa: E402

BLOCKS, LAYERS = 512, 32


def micro(work, n: int = 300) -> float:
    """Median microseconds of ``work()``, the compute stream held busy meanwhile."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(200 * kit.CYCLES_PER_MS))
    times = []
    for _ in range(n):
        began = time.perf_counter()
        work()
        times.append(time.perf_counter() - began)
    torch.cuda.synchronize()
    return round(statistics.median(times) * 1e6, 2)


def device_calls(streams: TorchCudaStreams) -> dict:
    device = streams.device
    side = streams.new_stream()
    runtime = streams.runtime
    compute = torch.cuda.current_stream()
    event = torch.cuda.Event(enable_timing=True)
    rows = torch.zeros(4096, 2048, dtype=torch.int64, device=device)  # 16 KiB rows
    out = torch.empty(512, 2048, dtype=torch.int64, device=device)
    index = torch.randint(0, 4096, (16384,), device=device)
    host = torch.empty(64 * 2**20, dtype=torch.uint8, pin_memory=True)
    found: dict = {
        "torch.cuda.current_stream": micro(lambda: torch.cuda.current_stream(device)),
        "torch.cuda.Event(enable_timing=True)": micro(lambda: torch.cuda.Event(enable_timing=True)),
        "new Event + record": micro(lambda: torch.cuda.Event(enable_timing=True).record(compute)),
        "event.record(side)": micro(lambda: event.record(side)),
        "side.wait_event": micro(lambda: side.wait_event(event)),
        "index slice": micro(lambda: index[512:1024]),
        "index_select 512 x 16 KiB (out=)": micro(lambda: torch.index_select(rows, 0, index[:512] % 4096, out=out)),
        "index_select, index sliced": micro(lambda: torch.index_select(rows, 0, index[512:1024], out=out)),
        "index_copy_ 512 rows": micro(lambda: rows.index_copy_(0, index[:512], out)),
    }

    def ctx_device():
        with torch.cuda.device(device), torch.cuda.stream(side):
            pass

    found["with device + stream (enter/exit)"] = micro(ctx_device)
    index_of = device.index
    found["torch._C._cuda_getCurrentRawStream"] = micro(lambda: torch._C._cuda_getCurrentRawStream(index_of))
    found["torch.cuda.set_stream x2"] = micro(lambda: (torch.cuda.set_stream(side), torch.cuda.set_stream(compute)))
    pages = [(slot, 0, slot * 7, 0) for slot in range(512)]
    found["page_table of 512 PageCopy tuples"] = micro(lambda: page_table(pages))
    python_loop = micro(lambda: sum(i * i for i in range(1000)), n=100)
    found["pure Python: sum of 1000 squares"] = python_loop
    if runtime is not None:
        ev = runtime.event_create()
        handle = side.cuda_stream
        found["runtime.event_record"] = micro(lambda: runtime.event_record(ev, handle))
        found["runtime.stream_wait_event"] = micro(lambda: runtime.stream_wait_event(handle, ev))
        for count in (1, 16, 512):
            dst = np.full(count, host.data_ptr(), dtype=np.int64) + np.arange(count, dtype=np.int64) * 65536
            src = np.full(count, out.data_ptr(), dtype=np.int64)
            sizes = np.full(count, 4096, dtype=np.int64)
            found[f"runtime.memcpy_batch {count}"] = micro(
                lambda d=dst, s=src, z=sizes: runtime.memcpy_batch(d, s, z, handle, SourceOrder.STREAM), n=100)
        runtime.event_destroy(ev)
        if runtime.graphs:  # what a job issued as a graph costs per chunk (an update) and once (the launch)
            graph = runtime.graph_create()
            node = runtime.graph_add_memcpy(graph, [], host.data_ptr(), out.data_ptr(), 4096)
            instance = runtime.graph_instantiate(graph)
            found["runtime.graph_set_memcpy"] = micro(lambda: runtime.graph_set_memcpy(
                instance, node, host.data_ptr() + 8192, out.data_ptr(), 4096))
            found["runtime.graph_launch (one 4 KiB copy)"] = micro(lambda: runtime.graph_launch(instance, handle))
            torch.cuda.synchronize()
            runtime.graph_destroy(graph, instance)
        kernels = RowKernels.load(torch.cuda.get_device_capability(device), int(torch.version.cuda.split(".")[0]),
                                  16384)
        if kernels is not None:
            numbers = torch.cat([torch.tensor([512], device=device), index[:512]])  # a job's count, then its rows
            found["RowKernels.gather 512 x 16 KiB"] = micro(lambda: kernels.launch(
                "gather", handle, rows.data_ptr(), out.data_ptr(), numbers.data_ptr(), 0, 512, 16384))
    return found


COLD_BYTES = 64 * 2**20
_evicted = np.ones(COLD_BYTES, dtype=np.uint8)


def evict_caches() -> None:
    """Write one byte of every 64-byte line of :data:`COLD_BYTES`: the host's caches and TLB cold
    (``benchmarks/bench_issue_host.py``'s ``cold_median_us`` does the same on a CPU alone)."""
    _evicted[::64] += 1


def cold_and_warm(work, n: int = 60) -> dict:
    """Median microseconds of ``work()`` right after :func:`evict_caches` and back to back, the
    compute stream held busy meanwhile (nothing waits for the device)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(400 * kit.CYCLES_PER_MS))
    cold, warm = [], []
    for _ in range(n):
        evict_caches()
        began = time.perf_counter()
        work()
        cold.append(time.perf_counter() - began)
        began = time.perf_counter()
        work()
        warm.append(time.perf_counter() - began)
    torch.cuda.synchronize()
    return {"cold_us": round(statistics.median(cold) * 1e6, 1), "warm_us": round(statistics.median(warm) * 1e6, 1)}


def cold_calls(streams: TorchCudaStreams, job_ids) -> dict:
    """What caches cost the issue: the runtime calls a 16 KiB-page graph job makes (3 event
    records, a wait, 5 copy-node updates, a launch), a trivial runtime call, and a whole
    ``start_store`` of that job, each cold (caches evicted just before) and warm. The runtime's
    part is what a compiled host path would still pay; the rest is kvtier's Python."""
    runtime = streams.runtime
    out: dict = {}
    if runtime is None or not runtime.graphs:
        return out
    side = streams.new_stream()
    handle = side.cuda_stream
    compute = torch.cuda.current_stream().cuda_stream
    host = torch.empty(2**20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(2**20, dtype=torch.uint8, device=streams.device)
    events = [runtime.event_create(timing=True) for _ in range(3)]
    graph = runtime.graph_create()
    nodes = [runtime.graph_add_memcpy(graph, [], host.data_ptr() + 4096 * i, dev.data_ptr(), 4096) for i in range(5)]
    instance = runtime.graph_instantiate(graph)

    def job_calls() -> None:
        runtime.event_record(events[0], compute)
        runtime.stream_wait_event(handle, events[0])
        runtime.event_record(events[1], handle)
        for i, node in enumerate(nodes):
            runtime.graph_set_memcpy(instance, node, host.data_ptr() + 4096 * (i + 5), dev.data_ptr(), 4096)
        runtime.graph_launch(instance, handle)
        runtime.event_record(events[2], handle)

    out["runtime calls of a 16 KiB graph job (10)"] = cold_and_warm(job_calls)
    out["runtime.get_last_error"] = cold_and_warm(runtime.get_last_error)
    torch.cuda.synchronize()
    runtime.graph_destroy(graph, instance)
    for event in events:
        runtime.event_destroy(event)
    pages = kit_pages(BLOCKS)
    cold, warm = [], []
    with kit_engine(streams) as (engine, _):
        for _ in range(3):
            kit.run_job(engine, Direction.STORE, pages, next(job_ids))
        for _ in range(15):  # a job each, waited for between (not timed): the start call after an eviction, then again
            for sink in (cold, warm):
                torch.cuda.synchronize()
                kit.gate()
                if sink is cold:
                    evict_caches()
                began = time.perf_counter()
                engine.start_store(next(job_ids), pages)
                sink.append(time.perf_counter() - began)
                engine.wait()
                engine.poll()
    out["start_store, LBNHC 16 KiB staged"] = {"cold_us": round(statistics.median(cold) * 1e6, 1),
                                               "after_a_device_wait_us": round(statistics.median(warm) * 1e6, 1)}
    return out


@contextlib.contextmanager
def kit_engine(streams: TorchCudaStreams, layout: str = "LBNHC", heads: int = 2,
               method: CopyMethod = CopyMethod.STAGED):
    """(a copy engine, its paged KV) at the kit's shape (``BLOCKS`` + 8 engine blocks x ``LAYERS``
    layers of ``heads`` x 8 KiB pages, ``BLOCKS`` slots of a pinned host region) on ``streams``;
    the engine closed, the region unpinned and the KV freed after."""
    case = Case(layout, layers=LAYERS, heads=heads, tokens=kit.TOKENS, content=kit.CONTENT, dtype=torch.bfloat16)
    kv = build(case, BLOCKS + 8, streams.device)
    paged = PagedKV(kv.views, BLOCKS + 8)
    slots = HostSlotLayout(LAYERS, 1, paged.page_bytes, 1, BLOCKS)
    buffer, pinning, _ = kit.host_region(slots.region_bytes, slots.slot_bytes)
    engine = CudaCopyEngine(BlockCopier(paged, HostSlots(buffer, slots)), streams, method)
    try:
        yield engine, paged
    finally:
        engine.close()
        pinning.release()
        del kv
        torch.cuda.empty_cache()


def kit_tuples(count: int) -> list[PageCopy]:
    """The kit's job of ``count`` blocks: consecutive slots from 0, scattered engine blocks."""
    return [PageCopy(slot, 0, 1 + (slot * 7919) % BLOCKS) for slot in range(count)]


def kit_pages(count: int):
    """:func:`kit_tuples` as kvtier's scheduler sends them to the workers: one host run, so a
    :class:`~kvtier.copy.base.SlotRun` (:func:`~kvtier.copy.base.slot_run_of` of its page table)."""
    table = page_table(kit_tuples(count))
    return slot_run_of(table) or table


def start(engine: CudaCopyEngine, direction: Direction, job_id: int, pages) -> None:
    """Start a store, or an asynchronous load, as the kit does."""
    if direction is Direction.STORE:
        engine.start_store(job_id, pages)
    else:
        engine.start_load(job_id, pages, synchronous=False)


class PhaseClock:
    """Host time spent inside chosen methods of chosen objects, summed per job: each wrapped
    method is replaced on its instance by a timing wrapper (outermost calls only are counted
    where a phase calls another), restored by :meth:`restore`."""

    def __init__(self):
        self.spent: dict[str, float] = {}
        self._patched: list[tuple[object, str]] = []

    def wrap(self, owner: object, method: str, phase: str) -> None:
        original = getattr(owner, method)

        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.spent[phase] = self.spent.get(phase, 0.0) + time.perf_counter() - began

        setattr(owner, method, timed)
        self._patched.append((owner, method))

    def take(self) -> dict[str, float]:
        spent, self.spent = self.spent, {}
        return spent

    def restore(self) -> None:
        for owner, method in self._patched:
            delattr(owner, method)
        self._patched = []


def phases(engine: CudaCopyEngine, streams: TorchCudaStreams, direction: Direction, pages, job_ids) -> dict:
    """Median microseconds per job of each phase of a start call (no profiler running): planning
    (absent for repeats), the device's copy call (or repeat) and, inside it for a staged job, the index upload, the kernels, the host
    copies and the marks and waits between lanes; ``total`` is the whole start call."""
    clock = PhaseClock()
    clock.wrap(engine, "_plan", "plan")
    clock.wrap(engine.runs, "table", "plan.table")
    clock.wrap(streams, "copy", "copy")
    clock.wrap(streams, "repeat", "copy")  # a job of a size kept as a repeat (CudaLanes.repeat): not planned
    if streams.runtime is not None:  # every runtime call the job makes: the rest of ``total`` is kvtier's Python
        for method in ("event_record", "stream_wait_event", "event_query", "memcpy", "memcpy_batch",
                       "graph_set_memcpy", "graph_launch"):
            clock.wrap(streams.runtime, method, f"runtime.{method}")
    for method in ("current_stream", "new_event", "record", "wait", "release"):
        clock.wrap(streams, method, "engine.events")
    for lanes in streams._lanes.values():
        for method, phase in (("_upload", "copy.upload"), ("_graph", "copy.graph_find"),
                              ("gather", "copy.kernels"), ("scatter", "copy.kernels"),
                              ("transfer", "copy.transfers"), ("mark", "copy.marks"), ("wait", "copy.waits")):
            clock.wrap(lanes, method, phase)
    samples: dict[str, list[float]] = {}
    for _ in range(20):
        torch.cuda.synchronize()
        kit.gate()
        clock.take()
        began = time.perf_counter()
        start(engine, direction, next(job_ids), pages)
        total = time.perf_counter() - began
        for phase, spent in {**clock.take(), "total": total}.items():
            samples.setdefault(phase, []).append(spent)
        engine.wait()
        engine.poll()
    clock.restore()
    return {phase: round(statistics.median(values) * 1e6, 1) for phase, values in sorted(samples.items())}


def profile_jobs(streams, layout: str, heads: int, method: CopyMethod, direction: Direction, job_ids) -> dict:
    with kit_engine(streams, layout, heads, method) as (engine, paged):
        return _profile_jobs(engine, paged, streams, direction, job_ids)


def _profile_jobs(engine: CudaCopyEngine, paged: PagedKV, streams, direction: Direction, job_ids) -> dict:
    tuples = kit_tuples(BLOCKS)
    table = page_table(tuples)
    pages = kit_pages(BLOCKS)  # what kvtier's scheduler sends the workers: a SlotRun
    for _ in range(3):
        kit.run_job(engine, direction, pages, next(job_ids))
    phase_us = phases(engine, streams, direction, pages, job_ids)

    def timed_starts(jobs, count: int = 15, profiler: cProfile.Profile | None = None) -> list[float]:
        """Seconds of each start call of ``jobs``' job, each issued behind a gate of compute as
        the kit issues them (the device idle before it, the host waited for it)."""
        seconds = []
        for _ in range(count):
            torch.cuda.synchronize()
            kit.gate()
            if profiler is not None:
                profiler.enable()
            began = time.perf_counter()
            start(engine, direction, next(job_ids), jobs)
            seconds.append(time.perf_counter() - began)
            if profiler is not None:
                profiler.disable()
            engine.wait()
            engine.poll()
        return seconds

    issue = timed_starts(pages)
    as_tuples = timed_starts(tuples, 10)
    as_table = timed_starts(table, 10)
    profiler = cProfile.Profile()
    timed_starts(pages, 15, profiler)
    hot = []  # back to back, the device kept busy: no wait between the calls (a warm host)
    torch.cuda.synchronize()
    kit.gate()
    for _ in range(10):
        began = time.perf_counter()
        start(engine, direction, next(job_ids), pages)
        hot.append(time.perf_counter() - began)
    engine.wait()
    engine.poll()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(22)
    graph_launches = sum(lanes.graph_launches for lanes in streams._lanes.values())  # noqa: SLF001
    return {"page_bytes": paged.page_bytes, "graph_launches": graph_launches, "phases_us": phase_us,
            "issue_ms_median": round(statistics.median(issue) * 1e3, 3),
            "issue_ms_min": round(min(issue) * 1e3, 3),
            "issue_ms_median_tuples": round(statistics.median(as_tuples) * 1e3, 3),
            "issue_ms_median_table": round(statistics.median(as_table) * 1e3, 3),
            "issue_ms_median_back_to_back": round(statistics.median(hot) * 1e3, 3), "profile": text.getvalue().splitlines()[:60]}


def mixed_jobs(streams, direction: Direction, job_ids, count: int = 40) -> dict:
    """Staged jobs of 1 to 512 blocks (seeded, uniform; 16 KiB LBNHC pages), each issued behind a
    gate of compute as the kit issues them, as serving hands them (a load as long as its prompt's
    hit): the share that went as graph launches and the start call's median and 90th percentile."""
    sizes = random.Random(0).choices(range(1, BLOCKS + 1), k=count)
    before = sum(lanes.graph_launches for lanes in streams._lanes.values())  # noqa: SLF001
    seconds = []
    with kit_engine(streams) as (engine, _):
        for size in sizes:
            pages = kit_pages(size)
            torch.cuda.synchronize()
            kit.gate()
            began = time.perf_counter()
            start(engine, direction, next(job_ids), pages)
            seconds.append(time.perf_counter() - began)
            engine.wait()
            assert all(done.ok for done in engine.poll())
        launches = sum(lanes.graph_launches for lanes in streams._lanes.values()) - before  # noqa: SLF001
    seconds.sort()
    return {"jobs": count, "graph_share": round(launches / count, 3),
            "issue_ms_median": round(statistics.median(seconds) * 1e3, 3),
            "issue_ms_p90": round(seconds[int(0.9 * (count - 1))] * 1e3, 3)}


def main() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    kit.CYCLES_PER_MS = kit.cycles_per_ms()
    streams = TorchCudaStreams(device)
    out: dict = {"card": torch.cuda.get_device_name(), "calls_us": device_calls(streams), "jobs": {}}
    try:  # reported: the rest of the profile stands if this part fails
        out["cold_calls"] = cold_calls(streams, itertools.count(10**6))
    except Exception as exc:  # noqa: BLE001
        out["cold_calls"] = {"error": f"{type(exc).__name__}: {exc}"}
    kernels = RowKernels.load(torch.cuda.get_device_capability(device), int(torch.version.cuda.split(".")[0]), 16384)
    out["row_kernels"] = kernels.how if kernels is not None else "unavailable: torch's ops"
    job_ids = itertools.count()
    for layout, heads, method in (("LBNHC", 1, CopyMethod.STAGED), ("LBNHC", 2, CopyMethod.STAGED),
                                  ("LBNHC", 8, CopyMethod.STAGED), ("BLNHC", 2, CopyMethod.RUNS)):
        for direction in Direction:
            name = f"{layout} {heads * 8} KiB {method.value} {direction.value}"
            out["jobs"][name] = profile_jobs(streams, layout, heads, method, direction, job_ids)
            print(name, out["jobs"][name]["issue_ms_median"], file=sys.stderr, flush=True)
    streams.close()
    # the same 16 KiB staged jobs issued op by op, and with torch's gather/scatter ops, in this
    # run: a lent GPU's host differs by 2x in call costs from one loan to the next, so only a
    # comparison within one run is fair
    for section, options in (("jobs_without_graphs", {"job_graphs": False}), ("jobs_torch_ops", {"own_kernels": False})):
        variant = TorchCudaStreams(device, **options)
        out[section] = {}
        for direction in Direction:
            name = f"LBNHC 16 KiB staged {direction.value}"
            out[section][name] = profile_jobs(variant, "LBNHC", 2, CopyMethod.STAGED, direction, job_ids)
        variant.close()
    out["mixed_sizes"] = {}
    for label, options in (("graphs", {}), ("op_by_op", {"job_graphs": False})):
        for direction in Direction:
            variant = TorchCudaStreams(device, **options)
            out["mixed_sizes"][f"{label} {direction.value}"] = mixed_jobs(variant, direction, job_ids)
            variant.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
