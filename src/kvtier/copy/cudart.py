"""The CUDA runtime calls torch does not expose, made through the libcudart torch itself loaded.

torch's binding (``torch.cuda.cudart()``) has ``cudaHostRegister`` but neither
``cudaGetLastError`` (a refused registration leaves its error pending, and torch raises it at the
next kernel launch: it must be drained, as vLLM does in ``v1/kv_offload/cpu/host_register.py:51-59``)
nor a batched copy. :class:`LoadedCudart` calls them with ctypes on the ``libcudart`` torch loaded
(:meth:`LoadedCudart.find`: the soname the dynamic linker resolved for torch, so it shares torch's
error state and streams; vLLM's ``CudaRTLibrary`` does the same), or on one found by name when
torch links the runtime statically (then a pending error of ours stays in our instance, where we
drain it).

The batched copy, ``cudaMemcpyBatchAsync`` (CUDA 12.8+, ``cuda_runtime_api.h``): 9 arguments in
12.8 and 12.9 (a ``failIdx`` pointer before the stream), 8 from 13.0; one
``struct cudaMemcpyAttributes`` (24 bytes) for every copy (``attrsIdxs = [0]``, ``numAttrs = 1``);
the stream last. A refused batch is never silent: :attr:`LoadedCudart.batch_refusals` counts
them (the GPU kit fails on any), and that job goes run by run.

:class:`CudaRuntime` is what the rest of :mod:`kvtier.copy` asks of it, so the tests drive the
callers with a recording stand-in, and this class against a stand-in C library
(``tests/test_cudart_binding.py``); the GPU kit (``scripts/gpu-check.sh``) runs it on a real
runtime. Every method is called from the thread that issues the engine's forward; none blocks
(copies are asynchronous on ``stream``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import logging
import os
from typing import Protocol

import numpy as np

logger = logging.getLogger(__name__)

SUCCESS = 0
NOT_READY = 600  # cudaErrorNotReady: an event or stream query while work is pending
MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction is inferred from the pointers (unified addressing)
FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1  # cudaMemcpyFlagPreferOverlapWithCompute
STREAM_NON_BLOCKING = 1  # cudaStreamNonBlocking: no implicit sync with the legacy default stream
EVENT_DEFAULT = 0  # cudaEventDefault: an event that can time the work between two records
EVENT_DISABLE_TIMING = 2  # cudaEventDisableTiming: the cheapest event, for ordering only
# cudaMemcpyBatchAsync codes that say the call itself is unavailable (not these pointers): batching
# is off for good after one. Any other refusal falls back for that job only, and is counted.
UNSUPPORTED = {31: "cudaErrorNotYetImplemented", 36: "cudaErrorCallRequiresNewerDriver",
               801: "cudaErrorNotSupported"}


class SourceOrder(enum.IntEnum):
    """``cudaMemcpySrcAccessOrder`` of a batched copy's sources (``driver_types.h``).

    STREAM for stores: the source is engine memory the compute stream may still be writing, read
    once the copy stream reaches the copy. ANY for loads (as vLLM's own offloading loads): the
    source is host memory no operation on the load stream writes and that outlives the copy (the
    scheduler reuses a slot only once its load is reported), so the driver may read it early."""

    STREAM = 1
    ANY = 3


class BatchState(enum.Enum):
    """How a :class:`LoadedCudart` issues a job's runs."""

    BATCHED = "one cudaMemcpyBatchAsync per job"
    NOT_IN_RUNTIME = "runtime before 12.8 or without cudaMemcpyBatchAsync: one cudaMemcpyAsync per run"
    UNSUPPORTED = "cudaMemcpyBatchAsync refused as unsupported: one cudaMemcpyAsync per run from then on"


class CudaError(RuntimeError):
    def __init__(self, call: str, code: int, name: str):
        super().__init__(f"{call} failed: {name} ({code})")
        self.code = code


def node_array(nodes: list[int]) -> ctypes.Array:
    """The dependencies argument of a ``cudaGraphAdd*Node`` call: ``nodes`` as a C array of graph
    node handles (one null element when empty: the call reads none)."""
    return (ctypes.c_void_p * max(len(nodes), 1))(*nodes)


class CudaRuntime(Protocol):
    """The runtime calls kvtier makes beside torch's. Return codes are ``cudaError_t`` (0: success)."""

    def host_register(self, ptr: int, size: int) -> int:
        """``cudaHostRegister(ptr, size, cudaHostRegisterDefault)``."""

    def host_unregister(self, ptr: int) -> int:
        """``cudaHostUnregister(ptr)``."""

    def get_last_error(self) -> int:
        """``cudaGetLastError()``: returns and clears this thread's pending error."""

    def error_name(self, code: int) -> str:
        """``cudaGetErrorName(code)``."""

    def memcpy_batch(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int,
                     order: SourceOrder) -> None:
        """Issue ``dsts[i] <- srcs[i]`` (``sizes[i]`` bytes; int64 arrays of addresses) on
        ``stream`` (a ``cudaStream_t``, never the legacy default stream), sources read in
        ``order``, in one batched call where the runtime has one (a single copy: one
        ``cudaMemcpyAsync``, stream-ordered, which satisfies either order). Raises
        :class:`CudaError` after draining the error it caused."""

    def event_create(self, timing: bool = False) -> int:
        """A new ``cudaEvent_t``: for ordering only (``cudaEventDisableTiming``), or able to time
        (``cudaEventDefault``) with ``timing``. Raises :class:`CudaError`."""

    def event_record(self, event: int, stream: int) -> None:
        """``cudaEventRecord(event, stream)``. Raises :class:`CudaError`."""

    def stream_wait_event(self, stream: int, event: int) -> None:
        """``cudaStreamWaitEvent(stream, event, 0)``: work issued on ``stream`` afterwards waits for
        ``event`` as last recorded. Raises :class:`CudaError`."""

    def event_query(self, event: int) -> bool:
        """``cudaEventQuery``: whether ``event`` completed (never blocks). Raises :class:`CudaError`
        on an error other than not ready."""

    def event_synchronize(self, event: int) -> None:
        """``cudaEventSynchronize``: block the calling thread until ``event`` completed (the one
        blocking call). Raises :class:`CudaError`."""

    def event_elapsed_ms(self, start: int, end: int) -> float:
        """``cudaEventElapsedTime``: milliseconds between two completed timing events. Raises
        :class:`CudaError`."""

    def event_destroy(self, event: int) -> None:
        """``cudaEventDestroy``; a failure is drained and logged, never raised."""

    graphs: bool  # whether the graph calls below exist (CUDA runtime 12.0 and later)

    def graph_create(self) -> int:
        """``cudaGraphCreate``: a new, empty graph. Raises :class:`CudaError`."""

    def graph_add_memcpy(self, graph: int, after: list[int], dst: int, src: int, size: int) -> int:
        """``cudaGraphAddMemcpyNode1D`` (``cudaMemcpyDefault``) after the nodes ``after``: the
        node. Raises :class:`CudaError`."""

    def graph_instantiate(self, graph: int) -> int:
        """``cudaGraphInstantiate(&exec, graph, 0)``. Raises :class:`CudaError`."""

    def graph_set_memcpy(self, instance: int, node: int, dst: int, src: int, size: int) -> None:
        """``cudaGraphExecMemcpyNodeSetParams1D``: the node's copy from the next launch on.
        Raises :class:`CudaError`."""

    def graph_launch(self, instance: int, stream: int) -> None:
        """``cudaGraphLaunch(instance, stream)``. Raises :class:`CudaError`."""

    def graph_destroy(self, graph: int, instance: int | None = None) -> None:
        """``cudaGraphExecDestroy`` then ``cudaGraphDestroy``; failures logged, never raised."""


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """``struct cudaMemcpyAttributes`` (CUDA 12.8+, 24 bytes). Location hints stay zero: they only
    matter for managed memory, and pinned host and device allocations are neither."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]


def _mapped_libraries(name: str) -> list[str]:
    """Paths of the shared libraries whose file name starts with ``name`` mapped into this process,
    in the order they first appear."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if "/" in line else ""
                if path.rsplit("/", 1)[-1].startswith(name) and path not in paths:
                    paths.append(path)
    except OSError:
        return []
    return paths


class LoadedCudart:
    """:class:`CudaRuntime` on a ``libcudart`` shared library (see the module docstring)."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        for name, args in (("cudaHostRegister", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]),
                           ("cudaHostUnregister", [ctypes.c_void_p]), ("cudaGetLastError", []),
                           ("cudaRuntimeGetVersion", [ctypes.POINTER(ctypes.c_int)]),
                           ("cudaMemcpyAsync", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                ctypes.c_void_p]),
                           ("cudaStreamCreateWithFlags", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]),
                           ("cudaStreamDestroy", [ctypes.c_void_p]),
                           ("cudaEventCreateWithFlags", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]),
                           ("cudaEventRecord", [ctypes.c_void_p, ctypes.c_void_p]),
                           ("cudaStreamWaitEvent", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]),
                           ("cudaEventQuery", [ctypes.c_void_p]),
                           ("cudaEventSynchronize", [ctypes.c_void_p]),
                           ("cudaEventElapsedTime", [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p,
                                                     ctypes.c_void_p]),
                           ("cudaEventDestroy", [ctypes.c_void_p])):
            function = getattr(lib, name)
            function.argtypes, function.restype = args, ctypes.c_int
        lib.cudaGetErrorName.argtypes, lib.cudaGetErrorName.restype = [ctypes.c_int], ctypes.c_char_p
        version = ctypes.c_int(0)
        self.version = version.value if lib.cudaRuntimeGetVersion(ctypes.byref(version)) == SUCCESS else 0
        self.path = getattr(lib, "_name", "")
        self._batch = self._batch_function()
        self.batch_state = BatchState.BATCHED if self._batch is not None else BatchState.NOT_IN_RUNTIME
        self.batch_refusals = 0  # cudaMemcpyBatchAsync calls refused (each such job went run by run)
        self.last_refusal = ""  # the error name of the latest one
        # built once: one attribute struct per source order, and attrsIdxs = [0]
        self._attributes = {order: _MemcpyAttributes(int(order), _MemLocation(0, 0), _MemLocation(0, 0),
                                                     FLAG_PREFER_OVERLAP_WITH_COMPUTE) for order in SourceOrder}
        self._first_attribute = ctypes.c_size_t(0)
        self.graphs = self._bind_graph_calls()

    def _bind_graph_calls(self) -> bool:
        """Bind the CUDA graph calls :mod:`kvtier.copy.cudagraph` makes (runtime 12.0 and later: the
        three-argument ``cudaGraphInstantiate``); False where any is missing (jobs go without graphs)."""
        if self.version < 12000:
            return False
        pointer, node_list = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
        calls = (("cudaGraphCreate", [ctypes.POINTER(pointer), ctypes.c_uint]),
                 ("cudaGraphAddMemcpyNode1D", [ctypes.POINTER(pointer), pointer, node_list, ctypes.c_size_t, pointer,
                                               pointer, ctypes.c_size_t, ctypes.c_int]),
                 ("cudaGraphInstantiate", [ctypes.POINTER(pointer), pointer, ctypes.c_ulonglong]),
                 ("cudaGraphExecMemcpyNodeSetParams1D", [pointer, pointer, pointer, pointer, ctypes.c_size_t,
                                                         ctypes.c_int]),
                 ("cudaGraphLaunch", [pointer, pointer]),
                 ("cudaGraphExecDestroy", [pointer]),
                 ("cudaGraphDestroy", [pointer]))
        if not all(hasattr(self._lib, name) for name, _ in calls):
            return False
        for name, args in calls:
            function = getattr(self._lib, name)
            function.argtypes, function.restype = args, ctypes.c_int
        return True

    @classmethod
    def find(cls, cuda_version: str | None) -> "LoadedCudart | None":
        """The runtime torch loaded, for torch built against CUDA ``cuda_version``
        (``torch.version.cuda``, e.g. "12.8"); None if there is none. In order: the library of
        soname ``libcudart.so.<major>`` the dynamic linker already resolved for torch
        (``RTLD_NOLOAD``: never a second copy); else a mapped ``libcudart*`` of that major (not
        merely the first one mapped: another package may bring its own); else, for a torch
        linking the runtime statically, one found by name, of that major."""
        major = int(cuda_version.split(".")[0]) if cuda_version else None
        soname = f"libcudart.so.{major}" if major else None
        if soname:
            try:
                return cls(ctypes.CDLL(soname, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL))
            except (OSError, AttributeError):
                pass
        candidates = _mapped_libraries("libcudart") or [soname, ctypes.util.find_library("cudart")]
        for candidate in candidates:
            if not candidate:
                continue
            try:
                runtime = cls(ctypes.CDLL(candidate))
            except (OSError, AttributeError):
                continue
            if major is None or runtime.version // 1000 == major:
                return runtime
            logger.info("kvtier: %s is CUDA runtime %d but torch uses CUDA %s: not that one", candidate,
                        runtime.version, cuda_version)
        return None

    def _batch_function(self):
        """``cudaMemcpyBatchAsync`` with the signature of this runtime's version: 12.8 and 12.9 take
        a ``failIdx`` before the stream, 13.0 dropped it; None before 12.8 or if not exported."""
        if self.version < 12080 or not hasattr(self._lib, "cudaMemcpyBatchAsync"):
            return None
        function = self._lib.cudaMemcpyBatchAsync
        pointers = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                    ctypes.POINTER(_MemcpyAttributes), ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t]
        with_fail_index = self.version < 13000
        function.argtypes = pointers + ([ctypes.POINTER(ctypes.c_size_t)] if with_fail_index else []) + [ctypes.c_void_p]
        function.restype = ctypes.c_int
        return function, with_fail_index

    @property
    def batched(self) -> bool:
        """Whether jobs go out as one ``cudaMemcpyBatchAsync`` each (else one call per run). A
        refused batch of one job does not change this: :attr:`batch_refusals` counts those."""
        return self.batch_state is BatchState.BATCHED

    def host_register(self, ptr: int, size: int) -> int:
        return self._lib.cudaHostRegister(ptr, size, 0)

    def host_unregister(self, ptr: int) -> int:
        return self._lib.cudaHostUnregister(ptr)

    def get_last_error(self) -> int:
        return self._lib.cudaGetLastError()

    def error_name(self, code: int) -> str:
        name = self._lib.cudaGetErrorName(code)
        return name.decode() if name else f"cudaError {code}"

    def stream_create(self) -> int:
        """A new non-blocking ``cudaStream_t`` on the current device, kvtier's alone (torch's pool
        streams are shared round robin, with vLLM's compute stream among them)."""
        stream = ctypes.c_void_p(0)
        code = self._lib.cudaStreamCreateWithFlags(ctypes.byref(stream), STREAM_NON_BLOCKING)
        if code != SUCCESS:
            self.get_last_error()
            raise CudaError("cudaStreamCreateWithFlags", code, self.error_name(code))
        return int(stream.value or 0)

    def stream_destroy(self, stream: int) -> None:
        """``cudaStreamDestroy``; a failure is drained and logged, never raised (shutdown)."""
        code = self._lib.cudaStreamDestroy(stream)
        if code != SUCCESS:
            self.get_last_error()
            logger.warning("kvtier: cudaStreamDestroy(0x%x) failed: %s", stream, self.error_name(code))

    def memcpy_batch(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int,
                     order: SourceOrder) -> None:
        count = len(sizes)
        if count == 0:
            return
        if count == 1:  # one descriptor: the plain call costs a third of the batched one's host time
            self.memcpy(int(dsts[0]), int(srcs[0]), int(sizes[0]), stream)
            return
        dsts, srcs, sizes = (a if a.dtype == np.int64 and a.flags.c_contiguous else np.ascontiguousarray(a, np.int64)
                             for a in (dsts, srcs, sizes))
        if self._batch is not None:
            function, with_fail_index = self._batch
            args = [dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, count, ctypes.byref(self._attributes[order]),
                    ctypes.byref(self._first_attribute), 1]
            fail_index = ctypes.c_size_t(0)
            code = function(*args, *([ctypes.byref(fail_index)] if with_fail_index else []), stream)
            if code == SUCCESS:
                return
            self.get_last_error()
            self._refused(code)
        for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            self.memcpy(dst, src, size, stream)

    def memcpy(self, dst: int, src: int, size: int, stream: int) -> None:
        """One ``cudaMemcpyAsync`` (direction from the pointers) on ``stream``. Raises :class:`CudaError`."""
        code = self._lib.cudaMemcpyAsync(dst, src, size, MEMCPY_DEFAULT, stream)
        if code != SUCCESS:
            self.get_last_error()
            raise CudaError("cudaMemcpyAsync", code, self.error_name(code))

    def event_create(self, timing: bool = False) -> int:
        event = ctypes.c_void_p(0)
        flags = EVENT_DEFAULT if timing else EVENT_DISABLE_TIMING
        self._check("cudaEventCreateWithFlags", self._lib.cudaEventCreateWithFlags(ctypes.byref(event), flags))
        return int(event.value or 0)

    def event_record(self, event: int, stream: int) -> None:
        code = self._lib.cudaEventRecord(event, stream)
        if code != SUCCESS:
            self._check("cudaEventRecord", code)

    def stream_wait_event(self, stream: int, event: int) -> None:
        code = self._lib.cudaStreamWaitEvent(stream, event, 0)
        if code != SUCCESS:
            self._check("cudaStreamWaitEvent", code)

    def event_query(self, event: int) -> bool:
        code = self._lib.cudaEventQuery(event)
        if code == SUCCESS:
            return True
        if code == NOT_READY:
            return False
        self._check("cudaEventQuery", code)
        return False

    def event_synchronize(self, event: int) -> None:
        self._check("cudaEventSynchronize", self._lib.cudaEventSynchronize(event))

    def event_elapsed_ms(self, start: int, end: int) -> float:
        milliseconds = ctypes.c_float(0.0)
        self._check("cudaEventElapsedTime", self._lib.cudaEventElapsedTime(ctypes.byref(milliseconds), start, end))
        return float(milliseconds.value)

    def event_destroy(self, event: int) -> None:
        code = self._lib.cudaEventDestroy(event)
        if code != SUCCESS:
            self.get_last_error()
            logger.warning("kvtier: cudaEventDestroy(0x%x) failed: %s", event, self.error_name(code))

    def graph_create(self) -> int:
        """A new, empty ``cudaGraph_t``. Raises :class:`CudaError`."""
        graph = ctypes.c_void_p(0)
        self._check("cudaGraphCreate", self._lib.cudaGraphCreate(ctypes.byref(graph), 0))
        return int(graph.value or 0)

    def graph_add_memcpy(self, graph: int, after: list[int], dst: int, src: int, size: int) -> int:
        """A node of ``graph`` copying ``size`` bytes (direction from the pointers) once the nodes
        ``after`` ran; its handle. Raises :class:`CudaError`."""
        node = ctypes.c_void_p(0)
        self._check("cudaGraphAddMemcpyNode1D", self._lib.cudaGraphAddMemcpyNode1D(
            ctypes.byref(node), graph, node_array(after), len(after), dst, src, size, MEMCPY_DEFAULT))
        return int(node.value or 0)

    def graph_instantiate(self, graph: int) -> int:
        """An executable instance of ``graph`` (``cudaGraphExec_t``). Raises :class:`CudaError`."""
        instance = ctypes.c_void_p(0)
        self._check("cudaGraphInstantiate", self._lib.cudaGraphInstantiate(ctypes.byref(instance), graph, 0))
        return int(instance.value or 0)

    def graph_set_memcpy(self, instance: int, node: int, dst: int, src: int, size: int) -> None:
        """The copy of ``node`` in ``instance`` from the next launch on (launches already issued
        are unaffected). Raises :class:`CudaError`."""
        code = self._lib.cudaGraphExecMemcpyNodeSetParams1D(instance, node, dst, src, size, MEMCPY_DEFAULT)
        if code != SUCCESS:
            self._check("cudaGraphExecMemcpyNodeSetParams1D", code)

    def graph_launch(self, instance: int, stream: int) -> None:
        """Issue ``instance`` on ``stream``: after the work issued there before, before the work
        issued there after. Raises :class:`CudaError`."""
        code = self._lib.cudaGraphLaunch(instance, stream)
        if code != SUCCESS:
            self._check("cudaGraphLaunch", code)

    def graph_destroy(self, graph: int, instance: int | None = None) -> None:
        """Destroy ``instance`` (no launch of it in flight) and ``graph``; failures drained and logged."""
        for call, handle in (("cudaGraphExecDestroy", instance), ("cudaGraphDestroy", graph)):
            if handle is None:
                continue
            code = getattr(self._lib, call)(handle)
            if code != SUCCESS:
                self.get_last_error()
                logger.warning("kvtier: %s(0x%x) failed: %s", call, handle, self.error_name(code))

    def _check(self, call: str, code: int) -> None:
        if code != SUCCESS:
            self.get_last_error()
            raise CudaError(call, code, self.error_name(code))

    def _refused(self, code: int) -> None:
        """A refused batch: counted (the GPU kit fails on any); the job goes run by run, and
        batching is off for good only when the call itself is unsupported (:data:`UNSUPPORTED`)."""
        name = self.error_name(code)
        self.batch_refusals += 1
        first_of_kind = name != self.last_refusal
        self.last_refusal = name
        if code in UNSUPPORTED:
            self._batch = None
            self.batch_state = BatchState.UNSUPPORTED
            logger.warning("kvtier: cudaMemcpyBatchAsync is not supported here (%s): copying run by run from now "
                           "on, slower for small pages", name)
        elif first_of_kind:
            logger.warning("kvtier: cudaMemcpyBatchAsync refused a job (%s): it is copied run by run "
                           "(refusals so far: %d)", name, self.batch_refusals)
