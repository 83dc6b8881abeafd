"""A CUDA device stand-in on host memory, for the CUDA engine's GPU path on CPU tensors: the CUDA
runtime (``kvtier.copy.cudart.CudaRuntime``, graphs included), kvtier's row kernels
(``kvtier.copy.kernels.RowKernels``' interface) and the parts of ``torch.cuda`` that
``TorchCudaStreams`` and its lanes use (test code, not shipped).

Every call runs at once, on the calling thread (a device that is never behind, so stream order
holds trivially; the ordering between lanes is tested on the simulated device, ``sim_device.py``):
copies move the bytes at the raw addresses they are given, a kernel gathers or scatters rows by
address, a graph runs its nodes in an order its edges allow, each as late as they allow (so a
missing edge shows), with its copies as last updated. With ``execute=False`` nothing is moved: a device whose calls cost
nothing, to time kvtier's own host work (``benchmarks/bench_issue_host.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
from collections import Counter

import numpy as np
import torch

from kvtier.copy.cudart import CudaError
from kvtier.copy.streams import TorchCudaStreams


class HostStream:
    def __init__(self, handle: int):
        self.cuda_stream = handle

    def __eq__(self, other):
        return isinstance(other, HostStream) and other.cuda_stream == self.cuda_stream

    def __hash__(self):
        return self.cuda_stream

    def synchronize(self):
        pass


class HostCuda:
    """The parts of ``torch.cuda`` the lanes use."""

    @contextlib.contextmanager
    def stream(self, stream):
        yield

    @contextlib.contextmanager
    def device(self, device):
        yield

    def current_device(self):
        return 0

    def ExternalStream(self, handle, device):  # noqa: N802 - torch.cuda.ExternalStream
        return HostStream(handle)


def _int64s(address: int, count: int) -> np.ndarray:
    return np.frombuffer((ctypes.c_int64 * count).from_address(address), dtype=np.int64)


class HostDevice:
    """The CUDA runtime (``kvtier.copy.cudart.CudaRuntime``) and kvtier's row kernels
    (``RowKernels``' interface) on host memory, every call run at once; ``fail``: calls that
    raise ``CudaError``; ``calls``: how many of each were made; ``execute``: whether copies and
    kernels move bytes."""

    graphs = True
    graph_nodes = True

    def __init__(self, fail=(), execute: bool = True):
        self.fail = set(fail)
        self.execute = execute
        self.calls: Counter[str] = Counter()
        self.handles = itertools.count(0x1000)
        self.graph_nodes_of: dict[int, list[int]] = {}
        self.nodes: dict[int, list] = {}
        self.instances: dict[int, dict[int, list]] = {}
        self.after: dict[int, list[int]] = {}  # node -> the nodes it waits for
        self.destroyed: list[int] = []

    def _call(self, name: str) -> None:
        self.calls[name] += 1
        if name in self.fail:
            raise CudaError(name, 1, "cudaErrorInvalidValue")

    # runtime: streams, events, copies
    def stream_create(self):
        return next(self.handles)

    def stream_destroy(self, stream):
        pass

    def event_create(self, timing=False):
        return next(self.handles)

    def event_record(self, event, stream):
        self.calls["event_record"] += 1

    def stream_wait_event(self, stream, event):
        self.calls["stream_wait_event"] += 1

    def event_query(self, event):
        return True

    def event_synchronize(self, event):
        pass

    def event_elapsed_ms(self, start, end):
        return 1.0

    def event_destroy(self, event):
        pass

    def get_last_error(self):
        return 0

    def memcpy(self, dst, src, size, stream):
        self._call("memcpy")
        if self.execute:
            ctypes.memmove(dst, src, size)

    def memcpy_batch(self, dsts, srcs, sizes, stream, order):
        self._call("memcpy_batch")
        if self.execute:
            for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
                ctypes.memmove(dst, src, size)

    # runtime: graphs
    def graph_create(self):
        self._call("graph_create")
        graph = next(self.handles)
        self.graph_nodes_of[graph] = []
        return graph

    def _add(self, graph, after, node):
        assert set(after) <= set(self.graph_nodes_of[graph]), "an edge from a node of another graph"
        handle = next(self.handles)
        self.nodes[handle] = node
        self.after[handle] = list(after)
        self.graph_nodes_of[graph].append(handle)
        return handle

    def graph_add_memcpy(self, graph, after, dst, src, size):
        self._call("graph_add_memcpy")
        return self._add(graph, after, ["copy", dst, src, size])

    def graph_instantiate(self, graph):
        self._call("graph_instantiate")
        instance = next(self.handles)
        self.instances[instance] = {node: list(self.nodes[node]) for node in self.graph_nodes_of[graph]}
        return instance

    def graph_set_memcpy(self, instance, node, dst, src, size):
        self._call("graph_set_memcpy")
        assert self.instances[instance][node][0] == "copy" and size > 0
        self.instances[instance][node] = ["copy", dst, src, size]

    def graph_launch(self, instance, stream):
        self._call("graph_launch")
        if not self.execute:
            return
        for node in self._latest_first(self.instances[instance]).values():
            if node[0] == "copy":
                ctypes.memmove(node[1], node[2], node[3])
            else:
                self._kernel(*node[1:])

    def _latest_first(self, nodes: dict[int, list]) -> dict[int, list]:
        """``nodes`` in an order a device may run them, each as late as its edges allow (of the
        nodes ready, the last created first): a missing edge shows as a node run after the
        ones that needed it."""
        done: dict[int, list] = {}
        while len(done) < len(nodes):
            node = max(n for n in nodes if n not in done and all(a in done for a in self.after[n]))
            done[node] = nodes[node]
        return done

    def graph_destroy(self, graph, instance=None):
        self.destroyed.append(graph)
        self.instances.pop(instance, None)

    # kvtier's row kernels
    def launch(self, kind, stream, rows, staged, numbers, first, pages, page_bytes, blocks=None):
        self._call("launch")
        if self.execute:
            self._kernel(kind, rows, staged, numbers, first, pages, page_bytes, blocks)

    def add_node(self, graph, after, kind, rows, staged, numbers, first, pages, page_bytes, blocks=None):
        self._call("add_node")
        return self._add(graph, after, ["kernel", kind, rows, staged, numbers, first, pages, page_bytes, blocks])

    def close(self):
        pass

    @staticmethod
    def _kernel(kind, rows, staged, numbers, first, pages, page_bytes, blocks):
        """The kernels' contract (kvtier.copy.kernels): the job's page count read from its
        numbers bounds the launch's pages; nothing past the job's numbers is read."""
        count = min(pages, int(_int64s(numbers, 1)[0]) - first)
        if count <= 0:
            return
        if blocks is None:
            row_of = _int64s(numbers, 1 + first + count)[1 + first:].tolist()
        else:
            layers, block_rows = blocks
            table = _int64s(numbers, 1 + layers + (first + count - 1) // layers + 1)[1:]
            row_of = [int(table[layers + p // layers]) * block_rows + int(table[p % layers])
                      for p in range(first, first + count)]
        for i, row in enumerate(row_of):
            engine, buffer = rows + row * page_bytes, staged + i * page_bytes
            if kind == "gather":
                ctypes.memmove(buffer, engine, page_bytes)
            else:
                ctypes.memmove(engine, buffer, page_bytes)


def host_streams(device: HostDevice, **options) -> TorchCudaStreams:
    """``TorchCudaStreams`` on ``device``: its runtime, its kernels, unpinned host buffers
    (``options``: more of its arguments, e.g. ``job_graphs``)."""
    return TorchCudaStreams(torch.device("cuda", 0), cuda=HostCuda(), runtime=device, find_runtime=False,
                            raw_current_stream=lambda index: 1,
                            pinned=lambda size: torch.empty(size, dtype=torch.uint8),
                            load_kernels=lambda where, page_bytes: device, **options)
