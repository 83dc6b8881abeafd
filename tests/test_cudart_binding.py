"""kvtier's ctypes binding of the CUDA runtime (kvtier.copy.cudart), driven against a stand-in
``libcudart`` compiled here with the system C compiler: it declares the calls as CUDA 12.8-13.1's
``cuda_runtime_api.h`` does, records the arguments it receives, and really copies the bytes (host
to host). What a mistake in the binding would do on a GPU, it does here:

- ``cudaMemcpyBatchAsync``: 9 arguments before CUDA 13 (``failIdx`` before the stream), 8 from
  13.0; the stand-in reads the stream where its own version puts it, so a wrong count hands it
  the wrong stream; ``attrsIdxs = [0]``, ``numAttrs = 1``; ``struct cudaMemcpyAttributes`` is 24
  bytes on both sides; sources in stream order for stores, any order for loads;
- a refused batch is counted and visible (``batch_refusals``), the job still copied run by run;
  batching off for good only on "not supported";
- ``LoadedCudart.find`` takes the runtime of torch's CUDA major, never merely the first
  ``libcudart*`` mapped into the process.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from kvtier.copy.cudart import BatchState, LoadedCudart, SourceOrder, _MemcpyAttributes

STANDIN = r"""
#include <stddef.h>
#include <string.h>

struct cudaMemLocation { int type; int id; };
struct cudaMemcpyAttributes {  /* driver_types.h, CUDA 12.8+ */
    int srcAccessOrder; struct cudaMemLocation srcLocHint; struct cudaMemLocation dstLocHint; unsigned int flags;
};
_Static_assert(sizeof(struct cudaMemcpyAttributes) == 24, "cudaMemcpyAttributes is 24 bytes");

static int version = VERSION, batch_result = 0, pending = 0;
static size_t rec[22];
static char streams[8], events[8];

void standin_configure(int batch_returns) { batch_result = batch_returns; memset(rec, 0, sizeof rec); }
void standin_record(size_t *out) { memcpy(out, rec, sizeof rec); }
size_t standin_attributes_size(void) { return sizeof(struct cudaMemcpyAttributes); }

int cudaRuntimeGetVersion(int *v) { *v = version; return 0; }
int cudaGetLastError(void) { int e = pending; pending = 0; return e; }
const char *cudaGetErrorName(int code) {
    return code == 0 ? "cudaSuccess" : code == 801 ? "cudaErrorNotSupported" : code == 1 ? "cudaErrorInvalidValue"
                                                                                           : "cudaErrorUnknown";
}
int cudaHostRegister(void *p, size_t size, unsigned int flags) { return 0; }
int cudaHostUnregister(void *p) { return 0; }
int cudaStreamCreateWithFlags(void **stream, unsigned int flags) {
    rec[14] = flags; *stream = &streams[++rec[13] % 8]; return 0;
}
int cudaStreamDestroy(void *stream) { rec[15]++; return 0; }
int cudaEventCreateWithFlags(void **event, unsigned int flags) {
    rec[19] = flags; *event = &events[++rec[16] % 8]; return 0;
}
int cudaEventRecord(void *event, void *stream) { rec[17]++; return stream == (void *)0xBAD ? 400 : 0; }
int cudaStreamWaitEvent(void *stream, void *event, unsigned int flags) { rec[18]++; return flags ? 1 : 0; }
int cudaEventDestroy(void *event) { return 0; }
int cudaEventQuery(void *event) { return event == (void *)0xBAD ? 400 : event == (void *)0x600 ? 600 : 0; }
int cudaEventSynchronize(void *event) { rec[20]++; return event == (void *)0xBAD ? 400 : 0; }
int cudaEventElapsedTime(float *ms, void *start, void *end) {
    rec[21]++; if (end == (void *)0x600) return 600; *ms = 2.5f; return 0;
}
int cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, void *stream) {
    rec[1]++; rec[11] = (size_t)stream; rec[12] = kind; memcpy(dst, src, n); return 0;
}
int cudaMemcpyBatchAsync(void *const *dsts, const void *const *srcs, const size_t *sizes, size_t count,
                         struct cudaMemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs,
                         void *eighth, void *ninth) {
    /* CUDA 13: (..., numAttrs, stream); 12.8/12.9: (..., numAttrs, failIdx, stream) */
    void *stream = version >= 13000 ? eighth : ninth;
    rec[0]++; rec[2] = count; rec[3] = numAttrs; rec[4] = attrsIdxs[0]; rec[5] = (size_t)stream;
    rec[6] = version >= 13000 ? 0 : (size_t)eighth;
    rec[7] = attrs[0].srcAccessOrder; rec[8] = attrs[0].flags; rec[9] = attrs[0].srcLocHint.type;
    rec[10] = attrs[0].dstLocHint.type;
    if (batch_result) { pending = batch_result; return batch_result; }
    for (size_t i = 0; i < count; i++) memcpy(dsts[i], srcs[i], sizes[i]);
    return 0;
}
"""
FIELDS = ["batch_calls", "async_calls", "count", "num_attrs", "attrs_idx0", "stream", "fail_idx", "order", "flags",
          "src_hint", "dst_hint", "async_stream", "async_kind", "streams_made", "stream_flags", "streams_destroyed",
          "events_made", "event_records", "event_waits", "event_flags", "event_syncs", "elapsed_calls"]


def compile_standin(directory, version: int, soname: str | None = None, name: str | None = None) -> str:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in libcudart (apt-get install gcc)")
    source = directory / f"standin{version}.c"
    source.write_text(STANDIN.replace("VERSION", str(version)))
    library = directory / (name or f"libcudart.so.{version // 1000}")
    flags = [f"-Wl,-soname,{soname}"] if soname else []
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", *flags, "-o", str(library), str(source)], check=True)
    return str(library)


def record(lib) -> dict[str, int]:
    out = (ctypes.c_size_t * 22)()
    lib.standin_record(out)
    return dict(zip(FIELDS, out))


@pytest.fixture(params=[12080, 12090, 13000, 13010])
def runtime(request, tmp_path):
    lib = ctypes.CDLL(compile_standin(tmp_path, request.param, name=f"libstandin{request.param}.so"))
    lib.standin_configure(0)
    return LoadedCudart(lib), lib


def buffers(count=5, size=24):
    src = np.random.default_rng(0).integers(0, 256, count * size, dtype=np.uint8)
    dst = np.zeros_like(src)
    offsets = np.arange(count, dtype=np.int64) * size
    return src, dst, dst.ctypes.data + offsets, src.ctypes.data + offsets, np.full(count, size, dtype=np.int64)


def test_the_attribute_struct_is_24_bytes_on_both_sides(runtime):
    _, lib = runtime
    lib.standin_attributes_size.restype = ctypes.c_size_t
    assert ctypes.sizeof(_MemcpyAttributes) == lib.standin_attributes_size() == 24


@pytest.mark.parametrize("order", list(SourceOrder))
def test_one_batched_call_with_the_arguments_of_this_runtime_version(runtime, order):
    cudart, lib = runtime
    src, dst, dsts, srcs, sizes = buffers()
    cudart.memcpy_batch(dsts, srcs, sizes, 0xABC0, order)
    seen = record(lib)
    assert seen["batch_calls"] == 1 and seen["async_calls"] == 0 and cudart.batched
    assert seen["stream"] == 0xABC0, "the stream is not where this CUDA version reads it (argument count)"
    assert (seen["fail_idx"] != 0) == (cudart.version < 13000)  # a failIdx pointer before 13.0 only
    assert (seen["count"], seen["num_attrs"], seen["attrs_idx0"]) == (5, 1, 0)
    assert (seen["order"], seen["flags"], seen["src_hint"], seen["dst_hint"]) == (int(order), 1, 0, 0)
    assert np.array_equal(dst, src)


def test_a_refused_batch_is_counted_and_the_job_still_copied(runtime, caplog):
    cudart, lib = runtime
    lib.standin_configure(1)  # cudaErrorInvalidValue for these pointers
    for _ in range(2):
        src, dst, dsts, srcs, sizes = buffers()
        cudart.memcpy_batch(dsts, srcs, sizes, 0xABC0, SourceOrder.ANY)
        assert np.array_equal(dst, src)
    seen = record(lib)
    assert seen["batch_calls"] == 2 and seen["async_calls"] == 10 and seen["async_stream"] == 0xABC0
    assert seen["async_kind"] == 4  # cudaMemcpyDefault
    assert cudart.batch_refusals == 2 and cudart.last_refusal == "cudaErrorInvalidValue"
    assert cudart.batch_state is BatchState.BATCHED  # tried again for the next job
    assert cudart.get_last_error() == 0  # drained
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1  # warned once per kind


def test_an_unsupported_batch_turns_batching_off_for_good_and_is_counted(runtime):
    cudart, lib = runtime
    lib.standin_configure(801)
    src, dst, dsts, srcs, sizes = buffers()
    cudart.memcpy_batch(dsts, srcs, sizes, 0xABC0, SourceOrder.STREAM)
    cudart.memcpy_batch(dsts, srcs, sizes, 0xABC0, SourceOrder.STREAM)
    assert record(lib)["batch_calls"] == 1 and np.array_equal(dst, src)
    assert cudart.batch_state is BatchState.UNSUPPORTED and not cudart.batched and cudart.batch_refusals == 1


def test_streams_are_created_non_blocking_and_destroyed(runtime):
    cudart, lib = runtime
    first, second = cudart.stream_create(), cudart.stream_create()
    assert first and second and first != second
    cudart.stream_destroy(first)
    seen = record(lib)
    assert (seen["streams_made"], seen["stream_flags"], seen["streams_destroyed"]) == (2, 1, 1)


def test_a_single_run_is_one_plain_async_copy(runtime):
    cudart, lib = runtime
    src, dst, dsts, srcs, sizes = buffers(count=1)
    cudart.memcpy_batch(dsts, srcs, sizes, 0xABC0, SourceOrder.STREAM)
    seen = record(lib)
    assert (seen["batch_calls"], seen["async_calls"], seen["async_stream"]) == (0, 1, 0xABC0)
    assert np.array_equal(dst, src)


def test_events_are_made_for_ordering_only_and_errors_are_raised_drained(runtime):
    from kvtier.copy.cudart import CudaError

    cudart, lib = runtime
    event = cudart.event_create()
    cudart.event_record(event, 0xABC0)
    cudart.stream_wait_event(0xABC0, event)
    seen = record(lib)
    assert event and (seen["events_made"], seen["event_records"], seen["event_waits"]) == (1, 1, 1)
    assert seen["event_flags"] == 2  # cudaEventDisableTiming
    with pytest.raises(CudaError, match="cudaEventRecord"):
        cudart.event_record(event, 0xBAD)
    assert cudart.get_last_error() == 0


def test_an_event_query_says_done_or_not_ready_and_raises_other_errors(runtime):
    from kvtier.copy.cudart import CudaError

    cudart, _ = runtime
    assert cudart.event_query(cudart.event_create()) is True
    assert cudart.event_query(0x600) is False  # the stand-in's cudaErrorNotReady
    with pytest.raises(CudaError, match="cudaEventQuery"):
        cudart.event_query(0xBAD)
    assert cudart.get_last_error() == 0


def test_timing_events_synchronize_and_elapsed_time(runtime):
    """The copy engine's own events: made able to time, waited for, timed; an error is raised
    (drained), a pair not yet done raises cudaErrorNotReady rather than a wrong time."""
    from kvtier.copy.cudart import CudaError

    cudart, lib = runtime
    start, end = cudart.event_create(timing=True), cudart.event_create(timing=True)
    assert record(lib)["event_flags"] == 0  # cudaEventDefault: can time
    cudart.event_synchronize(end)
    assert cudart.event_elapsed_ms(start, end) == 2.5
    seen = record(lib)
    assert (seen["event_syncs"], seen["elapsed_calls"]) == (1, 1)
    with pytest.raises(CudaError, match="cudaEventSynchronize"):
        cudart.event_synchronize(0xBAD)
    with pytest.raises(CudaError, match="cudaEventElapsedTime.*cudaErrorUnknown"):
        cudart.event_elapsed_ms(start, 0x600)
    assert cudart.get_last_error() == 0


def test_before_12_8_there_is_no_batched_call(tmp_path):
    cudart = LoadedCudart(ctypes.CDLL(compile_standin(tmp_path, 12060, name="libstandin12060.so")))
    assert cudart.batch_state is BatchState.NOT_IN_RUNTIME and not cudart.batched


def test_find_takes_the_runtime_of_torchs_cuda_major_not_the_first_mapped(tmp_path):
    """Another package's runtime mapped first (a different major, no matching soname): skipped."""
    ctypes.CDLL(compile_standin(tmp_path, 97000, name="libcudart-decoy.so.97"))
    ctypes.CDLL(compile_standin(tmp_path, 99010, name="libcudart-torch.so.99"))
    found = LoadedCudart.find("99.1")
    assert found is not None and found.version == 99010
    assert LoadedCudart.find("96.0") is None


def test_find_prefers_the_soname_the_dynamic_linker_resolved(tmp_path):
    ctypes.CDLL(compile_standin(tmp_path, 98000, name="libcudart-first.so"))  # mapped first, same major
    ctypes.CDLL(compile_standin(tmp_path, 98020, soname="libcudart.so.98", name="libcudart.so.98.2"))
    found = LoadedCudart.find("98.2")
    assert found is not None and found.version == 98020
