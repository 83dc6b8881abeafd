"""Eviction policy contract: which resident block goes first when a tier needs room.

A policy only orders keys; it owns no data and knows nothing about pins. The tier asks
:meth:`EvictionPolicy.evict` for victims and passes a predicate that refuses pinned keys, so a
block being read or written is never chosen. A key the predicate refuses is in use, and counts
as used: it moves to the recent end of its list (:func:`first_evictable`), so however many keys
stay pinned, the next scan does not pass them again, and evictions cost O(1) amortized (a peer
of the node service that pins half its pool cannot make every eviction scan that half). One
thread calls a policy (the orchestrator's); it is not thread-safe.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvtier.core.config import PolicyName
from kvtier.core.keys import BlockKey

__all__ = ["EvictionPolicy", "PolicyName", "first_evictable"]


def first_evictable(order: OrderedDict[BlockKey, None], can_evict: Callable[[BlockKey], bool]) -> BlockKey | None:
    """Remove and return the first key of ``order`` (least recent first) that ``can_evict``
    allows, or None; each key refused before it moves to the end (in use: as recent as a use),
    in the order they were passed. A pass that finds none leaves ``order`` as it was. Asks the
    predicate at most once per key."""
    for _ in range(len(order)):
        key = next(iter(order))
        if can_evict(key):
            del order[key]
            return key
        order.move_to_end(key)
    return None


class EvictionPolicy(ABC):
    @abstractmethod
    def insert(self, key: BlockKey) -> None:
        """A new block became resident. ``key`` must not be resident already."""

    @abstractmethod
    def touch(self, keys: Iterable[BlockKey]) -> None:
        """Resident ``keys`` were used, in this order (later = more recent). Unknown keys are ignored."""

    @abstractmethod
    def remove(self, key: BlockKey) -> None:
        """``key`` left the tier for another reason than eviction (delete, failed write). Unknown keys are ignored."""

    @abstractmethod
    def evict(self, can_evict: Callable[[BlockKey], bool]) -> BlockKey | None:
        """Choose, forget and return one resident key with ``can_evict(key)`` True, or None."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys."""

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...
