"""The host side of an engine attached to a ``kvtier node`` service: the node's pool is its host tier.

The :class:`~kvtier.runtime.host_side.HostSide` chosen when the connector config has
``"node": "<socket>"``. An attached engine has no disk or Redis tier of its own (the config refuses
them): the service owns the node's (``kvtier node --disk-dir/--redis-url``) and runs the same
promotion and cascade over its pool as an embedded engine runs over its host tier
(:class:`~kvtier.tiers.stack.TierStack`, :mod:`kvtier.node.tiers`). A lookup whose run continues
there is answered ``pending`` while the service promotes the blocks into the pool: :meth:`acquire`
answers RETRY, and vLLM's scheduler asks again; the answer that pins them says which tier each was
promoted from (the lookup reply's ``sources``), so the engine reports its hits by tier as an
embedded engine does (``kvtier_hit_tokens{tier}``, vLLM's cached tokens by source). Lives in vLLM's scheduler process and is driven by
ONE thread (the scheduler's). It never touches the pool's bytes: the workers copy engine pages <->
pool slots themselves (:mod:`kvtier.vllm.worker_side`).

Every call is one request/reply on the node socket (memory-only work on the service; a call
blocks at most the client's ``timeout_s``), batched per request or per step:

- :meth:`NodeHost.acquire`: ONE ``lookup(keys, pin=True, width)`` for all of a request's keys: the
  leading READY run, pinned under one handle held for the owner (the request);
- :meth:`NodeHost.begin_stores`: ONE ``reserve`` for all the blocks a step stores;
- :meth:`NodeHost.finish_store`: one ``commit`` (or ``abort``) per finished store job;
- :meth:`NodeHost.release`: one ``unpin`` of the owner's handle.

Failure is a miss, never an error: a service that is gone, or not started yet when the engine
starts (:class:`~kvtier.node.NodeUnavailable`), answers "no hit" and "store dropped" (counted in
``node_unavailable``) and the client attaches by itself on a later call (``retry_interval_s``); a
refused request (:class:`~kvtier.node.NodeError`) is logged (once per message) and handled the same
way. Only a service that answers at start-up and refuses the engine stops it (:func:`connect_node`).

Generations (a restarted service has a new, empty pool with another ``pool_id``): every hold and
reservation remembers the client's attachment ``generation`` it was made in. One of an older
generation is forgotten, never sent to the new service (its pin handle would name another
session's pin there; its reservation is not this session's, so it is never committed), and a load
planned from such a hold fails (:meth:`NodeHost.hold_lost`): the service released the pin when the
connection closed, so its slots may hold another engine's block by then, even in the same pool
(a call timed out and the client reattached to the same service). Copy jobs
carry the ``pool_id`` of their slots (:attr:`NodeHost.pool_id`), so a worker never copies into or
out of a pool other than the one the scheduler reserved or pinned in.

Slots: a block of an engine with ``width`` stored ranks has ``width`` slots, not necessarily the
same number on every rank; :meth:`NodeHost.held_slots` and :meth:`NodeHost.begin_stores` return
each block's slots as a tuple, rank order.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.core.keys import BlockKey
from kvtier.core.residency import Medium
from kvtier.core.stats import KVTierStats
from kvtier.core.values import ConfigError
from kvtier.node import NodeClient, NodeError, NodeUnavailable
from kvtier.node.protocol import Reservation, Role
from kvtier.policy.admission import StoreAdmission
from kvtier.runtime.host_side import Acquired, AcquireStatus
from kvtier.tiers.stack import BlockInfo

logger = logging.getLogger(__name__)

RETRY_PAUSE_S = 0.002
"""How long an idle engine step pauses after a RETRY answer before it asks the service again."""
USAGE_SAMPLE_S = 1.0
"""The pool's usage (a ``stats`` round trip) is sampled at most this often for the engine's gauges."""


@dataclass
class _NodeHold:
    """A request's pinned run in the pool: its keys, their slots (``width`` each) and the pin handle."""

    generation: int
    handle: int
    pool_id: str | None  # the pool its slots are in
    keys: list[BlockKey] = field(default_factory=list)
    slots: list[tuple[int, ...]] = field(default_factory=list)
    promoted: dict[BlockKey, Medium] = field(default_factory=dict)  # held keys the service promoted, by source


class NodeHost:
    """See the module docstring. ``client`` is attached by :func:`connect_node`, or attaches on a
    later call."""

    def __init__(self, client: NodeClient, width: int, admission: StoreAdmission):
        self.client = client
        self.width = width
        self.admission = admission
        self.stats = KVTierStats()
        self._holds: dict[str, _NodeHold] = {}
        self._writing: dict[BlockKey, tuple[int, BlockInfo]] = {}  # reserved, not yet committed -> (generation, info)
        self._asked_again = False  # the last acquire answered RETRY (the service is promoting)
        self._said: set[str] = set()
        self._usage: tuple[float, dict] | None = None

    # --- state of the attachment ------------------------------------------------------------
    @property
    def pool_id(self) -> str | None:
        """The pool the current attachment's slot numbers belong to (None while detached)."""
        attachment = self.client.attachment
        return attachment.pool_id if attachment is not None else None

    def _failed(self, exc: Exception) -> None:
        if isinstance(exc, NodeUnavailable):
            self.stats.node_unavailable += 1
            if "unavailable" not in self._said:
                self._said.add("unavailable")
                logger.warning("kvtier: %s: lookups are misses and stores are dropped until it answers again "
                               "(counted in kvtier_node_unavailable)", exc)
        elif str(exc) not in self._said:
            self._said.add(str(exc))
            logger.warning("kvtier: the node service refused a request: %s", exc)

    def _attached(self) -> None:
        """After a call that succeeded: note a (re)attachment for the log."""
        if "unavailable" in self._said:
            self._said.discard("unavailable")
            logger.info("kvtier: attached to the kvtier node at %s again (pool %s)", self.client.socket_path,
                        self.pool_id)

    # --- lookups ----------------------------------------------------------------------------
    def locate(self, key: BlockKey) -> Medium | None:
        """HOST if the pool holds ``key`` READY (one round trip), else None."""
        return Medium.HOST if self.leading_run([key]) else None

    def leading_run(self, keys: Sequence[BlockKey]) -> int:
        """Blocks at the start of ``keys`` the pool holds READY (one round trip, nothing pinned)."""
        if not keys:
            return 0
        try:
            hit = self.client.lookup(keys, width=self.width)
            return hit.hits + hit.below
        except (NodeUnavailable, NodeError) as exc:
            self._failed(exc)
            return 0

    def acquire(self, owner: str, keys: Sequence[BlockKey], first_parent: BlockKey | None = None,
                block_tokens: int = 0, *, tail_tokens: int = 0) -> Acquired:
        """Pin the leading READY run of ``keys`` in the pool for ``owner`` (replacing any earlier
        hold of it): one lookup. RETRY when the run continues in the service's tiers (it promotes
        those blocks into the pool meanwhile; the run found so far stays pinned until the next
        call). A tail, if ``tail_tokens``, is the last of ``keys`` like any other key: the service
        keeps tails apart itself."""
        self.release(owner)
        if not keys:
            return Acquired(AcquireStatus.READY, 0)
        try:  # the chain names what the service promotes, for its faster tiers (a remote hit kept on disk)
            hit = self.client.lookup(keys, pin=True, width=self.width, parent=first_parent,
                                     block_tokens=block_tokens, tail_tokens=tail_tokens)
        except (NodeUnavailable, NodeError) as exc:
            self._failed(exc)
            return Acquired(AcquireStatus.READY, 0)
        self._attached()
        promoted: dict[BlockKey, Medium] = {}
        if hit.hits:
            width = self.width
            slots = [tuple(hit.slots[i * width:(i + 1) * width]) for i in range(hit.hits)]
            promoted = {key: medium for key, medium in zip(keys, hit.sources) if medium is not None}
            self._holds[owner] = _NodeHold(self.client.generation, hit.pin, self.pool_id, list(keys[:hit.hits]),
                                           slots, promoted)
        self._asked_again = hit.pending
        if hit.pending:
            self.stats.lookups_retried += 1
            return Acquired(AcquireStatus.RETRY, hit.hits)
        return Acquired(AcquireStatus.READY, hit.hits, dict(Counter(promoted.values())))

    def promoted_source(self, owner: str, key: BlockKey) -> Medium | None:
        """The tier the service promoted ``owner``'s held ``key`` from for it (None: it was in the pool)."""
        hold = self._holds.get(owner)
        return hold.promoted.get(key) if hold else None

    def held(self, owner: str) -> list[BlockKey]:
        hold = self._holds.get(owner)
        return list(hold.keys) if hold else []

    def held_slots(self, owner: str) -> list[tuple[int, ...]]:
        """The slots (one per stored rank) of each of ``owner``'s held blocks, in key order."""
        hold = self._holds.get(owner)
        return list(hold.slots) if hold else []

    def held_pool(self, owner: str) -> str | None:
        """The pool ``owner``'s held slots are in (its load job names it: after a service restart
        a worker mapping another pool fails the job rather than read another pool's slots)."""
        hold = self._holds.get(owner)
        return hold.pool_id if hold else None

    def hold_lost(self, owner: str) -> bool:
        """Whether ``owner``'s pin went with the attachment it was made in: the client lost that
        connection since (a call timed out or failed; maybe reattached to the same service, the same
        ``pool_id``), and the service released the pin when it closed, so the slots may hold other
        blocks now. A load planned from such a hold must fail (vLLM recomputes), never copy."""
        hold = self._holds.get(owner)
        return hold is not None and (hold.generation != self.client.generation or not self.client.connected)

    def trim_hold(self, owner: str, num_blocks: int) -> None:
        """Keep only the first ``num_blocks`` of ``owner``'s hold. The service pins a run under one
        handle, so the rest stays pinned until :meth:`release` (a request's lifetime at most)."""
        hold = self._holds.get(owner)
        if hold is not None:
            for key in hold.keys[num_blocks:]:
                hold.promoted.pop(key, None)
            del hold.keys[num_blocks:]
            del hold.slots[num_blocks:]

    def release(self, owner: str) -> None:
        """Unpin ``owner``'s hold (one round trip; nothing to do if it belongs to an older attachment:
        the service released it when that connection dropped). Idempotent."""
        hold = self._holds.pop(owner, None)
        if hold is None or hold.generation != self.client.generation or not self.client.connected:
            return
        try:
            self.client.unpin([hold.handle])
        except (NodeUnavailable, NodeError) as exc:
            self._failed(exc)

    # --- stores -----------------------------------------------------------------------------
    def begin_stores(self, blocks: Sequence[tuple[BlockKey, BlockInfo]]) -> list[tuple[int, ...] | None]:
        """Reserve pool slots for ``blocks`` (one round trip): each block's slots (one per stored
        rank) or None (stored already by any engine, refused by ``store_threshold``, or no room:
        the pool full of pinned blocks or this engine at its ``cpu_bytes_to_use`` cap)."""
        out: list[tuple[int, ...] | None] = [None] * len(blocks)
        asked: list[int] = []
        for index, (key, _info) in enumerate(blocks):
            if self.admission.offer(key):
                asked.append(index)
            else:
                self.stats.stores_skipped_threshold += 1
        if not asked:
            return out
        keys = [blocks[i][0] for i in asked]
        tails = [n for n, i in enumerate(asked) if blocks[i][1].tail]
        try:
            answers = self.client.reserve(keys, self.width, tails)
        except (NodeUnavailable, NodeError) as exc:
            self._failed(exc)
            self.stats.stores_dropped += len(keys)
            return out
        self._attached()
        generation = self.client.generation
        for index, key, (status, slots) in zip(asked, keys, answers, strict=True):
            if status is Reservation.RESERVED and slots is not None:
                out[index] = tuple(slots)
                self._writing[key] = (generation, blocks[index][1])
                self.stats.stores_submitted += 1
            elif status is not Reservation.PRESENT:
                self.stats.stores_dropped += 1
        return out

    def begin_store(self, key: BlockKey, info: BlockInfo) -> tuple[int, ...] | None:
        return self.begin_stores([(key, info)])[0]

    def finish_store(self, keys: Sequence[BlockKey], ok: bool) -> None:
        """The workers copied ``keys`` into their slots (or failed): commit them, making them hits
        for every engine of the node, or abort them (one round trip). Reservations of an older
        attachment are forgotten: the service that made them is gone. A copied block that does not
        reach the pool that way (reserved by a service since gone, the service gone before or
        during the commit) is a dropped store, counted as one the pool refused at reserve
        (``stores_dropped``; behind vLLM's offloading, ``kvtier_node`` counts it so too)."""
        generation = self.client.generation
        mine, infos, lost = [], [], 0
        for key in keys:
            writing = self._writing.pop(key, None)
            if writing is not None and writing[0] == generation:
                mine.append(key)
                infos.append((writing[1].parent, writing[1].num_tokens, writing[1].tail))
            elif writing is not None:
                lost += 1
        if mine and self.client.connected:
            try:
                if ok:
                    self.client.commit(mine, infos)  # the service cascades them to its tiers
                else:
                    self.client.abort(mine)
                mine = []
            except (NodeUnavailable, NodeError) as exc:
                self._failed(exc)
        if ok:  # (a failed copy is aborted, not dropped: as an embedded engine's)
            self.stats.stores_dropped += lost + len(mine)

    # --- the rest of the orchestrator's surface ---------------------------------------------
    def poll(self) -> None:
        """Nothing to collect: the service runs its tiers' I/O."""

    def wait_for_tiers(self, timeout_s: float) -> bool:
        """After a RETRY (the service is promoting), let a step that computes nothing pause a
        little (at most ``timeout_s``, :data:`RETRY_PAUSE_S`) rather than ask again at once."""
        if not self._asked_again:
            return False
        time.sleep(min(timeout_s, RETRY_PAUSE_S))
        return True

    def has_pending_io(self) -> bool:
        return False

    def clear(self) -> None:
        """``reset_prefix_cache(reset_connector=True)``: the node's pool is every engine's, so one
        engine's reset deletes nothing from it (as from the secondary tiers); the engine's new key
        epoch keeps what the pool held from being offered to it again, unless ``keep_tiers_on_reset``
        (:meth:`kvtier.vllm.scheduler_side.KVTierScheduler.reset_cache`)."""
        if "clear" not in self._said:
            self._said.add("clear")
            logger.info("kvtier: a reset of the connector's cache deletes nothing from the kvtier node's pool "
                        "(other engines share it)")

    def take_stats(self) -> KVTierStats:
        """The counters since the last call, with this engine's share of the pool (sampled at most
        every :data:`USAGE_SAMPLE_S`)."""
        stats, self.stats = self.stats, KVTierStats()
        now = time.monotonic()
        if self._usage is None or now - self._usage[0] >= USAGE_SAMPLE_S:
            try:
                self._usage = (now, self.client.stats()) if self.client.connected else (now, {})
            except (NodeUnavailable, NodeError):
                self._usage = (now, {})
        usage = self._usage[1]
        mine = usage.get("engines", {}).get(self.client.engine)
        if mine is not None:
            stride = int(usage.get("slot_stride") or 0)
            capacity = int(usage.get("num_slots", 0)) * stride
            if self.client.cap_bytes is not None:
                capacity = min(capacity, self.client.cap_bytes)
            held = int(mine.get("held_slots", 0))
            stats.set_usage(Medium.HOST, held * stride, capacity, held // max(self.width, 1))
            stats.host_pinned_blocks = usage.get("pinned_blocks")
        return stats

    def close(self, drain_timeout_s: float = 0.0) -> None:
        """Release every hold and reservation of this engine, then disconnect (the service would
        release them on disconnect anyway; this makes it prompt and logged)."""
        for owner in list(self._holds):
            self.release(owner)
        generation = self.client.generation
        writing = [key for key, (gen, _info) in self._writing.items() if gen == generation]
        self._writing.clear()
        if writing and self.client.connected:
            try:
                self.client.abort(writing)
            except (NodeUnavailable, NodeError):
                pass
        self.client.close()


NODE_REGION_BYTES = 4096
"""An attached engine's per-rank shared-memory region holds its page description only (the
namespace reads it, as for an embedded host tier); its slots are the node pool's."""


def connect_node(socket_path: str, *, engine: str, role: Role, slot_bytes: int,
                 cap_bytes: int | None = None, map_pool: bool | None = None,
                 namespace: str | None = None, node_uid: int | None = None) -> NodeClient:
    """A client of the node service at ``socket_path``, for the connector config key ``node``;
    ``map_pool``: whether it maps the pool (default: its role's). Attached now if a service answers
    there; if none does (not started yet, restarting) it is only logged: the engine starts, misses,
    and the client attaches by itself once the service answers (every ``retry_interval_s``).
    Raises :class:`ConfigError` naming the key when a service answers and refuses this engine
    (another block size, another user). ``namespace``: a scheduler's namespace
    (:meth:`kvtier.core.keys.Namespace.config_json`), which the service's tiers store its blocks under.
    ``node_uid``: the config key ``node_uid``, a user the service may run as besides root and this
    process's (a service of anyone else is refused: a :class:`ConfigError`)."""
    client = NodeClient(socket_path, engine=engine, role=role, slot_bytes=slot_bytes, cap_bytes=cap_bytes,
                        map_pool=map_pool, namespace=namespace, node_uid=node_uid)
    try:
        client.connect()
    except NodeUnavailable as exc:
        logger.warning("kvtier: 'node' = %r: %s. The engine starts with misses (counted in kvtier_node_unavailable) "
                       "and attaches by itself once the service answers.", socket_path, exc)
    except NodeError as exc:
        raise ConfigError(f"kv_connector_extra_config: 'node' = {socket_path!r}: the service refused this "
                          f"engine: {exc}") from None
    return client
