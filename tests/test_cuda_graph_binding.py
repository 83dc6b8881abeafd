"""kvtier's ctypes binding of the CUDA graph calls (``LoadedCudart.graph_*``, ``RowKernels.add_node``),
driven against a stand-in ``libcudart`` + driver compiled here with the system C compiler (as
tests/test_cudart_binding.py does for the other runtime calls): the stand-in declares the calls
as ``cuda_runtime_api.h`` / ``cuda.h`` of CUDA 12-13 do, records what it receives and performs
the copies it is handed (host to host). What a mistake in the binding would do on a GPU (a
dependency list or size read from the wrong place, a kernel node whose struct layout or argument
pointers are off), it does here.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
from test_cudart_binding import STANDIN

from kvtier.copy.cudart import CudaError, LoadedCudart
from kvtier.copy.kernels import THREADS, KernelNodeParams, RowKernels

GRAPH_STANDIN = r"""
static size_t g[24];
static long long kernel_args[8];
static char graphs[4], nodes[64], instances[4];
void graph_record(size_t *out) { memcpy(out, g, sizeof g); }
void graph_kernel_args(long long *out) { memcpy(out, kernel_args, sizeof kernel_args); }

int cudaGraphCreate(void **graph, unsigned int flags) { g[0]++; g[1] = flags; *graph = &graphs[g[0] % 4]; return 0; }
int cudaGraphAddMemcpyNode1D(void **node, void *graph, void *const *deps, size_t count_deps, void *dst,
                             const void *src, size_t count, int kind) {
    g[2]++; g[3] = (size_t)graph; g[4] = count_deps; g[5] = count_deps ? (size_t)deps[count_deps - 1] : 0;
    g[6] = (size_t)dst; g[7] = (size_t)src; g[8] = count; g[9] = kind;
    if (!count) return 1;
    *node = &nodes[++g[10] % 64]; return 0;
}
int cudaGraphInstantiate(void **instance, void *graph, unsigned long long flags) {
    g[11] = flags == 0ULL ? 1 : 2; g[12] = (size_t)graph; *instance = &instances[1]; return 0;
}
int cudaGraphExecMemcpyNodeSetParams1D(void *instance, void *node, void *dst, const void *src, size_t count,
                                       int kind) {
    g[13]++; g[14] = (size_t)node; g[15] = kind;
    if (instance != &instances[1]) return 1;
    memcpy(dst, src, count); return 0;
}
int cudaGraphLaunch(void *instance, void *stream) { g[16]++; g[17] = (size_t)stream; return instance == &instances[1] ? 0 : 400; }
int cudaGraphExecDestroy(void *instance) { g[18]++; return 0; }
int cudaGraphDestroy(void *graph) { g[19]++; return 0; }

/* the driver: CUDA_KERNEL_NODE_PARAMS_v2 as cuda.h declares it */
struct KernelNodeParams {
    void *func; unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    void **kernelParams; void **extra; void *kern; void *ctx;
};
_Static_assert(sizeof(struct KernelNodeParams) == 72, "CUDA_KERNEL_NODE_PARAMS_v2 is 72 bytes");
size_t graph_kernel_params_size(void) { return sizeof(struct KernelNodeParams); }
int cuModuleGetFunction(void **function, void *module, const char *name) {
    size_t h = 0; for (const char *c = name; *c; c++) h = h * 31 + (unsigned char)*c;
    *function = (void *)(h & 0xFFFFFFFF); return 0;
}
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shm, void *stream, void **params, void **extra) { return 0; }
int cuGetErrorName(int code, const char **name) { *name = "CUDA_ERROR_INVALID_VALUE"; return 0; }
int cuGraphAddKernelNode_v2(void **node, void *graph, void *const *deps, size_t count_deps,
                            const struct KernelNodeParams *p) {
    g[20] = (size_t)p->func; g[21] = p->gridDimX; g[22] = p->blockDimX;
    g[23] = count_deps * 1000 + (p->gridDimY == 1 && p->gridDimZ == 1 && p->blockDimY == 1 && p->blockDimZ == 1 &&
                                 p->sharedMemBytes == 0 && !p->extra && !p->kern && !p->ctx);
    for (int i = 0; i < 8; i++) kernel_args[i] = *(long long *)p->kernelParams[i];
    if (graph != &graphs[1]) return 1;
    *node = &nodes[++g[10] % 64]; return 0;
}
"""
FIELDS = ["graphs_made", "graph_flags", "copy_nodes", "copy_graph", "copy_deps", "copy_last_dep", "copy_dst",
          "copy_src", "copy_size", "copy_kind", "nodes_made", "instantiate_flags", "instantiated_graph", "updates",
          "updated_node", "update_kind", "launches", "launch_stream", "instances_destroyed", "graphs_destroyed",
          "kernel_function", "kernel_grid", "kernel_block", "kernel_deps_and_plain"]


@pytest.fixture(params=[12080, 13000])
def standin(request, tmp_path):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in libcudart (apt-get install gcc)")
    source = tmp_path / "graphs.c"
    source.write_text(STANDIN.replace("VERSION", str(request.param)) + GRAPH_STANDIN)
    library = tmp_path / f"libgraphs{request.param}.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(library), str(source)], check=True)
    return ctypes.CDLL(str(library))


def record(lib) -> dict[str, int]:
    out = (ctypes.c_size_t * 24)()
    lib.graph_record(out)
    return dict(zip(FIELDS, out))


def test_copy_nodes_take_their_dependencies_addresses_and_size_and_are_updated_in_the_instance(standin):
    cudart = LoadedCudart(standin)
    assert cudart.graphs
    graph = cudart.graph_create()
    first = cudart.graph_add_memcpy(graph, [], 0x1000, 0x2000, 64)
    second = cudart.graph_add_memcpy(graph, [first, 0x77], 0x3000, 0x4000, 128)
    seen = record(standin)
    assert (seen["graphs_made"], seen["graph_flags"], seen["copy_nodes"], seen["copy_graph"]) == (1, 0, 2, graph)
    assert (seen["copy_deps"], seen["copy_last_dep"]) == (2, 0x77)
    assert (seen["copy_dst"], seen["copy_src"], seen["copy_size"], seen["copy_kind"]) == (0x3000, 0x4000, 128, 4)
    instance = cudart.graph_instantiate(graph)
    assert record(standin)["instantiate_flags"] == 1 and record(standin)["instantiated_graph"] == graph
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros_like(src)
    cudart.graph_set_memcpy(instance, second, dst.ctypes.data, src.ctypes.data, 200)
    assert np.array_equal(dst[:200], src[:200]) and not dst[200:].any()
    cudart.graph_launch(instance, 0xABC0)
    seen = record(standin)
    assert (seen["updates"], seen["updated_node"], seen["update_kind"]) == (1, second, 4)
    assert (seen["launches"], seen["launch_stream"]) == (1, 0xABC0)
    cudart.graph_destroy(graph, instance)
    seen = record(standin)
    assert (seen["instances_destroyed"], seen["graphs_destroyed"]) == (1, 1)


def test_graph_call_errors_are_raised_drained(standin):
    cudart = LoadedCudart(standin)
    graph = cudart.graph_create()
    with pytest.raises(CudaError, match="cudaGraphAddMemcpyNode1D"):
        cudart.graph_add_memcpy(graph, [], 0x1000, 0x2000, 0)
    with pytest.raises(CudaError, match="cudaGraphLaunch"):
        cudart.graph_launch(0xBAD, 0xABC0)
    with pytest.raises(CudaError, match="cudaGraphExecMemcpyNodeSetParams1D"):
        cudart.graph_set_memcpy(0xBAD, 0x1, 0x1000, 0x2000, 8)
    assert cudart.get_last_error() == 0


def test_without_the_graph_calls_or_before_cuda_12_jobs_go_without_graphs(tmp_path):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    for version, source in ((12080, STANDIN), (11080, STANDIN + GRAPH_STANDIN)):
        path = tmp_path / f"plain{version}.c"
        path.write_text(source.replace("VERSION", str(version)))
        library = tmp_path / f"libplain{version}.so"
        subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(library), str(path)], check=True)
        assert LoadedCudart(ctypes.CDLL(str(library))).graphs is False


def test_a_kernel_node_is_the_launch_of_the_same_kernel_with_the_same_arguments(standin):
    """``CUDA_KERNEL_NODE_PARAMS_v2`` is 72 bytes on both sides; the node names the function the
    launch would, one block of THREADS per page (or at most ``max_blocks``), and each argument
    pointer reaches its value."""
    standin.graph_kernel_params_size.restype = ctypes.c_size_t
    assert ctypes.sizeof(KernelNodeParams) == standin.graph_kernel_params_size() == 72
    kernels = RowKernels(standin, ctypes.c_void_p(1), 16, "stand-in")
    assert kernels.graph_nodes
    cudart = LoadedCudart(standin)
    graph = cudart.graph_create()
    before = cudart.graph_add_memcpy(graph, [], 0x1000, 0x2000, 64)
    node = kernels.add_node(graph, [before], "gather", 0xA000, 0xB000, 0xC000, 10, 5, 4096, blocks=(32, 2))
    seen = record(standin)
    args = (ctypes.c_longlong * 8)()
    standin.graph_kernel_args(args)
    assert node and seen["kernel_function"] == kernels._functions["gather_blocks"]  # noqa: SLF001
    assert (seen["kernel_grid"], seen["kernel_block"], seen["kernel_deps_and_plain"]) == (5, THREADS, 1001)
    assert list(args) == [0xA000, 0xB000, 0xC000, 4096 // 16, 5, 10, 32, 2]
    kernels.add_node(graph, [], "scatter", 0xA000, 0xB000, 0xC008, 0, 3, 4096)
    standin.graph_kernel_args(args)
    assert record(standin)["kernel_function"] == kernels._functions["scatter"]  # noqa: SLF001
    assert list(args)[:6] == [0xA000, 0xB000, 0xC008, 256, 3, 0] and record(standin)["kernel_deps_and_plain"] == 1
    capped = RowKernels(standin, ctypes.c_void_p(1), 16, "stand-in", max_blocks=2)
    capped.add_node(graph, [], "scatter", 0xA000, 0xB000, 0xC008, 4, 7, 4096)  # 7 pages on 2 blocks
    standin.graph_kernel_args(args)
    assert record(standin)["kernel_grid"] == 2 and list(args)[:6] == [0xA000, 0xB000, 0xC008, 256, 7, 4]
