"""kvtier's disk, Redis and S3 tiers as vLLM secondary tiers (``SecondaryTierManager``, 0.32 and 0.33).

Configured in the ``secondary_tiers`` of vLLM's ``TieringOffloadingSpec`` (or kvtier's
:class:`~kvtier.vllm.native.spec.KVTierOffloadingSpec`) with the keys of kvtier's own tiers::

    {"type": "kvtier_disk", "root_dir": "/var/cache/kvtier", "capacity_bytes": 200000000000}
    {"type": "kvtier_redis", "url": "redis://cache:6379/0"}
    {"type": "kvtier_s3", "url": "s3://bucket/kvcache", "capacity_bytes": 2000000000000}

(the type names come from kvtier's ``vllm.general_plugins`` entry point; without plugins, add
``"module_path": "kvtier.vllm.native"``). Two keys more than kvtier's own tiers: ``model_identity``
(names the weights where they cannot be fingerprinted), ``keep_on_reset`` (see ``drain_jobs``) and
vLLM's ``locality``.

What vLLM does with a tier, and what this one does in turn (vLLM's tiering/base.py and manager.py):

- construction, in the scheduler process: the keys are checked (a bad one stops vLLM with the key's
  name) and the model's weights fingerprinted; the storage opens once vLLM has set its block-hash
  seed (:mod:`kvtier.vllm.native.seed`), a few milliseconds later, on a thread of its own, from what
  the construction's check found of its server (one that did not answer is not asked again: the tier
  starts off, :mod:`kvtier.tiers.factory`). Until then lookups answer RETRY (vLLM asks again next
  step) and stores fail (each only a future miss);
- every call below comes from the scheduler thread (0.33: possibly its tier-poll thread, never
  concurrently: vLLM holds its manager lock), and answers from memory;
- ``lookup``: HIT / MISS from the tier's index; kvtier_redis answers RETRY while an EXISTS probe is
  in flight, kvtier_s3 while a HEAD probe is (:class:`~kvtier.tiers.presence.PresenceCache`; the S3
  tier also knows what its background LIST found);
- ``submit_store`` / ``submit_load``: one kvtier tier job per chunk, run on the tier's threads
  against the rows vLLM pinned; ``get_finished_jobs`` reports each vLLM job once, with the chunks
  that failed left out (a failed chunk is a miss; its record is quarantined or forgotten, so it is
  not offered again);
- ``drain_jobs`` waits for every job (never cuts a copy). vLLM calls it only from its manager's
  ``reset_cache`` (0.32 and 0.33: ``reset_prefix_cache(reset_connector=True)``, which
  ``pause_generation`` does before a weight update or a sleep), so the tier then moves to a new key
  epoch: nothing stored before is offered to this engine again, as with kvtier's own connector
  (:func:`~kvtier.core.keys.epoch_root`; nothing is deleted). ``"keep_on_reset": true`` keeps
  offering it (vLLM's own choice for its secondary tiers: right only if the weights never change
  in place);
- ``take_events`` reports what this process stored and what left the tier (vLLM turns them into KV
  events, medium STORAGE); ``get_stats`` adds kvtier's counters (:mod:`kvtier.vllm.native.metrics`);
- ``shutdown`` finishes the jobs and closes the tier; a namespace of a per-process hash seed (no
  other process could ever read it) is removed then, or at exit if vLLM exits without a shutdown
  (kvtier_disk: its directories; kvtier_redis, kvtier_s3: its values / objects, at shutdown only).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
from collections.abc import Collection, Iterable
from typing import Any, ClassVar

import vllm.envs as vllm_envs
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.core.keys import Namespace, draw_epoch
from kvtier.core.values import bool_value
from kvtier.core.tier_config import DiskTierConfig, RedisTierConfig, S3TierConfig, TierType, parse_tier
from kvtier.runtime.chunks.identity import HashSeed, model_identity, private_seed_warning
from kvtier.runtime.chunks.rows import Rows
from kvtier.runtime.chunks.run import config_json, namespace
from kvtier.runtime.chunks.store import ChunkStore
from kvtier.tiers.base import SecondaryTier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk.owners import mark_owned, reclaim_orphans
from kvtier.tiers.factory import check_tier, open_tier, open_wait_ends
from kvtier.vllm.logs import share_vllm_log_handlers
from kvtier.vllm.native import metrics
from kvtier.vllm.native.run_facts import engine_run
from kvtier.vllm.native.seed import SeedWatcher

logger = logging.getLogger(__name__)

OPEN_REPORT_S = 60.0
"""A tier not open this long after vLLM set its seed says so in the log (a hung mount, a slow scan)."""
ONE_PROCESS_WAIT_S = 0.002
"""The longest a step of vLLM's one-process engine waits for a load of this tier (see on_schedule_end)."""
SHUTDOWN_DRAIN_S = 30.0
"""How long a shutdown waits for the chunks still being written (or waiting for room) to land."""
PRIVATE_TTL_S = 3600
"""The longest a Redis value of a per-process namespace lives (its process may die without a shutdown)."""
_ANSWERS = (LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY)


def _miss(key: bytes, req_context: ReqContext | None = None) -> LookupResult:
    return LookupResult.MISS



class VllmTierAdapter(SecondaryTierManager):
    """Adapts one kvtier tier (disk, Redis, the node pool) to vLLM's ``SecondaryTierManager`` API,
    through a :class:`~kvtier.runtime.chunks.store.ChunkStore`; a subclass names its kind, locality
    and place."""

    kind: ClassVar[TierType]
    default_locality: ClassVar[Locality]
    tolerates_off_thread_polling: ClassVar[bool] = False  # vLLM 0.33: polled per step only (0.32 ignores it)

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, **tier_keys: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        share_vllm_log_handlers()
        locality = tier_keys.pop("locality", None)
        operator_identity = tier_keys.pop("model_identity", None)
        self.keep_on_reset = bool_value(tier_keys, "keep_on_reset", default=False, where=f"secondary_tiers[{tier_type}]")
        tier_keys.pop("keep_on_reset", None)
        self.locality = Locality(locality) if locality is not None else self.default_locality
        self.config = parse_tier(tier_keys, self.kind, where=f"secondary_tiers[{tier_type}]")
        check_tier(self.config, where=f"secondary_tiers[{tier_type}]")  # ConfigError stops start-up
        self.run = engine_run(offloading_spec)
        self.model = model_identity(self.run.model_name, self.run.kv_dtype, operator_identity)
        self._rows = Rows(primary_kv_view, self.run.copies, self.run.payload_bytes)
        self._events = bool(offloading_spec.kv_events_config.enable_kv_cache_events)
        self._one_process = not vllm_envs.VLLM_ENABLE_V1_MULTIPROCESSING
        self._metrics = metrics.TierMetrics(tier_type)
        self._failed: list[JobResult] = []  # jobs refused before the storage opened
        self._store: ChunkStore | None = None
        self._lookup = self._lookup_while_opening  # then _miss (open_wait_ends), or the store's once open
        self.seed: HashSeed | None = None
        self._epoch = b""  # the key epoch (drain_jobs); guarded by _epoch_lock with the store's creation
        self._epoch_lock = threading.Lock()
        self._opening = threading.Event()
        self._opening.set()
        self._opening_since = time.monotonic()
        self._retry_until = open_wait_ends(self._opening_since)  # "ask again" until then (factory.OPEN_WAIT_S)
        self._watcher = SeedWatcher(self._open, self._open_failed, name=f"kvtier-{tier_type}-open")
        logger.info("kvtier %s: %s; %d-token chunks of %d rank record(s) x %.2f MiB; opens once vLLM "
                    "has set its block-hash seed", tier_type, self.describe(), self.run.chunk_tokens,
                    self.run.copies, self.run.payload_bytes / 2**20)

    # ------------------------------------------------------------------ opening (the watcher's thread)

    def _open(self, seed: HashSeed) -> None:
        ns = namespace(self.run, self.model, seed)
        self._opening_since = time.monotonic()
        report = threading.Timer(OPEN_REPORT_S, self._report_slow_open)
        report.daemon = True
        report.start()
        config = self.config
        if not seed.shared and isinstance(config, RedisTierConfig):
            config = dataclasses.replace(config, ttl_seconds=min(config.ttl_seconds or PRIVATE_TTL_S, PRIVATE_TTL_S))
        tier = self._make_tier(config, ns, seed)
        self._opened(tier, seed)
        self.seed = seed
        with self._epoch_lock:  # a reset before the storage opened counts too
            self._store = ChunkStore(tier, self._rows, namespace_digest=ns.engine_digest,
                                     chunk_tokens=self.run.chunk_tokens, record_residency=self._events,
                                     answers=_ANSWERS)
            if self._epoch:
                self._store.new_epoch(self._epoch)
        if not seed.shared:
            logger.warning(private_seed_warning(self.tier_type, seed))
            # also when vLLM exits without shutting its connector down (one-process mode, a crash)
            atexit.register(self._remove_private_namespace, tier)
        logger.info("kvtier %s: namespace %s (hash %s, seed %s %s)", self.tier_type, ns.engine_digest.hex()[:16],
                    seed.algorithm, seed.kind.value, seed.digest[:12])
        self._lookup = self._store.lookup  # lookups see the storage from here on
        if type(self).lookup is VllmTierAdapter.lookup:
            # vLLM's calls then reach the store's lookup without this class's frame (same arguments,
            # vLLM's own answers): ~40 ns of ~150 per chunk. A subclass that overrides lookup keeps it.
            self.lookup = self._store.lookup  # type: ignore[method-assign]
        self._opening.clear()

    def _open_failed(self, exc: BaseException) -> None:
        logger.error("kvtier %s: cannot open (%s: %s); it serves misses and stores nothing",
                     self.tier_type, type(exc).__name__, exc)
        self._lookup = _miss
        self._opening.clear()

    def _report_slow_open(self) -> None:
        if self._opening.is_set() and self._store is None:
            logger.error("kvtier %s: %s is still not open %.0f s after vLLM set its seed (a hung mount or "
                         "server, a large root without a snapshot?): lookups are misses until it opens",
                         self.tier_type, self.describe(), time.monotonic() - self._opening_since)

    def _make_tier(self, config: Any, ns: Namespace, seed: HashSeed) -> SecondaryTier:
        """Open the storage (the watcher's thread): kvtier's tier of this kind for ``config``."""
        return open_tier(config, model_name=self.run.model_name, namespace=ns,
                         namespace_json=config_json(ns, self.run, seed), payload_bytes=self.run.payload_bytes,
                         where=f"secondary_tiers[{self.tier_type}]")

    def _opened(self, tier: SecondaryTier, seed: HashSeed) -> None:
        """The storage is open (the watcher's thread, before lookups see it)."""

    def describe(self) -> str:
        raise NotImplementedError

    # ------------------------------------------------------------------ vLLM's calls

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        # The scheduler's hot path, once per chunk per lookup pass: the store's lookup answers in
        # vLLM's own values. Until the storage is open: "ask again" for factory.OPEN_WAIT_S, then misses.
        return self._lookup(key, req_context)

    def _lookup_while_opening(self, key: bytes, req_context: ReqContext | None = None) -> LookupResult:
        return LookupResult.RETRY if time.monotonic() <= self._retry_until else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        store = self._store
        if store is None:
            self._failed.append(JobResult(job_id=job_metadata.job_id, success=False))
            return
        store.submit_store(job_metadata.job_id, list(job_metadata.keys), job_metadata.chunk_ids)

    def submit_load(self, job_metadata: TransferJob) -> None:
        store = self._store
        if store is None:  # vLLM loads only what lookup() called a HIT, which needs the store
            self._failed.append(JobResult(job_id=job_metadata.job_id, success=False))
            return
        store.submit_load(job_metadata.job_id, list(job_metadata.keys), job_metadata.chunk_ids)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results, self._failed = self._failed, []
        if self._store is not None:
            for outcome in self._store.poll():
                results.append(JobResult(
                    job_id=outcome.job_id, success=outcome.ok,
                    successful_keys=outcome.ok_keys or None,
                    transfer_time=outcome.seconds, transfer_bytes=outcome.num_bytes))
        return results

    def on_schedule_end(self, context: Any) -> None:
        """vLLM's one-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) steps again at once when
        a step computes nothing, holding the GIL, so this tier's reader threads wait up to the 5 ms
        switch interval each time they need it back (its multiprocess engine core sleeps 1 ms per
        idle step for this reason). While a load of this tier is in flight, a step there ends by
        waiting for the tier's next outcome, at most :data:`ONE_PROCESS_WAIT_S`: the scheduler's
        one bounded wait, in that mode only."""
        store = self._store
        if store is not None and self._one_process and store.reading:
            store.wait_for_outcome(ONE_PROCESS_WAIT_S)

    def has_pending_work(self) -> bool:
        return bool(self._failed) or (self._store is not None and self._store.busy)

    def touch(self, keys: Collection[bytes], req_context: ReqContext) -> None:
        if self._store is not None:
            self._store.touch(list(keys))

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Request-level offloading: vLLM then offers this tier every chunk of the request, the
        prefix it already holds included (0.32's connector never calls :meth:`touch`). A chunk the
        tier holds is touched, not written again (:class:`~kvtier.runtime.chunks.store.ChunkStore`):
        this is how a prefix that stays hot in vLLM's own tiers stays recent here."""
        return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._store is None:
            return ()
        return [OffloadingEvent(keys=keys, medium=Medium.STORAGE, removed=removed, locality=self.locality,
                                ownership=self.tier_type)
                for removed, keys in self._store.take_residency()]

    def drain_jobs(self) -> None:
        """Wait for every job; then (vLLM resets its cache: see the module doc) a new key epoch."""
        store = self._store
        if store is not None:
            store.drain()
        if self.keep_on_reset:
            return
        with self._epoch_lock:
            self._epoch = draw_epoch()
            if self._store is not None:
                self._store.new_epoch(self._epoch)
        logger.info("kvtier %s: vLLM reset its offloading cache: new key epoch; what the tier holds from before is "
                    "not offered to this engine again (keep_on_reset: false)", self.tier_type)

    def shutdown(self) -> None:
        self._watcher.stop()
        store, self._store = self._store, None
        self._lookup = _miss
        if self.__dict__.get("lookup") is not None and store is not None and self.__dict__["lookup"] == store.lookup:
            del self.lookup  # the class's lookup again: misses
        if store is None:
            self._rows.release()
        else:
            private = self.seed is not None and not self.seed.shared
            if not private and not store.drain(SHUTDOWN_DRAIN_S):  # what the engine stored is kept
                logger.warning("kvtier %s: shutting down with %d chunks not written after %.0f s (dropped)",
                               self.tier_type, store.waiting, SHUTDOWN_DRAIN_S)
            store.close(clear=private and self.kind in (TierType.REDIS, TierType.S3))
            if private:
                self._remove_private_namespace(store.tier)

    def _remove_private_namespace(self, tier: SecondaryTier) -> None:
        """Remove what is left of a per-process namespace once its tier is closed (disk: its
        directories; Redis: nothing, its values were cleared). Runs at shutdown, and at exit."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return metrics.definitions()

    def get_stats(self) -> Any:
        return None if self._store is None else self._metrics.take(self._store)

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        """vLLM 0.33's ``vllm:kv_offload_config_info`` labels (0.32 never calls it)."""
        return ("kvtier_location", "kvtier_capacity_bytes", "kvtier_weights")

    def config_info(self) -> dict[str, str | int]:
        return {"kvtier_location": self.location(), "kvtier_capacity_bytes": self.capacity(),
                "kvtier_weights": self.model.weights[:23]}

    def location(self) -> str:
        raise NotImplementedError

    def capacity(self) -> int:
        return 0


class KVTierDiskTier(VllmTierAdapter):
    """kvtier's disk tier (checksummed records, a bound shared by every engine on the root)."""

    medium: ClassVar[Medium] = Medium.STORAGE
    kind = TierType.FS
    default_locality = Locality.LOCAL
    config: DiskTierConfig

    def _opened(self, tier: SecondaryTier, seed: HashSeed) -> None:
        """A per-process namespace is marked with its owner, so that whoever opens the root after
        this process died without a shutdown (SIGKILL, OOM) removes it; such namespaces of dead
        processes are removed now."""
        assert isinstance(tier, DiskTier)
        if not seed.shared:
            mark_owned(tier.namespace_dir)
        reclaim_orphans(self.config.root_dir)

    def _remove_private_namespace(self, tier: SecondaryTier) -> None:
        """Nobody else can read a per-process namespace: its directories go whole (records, ledger,
        config.json), after the tier's writers stopped (shutdown; at exit, Python joined them)."""
        import shutil

        assert isinstance(tier, DiskTier)
        for directory in (tier.namespace_dir, *(tier.rank_dir(r) for r in range(self.run.copies))):
            shutil.rmtree(directory, ignore_errors=True)

    def describe(self) -> str:
        return f"{self.config.root_dir} ({self.config.capacity_bytes / 2**30:.1f} GiB)"

    def location(self) -> str:
        return str(self.config.root_dir)

    def capacity(self) -> int:
        return self.config.capacity_bytes


class KVTierRedisTier(VllmTierAdapter):
    """kvtier's Redis / Valkey tier (shared by engines; a server that is down only costs misses).
    Medium STORAGE, locality REMOTE, as vLLM's own remote store (``obj``); hits EXTERNAL_UNSPECIFIED,
    vLLM's source for a remote store (the DISK it would derive from STORAGE would be false). Each
    tier class sets ``cache_hit_source`` itself: vLLM's ``__init_subclass__`` derives it from the
    medium for every class whose own ``__dict__`` lacks it, so a shared base would not do."""

    medium: ClassVar[Medium] = Medium.STORAGE
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED
    kind = TierType.REDIS
    default_locality = Locality.REMOTE
    config: RedisTierConfig

    def describe(self) -> str:
        return self.config.redacted_url()

    def location(self) -> str:
        return self.config.redacted_url()


class KVTierS3Tier(VllmTierAdapter):
    """kvtier's S3 tier (an S3-compatible object store shared by the fleet, bounded by a sweep; a store
    that is down only costs misses). Medium STORAGE, locality REMOTE, as vLLM's own object-store tier
    (``obj``); hits EXTERNAL_UNSPECIFIED, vLLM's source for a remote store."""

    medium: ClassVar[Medium] = Medium.STORAGE
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED
    kind = TierType.S3
    default_locality = Locality.REMOTE
    config: S3TierConfig

    def describe(self) -> str:
        bound = f"{self.config.capacity_bytes / 2**30:.1f} GiB" if self.config.capacity_bytes else "no capacity_bytes"
        return f"{self.config.location} ({bound})"

    def location(self) -> str:
        return self.config.location

    def capacity(self) -> int:
        return self.config.capacity_bytes or 0
