"""A staged job shape as one CUDA graph, replayed per job with that job's host addresses.

Issued op by op (:meth:`~kvtier.copy.staging.StagedRuns.issue`), a staged job costs the thread
that issues the forward ~6 device calls per chunk: 4-32 chunks for a 512-block job. Jobs of one
shape (:func:`~kvtier.copy.jobgraph.graph_key`: direction, pages, one host run per chunk) differ
only in the host address of each chunk's copy and in the numbers uploaded for the kernels, so a
:class:`CudaJobGraph` holds the whole schedule (:class:`~kvtier.copy.jobgraph.JobGraph`) as a
CUDA graph: kernel nodes (kvtier's gather or scatter, :class:`~kvtier.copy.kernels.RowKernels`)
and copy nodes, with the schedule's edges. Per job: one ``cudaGraphExecMemcpyNodeSetParams1D``
per chunk and one ``cudaGraphLaunch``.

Fixed when built, so the owner (:class:`~kvtier.copy.lanes.CudaLanes`) retires a graph when
any of it changes: the kernels' arguments (engine rows, staging buffers, the device address the
job's numbers are uploaded to, pages per launch, the block geometry), each copy's staging side
and size, the edges.

Ordering: launched on the TRANSFER lane (the side stream), after the job's upload issued there,
a graph runs after everything issued there before and before everything issued after; so the
copy engine's events order it against the compute stream as they order a job issued op by op.
A launch does not wait for the previous launch of the same graph to finish on the host: an
update applies to later launches only (CUDA's contract for executable graph updates).

Buffers: the plan's arrays are read by :meth:`CudaJobGraph.launch` only (the addresses are
copied into the graph). Calling thread only (the one that issues the forward); :meth:`destroy`
once no launch of the graph is in flight.
"""

from __future__ import annotations

from typing import Any

from kvtier.copy.base import Direction
from kvtier.copy.cudart import CudaRuntime
from kvtier.copy.jobgraph import JobGraph
from kvtier.copy.staging import StagedRuns


class CudaJobGraph:
    """One job shape's instantiated CUDA graph; ``copies[c]``: the node of chunk ``c``'s host copy."""

    def __init__(self, runtime: CudaRuntime, graph: int, instance: int, copies: list[int],
                 staging: list[int] | None = None, sizes: list[int] | None = None):
        self.runtime = runtime
        self.graph, self.instance = graph, instance
        self.copies = copies
        # each copy's staging-side address and size: the same for every job of the graph's shape
        # (its direction's buffers, its chunking), so only the host side is read per launch
        self.staging, self.sizes = staging, sizes

    @classmethod
    def build(cls, runtime: CudaRuntime, kernels: Any, plan: StagedRuns, uploaded: int, page_bytes: int
              ) -> CudaJobGraph:
        """The graph of ``plan``'s shape, its copies at ``plan``'s addresses; ``uploaded``: the
        device address the job's numbers are uploaded to (the same for every job of the graph);
        ``kernels``: :class:`~kvtier.copy.kernels.RowKernels`. Raises
        :class:`~kvtier.copy.cudart.CudaError` (nothing is left allocated)."""
        schedule = JobGraph.record(plan)
        dsts, srcs, sizes = (a.tolist() for a in plan.copy_addresses())
        graph = runtime.graph_create()
        try:
            nodes: list[int] = []
            copies = [0] * plan.num_chunks
            for node in schedule.nodes:
                after = [nodes[i] for i in node.after]
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
        return cls(runtime, graph, instance, copies, plan.staging_addr.tolist(), plan.sizes.tolist())

    def launch(self, plan: StagedRuns, stream: int) -> None:
        """Issue ``plan`` (of this graph's shape, its numbers already uploaded) on ``stream``.
        Raises :class:`~kvtier.copy.cudart.CudaError` (then nothing of the job was launched)."""
        runtime, instance = self.runtime, self.instance
        set_memcpy = runtime.graph_set_memcpy
        if self.staging is None or self.sizes is None:
            dsts, srcs, sizes = (a.tolist() for a in plan.copy_addresses())
        elif plan.direction is Direction.STORE:
            dsts, srcs, sizes = plan.host_addr.tolist(), self.staging, self.sizes
        else:
            dsts, srcs, sizes = self.staging, plan.host_addr.tolist(), self.sizes
        for node, dst, src, size in zip(self.copies, dsts, srcs, sizes):
            set_memcpy(instance, node, dst, src, size)
        runtime.graph_launch(instance, stream)

    def destroy(self) -> None:
        """Free the graph (no launch of it in flight)."""
        self.runtime.graph_destroy(self.graph, self.instance)

