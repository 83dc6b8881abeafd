"""What the scheduler side talks to: an engine's host tier and what lies below it (:class:`HostSide`).

Chosen by :func:`kvtier.runtime.host_factory.open_host_side`: the engine's own host tier and tiers
(:class:`kvtier.runtime.orchestrator.Orchestrator`), or a ``kvtier node`` service's pool and its
tiers (:class:`kvtier.runtime.node_host.NodeHost`: each call one round trip). Both run the same
promotion and cascade (:class:`kvtier.tiers.stack.TierStack`, here or in the service). ONE thread
(vLLM's scheduler) calls every method; each answers from memory or one bounded round trip, and
:meth:`HostSide.wait_for_tiers` is the one wait. A block's slots are a tuple, one per stored rank
(the host tier's same number on every rank), in the pool ``pool_id`` names (None: the engine's own).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.core.keys import BlockKey
from kvtier.core.residency import Medium
from kvtier.core.stats import KVTierStats
from kvtier.tiers.stack import BlockInfo


class AcquireStatus(enum.Enum):
    READY = "ready"  # the returned run is pinned in host slots for the owner
    RETRY = "retry"  # promotions or presence probes are running; ask again later (never wait)


@dataclass(frozen=True)
class Acquired:
    status: AcquireStatus
    num_blocks: int = 0
    promoted: dict[Medium, int] = field(default_factory=dict)  # of num_blocks: promoted for this owner, by source

    @property
    def from_disk(self) -> int:
        return self.promoted.get(Medium.DISK, 0)


class HostSide(Protocol):
    """The calls :class:`kvtier.vllm.scheduler_side.KVTierScheduler` makes (see the module docstring)."""

    @property
    def stats(self) -> KVTierStats:
        """This interval's counters (the scheduler adds its own)."""

    @property
    def pool_id(self) -> str | None:
        """The node pool new reservations are in (None: the engine's own regions)."""

    def locate(self, key: BlockKey) -> Medium | None: ...

    def leading_run(self, keys: Sequence[BlockKey]) -> int: ...

    def acquire(self, owner: str, keys: Sequence[BlockKey], first_parent: BlockKey | None = None,
                block_tokens: int = 0, *, tail_tokens: int = 0) -> Acquired:
        """Pin the longest available run of ``keys`` for ``owner`` (replacing its earlier hold);
        RETRY while blocks below are promoted or probed. ``first_parent`` (the key before
        ``keys[0]``, or the namespace digest), ``block_tokens`` and ``tail_tokens`` (> 0: the last
        key is a tail of that many tokens) name the records of promoted blocks."""

    def promoted_source(self, owner: str, key: BlockKey) -> Medium | None: ...

    def held(self, owner: str) -> list[BlockKey]: ...

    def held_slots(self, owner: str) -> list[tuple[int, ...]]: ...

    def held_pool(self, owner: str) -> str | None: ...

    def hold_lost(self, owner: str) -> bool:
        """Whether ``owner``'s pin may be gone (a node connection lost since it was made): a load
        from its slots must fail rather than copy what may be another block's bytes now."""

    def trim_hold(self, owner: str, num_blocks: int) -> None: ...

    def release(self, owner: str) -> None: ...

    def begin_stores(self, blocks: Sequence[tuple[BlockKey, BlockInfo]]) -> list[tuple[int, ...] | None]:
        """Reserve slots for each block (None: stored already, refused by admission, or no room)."""

    def finish_store(self, keys: Sequence[BlockKey], ok: bool) -> None: ...

    def poll(self) -> None: ...

    def wait_for_tiers(self, timeout_s: float) -> bool: ...

    def clear(self) -> None: ...

    def take_stats(self) -> KVTierStats: ...

    def close(self) -> None: ...
