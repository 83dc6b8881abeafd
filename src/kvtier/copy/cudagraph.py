"""A staged job shape as one CUDA graph, replayed per job with that job's host addresses.

Issued op by op (:meth:`~kvtier.copy.staging.StagedRuns.issue`), a staged job costs the thread
that issues the forward ~6 device calls per chunk: 4-32 chunks for a 512-block job. Jobs of one
shape (:func:`~kvtier.copy.jobgraph.graph_key`: direction, pages, one host run per chunk) differ
only in the host address of each chunk's copy and in the numbers uploaded for the kernels, so a
:class:`CudaJobGraph` holds the whole schedule (:class:`~kvtier.copy.jobgraph.JobGraph`) as a
CUDA graph: kernel nodes (kvtier's gather or scatter, :class:`~kvtier.copy.kernels.RowKernels`)
and copy nodes, with the schedule's edges, after a first copy node that uploads the job's numbers
from the lanes' page-locked ring (a plain ``cudaMemcpyAsync`` of them cost 10-25 us of host time
on an H100's host, an update 3-4 us). Per job: one ``cudaGraphExecMemcpyNodeSetParams1D`` per
chunk and one for the upload, and one ``cudaGraphLaunch``.

Fixed when built, so the owner (:class:`~kvtier.copy.lanes.CudaLanes`) retires a graph when
any of it changes: the kernels' arguments (engine rows, staging buffers, the device address the
job's numbers are uploaded to, pages per launch, the block geometry), each copy's staging side
and size, the edges.

Ordering: launched on the TRANSFER lane (the side stream), a graph runs after everything issued
there before (every earlier job's kernels too: a job ends with that lane waiting for its KERNEL
lane, so its upload never overwrites numbers a kernel still reads) and before everything issued
after; so the
copy engine's events order it against the compute stream as they order a job issued op by op.
A launch does not wait for the previous launch of the same graph to finish on the host: an
update applies to later launches only (CUDA's contract for executable graph updates).

Buffers: the plan's arrays are read by :meth:`CudaJobGraph.launch` only (the addresses are
copied into the graph); the ring words a launch uploads from stay untouched until it ran (the
lanes fence them, :meth:`~kvtier.copy.lanes.CudaLanes._take`). Calling thread only (the one that issues the forward); :meth:`destroy`
once no launch of the graph is in flight.
"""

from __future__ import annotations

from typing import Any

from kvtier.copy.base import Direction
from kvtier.copy.cudart import CudaRuntime
from kvtier.copy.jobgraph import JobGraph
from kvtier.copy.staging import StagedRuns


class CudaJobGraph:
    """One job shape's instantiated CUDA graph; ``copies[c]``: the node of chunk ``c``'s host copy;
    ``upload``: the node that copies the job's numbers (``upload_bytes``) from page-locked host
    memory to the device address the kernels read, before any of them runs."""

    def __init__(self, runtime: CudaRuntime, graph: int, instance: int, copies: list[int],
                 staging: list[int], sizes: list[int], upload: int, uploaded: int, upload_bytes: int):
        self.runtime = runtime
        self.graph, self.instance = graph, instance
        self.copies = copies
        # each copy's staging-side address and size: the same for every job of the graph's shape
        # (its direction's buffers, its chunking), so only the host side is read per launch
        self.staging, self.sizes = staging, sizes
        self.upload, self.uploaded, self.upload_bytes = upload, uploaded, upload_bytes

    @classmethod
    def build(cls, runtime: CudaRuntime, kernels: Any, plan: StagedRuns, uploaded: int, page_bytes: int,
              numbers: int, upload_from: int) -> CudaJobGraph:
        """The graph of ``plan``'s shape, its copies at ``plan``'s addresses; ``uploaded``: the
        device address the job's ``numbers`` int64 numbers are uploaded to (the same for every
        job of the graph) from page-locked ``upload_from`` (per job: :meth:`launch`);
        ``kernels``: :class:`~kvtier.copy.kernels.RowKernels`. Raises
        :class:`~kvtier.copy.cudart.CudaError` (nothing is left allocated)."""
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
                    table, blocks = plan.kernel_table(uploaded, node.first)
                    handle = kernels.add_node(graph, after, node.op, plan.rows_address,
                                              plan.buffers.address_list[node.buffer], table, node.pages, page_bytes,
                                              blocks=blocks)
                nodes.append(handle)
            instance = runtime.graph_instantiate(graph)
        except Exception:
            runtime.graph_destroy(graph)
            raise
        return cls(runtime, graph, instance, copies, plan.staging_addr.tolist(), plan.sizes.tolist(), upload,
                   uploaded, 8 * numbers)

    def launch(self, plan: StagedRuns, stream: int, numbers_at: int) -> None:
        """Issue ``plan`` (of this graph's shape) on ``stream``, its numbers uploaded from
        page-locked ``numbers_at`` (left untouched until the launch ran). Raises
        :class:`~kvtier.copy.cudart.CudaError` (then nothing of the job was launched)."""
        runtime, instance = self.runtime, self.instance
        set_memcpy = runtime.graph_set_memcpy
        set_memcpy(instance, self.upload, self.uploaded, numbers_at, self.upload_bytes)
        if plan.direction is Direction.STORE:
            dsts, srcs, sizes = plan.host_addr.tolist(), self.staging, self.sizes
        else:
            dsts, srcs, sizes = self.staging, plan.host_addr.tolist(), self.sizes
        for node, dst, src, size in zip(self.copies, dsts, srcs, sizes):
            set_memcpy(instance, node, dst, src, size)
        runtime.graph_launch(instance, stream)

    def destroy(self) -> None:
        """Free the graph (no launch of it in flight)."""
        self.runtime.graph_destroy(self.graph, self.instance)

