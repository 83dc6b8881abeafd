"""Least-recently-used eviction.

One thread calls this policy (the orchestrator's); it is not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

from kvtier.core.keys import BlockKey
from kvtier.policy.base import EvictionPolicy, first_evictable


class LRUPolicy(EvictionPolicy):
    """Evicts the least recently inserted-or-touched key that the predicate allows.

    Invariants:

    * ``_order`` holds exactly the resident keys, least recent first, most recent last.
    * ``insert``, ``touch`` (per key) and ``remove`` are O(1). ``evict`` is O(1 + s), where s is
      the number of keys the predicate refuses (pinned) before the victim; refused keys move to
      the most recent end (:func:`~kvtier.policy.base.first_evictable`), so s is O(1) amortized.

    ``can_evict`` must not call back into the policy.
    """

    def __init__(self) -> None:
        self._order: OrderedDict[BlockKey, None] = OrderedDict()

    def insert(self, key: BlockKey) -> None:
        """Make ``key`` resident as the most recent key. Raises ValueError if it is resident."""
        if key in self._order:
            raise ValueError(f"key {key.hex()} is already resident")
        self._order[key] = None

    def touch(self, keys: Iterable[BlockKey]) -> None:
        """Move each resident key to the most recent end, in order; others are ignored.

        When every key is resident (a hit run: the usual case) this is one loop in C; a key that
        is not makes it redo the run key by key, which ends in the same order."""
        order = self._order
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        try:
            deque(map(order.move_to_end, keys), maxlen=0)
            return
        except KeyError:
            pass
        for key in keys:
            if key in order:
                order.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        """Forget ``key`` if it is resident."""
        self._order.pop(key, None)

    def evict(self, can_evict: Callable[[BlockKey], bool]) -> BlockKey | None:
        """Forget and return the least recent key with ``can_evict(key)`` True, or None; the keys
        refused before it become the most recent."""
        return first_evictable(self._order, can_evict)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
