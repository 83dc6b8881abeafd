"""The node's disk and Redis tiers, owned by the ``kvtier node`` service: cascade and promotion.

With ``--disk-dir`` / ``--redis-url`` the service, not the engines, owns the tiers below its pool
(one writer per disk root, one Redis connection pool per node):

- **cascade**: a block an engine commits into the pool is written to each tier that lacks it
  (tails stay off Redis), its slots pinned by the service (:meth:`NodeIndex.hold`) until the write
  completes; a tier whose writes in flight are at their bound gets the block later, in order, as
  its writes complete (slot pinned meanwhile), as :class:`kvtier.runtime.orchestrator.Orchestrator`
  does. A pool eviction then loses nothing held below.
- **promotion**: a pinning lookup whose run continues below the pool reserves pool slots for the
  next blocks (writer: the service's own session, ``node:promoted``) and reads them there from the
  first tier that holds them; the lookup answers ``pending`` (the engine asks again: vLLM's
  scheduler is told RETRY). A finished promotion is *parked* for the session that asked (pinned)
  until one of its lookups needs no more promotions, so it is not evicted before it asks again.
  A Redis tier that does not know yet is asked to probe, and the answer is ``pending`` too.
- **namespaces**: the disk format keeps the namespace per root directory and every record's
  header names its digests, so tiers are opened per namespace: the first scheduler that says
  hello with a namespace description (:class:`NamespaceInfo`) opens them, on a helper thread
  (a disk scan or a Redis connect never runs on the loop). While they open, a pinning lookup
  that misses in the pool answers ``pending`` for at most :data:`OPEN_WAIT_S` (the first lookups
  after a restart are disk hits, not recomputes); past that, or if they fail to open, the
  namespace's blocks are pool-only (lookups miss below, commits are not cascaded).

Threads: every method runs on the service's loop thread (holding :attr:`NodeServer.lock`). The
tiers' workers post outcomes on their outboxes and ring :attr:`NodeTiers.bell` (a
:class:`Waker` the loop's selector watches); the loop then calls :meth:`NodeTiers.poll`, which
never waits. Buffers: reads go into and writes come from pool slots (the service's own mapping),
pinned or WRITING while the job runs; the tier drops its reference when the result comes out.

Guarantees are the tiers' own: records carry checksums and their namespace's digests; a corrupt
or foreign record read back is quarantined and answers a miss (counted in ``checksum_failures``),
never bytes into a slot that becomes READY. With a fleet key (``kvtier node --fleet-key-env``:
the tier configs' ``auth``) records are sealed, and one its keys did not sign is a miss
(``auth_failures``).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvtier.core.keys import KEY_BYTES, BlockKey
from kvtier.core.residency import Medium
from kvtier.core.tier_config import SecondaryTierConfig
from kvtier.node.index import EntryState, NodeEntry, NodeIndex, Session
from kvtier.node.protocol import Reservation
from kvtier.tiers.base import IoError, IoKind, IoResult, SecondaryTier, first_holder
from kvtier.tiers.factory import open_tier

log = logging.getLogger("kvtier.node")

OPEN_WAIT_S = 5.0
"""How long pinning lookups that miss in the pool are told to ask again while their namespace's
tiers are still opening."""

PROMOTER = "node:promoted"
"""The engine name the service's own promotions are charged to (its stats show them)."""


@dataclass(frozen=True)
class NamespaceInfo:
    """What the tiers need to know of an engine's namespace: sent in its scheduler's hello."""

    engine_digest: bytes
    ranks: tuple[bytes, ...]  # one digest per stored rank
    config_json: str
    model_name: str

    def rank_digests(self) -> list[bytes]:
        return list(self.ranks)

    def to_message(self) -> dict[str, Any]:
        return {"digest": self.engine_digest, "ranks": list(self.ranks), "json": self.config_json,
                "model": self.model_name}

    @classmethod
    def from_message(cls, raw: Any) -> NamespaceInfo:
        """Raises ValueError naming the field of hello's ``namespace`` that is wrong."""
        if not isinstance(raw, dict):
            raise ValueError("hello 'namespace' must be a map")
        digest, ranks = raw.get("digest"), raw.get("ranks")
        if not isinstance(digest, bytes) or len(digest) < 8:
            raise ValueError("hello 'namespace.digest' must be at least 8 bytes")
        if not isinstance(ranks, list) or not ranks or not all(
                isinstance(r, bytes) and len(r) == KEY_BYTES for r in ranks):
            raise ValueError(f"hello 'namespace.ranks' must list one {KEY_BYTES}-byte digest per stored rank")
        if not isinstance(raw.get("json"), str) or not isinstance(raw.get("model"), str):
            raise ValueError("hello 'namespace.json' and 'namespace.model' must be strings")
        return cls(digest, tuple(ranks), raw["json"], raw["model"])


class Waker(threading.Event):
    """A tier bell the loop's selector can wait on: each ``set`` also writes a byte to a socket
    pair whose :attr:`reader` the selector watches. ``set`` from any thread; the rest from the loop."""

    def __init__(self) -> None:
        super().__init__()
        self.reader, self._writer = socket.socketpair()
        self.reader.setblocking(False)
        self._writer.setblocking(False)

    def set(self) -> None:
        super().set()
        try:
            self._writer.send(b"\0")
        except OSError:  # full (the loop will drain it) or closed
            pass

    def drain(self) -> None:
        self.clear()
        try:
            while self.reader.recv(4096):
                pass
        except OSError:
            pass

    def close(self) -> None:
        self.reader.close()
        self._writer.close()


@dataclass
class _TierSet:
    """One namespace's tiers (fastest first), being opened or open."""

    namespace: NamespaceInfo
    opening: Future | None
    wait_until: float  # lookups are told to ask again until then while the tiers open
    tiers: tuple[SecondaryTier, ...] = ()
    waiting: dict[SecondaryTier, deque[tuple[BlockKey, NodeEntry, int, bool]]] = field(default_factory=dict)
    # Commits made while the tiers open (key, [parent, num_tokens, tail]), not pinned: cascaded
    # once they are open if still in the pool. At most the pool's slot count are remembered.
    before_open: deque[tuple[BlockKey, Any]] = field(default_factory=deque)


@dataclass(frozen=True, slots=True)
class _Read:
    key: BlockKey
    tier: SecondaryTier
    session: Session


@dataclass(frozen=True, slots=True)
class _Write:
    entry: NodeEntry
    tier: SecondaryTier


class NodeTiers:
    """The service's tiers below the pool, per namespace. See the module docstring."""

    def __init__(self, configs: tuple[SecondaryTierConfig, ...], pool: memoryview) -> None:
        self.configs = configs
        self.pool = pool  # the service's mapping of the whole pool
        self.bell = Waker()
        self.index: NodeIndex | None = None
        self.stride = self.slot_bytes = 0
        self.promoter = Session(0, PROMOTER)
        self._sets: dict[bytes, _TierSet] = {}
        self._opener = ThreadPoolExecutor(1, thread_name_prefix="kvtier-node-open")
        self._job_ids = iter(range(1, 1 << 62))
        self._reads: dict[int, _Read] = {}
        self._promoting: set[BlockKey] = set()
        self._writes: dict[int, _Write] = {}
        self.counts: dict[str, int] = {}

    def bind(self, index: NodeIndex, stride: int, slot_bytes: int) -> None:
        """The pool was cut (only while it holds nothing): its index and slot geometry."""
        self.index, self.stride, self.slot_bytes = index, stride, slot_bytes

    def _count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def _views(self, slots: tuple[int, ...]) -> list[memoryview]:
        return [self.pool[s * self.stride:s * self.stride + self.slot_bytes] for s in slots]

    # --- namespaces --------------------------------------------------------------------------
    def attach(self, session: Session, namespace: NamespaceInfo) -> None:
        """A scheduler said hello with its namespace: its tiers open (once, in the background)."""
        session.namespace = namespace.engine_digest
        if namespace.engine_digest in self._sets:
            return
        future = self._opener.submit(self._open, namespace, self.slot_bytes)
        future.add_done_callback(lambda _f: self.bell.set())
        self._sets[namespace.engine_digest] = _TierSet(namespace, future, time.monotonic() + OPEN_WAIT_S)

    def _open(self, namespace: NamespaceInfo, payload_bytes: int) -> tuple[SecondaryTier, ...]:
        tiers: list[SecondaryTier] = []
        for config in self.configs:  # cascade order: disk, then Redis
            tiers.append(open_tier(config, model_name=namespace.model_name, namespace=namespace,  # type: ignore[arg-type]
                                   namespace_json=namespace.config_json, payload_bytes=payload_bytes))
        return tuple(tiers)

    def _settle_open(self, tier_set: _TierSet) -> None:
        future = tier_set.opening
        if future is None or not future.done():
            return
        tier_set.opening = None
        try:
            tier_set.tiers = future.result()
        except Exception as exc:  # noqa: BLE001 (logged; the namespace stays pool-only)
            log.error("tiers of namespace %s could not open: %s (its blocks stay in the pool only)",
                      tier_set.namespace.engine_digest.hex()[:16], exc)
            return
        for tier in tier_set.tiers:
            tier.outbox.share_bell(self.bell)
            tier_set.waiting[tier] = deque()
        log.info("namespace %s: tiers %s open", tier_set.namespace.engine_digest.hex()[:16],
                 ", ".join(t.medium.value for t in tier_set.tiers))
        remembered, tier_set.before_open = tier_set.before_open, deque()
        for key, block in remembered:
            self._cascade(tier_set, key, block)

    def _tiers_of(self, session: Session, width: int) -> _TierSet | None:
        tier_set = self._sets.get(session.namespace) if session.namespace is not None else None
        if tier_set is None or not tier_set.tiers or len(tier_set.namespace.ranks) != width:
            return None
        return tier_set

    def _opening(self, session: Session) -> bool:
        """Whether ``session``'s tiers are still opening and its lookups may wait for them."""
        tier_set = self._sets.get(session.namespace) if session.namespace is not None else None
        return (tier_set is not None and tier_set.opening is not None
                and time.monotonic() < tier_set.wait_until)

    # --- lookups -----------------------------------------------------------------------------
    def after_lookup(self, session: Session, keys: list[BlockKey], hits: int, width: int, pin: bool
                     ) -> tuple[bool, int]:
        """The pool held ``keys[:hits]``: ``(pending, below)``. Without ``pin``: ``below`` = how many
        of the next keys a tier is known to hold (memory only). With ``pin``: promotions of the next
        keys start (all of the run at once) and ``pending`` says to ask again."""
        assert self.index is not None
        tier_set = self._tiers_of(session, width)
        pending, below = False, 0
        if tier_set is None and pin and hits < len(keys) and self._opening(session):
            return True, 0
        for position in range(hits, len(keys) if tier_set is not None else hits):
            key = keys[position]
            if self.index.entry(key) is not None:  # being promoted, stored, or READY at another width
                pending = pending or key in self._promoting
                break
            source, unknown = first_holder(tier_set.tiers, key)  # type: ignore[union-attr]
            if source is None:
                if unknown is not None and pin:
                    unknown.probe(keys[position:])
                    pending = True
                break
            below += 1
            if not pin:
                continue
            status, slots = self.index.reserve(self.promoter, [key], width)
            if status[0] is not Reservation.RESERVED or slots[0] is None:
                break
            job_id = next(self._job_ids)
            self._reads[job_id] = _Read(key, source, session)
            self._promoting.add(key)
            source.submit_read(job_id, key, self._views(slots[0]))
            pending = True
        if pin and not pending and session.parked:  # nothing more to wait for: what it needs is pinned now
            self.index.let_go(session.parked)
            session.parked = []
        return pending, below

    # --- cascade -----------------------------------------------------------------------------
    def committed(self, session: Session, keys: list[BlockKey], blocks: list[Any]) -> None:
        """``keys`` were committed by ``session`` with their ``[parent, num_tokens, tail]``: write
        each to the tiers of its namespace that lack it."""
        assert self.index is not None
        for key, block in zip(keys, blocks):
            entry = self.index.entry(key)
            if entry is None or entry.state is not EntryState.READY:
                continue
            tier_set = self._tiers_of(session, len(entry.slots))
            if tier_set is None:
                opening = self._sets.get(session.namespace) if session.namespace is not None else None
                if opening is None or opening.opening is None:
                    return  # no tiers for this namespace (none configured, failed to open, another width)
                if len(opening.before_open) < self.index.num_slots:
                    opening.before_open.append((key, block))
                else:
                    self._count("cascades_skipped_opening")
                continue
            self._cascade(tier_set, key, block)

    def _cascade(self, tier_set: _TierSet, key: BlockKey, block: Any) -> None:
        """Queue ``key`` (READY in the pool, else skipped) for each tier of ``tier_set`` that lacks
        it, held in the pool until written."""
        assert self.index is not None
        entry = self.index.entry(key)
        if (entry is None or entry.state is not EntryState.READY
                or len(entry.slots) != len(tier_set.namespace.ranks)):
            return
        parent, num_tokens, tail = bytes(block[0]), int(block[1]), bool(block[2])
        for tier in tier_set.tiers:
            if tier.contains(key) or (tail and tier.medium is Medium.REMOTE):
                continue
            held = self.index.hold(key)
            assert held is not None
            tier_set.waiting[tier].append((key, parent, num_tokens, tail))
            self._feed(tier_set, tier)

    def _feed(self, tier_set: _TierSet, tier: SecondaryTier) -> None:
        """Submit what waits for ``tier`` while it has room; drop it all (a future miss, counted)
        while it takes no writes (closed, server down)."""
        assert self.index is not None
        waiting = tier_set.waiting[tier]
        while waiting:
            room = tier.write_room()
            if room == 0:
                return
            key, parent, num_tokens, tail = waiting.popleft()
            entry = self.index.entry(key)
            assert entry is not None  # pinned since it was queued
            job_id = next(self._job_ids)
            if room is not None and tier.submit_write(job_id, key, parent, num_tokens, self._views(entry.slots),
                                                      tail=tail):
                self._writes[job_id] = _Write(entry, tier)
            else:
                self.index.let_go([entry])
                self._count(f"writes_dropped_{tier.medium.value.lower()}")

    # --- completions -------------------------------------------------------------------------
    def poll(self) -> None:
        """Apply the tiers' outcomes (loop thread; never waits)."""
        self.bell.drain()
        for tier_set in self._sets.values():
            self._settle_open(tier_set)
            for tier in tier_set.tiers:
                for result in tier.poll():
                    if result.kind is IoKind.WRITE:
                        self._written(result)
                    else:
                        self._read(result)
                if tier_set.waiting[tier]:
                    self._feed(tier_set, tier)

    def _written(self, result: IoResult) -> None:
        write = self._writes.pop(result.job_id, None)
        if write is None:
            return
        assert self.index is not None
        self.index.let_go([write.entry])
        medium = write.tier.medium.value.lower()
        self._count(f"written_{medium}" if result.ok else f"writes_dropped_{medium}")

    def _read(self, result: IoResult) -> None:
        read = self._reads.pop(result.job_id, None)
        if read is None:
            return
        assert self.index is not None
        self._promoting.discard(read.key)
        medium = read.tier.medium.value.lower()
        if not result.ok:
            self.index.abort(self.promoter, [read.key])
            self._count("promotion_failures")
            if result.error is IoError.CORRUPT:
                self._count("checksum_failures")
            elif result.error is IoError.UNAUTHENTICATED:
                self._count("auth_failures")
            log.warning("%s block %s unreadable (%s): a miss", medium, read.key.hex()[:16], result.error)
            return
        self.index.commit(self.promoter, [read.key])
        self._count(f"promoted_{medium}")
        entry = self.index.hold(read.key)
        if entry is not None:
            if read.session.closed:
                self.index.let_go([entry])
            else:
                read.session.parked.append(entry)

    # --- observability and shutdown ----------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self._reads or self._writes or any(
            q for s in self._sets.values() for q in s.waiting.values()))

    def snapshot(self) -> dict[str, Any]:
        namespaces = {}
        for digest, tier_set in self._sets.items():
            usage = {}
            for tier in tier_set.tiers:
                u = tier.usage()
                usage[tier.medium.value.lower()] = {"used_bytes": u.used_bytes, "capacity_bytes": u.capacity_bytes,
                                                    "blocks": u.num_blocks}
            namespaces[digest.hex()[:16]] = {"open": bool(tier_set.tiers), "tiers": usage}
        return {**self.counts, "promotions_in_flight": len(self._reads), "writes_in_flight": len(self._writes),
                "namespaces": namespaces}

    def close(self, drain_s: float = 5.0) -> None:
        """Give writes in flight up to ``drain_s`` to land (what the engines stored survives a
        graceful stop), then close every tier. Loop thread, after the loop stopped."""
        deadline = time.monotonic() + drain_s
        while self.busy and time.monotonic() < deadline:
            self.bell.wait(0.05)
            self.poll()
        self._opener.shutdown(wait=True)
        for tier_set in self._sets.values():
            self._settle_open(tier_set)
            for tier in tier_set.tiers:
                tier.close()
        self.bell.close()
        self.pool.release()

