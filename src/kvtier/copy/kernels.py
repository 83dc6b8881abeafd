"""kvtier's own gather and scatter kernels for staged copies: compiled once with NVRTC, launched
with one driver call each.

Why not torch's ``index_select`` / ``index_copy_``: they are the same kind of kernel (device
memory to device memory, at the memory's speed, a few microseconds of the SMs per chunk), but a
torch op costs 15-20 us of host time per chunk on the thread that issues the forward (dispatch,
an index slice, the current stream), measured on the GPU kit's host; a staged job of 512 blocks x
32 layers is 4-32 chunks. A driver launch through ctypes costs a few microseconds, takes raw
addresses (no slice tensors) and its stream as an argument (no current-stream switch).

The kernels (a thread block per page, or fewer blocks each looping over pages: ``max_blocks``;
a page moves in 16- or 8-byte words, four loads per thread in flight):

- ``gather``: ``staged[i] = rows[row(first + i)]`` for the launch's pages (a store's chunk, host
  order);
- ``scatter``: ``rows[row(first + i)] = staged[i]`` (a load's chunk; no row is named twice in a
  job: slots are distinct, and so are the engine pages of a job);
- ``gather_blocks`` / ``scatter_blocks``: the same for a job of whole blocks (most jobs), whose
  rows the kernel computes from the job's engine blocks and the layers' first rows: the host
  uploads one number per block instead of one per (block, layer) page, and computes no index.

Every kernel reads the job's numbers from the device (:meth:`RowKernels.launch`), the job's page
count first: a launch copies at most ``pages`` pages and never past the job's last, so one CUDA
graph (:mod:`kvtier.copy.cudagraph`), its launches sized for the largest chunk, serves jobs of
every size with its number of chunks.

:class:`RowKernels` is made once per copy engine side stream pair (:class:`~kvtier.copy.lanes.CudaLanes`,
at registration, the device idle), on the thread that issues the forward, whose current context
is torch's primary context of the device; every launch is made from that thread. It is used only
where NVRTC and the driver library are found and the kernels compile and load; otherwise
(:meth:`RowKernels.load` returns None, with the reason logged) staged jobs use torch's ops.
Launches never block; a failed launch raises :class:`~kvtier.copy.cudart.CudaError` (the engine
reports the job failed).

Bit-exactness is checked on a GPU by the kit's round trips (``tests/gpu``), which compare every
byte moved with the CPU engine's; on CPU the staged schedule runs torch's ops on the simulated
device.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import sys

from kvtier.copy.cudart import CudaError, node_array

logger = logging.getLogger(__name__)

SOURCE = r"""
struct alignas(16) W16 { unsigned long long a, b; };
typedef unsigned long long W8;

// One thread block copies one page of ``words`` words at a time: each thread loads up to UNROLL
// words (a block moves UNROLL * blockDim.x words in flight), then stores them.
#define KVTIER_UNROLL 4
template <typename W>
__device__ __forceinline__ void kvtier_copy_page(W* __restrict__ to, const W* __restrict__ from, long long words) {
    for (long long base = threadIdx.x; base < words; base += KVTIER_UNROLL * (long long)blockDim.x) {
        W v[KVTIER_UNROLL];
#pragma unroll
        for (int u = 0; u < KVTIER_UNROLL; ++u) {
            const long long w = base + (long long)u * blockDim.x;
            if (w < words) v[u] = from[w];
        }
#pragma unroll
        for (int u = 0; u < KVTIER_UNROLL; ++u) {
            const long long w = base + (long long)u * blockDim.x;
            if (w < words) to[w] = v[u];
        }
    }
}

// numbers: the job's page count, then each page's row (row kernels), or each layer's row of engine
// block 0 followed by the job's engine blocks (block kernels: page p is layer p % layers of block
// p / layers, at row blocks[p / layers] * block_rows + layer_rows[p % layers]). A launch copies the
// job's pages first + i for i < min(pages, count - first): ``pages`` may exceed what the job has
// there (a CUDA graph's launch serves jobs of several sizes), the count read on the device bounds it.
__device__ __forceinline__ long long kvtier_count(const long long* __restrict__ numbers, long long pages,
                                                  long long first) {
    const long long left = numbers[0] - first;
    return left < pages ? left : pages;
}
__device__ __forceinline__ long long kvtier_block_row(const long long* __restrict__ numbers, long long layers,
                                                      long long block_rows, long long p) {
    return numbers[1 + layers + p / layers] * block_rows + numbers[1 + p % layers];
}

// Block b copies the launch's pages b, b + gridDim.x, ... (one page per block when the grid is
// ``pages`` blocks; fewer blocks take fewer of the SMs the forward pass runs on, for longer).
#define KVTIER_ROW_KERNELS(W, SUFFIX)                                                                \
extern "C" __global__ void kvtier_gather##SUFFIX(const W* __restrict__ rows, W* __restrict__ staged,  \
        const long long* __restrict__ numbers, long long words, long long pages, long long first) {  \
    const long long count = kvtier_count(numbers, pages, first);                                     \
    for (long long i = blockIdx.x; i < count; i += gridDim.x)                                        \
        kvtier_copy_page<W>(staged + i * words, rows + numbers[1 + first + i] * words, words);       \
}                                                                                                    \
extern "C" __global__ void kvtier_scatter##SUFFIX(W* __restrict__ rows, const W* __restrict__ staged, \
        const long long* __restrict__ numbers, long long words, long long pages, long long first) {  \
    const long long count = kvtier_count(numbers, pages, first);                                     \
    for (long long i = blockIdx.x; i < count; i += gridDim.x)                                        \
        kvtier_copy_page<W>(rows + numbers[1 + first + i] * words, staged + i * words, words);       \
}                                                                                                    \
extern "C" __global__ void kvtier_gather_blocks##SUFFIX(                                             \
        const W* __restrict__ rows, W* __restrict__ staged, const long long* __restrict__ numbers,    \
        long long words, long long pages, long long first, long long layers, long long block_rows) { \
    const long long count = kvtier_count(numbers, pages, first);                                     \
    for (long long i = blockIdx.x; i < count; i += gridDim.x)                                        \
        kvtier_copy_page<W>(staged + i * words,                                                      \
                            rows + kvtier_block_row(numbers, layers, block_rows, first + i) * words, words); \
}                                                                                                    \
extern "C" __global__ void kvtier_scatter_blocks##SUFFIX(                                            \
        W* __restrict__ rows, const W* __restrict__ staged, const long long* __restrict__ numbers,    \
        long long words, long long pages, long long first, long long layers, long long block_rows) { \
    const long long count = kvtier_count(numbers, pages, first);                                     \
    for (long long i = blockIdx.x; i < count; i += gridDim.x)                                        \
        kvtier_copy_page<W>(rows + kvtier_block_row(numbers, layers, block_rows, first + i) * words, \
                            staged + i * words, words);                                              \
}

KVTIER_ROW_KERNELS(W16, 16)
KVTIER_ROW_KERNELS(W8, 8)
"""
THREADS = 256  # per block
MAX_PAGES_PER_LAUNCH = 2**31 - 1  # the grid's x limit


class KernelNodeParams(ctypes.Structure):
    """``CUDA_KERNEL_NODE_PARAMS_v2`` (``cuda.h``, CUDA 12.0 and later; 72 bytes): a kernel node's
    function, grid, block, shared memory and arguments (``kern`` / ``ctx`` null: ``func`` in the
    current context)."""

    _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint), ("kernelParams", ctypes.c_void_p),
                ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


def _nvrtc_candidates(major: int) -> list[str]:
    """Where libnvrtc of CUDA ``major`` may be: mapped already (torch loaded it), the dynamic
    linker's soname, the pip packages of NVIDIA's libraries torch depends on."""
    from kvtier.copy.cudart import _mapped_libraries

    found = [p for p in _mapped_libraries("libnvrtc.so") if "builtins" not in p]
    found.append(f"libnvrtc.so.{major}")
    for root in sys.path:
        for pattern in (f"nvidia/cu{major}/lib/libnvrtc.so*", "nvidia/cuda_nvrtc/lib/libnvrtc.so*",
                        "torch/lib/libnvrtc*.so*"):
            found.extend(p for p in sorted(glob.glob(os.path.join(root, pattern))) if "builtins" not in p)
    return found


class _Nvrtc:
    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]

    def check(self, call: str, code: int) -> None:
        if code != 0:
            raise RuntimeError(f"{call} failed: {self.lib.nvrtcGetErrorString(code).decode()}")

    def compile(self, source: str, arch: tuple[int, int]) -> tuple[bytes, str]:
        """(image, kind): a CUBIN for ``sm_XY``, else PTX for ``compute_XY`` (the driver JITs it)."""
        for option, kind in ((f"--gpu-architecture=sm_{arch[0]}{arch[1]}", "cubin"),
                             (f"--gpu-architecture=compute_{arch[0]}{arch[1]}", "ptx")):
            image = self.build(source, option, kind)
            if image is not None:
                return image, kind
        raise RuntimeError(f"NVRTC compiled the row kernels for neither sm_{arch[0]}{arch[1]} nor its PTX")

    def build(self, source: str, option: str, kind: str) -> bytes | None:
        """``source`` compiled with ``option`` (``--gpu-architecture=...``) to ``kind`` ("cubin" or
        "ptx"); None if it does not compile (NVRTC's log at INFO)."""
        lib = self.lib
        size_call, get_call = ("nvrtcGetCUBINSize", "nvrtcGetCUBIN") if kind == "cubin" else \
            ("nvrtcGetPTXSize", "nvrtcGetPTX")
        program = ctypes.c_void_p()
        self.check("nvrtcCreateProgram", lib.nvrtcCreateProgram(
            ctypes.byref(program), source.encode(), b"kvtier_rows.cu", 0, None, None))
        try:
            options = (ctypes.c_char_p * 2)(option.encode(), b"-std=c++17")
            code = lib.nvrtcCompileProgram(program, 2, options)
            if code != 0:
                size = ctypes.c_size_t()
                lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value + 1)
                lib.nvrtcGetProgramLog(program, log)
                logger.info("kvtier: NVRTC %s: %s", option, log.value.decode(errors="replace").strip()[:500])
                return None
            size = ctypes.c_size_t()
            self.check(size_call, getattr(lib, size_call)(program, ctypes.byref(size)))
            image = ctypes.create_string_buffer(size.value)
            self.check(get_call, getattr(lib, get_call)(program, image))
            return image.raw
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(program))


class RowKernels:
    """The gather and scatter kernels of one word size, loaded in the current context (see the
    module docstring). ``word_bytes``: 16 or 8; every page is a whole number of words and every
    address passed is aligned to one. ``max_blocks``: the most thread blocks a launch runs (each
    then copies every ``max_blocks``-th page of it); None: one block per page, which finishes a
    chunk soonest but takes every SM the forward pass is not holding while it runs."""

    def __init__(self, driver: ctypes.CDLL, module: ctypes.c_void_p, word_bytes: int, how: str,
                 max_blocks: int | None = None):
        if max_blocks is not None and max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1 (or None: a block per page), not {max_blocks}")
        self._driver = driver
        self._module = module
        self.word_bytes = word_bytes
        self.how = how
        self.max_blocks = max_blocks
        self._launch = driver.cuLaunchKernel
        self._launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        self._launch.restype = ctypes.c_int
        self._functions = {}
        for kind in ("gather", "scatter", "gather_blocks", "scatter_blocks"):
            function = ctypes.c_void_p()
            code = driver.cuModuleGetFunction(ctypes.byref(function), module, f"kvtier_{kind}{word_bytes}".encode())
            if code != 0:
                raise CudaError("cuModuleGetFunction", code, self._error_name(code))
            self._functions[kind] = function.value
        # the launch's argument slots, filled in place before each launch (one thread only)
        self._pointers = [ctypes.c_void_p() for _ in range(3)]  # rows, staged, index or table
        self._numbers = [ctypes.c_longlong() for _ in range(5)]  # words, pages, first[, layers, block_rows]
        self._params = (ctypes.c_void_p * 8)(*(ctypes.cast(ctypes.byref(v), ctypes.c_void_p)
                                               for v in self._pointers + self._numbers))
        self._add_node = getattr(driver, "cuGraphAddKernelNode_v2", None)  # CUDA 12.0+ drivers
        if self._add_node is not None:
            self._add_node.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                       ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                       ctypes.POINTER(KernelNodeParams)]
            self._add_node.restype = ctypes.c_int

    @property
    def graph_nodes(self) -> bool:
        """Whether :meth:`add_node` can put launches in CUDA graphs (the driver has the call)."""
        return self._add_node is not None

    @classmethod
    def load(cls, arch: tuple[int, int], cuda_major: int, page_bytes: int,
             max_blocks: int | None = None) -> RowKernels | None:
        """The kernels for pages of ``page_bytes`` on a device of compute capability ``arch``, in
        the calling thread's current context, launched on at most ``max_blocks`` thread blocks;
        None (logged) where they cannot be had."""
        word = next((w for w in (16, 8) if page_bytes % w == 0), None)
        if word is None:
            logger.info("kvtier: pages of %d B are not whole 8-byte words: staged copies use torch's ops", page_bytes)
            return None
        try:
            driver = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            logger.info("kvtier: no CUDA driver library for kvtier's copy kernels (%s): torch's ops instead", exc)
            return None
        nvrtc, tried = None, []
        for candidate in _nvrtc_candidates(cuda_major):
            try:
                nvrtc = _Nvrtc(ctypes.CDLL(candidate))
                break
            except (OSError, AttributeError):
                tried.append(candidate)
        if nvrtc is None:
            logger.info("kvtier: no NVRTC of CUDA %d found (tried %s): staged copies use torch's ops", cuda_major,
                        ", ".join(tried[:4]))
            return None
        try:
            image, kind = nvrtc.compile(SOURCE, arch)
            module = ctypes.c_void_p()
            code = driver.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(image))
            if code != 0:
                raise CudaError("cuModuleLoadData", code, str(code))
            blocks = "a block per page" if max_blocks is None else f"at most {max_blocks} blocks a launch"
            kernels = cls(driver, module, word, f"{kind} for sm_{arch[0]}{arch[1]}, {word}-byte words, {blocks}",
                          max_blocks)
        except Exception as exc:  # noqa: BLE001 - an optimization only: any failure leaves torch's ops
            logger.warning("kvtier: kvtier's copy kernels are unavailable (%s): staged copies use torch's ops", exc)
            return None
        logger.info("kvtier: staged copies gather and scatter with kvtier's kernels (%s)", kernels.how)
        return kernels

    def launch(self, kind: str, stream: int, rows: int, staged: int, numbers: int, first: int, pages: int,
               page_bytes: int, blocks: tuple[int, int] | None = None) -> None:
        """Issue on ``stream``, for the job's pages ``first + i``, ``i < min(pages, count - first)``
        (pages of ``page_bytes``): ``kind`` "gather", ``staged[i] = rows[row(first + i)]``, or
        "scatter", ``rows[row(first + i)] = staged[i]``. ``numbers``: the device address of the
        job's int64 numbers, its page count ``count`` first; then, without ``blocks``, each page's
        row; with ``blocks = (layers, block_rows)`` (a job of whole blocks: page ``p`` is layer ``p
        % layers`` of block ``p // layers``, at row ``job_blocks[p // layers] * block_rows +
        layer_rows[p % layers]``), ``layer_rows`` (``layers`` of them) and the job's blocks."""
        words = page_bytes // self.word_bytes
        name = f"{kind}_blocks" if blocks is not None else kind
        self._run(name, stream, pages, (rows, staged, numbers), (words, pages, first, *(blocks or ())))

    def add_node(self, graph: int, after: list[int], kind: str, rows: int, staged: int, numbers: int, first: int,
                 pages: int, page_bytes: int, blocks: tuple[int, int] | None = None) -> int:
        """:meth:`launch`'s kernel as a node of CUDA graph ``graph`` run after the nodes ``after``
        (``cuGraphAddKernelNode_v2``; the arguments are copied into the node): its handle. Raises
        :class:`~kvtier.copy.cudart.CudaError`."""
        assert self._add_node is not None and pages > 0
        words = page_bytes // self.word_bytes
        name = f"{kind}_blocks" if blocks is not None else kind
        self._fill(pages, (rows, staged, numbers), (words, pages, first, *(blocks or ())))
        params = KernelNodeParams(self._functions[name], self.grid(pages), 1, 1, THREADS, 1, 1, 0,
                                  ctypes.cast(self._params, ctypes.c_void_p), None, None, None)
        node = ctypes.c_void_p(0)
        code = self._add_node(ctypes.byref(node), graph, node_array(after), len(after), ctypes.byref(params))
        if code != 0:
            raise CudaError(f"cuGraphAddKernelNode(kvtier_{name})", code, self._error_name(code))
        return int(node.value or 0)

    def grid(self, pages: int) -> int:
        """The thread blocks a launch of ``pages`` pages runs on."""
        return pages if self.max_blocks is None else min(pages, self.max_blocks)

    def _fill(self, pages: int, pointers: tuple[int, ...], numbers: tuple[int, ...]) -> None:
        """Put a launch's arguments in the slots ``_params`` points to."""
        if pages > MAX_PAGES_PER_LAUNCH:
            raise ValueError(f"{pages} pages in one launch (at most {MAX_PAGES_PER_LAUNCH})")
        for slot, value in zip(self._pointers, pointers):
            slot.value = value
        for slot, value in zip(self._numbers, numbers):
            slot.value = value

    def _run(self, kind: str, stream: int, pages: int, pointers: tuple[int, ...], numbers: tuple[int, ...]) -> None:
        if pages <= 0:
            return
        self._fill(pages, pointers, numbers)
        code = self._launch(self._functions[kind], self.grid(pages), 1, 1, THREADS, 1, 1, 0, stream, self._params, None)
        if code != 0:
            raise CudaError(f"cuLaunchKernel(kvtier_{kind})", code, self._error_name(code))

    def _error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        self._driver.cuGetErrorName(code, ctypes.byref(name))
        return name.value.decode() if name.value else f"CUresult {code}"

    def close(self) -> None:
        """Unload the module (every launch completed: the caller synchronized its streams)."""
        if self._module is not None:
            self._driver.cuModuleUnload(self._module)
            self._module = None
