"""The CUDA calls kvtier makes, against a stand-in for ``torch.cuda`` and the CUDA runtime that records
them (this project has no GPU; the GPU kit, scripts/gpu-check.sh, makes the same calls for real):

- ``TorchCudaStreams`` and the CUDA engine: which stream each call goes to, which events are
  recorded and waited on, the batched copy's arrays and source ordering, ``non_blocking``;
- host pinning: chunk sizes (<= 64 GiB, whole slots and pages), a refused registration drained at
  once and rolled back, every unregistration's result checked;
- sleep mode (vLLM 0.33): copies finished and pinning undone before sleep, pinning redone after.
"""

from __future__ import annotations

import contextlib
import logging
import mmap

import numpy as np
import pytest
import torch
from test_transfer import NUM_BLOCKS, cpu_layers

from kvtier.copy import BlockCopier, Direction, HostSlots, PageCopy, PagedKV
from kvtier.copy.cuda import CudaCopyEngine
from kvtier.copy.cudart import SourceOrder
from kvtier.copy.pinning import MAX_REGISTER_CHUNK_BYTES, pin_host_memory, register_chunk_bytes
from kvtier.copy.streams import TorchCudaStreams
from kvtier.core.slots import HostSlotLayout


class Recorder:
    def __init__(self):
        self.calls: list[tuple] = []
        self.current: list[str] = []  # stream names entered with cuda.stream(...)


class FakeStream:
    def __init__(self, recorder: Recorder, name: str, handle: int):
        self.recorder, self.name, self.cuda_stream = recorder, name, handle

    def wait_event(self, event):
        self.recorder.calls.append(("wait", self.name, event.name))

    def __eq__(self, other):
        return isinstance(other, FakeStream) and other.cuda_stream == self.cuda_stream

    def __hash__(self):
        return self.cuda_stream


class FakeEvent:
    count = 0

    def __init__(self, recorder: Recorder, enable_timing: bool):
        FakeEvent.count += 1
        self.recorder, self.name, self.timing, self.on = recorder, f"e{FakeEvent.count}", enable_timing, None

    def record(self, stream):
        self.on = stream.name
        self.recorder.calls.append(("record", self.name, stream.name))

    def query(self):
        return True

    def synchronize(self):
        self.recorder.calls.append(("synchronize", self.name))

    def elapsed_time(self, end):
        return 2.5  # milliseconds, as torch reports


class FakeCuda:
    """The parts of ``torch.cuda`` TorchCudaStreams uses; pool streams handed out round robin."""

    def __init__(self, recorder: Recorder, pool: int = 4):
        self.recorder = recorder
        self.pool = [FakeStream(recorder, f"pool{i}", 0x1000 + i) for i in range(pool)]
        self.compute = self.pool[0]
        self.handed = 0

    def current_stream(self, device):
        return self.compute

    def Stream(self, device):  # noqa: N802 - torch.cuda.Stream
        stream = self.pool[self.handed % len(self.pool)]
        self.handed += 1
        return stream

    def ExternalStream(self, handle, device):  # noqa: N802 - torch.cuda.ExternalStream
        return FakeStream(self.recorder, f"own{handle:x}", handle)

    def Event(self, enable_timing=False):  # noqa: N802 - torch.cuda.Event
        return FakeEvent(self.recorder, enable_timing)

    @contextlib.contextmanager
    def stream(self, stream):
        self.recorder.current.append(stream.name)
        yield
        self.recorder.current.pop()

    @contextlib.contextmanager
    def device(self, device):
        self.recorder.calls.append(("device", str(device)))
        yield


class FakeRuntime:
    """The CUDA runtime calls (kvtier.copy.cudart.CudaRuntime), recorded; ``refuse``: the indices
    of host_register calls that fail, ``unregister_fails``: of host_unregister calls."""

    def __init__(self, recorder: Recorder, refuse=(), unregister_fails=()):
        self.recorder, self.refuse, self.unregister_fails = recorder, set(refuse), set(unregister_fails)
        self.registered: list[tuple[int, int]] = []
        self.pending = 0  # the pending error (cudaGetLastError's)

    def host_register(self, ptr, size):
        index = len([c for c in self.recorder.calls if c[0] == "register"])
        self.recorder.calls.append(("register", ptr, size))
        if index in self.refuse:
            self.pending = 712
            return 712
        self.registered.append((ptr, size))
        return 0

    def host_unregister(self, ptr):
        index = len([c for c in self.recorder.calls if c[0] == "unregister"])
        self.recorder.calls.append(("unregister", ptr))
        if index in self.unregister_fails:
            self.pending = 1
            return 1
        return 0

    def get_last_error(self):
        self.recorder.calls.append(("get_last_error",))
        error, self.pending = self.pending, 0
        return error

    def error_name(self, code):
        return f"cudaError{code}"

    def memcpy_batch(self, dsts, srcs, sizes, stream, order):
        self.recorder.calls.append(("memcpy_batch", np.array(dsts), np.array(srcs), np.array(sizes), stream, order))

    def stream_create(self):
        self.created = getattr(self, "created", 0) + 1
        self.recorder.calls.append(("stream_create", 0x2000 + self.created))
        return 0x2000 + self.created

    def stream_destroy(self, handle):
        self.recorder.calls.append(("stream_destroy", handle))

    def event_create(self, timing=False):
        self.events = getattr(self, "events", 0) + 1
        self.recorder.calls.append(("event_create", 0x3000 + self.events, timing))
        return 0x3000 + self.events

    def event_record(self, event, stream):
        self.recorder.calls.append(("event_record", event, stream))

    def stream_wait_event(self, stream, event):
        self.recorder.calls.append(("stream_wait_event", stream, event))

    def event_query(self, event):
        return True

    def event_synchronize(self, event):
        self.recorder.calls.append(("event_synchronize", event))

    def event_elapsed_ms(self, start, end):
        return 2.5

    def event_destroy(self, event):
        self.recorder.calls.append(("event_destroy", event))


def cuda_rig(runtime: bool = True, foreach=None):
    recorder = Recorder()
    cuda = FakeCuda(recorder)
    streams = TorchCudaStreams(torch.device("cuda", 0), cuda=cuda,
                               runtime=FakeRuntime(recorder) if runtime else None, find_runtime=False,
                               foreach_copy=foreach or (lambda *a, **k: recorder.calls.append(("foreach", k))))
    layers = cpu_layers()
    kv = PagedKV(layers, NUM_BLOCKS)
    layout = HostSlotLayout(len(layers), 1, kv.page_bytes, 1, 4)
    host = HostSlots(torch.zeros(layout.region_bytes, dtype=torch.uint8), layout)
    return CudaCopyEngine(BlockCopier(kv, host), streams), recorder, cuda


def names(engine):
    return {d: s.name for d, s in engine._streams.items()}  # noqa: SLF001


ORDERING = ("event_record", "stream_wait_event", "memcpy_batch")


def ordering(recorder):
    return [c for c in recorder.calls if c[0] in ORDERING]


def test_a_store_is_one_batched_copy_on_the_store_stream_after_the_compute_stream():
    engine, recorder, cuda = cuda_rig()
    compute, store = cuda.compute.cuda_stream, engine._streams[Direction.STORE].cuda_stream  # noqa: SLF001
    assert compute not in {s.cuda_stream for s in engine._streams.values()}  # noqa: SLF001 - never ours
    recorder.calls.clear()
    engine.start_store(1, [PageCopy(0, 0, 3), PageCopy(1, 0, 4)])
    record_ready, wait_ready, record_start, batch, record_end = ordering(recorder)
    assert record_ready[0] == "event_record" and record_ready[2] == compute  # ready: on the compute stream
    assert wait_ready == ("stream_wait_event", store, record_ready[1])  # the store stream waits for it
    assert record_start[0] == "event_record" and record_start[2] == store
    _, dsts, srcs, sizes, handle, order = batch
    assert handle == store
    assert ("device", "cuda:0") in recorder.calls[recorder.calls.index(batch) - 1:]
    assert order is SourceOrder.STREAM  # engine memory the compute stream wrote: read in stream order
    plan = engine.runs.plan(Direction.STORE, [PageCopy(0, 0, 3), PageCopy(1, 0, 4)])
    assert (dsts == plan.dst_addr).all() and (srcs == plan.src_addr).all() and (sizes == plan.sizes).all()
    assert record_end[0] == "event_record" and record_end[2] == store
    assert all(c[2] for c in recorder.calls if c[0] == "event_create")  # timing events: the job is timed
    [done] = engine.poll()
    assert done.ok and done.seconds == 0.0025


def test_a_jobs_events_are_the_runtimes_and_go_back_to_the_pool():
    """No torch event or stream object per job: ready is handed back once the side stream's wait
    is issued, start and end once the job is polled; ten jobs polled one by one make two events."""
    engine, recorder, cuda = cuda_rig()
    cuda.Event = None  # a torch event made per job would fail here
    for job in range(10):
        engine.start_store(job, [PageCopy(0, 0, 3)])
        assert [d.job_id for d in engine.poll()] == [job]
    made = [c[1] for c in recorder.calls if c[0] == "event_create"]
    assert len(made) == 2
    assert {c[1] for c in recorder.calls if c[0] == "event_record"} == set(made)
    engine.close()
    assert sorted(c[1] for c in recorder.calls if c[0] == "event_destroy") == sorted(made)


@pytest.mark.parametrize("synchronous", [True, False])
def test_a_load_is_one_batched_copy_and_holds_the_compute_stream_only_if_synchronous(synchronous):
    engine, recorder, cuda = cuda_rig()
    compute, load = cuda.compute.cuda_stream, engine._streams[Direction.LOAD].cuda_stream  # noqa: SLF001
    recorder.calls.clear()
    engine.start_load(1, [PageCopy(0, 0, 3)], synchronous=synchronous)
    [batch] = [c for c in recorder.calls if c[0] == "memcpy_batch"]
    assert batch[4] == load
    assert batch[5] is SourceOrder.ANY  # host memory nothing on the load stream writes: any order
    end = [c for c in recorder.calls if c[0] == "event_record" and c[2] == load][-1][1]
    compute_waits = [c for c in recorder.calls if c[0] == "stream_wait_event" and c[1] == compute]
    assert compute_waits == ([("stream_wait_event", compute, end)] if synchronous else [])


def test_without_a_runtime_library_copies_go_through_torch_non_blocking_on_the_side_stream():
    seen = []
    engine, recorder, cuda = cuda_rig(runtime=False, foreach=lambda d, s, **k: seen.append((len(d), k,
                                                                                            list(recorder.current))))
    engine.start_store(1, [PageCopy(0, 0, 3)])
    assert seen == [(3, {"non_blocking": True}, [names(engine)[Direction.STORE]])]
    assert [c[0] for c in recorder.calls if c[0] in ("record", "wait")] == ["record", "wait", "record", "record"]


def test_side_streams_are_kvtiers_own_and_destroyed_at_close():
    engine, recorder, cuda = cuda_rig()
    own = {s.cuda_stream for s in engine._streams.values()}  # noqa: SLF001
    created = {c[1] for c in recorder.calls if c[0] == "stream_create"}
    assert own == created and len(own) == 2 and cuda.handed == 0  # no pool stream taken
    assert engine.device.owns_side_streams and not cuda_rig(runtime=False)[0].device.owns_side_streams
    engine.start_store(1, [PageCopy(0, 0, 3)])
    engine.close()
    assert {c[1] for c in recorder.calls if c[0] == "stream_destroy"} == own
    kinds = [c[0] for c in recorder.calls]
    assert kinds.index("event_synchronize") < kinds.index("event_destroy") < kinds.index("stream_destroy")
    assert [d.job_id for d in engine.poll()] == [1]  # completed before close: still reported, no event touched


def test_without_a_runtime_library_side_streams_come_from_the_pool_never_the_compute_stream():
    engine, recorder, cuda = cuda_rig(runtime=False)
    assert cuda.compute.cuda_stream not in {s.cuda_stream for s in engine._streams.values()}  # noqa: SLF001
    assert len({s.cuda_stream for s in engine._streams.values()}) == 2  # noqa: SLF001


def test_a_pool_side_stream_that_became_the_compute_stream_is_replaced():
    """Without a runtime library the side streams are torch's pool streams, which vLLM may be
    handed too: one found to be the compute stream at a job is replaced before use."""
    seen = []
    engine, recorder, cuda = cuda_rig(runtime=False, foreach=lambda d, s, **k: seen.append(list(recorder.current)))
    taken = names(engine)[Direction.LOAD]
    cuda.compute = engine._streams[Direction.LOAD]  # noqa: SLF001 - the pool handed vLLM that stream
    engine.start_load(1, [PageCopy(0, 0, 3)])
    [[used]] = seen
    assert used not in (taken, names(engine)[Direction.STORE]) and used == names(engine)[Direction.LOAD]


# ---- pinning ---------------------------------------------------------------------------------


SLOT = 3 * 4096


def region(slots=10):
    return torch.zeros(slots * SLOT, dtype=torch.uint8)


def test_registration_chunks_are_whole_slots_and_pages_and_at_most_64_gib():
    for slot in (SLOT, 5000, 2**20 * 3, 70 * 2**30):
        chunk = register_chunk_bytes(slot)
        assert chunk % slot == 0 and chunk % mmap.PAGESIZE == 0
        assert chunk <= MAX_REGISTER_CHUNK_BYTES or chunk == np.lcm(slot, mmap.PAGESIZE)


def test_a_region_is_registered_in_chunks_and_released_in_reverse():
    recorder = Recorder()
    runtime = FakeRuntime(recorder)
    buffer = region()
    pinning = pin_host_memory(buffer, SLOT, runtime, chunk_limit=int(2.5 * SLOT))
    registers = [c for c in recorder.calls if c[0] == "register"]
    assert [size for _, _, size in registers] == [2 * SLOT] * 5
    assert [ptr - buffer.data_ptr() for _, ptr, _ in registers] == [0, 2 * SLOT, 4 * SLOT, 6 * SLOT, 8 * SLOT]
    assert pinning.pinned
    pinning.release()
    assert [c[1] for c in recorder.calls if c[0] == "unregister"] == [ptr for _, ptr, _ in reversed(registers)]
    pinning.release()  # idempotent
    assert len([c for c in recorder.calls if c[0] == "unregister"]) == 5


def test_a_refused_registration_is_drained_at_once_and_rolled_back(caplog):
    recorder = Recorder()
    runtime = FakeRuntime(recorder, refuse={2})
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        pinning = pin_host_memory(region(), SLOT, runtime, chunk_limit=2 * SLOT)
    kinds = [c[0] for c in recorder.calls]
    assert kinds == ["register", "register", "register", "get_last_error", "unregister", "unregister"]
    assert runtime.pending == 0  # nothing left for torch's next kernel launch to raise
    assert not pinning.pinned and "cudaError712" in caplog.text and "pageable" in caplog.text


def test_a_failed_unregistration_is_drained_and_logged_not_raised(caplog):
    recorder = Recorder()
    runtime = FakeRuntime(recorder, unregister_fails={0})
    pinning = pin_host_memory(region(), SLOT, runtime, chunk_limit=5 * SLOT)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        pinning.release()
    assert [c[0] for c in recorder.calls][-3:] == ["unregister", "get_last_error", "unregister"]
    assert runtime.pending == 0 and "cudaHostUnregister" in caplog.text


def test_nothing_is_registered_without_cuda():
    recorder = Recorder()
    pinning = pin_host_memory(region(), SLOT, cuda_available=lambda: False)
    assert not pinning.pinned and recorder.calls == []


# ---- sleep mode (vLLM 0.33) -------------------------------------------------------------------


def test_sleep_mode_finishes_copies_unpins_and_pins_again(tmp_path, monkeypatch):
    from support.engine_sim import SimEngine, prompts_of, write_model

    import kvtier.vllm.worker_side as worker_side
    from kvtier.vllm.connector import KVTierConnector

    recorder = Recorder()
    runtime = FakeRuntime(recorder)
    real_pin = worker_side.pin_host_memory
    monkeypatch.setattr(worker_side, "pin_host_memory", lambda buffer, slot_bytes: real_pin(buffer, slot_bytes, runtime))
    assert KVTierConnector.supports_sleep_mode(None)
    with SimEngine(write_model(tmp_path / "model", seed=3), kvtier={"cpu_bytes_to_use": 2**20}) as sim:
        worker = sim.worker._worker  # noqa: SLF001
        assert worker._pinning.pinned  # noqa: SLF001 - pinned at register_kv_caches
        waited = []
        real_wait = worker.copies.wait
        worker.copies.wait = lambda job_ids=None: waited.append(job_ids) or real_wait(job_ids)
        sim.generate(prompts_of(1, 1, 40), 2)
        sim.worker.unregister_kv_caches()
        assert waited == [None]  # every copy in flight finished first
        assert [c[0] for c in recorder.calls] == ["register", "unregister"]
        sim.worker.unregister_kv_caches()  # idempotent
        sim.worker.restore_kv_caches()
        sim.worker.restore_kv_caches()
        assert [c[0] for c in recorder.calls] == ["register", "unregister", "register"]
        assert sim.generate(prompts_of(2, 1, 40), 2)  # the engine runs on after waking
