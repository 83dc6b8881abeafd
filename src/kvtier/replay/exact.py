"""One size point of a replay, through kvtier's own code: the orchestrator (lookup across tiers,
promotion, cascade), the host tier's index with its LRU or ARC policy and tails, ``store_threshold``
admission, the disk tier's index, and the connector's per-request decisions
(:mod:`kvtier.runtime.requests`: the hit with its tail, the offload limit, the tails a request
leaves), in the order the connector's scheduler side calls them:

- a request starts: :func:`~kvtier.runtime.requests.find_hit` beyond the engine's own hit (asked
  again while blocks are promoted from disk or Redis, as vLLM asks again next step), then its
  prompt's full blocks up to the offload limit are offered in one batch (``begin_stores``: a block
  any tier has is touched, else admitted or not, and given a host slot), its hold is released (its
  load is done) and the stores finish (READY, cascaded to disk and Redis);
- it finishes: the full blocks of its answer are offered one at a time (vLLM completes one every
  block of decode steps; only with ``offload_prompt_only`` off), then its tails (its load, which
  is asynchronous, was done a step before it computed anything).

Every job of the simulated tiers completes at the next poll. Nothing here knows vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.policy.admission import StoreAdmission
from kvtier.replay.sim_tiers import SimDiskTier, SimRemoteTier
from kvtier.replay.workload import FINISH, START, ReplayRequest, ReplaySettings
from kvtier.runtime.orchestrator import HostBytes, Orchestrator
from kvtier.runtime.requests import find_hit, offload_limit, tail_ends
from kvtier.tiers.base import Medium
from kvtier.tiers.host import HostIndex
from kvtier.tiers.stack import BlockInfo

MAX_ASKS = 64
"""Lookups of one request before the replay gives up on a tier that keeps saying "ask again"
(the simulated tiers answer at the next poll: one retry per tier is the most a lookup needs)."""


@dataclass(frozen=True)
class TierSizes:
    """One size point in blocks: host slots, disk bytes (the disk tier's bound is in bytes) and its
    block's bytes, remote records. 0 disk or remote: no such tier."""

    host_slots: int
    disk_bytes: int = 0
    disk_block_bytes: int = 1
    remote_blocks: int = 0


@dataclass
class Served:
    """Prompt tokens of a replay by where they came from, and what the tiers did."""

    requests: int = 0
    prompt_tokens: int = 0
    engine: int = 0
    host: int = 0
    disk: int = 0
    remote: int = 0
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def kvtier(self) -> int:
        return self.host + self.disk + self.remote

    @property
    def computed(self) -> int:
        return self.prompt_tokens - self.engine - self.kvtier

    def by_tier(self) -> dict[str, int]:
        return {"engine": self.engine, "host": self.host, "disk": self.disk, "remote": self.remote,
                "computed": self.computed}


def build_orchestrator(sizes: TierSizes, settings: ReplaySettings) -> Orchestrator:
    """kvtier's orchestrator over a host index of ``sizes.host_slots`` and the simulated tiers."""
    tiers = []
    if sizes.disk_bytes:
        tiers.append(SimDiskTier(sizes.disk_bytes, sizes.disk_block_bytes))
    if sizes.remote_blocks:
        tiers.append(SimRemoteTier(sizes.remote_blocks, sizes.disk_block_bytes))
    return Orchestrator(
        host=HostIndex(sizes.host_slots, settings.eviction_policy, settings.run_coldness),
        host_bytes=HostBytes([memoryview(bytearray(0))], 0) if tiers else None,
        tiers=tiers,
        admission=StoreAdmission(settings.store_threshold, settings.max_tracker_size),
    )


class PointReplay:
    """Feeds a trace's events to one orchestrator; :attr:`served` accumulates the outcome."""

    def __init__(self, sizes: TierSizes, settings: ReplaySettings):
        if sizes.host_slots < 1:
            raise ValueError("the host tier needs at least one slot")
        self.settings = settings
        self.orchestrator = build_orchestrator(sizes, settings)
        self.served = Served()
        self._stored: dict[int, int] = {}  # running request -> full blocks offered so far

    def feed(self, kind: str, request: ReplayRequest) -> None:
        if kind == START:
            self._start(request)
        elif kind == FINISH:
            self._finish(request)

    def _limit(self, request: ReplayRequest, computed: int, num_tokens: int) -> int:
        return offload_limit(computed, num_tokens, request.prompt_tokens, prompt_only=self.settings.offload_prompt_only,
                             max_offload_tokens=request.max_offload_tokens)

    def _start(self, request: ReplayRequest) -> None:
        orch, served = self.orchestrator, self.served
        owner = str(request.index)
        chain = request.chain
        prompt = request.prompt_tokens
        hit = None
        for _ in range(MAX_ASKS):
            hit = find_hit(orch, owner, chain, prompt, request.engine_hit, tails=self.settings.tails)
            if hit is not None:
                break
            orch.poll()
        served.requests += 1
        served.prompt_tokens += prompt
        served.engine += request.engine_hit
        if hit is not None:
            served.host += hit.by_source.get(Medium.HOST, 0)
            served.disk += hit.by_source.get(Medium.DISK, 0)
            served.remote += hit.by_source.get(Medium.REMOTE, 0)
        full = self._limit(request, prompt, prompt) // chain.block_tokens
        self._store(chain, 0, min(full, len(chain.keys)), release=owner)
        self._stored[request.index] = min(full, len(chain.keys))

    def _store(self, chain, first: int, end: int, *, release: str | None = None, one_by_one: bool = False) -> None:
        """Offer full blocks ``first..end-1`` (one batch, or one per step), then finish them."""
        orch = self.orchestrator
        block = chain.block_tokens
        batches = [[i] for i in range(first, end)] if one_by_one else [list(range(first, end))]
        for batch in batches:
            if not batch and release is None:
                continue
            asked = [(chain.keys[i], BlockInfo(chain.parent_of(i), block)) for i in batch]
            slots = orch.begin_stores(asked)
            if release is not None:
                orch.release(release)
                release = None
            orch.finish_store([key for (key, _), slot in zip(asked, slots) if slot is not None], ok=True)
            orch.poll()

    def _finish(self, request: ReplayRequest) -> None:
        chain = request.chain
        block = chain.block_tokens
        computed = request.computed_tokens
        limit = self._limit(request, computed, computed + 1)
        first = self._stored.pop(request.index)
        self._store(chain, first, min(limit // block, len(chain.keys)), one_by_one=True)
        if not self.settings.tails:
            return
        orch = self.orchestrator
        begun = []  # the connector begins both tails in request_finished; they commit together a step later
        for end in tail_ends(limit, request.prompt_tokens):
            index, tokens = divmod(end, block)
            if not tokens or len(chain.keys) < index:
                continue
            try:
                key = chain.tail_key_of(index, end)
            except KeyError:  # an access log that did not record this tail
                continue
            [slot] = orch.begin_stores([(key, BlockInfo(chain.parent_of(index), tokens, tail=True))])
            if slot is not None:
                begun.append(key)
        orch.finish_store(begun, ok=True)
        orch.poll()

    def result(self) -> Served:
        stats = self.orchestrator.take_stats()
        served = self.served
        served.counters = {
            "host_evictions": stats.host_evictions, "stores_submitted": stats.stores_submitted,
            "stores_skipped_threshold": stats.stores_skipped_threshold, "stores_dropped": stats.stores_dropped,
            "promotions": stats.promotions,
            "disk_evictions": sum(t.evictions for t in self.orchestrator.tiers if t.medium is Medium.DISK),
            "remote_evictions": sum(t.evictions for t in self.orchestrator.tiers if t.medium is Medium.REMOTE),
        }
        return served


def replay_point(events: Sequence[tuple[str, ReplayRequest]], sizes: TierSizes, settings: ReplaySettings) -> Served:
    """Replay ``events`` (from :func:`kvtier.replay.workload.replay_events`) at one size point."""
    point = PointReplay(sizes, settings)
    for kind, request in events:
        point.feed(kind, request)
    return point.result()
