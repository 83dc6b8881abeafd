"""What crosses the scheduler <-> worker boundary each step (pickled by vLLM).

Scheduler -> workers: :class:`KVTierConnectorMetadata` (copy jobs to run).
Workers -> scheduler: :class:`KVTierWorkerMetadata` (jobs each worker finished), summed across
ranks by vLLM with :meth:`KVTierWorkerMetadata.aggregate`; the scheduler acts on a job once all
``world_size`` workers reported it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvtier.copy.base import SlotRun
from kvtier.core.stats import KVTierStats, TransferCounters


@dataclass
class CopyJob:
    job_id: int
    req_id: str
    pages: np.ndarray | SlotRun  # [n, 4] int64 (slot, sub, block_id, group) rows (kvtier.copy.page_table), or
    # a job of one host run as a SlotRun (first slot, engine blocks); slots: rank 0's (every rank's, unless
    # rank_slots says otherwise). Arrays, not PageCopy tuples: vLLM's multiprocess executor pickles the
    # metadata to the workers each step (512 tuples: ~0.5 ms; the array: ~10 us)
    # Attached to a kvtier node: the pool the slots belong to (a worker mapping another pool
    # reattaches, else fails the job), and rank 0's slot -> every stored rank's slot, when a
    # block's slots differ between ranks (tensor parallelism). None: embedded host tier.
    pool_id: str | None = None
    rank_slots: dict[int, tuple[int, ...]] | None = None
    # A load whose pin went with a lost node connection (HostSide.hold_lost): the service released
    # it, so its slots may hold another block now; every worker reports the job failed, copying nothing.
    lost: bool = False


@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):
    loads: list[CopyJob] = field(default_factory=list)  # host -> engine, run after the forward
    stores: list[CopyJob] = field(default_factory=list)  # engine -> host, run after the forward
    # stores to finish BEFORE the step writes anything (their blocks are handed out again); one of
    # this step's own stores among them (a finished request's tail) is started first
    flush_job_ids: set[int] = field(default_factory=set)


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    completed: dict[int, int] = field(default_factory=dict)  # job id -> number of workers done
    failed: dict[int, int] = field(default_factory=dict)  # job id -> number of workers that failed it
    engine_to_host: TransferCounters = field(default_factory=TransferCounters)
    host_to_engine: TransferCounters = field(default_factory=TransferCounters)
    copy_methods: dict[str, int] = field(default_factory=dict)  # copy jobs by how they moved (CopyDone.method)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVTierWorkerMetadata)
        merged = KVTierWorkerMetadata(dict(self.completed), dict(self.failed))
        for methods in (self.copy_methods, other.copy_methods):
            for method, jobs in methods.items():
                merged.copy_methods[method] = merged.copy_methods.get(method, 0) + jobs
        for job_id, count in other.completed.items():
            merged.completed[job_id] = merged.completed.get(job_id, 0) + count
        for job_id, count in other.failed.items():
            merged.failed[job_id] = merged.failed.get(job_id, 0) + count
        for name in ("engine_to_host", "host_to_engine"):
            counters = getattr(merged, name)
            counters.add(getattr(self, name))
            counters.add(getattr(other, name))
        return merged


@dataclass
class KVTierConnectorStats(KVConnectorStats):
    """vLLM connector stats: ``data`` is :meth:`KVTierStats.as_dict` (flat, additive)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        total = KVTierStats.from_dict(self.data).add(KVTierStats.from_dict(other.data))
        self.data = total.as_dict()
        return self

    def reduce(self) -> dict[str, int | float]:
        stats = KVTierStats.from_dict(self.data)
        reduced: dict[str, Any] = {
            "lookups": stats.lookups,
            "hit_tokens_host": stats.hit_tokens_host,
            "hit_tokens_disk": stats.hit_tokens_disk,
            "hit_tokens_remote": stats.hit_tokens_remote,
            "hit_tokens_s3": stats.hit_tokens_s3,
            "stores_dropped": stats.stores_dropped,
            "stores_voided": stats.stores_voided,
            "checksum_failures": stats.checksum_failures,
            "auth_failures": stats.auth_failures,
        }
        for direction in ("engine_to_host", "host_to_engine", "host_to_disk", "disk_to_host", "host_to_remote",
                          "remote_to_host", "host_to_s3", "s3_to_host"):
            counters: TransferCounters = getattr(stats, direction)
            reduced[f"{direction}_MB"] = round(counters.bytes / 1e6, 1)
            if counters.seconds > 0:
                reduced[f"{direction}_GBps"] = round(counters.bytes / counters.seconds / 1e9, 2)
        return reduced

    def is_empty(self) -> bool:
        return KVTierStats.from_dict(self.data).is_empty()
