"""The node's disk, Redis and S3 tiers, owned by the ``kvtier node`` service: one tier stack per namespace.

With ``--disk-dir`` / ``--redis-url`` / ``--s3-url`` the service, not the engines, owns the tiers
below its pool (one writer per disk root, one Redis connection pool and one S3 client per node). Lookup across them, promotion and
cascade are :class:`~kvtier.tiers.stack.TierStack`'s, run over the pool's index as an embedded
engine runs them over its host tier: what the service does for a block is what an embedded engine
does. Promotions reserve pool slots for the service's own session (:data:`PROMOTER`) and are parked
for the session that asked; a pinning lookup that needs no more promotions lets them go.

Namespaces: the disk format keeps the namespace per root directory and every record's header names
its digests, so tiers are opened per namespace and slot size (a record's payload is one slot), by
the first scheduler that says hello with them (:class:`kvtier.node.messages.Hello`), on a helper
thread (a disk scan or a Redis connect never runs on the loop; the first namespace's Redis and S3
tiers start from what ``kvtier node``'s start-up check found of their servers, not asking again:
:mod:`kvtier.tiers.factory`); at most :data:`MAX_NAMESPACES`
(beyond, a namespace's blocks are pool-only, counted). While they open, a pinning lookup that misses in the pool answers
``pending`` for at most :data:`~kvtier.tiers.factory.OPEN_WAIT_S` (the first lookups after a restart are disk hits, not
recomputes) and commits are remembered (unpinned, at most the pool's slot count) and cascaded once
they are open; if they fail to open, the namespace's blocks are pool-only.

Threads: every method runs on the service's loop thread (holding :attr:`NodeServer.lock`). The
tiers' workers ring :attr:`NodeTiers.bell` (a :class:`Waker` the loop's selector watches); the loop
then calls :meth:`NodeTiers.poll`, which never waits. Buffers: reads go into and writes come from
pool slots (the service's own mapping), WRITING or pinned while the job runs. Records are the
tiers' own (checksums, namespaces, fleet-key seals: a bad one is a counted miss).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvtier.core.keys import BlockKey, Namespace
from kvtier.core.stats import KVTierStats
from kvtier.core.tier_config import SecondaryTierConfig, tier_type
from kvtier.node.index import EntryState, NodeIndex, Session
from kvtier.node.protocol import Reservation
from kvtier.tiers.base import Medium, SecondaryTier
from kvtier.tiers.factory import open_tier, open_wait_ends
from kvtier.tiers.stack import BlockInfo, Chain, TierStack

log = logging.getLogger("kvtier.node")

MAX_NAMESPACES = 64
"""Namespaces (with slot sizes) whose tiers the service opens; each costs tier threads and
connections, and a hello names any it likes."""

PROMOTER = "node:promoted"
"""The engine name the service's own promotions are charged to (its stats show them)."""


class Waker(threading.Event):
    """A tier bell the loop's selector can wait on (:attr:`fd`, an eventfd each ``set`` also
    signals). ``set`` from any thread; the rest from the loop."""

    def __init__(self) -> None:
        super().__init__()
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def set(self) -> None:
        super().set()
        with contextlib.suppress(OSError):  # closed (the service stopped)
            os.eventfd_write(self.fd, 1)

    def drain(self) -> None:
        self.clear()
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.fd)

    def close(self) -> None:
        os.close(self.fd)


class PoolSlots:
    """The pool's index as the :class:`~kvtier.tiers.stack.SlotIndex` of one namespace's stack:
    blocks of ``width`` slots, promotions reserved and committed by the service's ``promoter``
    session, its own pins taken with :meth:`NodeIndex.hold`."""

    def __init__(self, index: NodeIndex, promoter: Session, width: int) -> None:
        self.index, self.promoter, self.width = index, promoter, width  # index: the pool's current one (rebound)

    def is_ready(self, key: BlockKey) -> bool:
        entry = self.index.entry(key)
        return entry is not None and entry.state is EntryState.READY and len(entry.slots) == self.width

    def __contains__(self, key: object) -> bool:
        return self.index.entry(key) is not None  # type: ignore[arg-type]

    def take(self, key: BlockKey, tail: bool) -> tuple[int, ...] | None:
        status, slots = self.index.reserve(self.promoter, [key], self.width, frozenset({0}) if tail else frozenset())
        return slots[0] if status[0] is Reservation.RESERVED else None

    def commit(self, key: BlockKey) -> None:
        self.index.commit(self.promoter, [key])

    def abort(self, key: BlockKey) -> None:
        self.index.abort(self.promoter, [key])

    def pin(self, key: BlockKey) -> None:
        self.index.hold(key)

    def unpin(self, key: BlockKey) -> None:
        entry = self.index.entry(key)
        assert entry is not None, "a pinned block is never evicted"
        self.index.let_go([entry])

    def slots(self, key: BlockKey) -> tuple[int, ...]:
        entry = self.index.entry(key)
        assert entry is not None
        return entry.slots


@dataclass
class _Namespace:
    """One namespace's tiers (fastest first), being opened or open."""

    namespace: Namespace
    payload_bytes: int  # the slot size its tiers' records hold
    opening: Future | None
    wait_until: float  # lookups are told to ask again until then while the tiers open
    stack: TierStack | None = None
    slots: PoolSlots | None = None  # the stack's index
    # Commits made while the tiers open, not pinned: cascaded once they are open if still in the pool.
    before_open: deque[tuple[BlockKey, BlockInfo]] = field(default_factory=deque)


class NodeTiers:
    """The service's tiers below the pool, per namespace. See the module docstring."""

    def __init__(self, configs: tuple[SecondaryTierConfig, ...], pool: memoryview) -> None:
        self.configs = configs
        self.pool = pool  # the service's mapping of the whole pool
        self.bell = Waker()
        self.index: NodeIndex | None = None
        self.stride = self.slot_bytes = 0
        self.promoter = Session(0, PROMOTER)
        self._namespaces: dict[tuple[bytes, int], _Namespace] = {}  # (engine digest, slot bytes) -> its tiers
        self._opener = ThreadPoolExecutor(1, thread_name_prefix="kvtier-node-open")
        self.skipped_opening = 0  # commits neither cascaded nor remembered while tiers opened
        self.namespaces_refused = 0  # hellos whose namespace got no tiers (MAX_NAMESPACES open)
        self.tiers_failed = 0  # tiers of a namespace that could not open (the others serve); opener thread

    def bind(self, index: NodeIndex, stride: int, slot_bytes: int) -> None:
        """The pool was cut (only while it holds nothing, so no tier job is in flight): its index
        and slot geometry. Tiers opened for another slot size stay (their namespace's sessions
        may come back after another cut) but are used only by sessions of their size."""
        self.index, self.stride, self.slot_bytes = index, stride, slot_bytes
        for ns in self._namespaces.values():
            if ns.slots is not None:
                ns.slots.index = index

    def _views(self, slots: tuple[int, ...]) -> list[memoryview]:
        return [self.pool[s * self.stride:s * self.stride + self.slot_bytes] for s in slots]

    # --- namespaces --------------------------------------------------------------------------
    def attach(self, session: Session, namespace: Namespace, model_name: str, namespace_json: str) -> None:
        """A scheduler said hello with its namespace: its tiers open (once, in the background)."""
        key = (namespace.engine_digest, self.slot_bytes)
        if key not in self._namespaces:
            if len(self._namespaces) >= MAX_NAMESPACES:
                self.namespaces_refused += 1
                log.warning("engine %r: %d namespaces have tiers already; this one's blocks stay in the pool only",
                            session.engine, MAX_NAMESPACES)
                return
            future = self._opener.submit(self._open, namespace, model_name, namespace_json, self.slot_bytes)
            future.add_done_callback(lambda _f: self.bell.set())
            self._namespaces[key] = _Namespace(namespace, self.slot_bytes, future, open_wait_ends(time.monotonic()))
        session.namespace = key

    def _open(self, namespace: Namespace, model_name: str, namespace_json: str, payload_bytes: int
              ) -> tuple[SecondaryTier, ...]:
        """The namespace's tiers that open (disk, Redis, S3 order), each on its own: one that cannot
        (a Redis user refused the namespace's keys, a root it may not write) is logged and left out,
        and the others serve, as each of vLLM's offloading tiers opens alone (the opener's thread)."""
        opened = []
        for config in self.configs:
            try:
                opened.append(open_tier(config, model_name=model_name, namespace=namespace,
                                        namespace_json=namespace_json, payload_bytes=payload_bytes))
            except Exception as exc:  # noqa: BLE001 (logged; the namespace's other tiers serve)
                self.tiers_failed += 1
                log.error("namespace %s: its %s tier could not open: %s (its blocks skip that tier)",
                          namespace.engine_digest.hex()[:16], tier_type(config).value, exc)
        return tuple(opened)

    def _settle_open(self, ns: _Namespace) -> None:
        future = ns.opening
        if future is None or not future.done():
            return
        ns.opening = None
        digest = ns.namespace.engine_digest.hex()[:16]
        try:
            tiers = future.result()
        except Exception as exc:  # noqa: BLE001 (logged; the namespace stays pool-only)
            log.error("tiers of namespace %s could not open: %s (its blocks stay in the pool only)", digest, exc)
            return
        if not tiers:  # each was logged by _open
            log.error("no tier of namespace %s opened: its blocks stay in the pool only", digest)
            return
        assert self.index is not None
        width = len(ns.namespace.ranks)
        ns.slots = PoolSlots(self.index, self.promoter, width)
        ns.stack = TierStack(ns.slots, self._views, tiers, bell=self.bell)
        log.info("namespace %s: tiers %s open", digest, ", ".join(t.medium.value for t in tiers))
        remembered, ns.before_open = ns.before_open, deque()
        for key, info in remembered:
            ns.stack.cascade(key, info)

    def _of(self, session: Session) -> _Namespace | None:
        return self._namespaces.get(session.namespace) if session.namespace is not None else None

    # --- lookups and commits ------------------------------------------------------------------
    def after_lookup(self, session: Session, keys: list[BlockKey], hits: int, width: int, pin: bool,
                     chain: Chain) -> tuple[bool, int, dict[BlockKey, Medium]]:
        """The pool held ``keys[:hits]``: ``(pending, below, promoted)``. Without ``pin``: ``below``
        = how many of the next keys the pool or a tier is known to hold (memory only). With
        ``pin``: the rest of the run is promoted (:meth:`TierStack.promote
        <kvtier.tiers.stack.TierStack.promote>`) and ``pending`` says to ask again; an answer that
        needs no more lets go of what was parked, and ``promoted`` names the tier each block
        promoted for the session came from (what the engine reports its hits by)."""
        ns = self._of(session)
        stack = ns.stack if ns is not None and len(ns.namespace.ranks) == width else None
        if stack is None:  # no tiers for it (none configured, failed, another width), or still opening
            opening = ns is not None and ns.opening is not None and time.monotonic() < ns.wait_until
            return pin and hits < len(keys) and opening, 0, {}
        if not pin:
            return False, stack.leading_run(keys[hits:]), {}
        pending = stack.promote(session.id, keys, hits, chain)
        return pending, 0, {} if pending else stack.settle(session.id)

    def committed(self, session: Session, keys: list[BlockKey], infos: list[BlockInfo]) -> None:
        """``keys`` were committed by ``session``: write each to the tiers of its namespace that lack it."""
        ns = self._of(session)
        if ns is None:
            return
        for key, info in zip(keys, infos):
            if ns.stack is not None:
                ns.stack.cascade(key, info)  # a block of another width is never READY there: skipped
            elif ns.opening is None:
                return  # its tiers failed to open
            elif self.index is not None and len(ns.before_open) < self.index.num_slots:
                ns.before_open.append((key, info))
            else:
                self.skipped_opening += 1

    def release(self, session: Session) -> None:
        """``session``'s connection dropped: what was parked for it is let go."""
        ns = self._of(session)
        if ns is not None and ns.stack is not None:
            ns.stack.forget(session.id)

    # --- completions, observability, shutdown -------------------------------------------------
    def poll(self) -> None:
        """Apply the tiers' outcomes, refresh them when due (loop thread; never waits)."""
        self.bell.drain()
        for ns in self._namespaces.values():
            self._settle_open(ns)
            if ns.stack is not None:
                ns.stack.poll()

    def snapshot(self) -> dict[str, Any]:
        total, reads, writes, namespaces = KVTierStats(), 0, 0, {}
        evicted, unavailable = Counter[Medium](), Counter[Medium]()
        for (digest, payload), ns in self._namespaces.items():
            usage = {}
            if ns.stack is not None:
                total.add(ns.stack.stats)
                in_flight = ns.stack.in_flight()
                reads, writes = reads + in_flight[0], writes + in_flight[1]
                for tier in ns.stack.tiers:
                    evicted[tier.medium] += tier.evictions
                    unavailable[tier.medium] += tier.unavailable
                    u = tier.usage()
                    usage[tier.medium.value.lower()] = {"used_bytes": u.used_bytes, "capacity_bytes": u.capacity_bytes,
                                                        "blocks": u.num_blocks}
            name = digest.hex()[:16] + ("" if payload == self.slot_bytes else f"@{payload}")
            namespaces[name] = {"open": ns.stack is not None, "tiers": usage}
        counts = {"promotion_failures": total.promotion_failures, "checksum_failures": total.checksum_failures,
                  "auth_failures": total.auth_failures, "cascades_skipped_opening": self.skipped_opening,
                  "namespaces_refused": self.namespaces_refused, "tiers_failed": self.tiers_failed}
        for medium in (Medium.DISK, Medium.REMOTE, Medium.S3):
            name = medium.value.lower()
            counts[f"written_{name}"] = total.written_to(medium).jobs
            counts[f"writes_dropped_{name}"] = getattr(total, f"{name}_writes_dropped")
            counts[f"promoted_{name}"] = total.read_from(medium).jobs
            counts[f"evicted_{name}"] = evicted[medium]
            counts[f"unavailable_{name}"] = unavailable[medium]
        return {**counts, "promotions_in_flight": reads, "writes_in_flight": writes, "namespaces": namespaces}

    @property
    def busy(self) -> bool:
        return any(ns.stack is not None and ns.stack.busy for ns in self._namespaces.values())

    def close(self, drain_s: float = 5.0) -> None:
        """Give writes in flight up to ``drain_s`` to land (what the engines stored survives a
        graceful stop), then close every tier. Loop thread, after the loop stopped."""
        deadline = time.monotonic() + drain_s
        self._opener.shutdown(wait=True)
        for ns in self._namespaces.values():
            self._settle_open(ns)
            if ns.stack is not None:
                ns.stack.close(max(0.0, deadline - time.monotonic()))
        self.bell.close()
        self.pool.release()
