"""A staged job shape as one CUDA graph, replayed per job with that job's host addresses.

Issued op by op (:meth:`~kvtier.copy.staged_runs.StagedRuns.issue`), a staged job costs the thread
that issues the forward ~6 device calls per chunk: 4-32 chunks for a 512-block job. Jobs of one
shape (:func:`~kvtier.copy.jobgraph.graph_key`: direction, chunks, one host run per chunk, and
for a job of one chunk its pages rounded up to a power of two) differ only in the host address
and size of each chunk's copy and in the numbers uploaded for the kernels (the kernels read the
job's page count there, and copy no page past it: a kernel node sized for its shape's largest
chunk serves every job of the shape), so a :class:`CudaJobGraph` holds the whole schedule
(:class:`~kvtier.copy.jobgraph.JobGraph`) as a CUDA graph: kernel nodes (kvtier's gather or scatter, :class:`~kvtier.copy.kernels.RowKernels`)
and copy nodes, with the schedule's edges, after a first copy node that uploads the job's numbers
from the lanes' page-locked ring (a plain ``cudaMemcpyAsync`` of them cost 10-25 us of host time
on an H100's host, an update 3-4 us). Per job: one ``cudaGraphExecMemcpyNodeSetParams1D`` per
chunk and one for the upload (addresses and sizes), and one ``cudaGraphLaunch``.

Fixed when built, so the owner (:class:`~kvtier.copy.lanes.CudaLanes`) retires a graph when
any of it changes: the kernels' arguments (engine rows, staging buffers, the device address the
job's numbers are uploaded to, pages per launch, the block geometry), each copy's staging side,
the edges.

Ordering: launched on the TRANSFER lane (the side stream), a graph runs after everything issued
there before (every earlier job's kernels too: a job ends with that lane waiting for its KERNEL
lane, so its upload never overwrites numbers a kernel still reads) and before everything issued
after; so the
copy engine's events order it against the compute stream as they order a job issued op by op.
A launch does not wait for the previous launch of the same graph to finish on the host: an
update applies to later launches only (CUDA's contract for executable graph updates).

Buffers: a launch takes the job's host addresses and sizes as lists (copied into the graph); the
ring words a launch uploads from stay untouched until it ran (the lanes fence them,
:meth:`~kvtier.copy.lanes.CudaLanes._take`). Calling thread only (the one that issues the forward);
:meth:`destroy` once no launch of the graph is in flight.
"""

from __future__ import annotations

from typing import Any

from kvtier.copy.base import Direction
from kvtier.copy.cudart import CudaRuntime
from kvtier.copy.jobgraph import JobGraph, graph_pages
from kvtier.copy.staged_runs import StagedRuns


class CudaJobGraph:
    """One job shape's instantiated CUDA graph; ``copies[c]``: the node of chunk ``c``'s host copy;
    ``upload``: the node that copies the job's numbers from page-locked host memory to the device
    address the kernels read (``uploaded``), before any of them runs."""

    def __init__(self, runtime: CudaRuntime, graph: int, instance: int, copies: list[int],
                 staging: list[int], upload: int, uploaded: int):
        self.runtime = runtime
        self.graph, self.instance = graph, instance
        self.copies = copies
        # each copy's staging-side address: the same for every job of the graph's shape (its
        # direction's buffers, its chunking), so only the host side and the sizes are read per launch
        self.staging = staging
        self.upload, self.uploaded = upload, uploaded

    @classmethod
    def build(cls, runtime: CudaRuntime, kernels: Any, plan: StagedRuns, uploaded: int, page_bytes: int,
              numbers: int, upload_from: int) -> CudaJobGraph:
        """The graph of ``plan``'s shape (:func:`~kvtier.copy.jobgraph.graph_key`), its copies at
        ``plan``'s addresses, each kernel node sized for the largest chunk of the shape
        (:func:`~kvtier.copy.jobgraph.graph_pages`); ``uploaded``: the device address the job's
        ``numbers`` int64 numbers are uploaded to (the same for every job of the graph) from
        page-locked ``upload_from`` (per job: :meth:`launch`); ``kernels``:
        :class:`~kvtier.copy.kernels.RowKernels`. Raises :class:`~kvtier.copy.cudart.CudaError`
        (nothing is left allocated)."""
        schedule = JobGraph.record(plan)
        dsts, srcs, sizes = (a.tolist() for a in plan.copy_addresses())
        graph = runtime.graph_create()
        try:
            upload = runtime.graph_add_memcpy(graph, [], uploaded, upload_from, 8 * numbers)
            nodes: list[int] = []
            copies = [0] * plan.num_chunks
            for node in schedule.nodes:
                after = [nodes[i] for i in node.after] or [upload]  # the schedule's first operations
                if node.op == "transfer":
                    c = node.chunk
                    handle = copies[c] = runtime.graph_add_memcpy(graph, after, dsts[c], srcs[c], sizes[c])
                else:
                    handle = kernels.add_node(graph, after, node.op, plan.rows_address,
                                              plan.buffers.address_list[node.buffer], uploaded, node.first,
                                              graph_pages(node.pages, plan.chunk_pages, plan.num_chunks), page_bytes,
                                              blocks=plan.kernel_blocks())
                nodes.append(handle)
            instance = runtime.graph_instantiate(graph)
        except Exception:
            runtime.graph_destroy(graph)
            raise
        return cls(runtime, graph, instance, copies, plan.staging_addr.tolist(), upload, uploaded)

    def launch(self, direction: Direction, host_addrs: list[int], sizes: list[int], stream: int,
               numbers_at: int, numbers: int) -> None:
        """Issue a job of this graph's shape and ``direction`` on ``stream``: its chunks' host
        addresses and copy sizes, its ``numbers`` int64 numbers uploaded from page-locked
        ``numbers_at`` (left untouched until the launch ran). Raises
        :class:`~kvtier.copy.cudart.CudaError` (then nothing of the job was launched)."""
        runtime, instance = self.runtime, self.instance
        set_memcpy = runtime.graph_set_memcpy
        set_memcpy(instance, self.upload, self.uploaded, numbers_at, 8 * numbers)
        if direction is Direction.STORE:
            dsts, srcs = host_addrs, self.staging
        else:
            dsts, srcs = self.staging, host_addrs
        for node, dst, src, size in zip(self.copies, dsts, srcs, sizes):
            set_memcpy(instance, node, dst, src, size)
        runtime.graph_launch(instance, stream)

    def destroy(self) -> None:
        """Free the graph (no launch of it in flight)."""
        self.runtime.graph_destroy(self.graph, self.instance)

