"""Eviction policy contract: which resident block goes first when a tier needs room.

A policy only orders keys; it owns no data and knows nothing about pins. The tier asks
:meth:`EvictionPolicy.evict` for victims and passes a predicate that refuses pinned keys, so a
block being read or written is never chosen. One thread calls a policy (the orchestrator's); it
is not thread-safe.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

from kvtier.core.config import PolicyName
from kvtier.core.keys import BlockKey

__all__ = ["EvictionPolicy", "PolicyName"]


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
