"""Worker-side half of the connector: runs the copy jobs the scheduler planned.

Runs in each vLLM worker process; vLLM calls every hook on the worker's main thread.

- Loads (host slots -> engine blocks) are asynchronous for vLLM: the request waits in
  WAITING_FOR_REMOTE_KVS, in no batch, until its load is reported. They start in
  ``start_load_kv`` (vLLM 0.32 calls it after the step's forward is launched, in both runners),
  ordered after the engine work issued before (:mod:`kvtier.copy.base`); the request is reported in
  ``finished_recving`` once copied, also in ``failed_recving`` if the copy failed: vLLM then
  recomputes the whole request, and it puts the blocks into its prefix cache only after a load
  that succeeded. (A synchronous load's blocks are cached when allocated, and vLLM 0.32 keeps
  them cached after a failed one, unwritten, for the request to recompute in place: an abort,
  a preemption or a chunked recompute first would let another request hit them.) Slow tiers
  never reach this path: the scheduler promotes disk blocks into host slots first.
- Stores (engine blocks -> host slots) start in ``wait_for_save``, after the forward queued its KV
  writes, and complete in the background; when vLLM is about to reuse blocks a pending store
  reads (preemption), this side waits for it.
- Every job is reported to the scheduler (worker metadata) only once its copies completed.

Owns rank ``r``'s host region: creates it in ``register_kv_caches`` and unlinks its name at
shutdown (the scheduler normally unlinks it first, right after attaching).

Attached to a kvtier node (``node`` in the connector config, :mod:`kvtier.runtime.node_host`):
rank ``r``'s region holds its page description only; its slots are the node pool's, which each
rank maps itself (the memfd the service passes at hello, over its own connection) and copies into
and out of; bytes never cross the socket. A job names the pool its slots belong to (``pool_id``):
a rank mapping another pool (the service restarted) first reattaches, waiting for its copies in
flight to finish (they keep the old mapping alive), and fails the job if the ids still differ, so
no store is copied into one pool and committed in another. A failed load is recomputed by vLLM.
A rank whose service is not running yet at start-up maps the pool at the first job that names one.

Replicated KV (``EngineGeometry.replicated``: MLA under tensor parallelism, every rank holds the
same latent): one copy is stored, rank 0's. Rank 0 creates the only region; every other rank
attaches it (and checks that its own pages are laid out exactly as rank 0 published), loads from
it like rank 0, and stores nothing: its store jobs are reported done at once (the scheduler still
waits for rank 0's copy, as it waits for every rank's report).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.v1.kv_cache_interface import KVCacheConfig

from kvtier.copy import CopyEngine, Direction, HostPinning, HostSlots, PagedKV, make_copy_engine, pin_host_memory
from kvtier.copy.base import CopyDone, page_table
from kvtier.node import NodeClient, NodeError, NodeUnavailable
from kvtier.node.protocol import Role
from kvtier.runtime.node_host import NODE_REGION_BYTES, connect_node
from kvtier.tiers.shm import SharedRegion, region_name
from kvtier.vllm.geometry import EngineGeometry
from kvtier.vllm.metadata import CopyJob, KVTierConnectorMetadata, KVTierWorkerMetadata
from kvtier.vllm.page_format import attention_backends, describe_pages, encode_description
from kvtier.vllm.rocm_layout import rocm_shuffled_kv_cache

logger = logging.getLogger(__name__)


class KVTierWorker:
    def __init__(self, vllm_config: VllmConfig, geometry: EngineGeometry, kv_cache_config: KVCacheConfig,
                 node: str | None = None, node_uid: int | None = None):
        """``node``: the connector config's ``node`` socket (None: an embedded host region);
        ``node_uid``: its ``node_uid``."""
        self.vllm_config = vllm_config
        self.node = node
        self.node_uid = node_uid
        self._node: NodeClient | None = None
        self._pool_id: str | None = None
        self._paged: PagedKV | None = None
        self._carried: list[CopyDone] = []  # completions of a copy engine replaced at a reattach, or failed jobs
        self.geometry = geometry
        self.rank = vllm_config.parallel_config.rank
        self.num_blocks = kv_cache_config.num_blocks
        self.kv_cache_layout = kv_cache_config.kv_cache_layout
        self.region: SharedRegion | None = None
        self.copies: CopyEngine | None = None
        self._buffer: torch.Tensor | None = None
        self._pinning = HostPinning(None, [])
        self._load_req: dict[int, str] = {}  # load job -> its request
        self._meta = KVTierWorkerMetadata()
        # False only on ranks > 0 with replicated KV: rank 0's copy is everyone's
        self._stores_pages = not geometry.replicated or self.rank == 0

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = self.geometry.layout
        # Each layer's pages as vLLM sized them, padding included (padded attention, skip-quantized
        # sliding-window and Mamba state pages; per-layer sizes in a mixed-type group).
        paged = PagedKV([kv_caches[name] for name in self.geometry.layer_names], self.num_blocks,
                        self.geometry.layer_groups or None, self.geometry.layer_page_bytes or None)
        if paged.page_bytes != layout.page_bytes:
            raise RuntimeError(
                f"kvtier: engine KV page is {paged.page_bytes} B but the KV cache spec says {layout.page_bytes} B"
            )
        names = self.geometry.layer_names
        description = describe_pages(
            kv_caches, names, self.num_blocks, attention_backends(self.vllm_config, names), self.kv_cache_layout,
            rocm_shuffled=rocm_shuffled_kv_cache(),
        )
        published = encode_description(description)
        region_bytes = layout.region_bytes if self.node is None else NODE_REGION_BYTES
        if self._stores_pages:
            self.region = SharedRegion.create(region_name(self.geometry.engine_id, self.rank), region_bytes)
            atexit.register(self.region.unlink)  # in case no scheduler ever attached and unlinked it
            self.region.publish(published)  # the scheduler folds it into the namespace
        else:  # replicated KV: rank 0's region (attach waits until rank 0 created and described it)
            self.region = SharedRegion.attach(region_name(self.geometry.engine_id, 0), region_bytes)
            if self.region.description != published:
                raise RuntimeError(
                    f"kvtier: rank {self.rank}'s KV pages are laid out differently from rank 0's, so the KV "
                    "cannot be stored once for all ranks (replicated MLA latent); this is a bug, please "
                    "report it with both ranks' attention backends"
                )
        if self.node is not None:
            self._paged = paged
            self._node = connect_node(self.node, engine=f"{self.geometry.engine_id}/rank{self.rank}",
                                      role=Role.WORKER, slot_bytes=layout.slot_bytes, node_uid=self.node_uid)
            if self._node.connected:  # else it maps the pool at the first job that names one
                self._map_pool()
            return
        buffer = self._buffer = torch.frombuffer(self.region.view, dtype=torch.uint8)
        self._pinning = pin_host_memory(buffer, layout.slot_bytes)
        self.copies = make_copy_engine(paged, HostSlots(buffer, layout))

    # --- the node pool ---------------------------------------------------------------------
    def _map_pool(self) -> None:
        """Build the copy engine over the pool the node client just attached to (its mapping is
        this worker's from now on: the tensors view it until they are dropped)."""
        assert self._node is not None and self._paged is not None
        mapping = self._node.take_pool()
        attachment = self._node.attachment
        assert mapping is not None and attachment is not None, "a worker's hello always carries the pool"
        layout = dataclasses.replace(self.geometry.layout, num_slots=mapping.num_slots)
        if mapping.stride != layout.slot_bytes:
            raise RuntimeError(
                f"kvtier: this engine's blocks are {layout.slot_bytes} bytes per rank, not a multiple of 4 KiB, so "
                f"they cannot be laid out contiguously in the kvtier node's pool (slot stride {mapping.stride}); "
                "remove 'node' from the connector config, or use another 'block_size'")
        buffer = self._buffer = torch.frombuffer(mapping.view, dtype=torch.uint8, count=layout.region_bytes)
        self._pinning = pin_host_memory(buffer, layout.slot_bytes)
        self.copies = make_copy_engine(self._paged, HostSlots(buffer, layout))
        self._pool_id = attachment.pool_id
        logger.info("kvtier: rank %d mapped the kvtier node's pool %s (%d slots)", self.rank, self._pool_id,
                    mapping.num_slots)

    def _reattach(self) -> None:
        """The scheduler works in another pool (the service restarted): finish this rank's copies
        on the old one, then map the new one. On failure the old engine stays (its jobs fail)."""
        assert self._node is not None
        try:
            self._node.connect()
        except (NodeUnavailable, NodeError) as exc:
            logger.warning("kvtier: rank %d cannot reattach to the kvtier node: %s", self.rank, exc)
            return
        if self.copies is not None:
            self.copies.wait()
            self._carried.extend(self.copies.poll())
            self.copies.close()
            self.copies = None
        self._pinning.release()
        self._map_pool()

    def _runnable(self, job: CopyJob, direction: Direction) -> CopyJob | None:
        """``job`` with this rank's slots, if its slots are in the pool this rank maps (reattaching
        first if the pool changed) and its pin still held (not ``lost``); else None, and the job
        is reported failed."""
        if job.pool_id is None or self._node is None:
            return job
        if job.lost:  # its pin went with a lost connection: the slots may be another block's now
            self._carried.append(CopyDone(job.job_id, direction, False, 0, 0.0))
            return None
        if job.pool_id != self._pool_id:
            self._reattach()
        if job.pool_id != self._pool_id:
            self._carried.append(CopyDone(job.job_id, direction, False, 0, 0.0))
            return None
        if job.rank_slots is not None and self.rank > 0:
            job = dataclasses.replace(job, pages=rank_pages(job, self.rank))
        return job

    def handle_preemptions(self, meta: KVTierConnectorMetadata) -> None:
        """Before the step writes any block: finish the stores whose blocks vLLM hands out again
        in this step. A store sent in this same step (a finished request's tail, read from blocks
        vLLM freed at finish) starts here first, before the wait; :meth:`start_stores` then skips it."""
        if not meta.flush_job_ids:
            return
        self._start_stores([job for job in meta.stores if job.job_id in meta.flush_job_ids])
        if self.copies is not None:
            self.copies.wait(meta.flush_job_ids)

    def start_loads(self, meta: KVTierConnectorMetadata) -> None:
        """Start this step's loads into the engine blocks (asynchronous: their requests are in no
        batch until :meth:`take_transfer_results` reports them)."""
        for job in meta.loads:
            self._load_req[job.job_id] = job.req_id
            runnable = self._runnable(job, Direction.LOAD)
            if runnable is None:
                continue
            assert self.copies is not None
            self.copies.start_load(job.job_id, runnable.pages, synchronous=False)

    def start_stores(self, meta: KVTierConnectorMetadata) -> None:
        """Start this step's stores (after the forward queued its KV writes), but those
        :meth:`handle_preemptions` started already."""
        self._start_stores([job for job in meta.stores if job.job_id not in meta.flush_job_ids])

    def _start_stores(self, jobs: list[CopyJob]) -> None:
        for job in jobs:
            if not self._stores_pages:
                self._meta.completed[job.job_id] = 1  # nothing to copy here: rank 0 stores the one copy
                continue
            runnable = self._runnable(job, Direction.STORE)
            if runnable is None:
                continue
            assert self.copies is not None
            self.copies.start_store(job.job_id, runnable.pages)

    def take_transfer_results(self) -> KVConnectorTransferResults:
        """Collect completed copies. ``finished_recving``: the requests whose load is done, also
        in ``failed_recving`` if it failed (vLLM recomputes the whole request). Never
        ``finished_sending``: kvtier delays no block frees (the scheduler's reuse fence keeps a
        store's blocks intact instead)."""
        results = KVConnectorTransferResults()
        if self.copies is None and not self._carried:
            return results
        finished, self._carried = self._carried, []
        for done in finished + (self.copies.poll() if self.copies is not None else []):
            self._meta.completed[done.job_id] = 1
            if done.method:
                self._meta.copy_methods[done.method] = self._meta.copy_methods.get(done.method, 0) + 1
            if not done.ok:
                self._meta.failed[done.job_id] = 1
            if done.direction is Direction.LOAD:
                req_id = self._load_req.pop(done.job_id)
                results.finished_recving.add(req_id)
                if done.ok:
                    self._meta.host_to_engine.record(done.num_bytes, done.seconds)
                else:
                    results.failed_recving.add(req_id)
                continue
            self._meta.engine_to_host.record(done.num_bytes, done.seconds)
        return results

    def take_worker_meta(self) -> KVTierWorkerMetadata | None:
        meta = self._meta
        if not meta.completed and not meta.failed:
            return None
        self._meta = KVTierWorkerMetadata()
        return meta

    def unregister_kv_caches(self) -> None:
        """Sleep mode (vLLM 0.33): finish every copy in flight, then undo the host pinning. The
        engine steps no request while asleep, so no job starts before :meth:`restore_kv_caches`;
        finished jobs are reported by the next step as usual. Idempotent."""
        if self.copies is not None:
            self.copies.wait()
        self._pinning.release()

    def restore_kv_caches(self) -> None:
        """After sleep mode: pin the host region again. The engine's KV tensors keep their
        addresses (vLLM's sleep allocator remaps the same virtual range), so the copy engine's
        views and address arrays stay valid. Idempotent."""
        if self._buffer is not None and not self._pinning.pinned:
            self._pinning = pin_host_memory(self._buffer, self.geometry.layout.slot_bytes)

    def shutdown(self) -> None:
        if self.copies is not None:
            self.copies.close()
            self.copies = None
        self._pinning.release()
        if self.region is not None and self._stores_pages:
            self.region.unlink()
        if self._node is not None:
            self._node.close()


def rank_pages(job: CopyJob, rank: int) -> np.ndarray:
    """``job``'s page table with ``rank``'s slots (``job.rank_slots``: rank 0's slot -> every
    rank's); the job's own table is left as it is."""
    pages = page_table(job.pages).copy()
    if job.rank_slots is not None:
        pages[:, 0] = [job.rank_slots[slot][rank] for slot in pages[:, 0].tolist()]
    return pages
