"""The CUDA runtime calls torch does not expose, made through the libcudart torch itself loaded.

torch's binding (``torch.cuda.cudart()``) has ``cudaHostRegister`` but neither
``cudaGetLastError`` (a refused registration leaves its error pending, and torch raises it at the
next kernel launch: it must be drained, as vLLM does in ``v1/kv_offload/cpu/host_register.py:51-59``)
nor a batched copy. :class:`LoadedCudart` calls them with ctypes on the ``libcudart`` already
mapped into the process (so it shares torch's error state and streams; vLLM's ``CudaRTLibrary``
does the same), or on one found by name when torch links the runtime statically (then a pending
error of ours stays in our instance, where we drain it).

:class:`CudaRuntime` is what the rest of :mod:`kvtier.copy` asks of it, so the tests drive the
callers with a recording stand-in. Nothing here runs without a GPU: these calls are checked by
the GPU kit (``scripts/gpu-check.sh``). Every method is called from the thread that issues the
engine's forward; none blocks (copies are asynchronous on ``stream``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Protocol

import numpy as np

logger = logging.getLogger(__name__)

SUCCESS = 0
MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction is inferred from the pointers (unified addressing)
SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream
FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1  # cudaMemcpyFlagPreferOverlapWithCompute


class CudaError(RuntimeError):
    def __init__(self, call: str, code: int, name: str):
        super().__init__(f"{call} failed: {name} ({code})")
        self.code = code


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

    def memcpy_batch(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        """Issue ``dsts[i] <- srcs[i]`` (``sizes[i]`` bytes; int64 arrays of addresses) on
        ``stream`` (a ``cudaStream_t``, never the legacy default stream), every source read in
        stream order, in one batched call where the runtime has one. Raises :class:`CudaError`
        after draining the error it caused."""


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """``struct cudaMemcpyAttributes`` (CUDA 12.8+). Location hints stay zero: they only matter
    for managed memory, and pinned host and device allocations are neither."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]


def _loaded_library_path(name: str) -> str | None:
    """Path of a shared library whose file name starts with ``name`` mapped into this process."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if "/" in line else ""
                if path.rsplit("/", 1)[-1].startswith(name):
                    return path
    except OSError:
        return None
    return None


class LoadedCudart:
    """:class:`CudaRuntime` on a ``libcudart`` shared library (see the module docstring)."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        for name, args in (("cudaHostRegister", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]),
                           ("cudaHostUnregister", [ctypes.c_void_p]), ("cudaGetLastError", []),
                           ("cudaRuntimeGetVersion", [ctypes.POINTER(ctypes.c_int)]),
                           ("cudaMemcpyAsync", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                ctypes.c_void_p])):
            function = getattr(lib, name)
            function.argtypes, function.restype = args, ctypes.c_int
        lib.cudaGetErrorName.argtypes, lib.cudaGetErrorName.restype = [ctypes.c_int], ctypes.c_char_p
        version = ctypes.c_int(0)
        self.version = version.value if lib.cudaRuntimeGetVersion(ctypes.byref(version)) == SUCCESS else 0
        self._batch = self._batch_function()

    @classmethod
    def find(cls) -> "LoadedCudart | None":
        """The runtime torch loaded (or one found by name); None if there is none."""
        path = _loaded_library_path("libcudart")
        candidates = [path] if path else [ctypes.util.find_library("cudart"), "libcudart.so.13", "libcudart.so.12"]
        for candidate in candidates:
            if not candidate:
                continue
            try:
                return cls(ctypes.CDLL(candidate))
            except (OSError, AttributeError):
                continue
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
        """Whether copies go out as one ``cudaMemcpyBatchAsync`` per job (else one call per run)."""
        return self._batch is not None

    def host_register(self, ptr: int, size: int) -> int:
        return self._lib.cudaHostRegister(ptr, size, 0)

    def host_unregister(self, ptr: int) -> int:
        return self._lib.cudaHostUnregister(ptr)

    def get_last_error(self) -> int:
        return self._lib.cudaGetLastError()

    def error_name(self, code: int) -> str:
        name = self._lib.cudaGetErrorName(code)
        return name.decode() if name else f"cudaError {code}"

    def memcpy_batch(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        count = len(sizes)
        if count == 0:
            return
        dsts, srcs, sizes = (np.ascontiguousarray(a, dtype=np.int64) for a in (dsts, srcs, sizes))
        if self._batch is not None:
            function, with_fail_index = self._batch
            # Sources in stream order, loads included: vLLM lets loads read host memory out of order
            # (ANY), which a pageable region (pinning refused) may not allow; this holds for both.
            attributes = _MemcpyAttributes(SRC_ACCESS_ORDER_STREAM, _MemLocation(0, 0), _MemLocation(0, 0),
                                           FLAG_PREFER_OVERLAP_WITH_COMPUTE)
            first = ctypes.c_size_t(0)
            args = [dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, count, ctypes.byref(attributes),
                    ctypes.byref(first), 1]
            fail_index = ctypes.c_size_t(0)
            code = function(*args, *([ctypes.byref(fail_index)] if with_fail_index else []), stream)
            if code == SUCCESS:
                return
            self.get_last_error()
            # Not supported by this driver, or refused for these pointers: the runs go one by one
            # (a real device error shows again there, and is raised).
            logger.warning("kvtier: cudaMemcpyBatchAsync failed (%s); copying run by run from now on",
                           self.error_name(code))
            self._batch = None
        for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            code = self._lib.cudaMemcpyAsync(dst, src, size, MEMCPY_DEFAULT, stream)
            if code != SUCCESS:
                self.get_last_error()
                raise CudaError("cudaMemcpyAsync", code, self.error_name(code))
