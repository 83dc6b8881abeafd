"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003) as an eviction policy.

The tier, not the policy, decides when to evict, so the paper's single ``ARC(x)`` step is split
across the contract: a miss that the tier admits is :meth:`ARCPolicy.insert` (ghost hits adapt
``p`` there), a hit is :meth:`ARCPolicy.touch`, and the paper's ``REPLACE`` is
:meth:`ARCPolicy.evict`, called by the tier whenever it needs room (usually just before the
insert; ``p`` then reflects the misses up to the previous one).

One thread calls this policy (the orchestrator's); it is not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Literal, NamedTuple

from kvtier.core.keys import BlockKey
from kvtier.policy.base import EvictionPolicy, first_evictable

_List = OrderedDict[BlockKey, None]
ListName = Literal["T1", "T2", "B1", "B2"]


class ARCSizes(NamedTuple):
    t1: int
    t2: int
    b1: int
    b2: int


class ARCPolicy(EvictionPolicy):
    """ARC over ``capacity`` (c) blocks.

    Lists are OrderedDicts, least recent first: T1 (resident, seen once), T2 (resident, seen
    twice or more), B1 and B2 (ghosts: keys recently evicted from T1 resp. T2, no data).

    Invariants (checked by the tests after every operation):

    * T1, T2, B1, B2 are pairwise disjoint; ``len(self) == |T1| + |T2|`` is the resident count.
    * ``0 <= p <= c``.
    * Ghost bounds: ``|T1| + |B1| <= c`` and ``|T1| + |T2| + |B1| + |B2| <= 2c`` whenever the
      tier keeps at most c keys resident. The policy never refuses an insert, so if the tier
      overfills it the ghosts shrink (to empty if need be) and the bounds hold in the form
      ``|T1| + |B1| <= max(c, |T1|)`` and ``total <= max(2c, |T1| + |T2|)``.

    ``can_evict`` must not call back into the policy. ``evict`` is O(1 + s) where s is the
    number of refused (pinned) keys skipped, each moved to the recent end of its list (T1 or
    T2: p and the ghosts unchanged), so s is O(1) amortized; every other operation is O(1) per key.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"ARC capacity must be >= 1, got {capacity}")
        self._c = capacity
        self._p = 0.0
        self._t1: _List = OrderedDict()
        self._t2: _List = OrderedDict()
        self._b1: _List = OrderedDict()
        self._b2: _List = OrderedDict()
        self._last_miss_in_b2 = False

    @property
    def capacity(self) -> int:
        return self._c

    @property
    def p(self) -> float:
        """Adaptive target size of T1, in [0, capacity]."""
        return self._p

    def sizes(self) -> ARCSizes:
        return ARCSizes(len(self._t1), len(self._t2), len(self._b1), len(self._b2))

    def where(self, key: BlockKey) -> ListName | None:
        """Which list holds ``key`` ("T1", "T2", "B1" or "B2"), or None if it is unknown."""
        lists: tuple[tuple[ListName, _List], ...] = (
            ("T1", self._t1),
            ("T2", self._t2),
            ("B1", self._b1),
            ("B2", self._b2),
        )
        return next((name for name, lst in lists if key in lst), None)

    def insert(self, key: BlockKey) -> None:
        """Admit a missed key. Ghost hits adapt ``p`` and go to T2; new keys go to T1.

        Raises ValueError if ``key`` is resident.
        """
        if key in self._t1 or key in self._t2:
            raise ValueError(f"key {key.hex()} is already resident")
        b1, b2 = len(self._b1), len(self._b2)
        if key in self._b1:
            self._p = min(float(self._c), self._p + max(1.0, b2 / b1))
            del self._b1[key]
            self._t2[key] = None
            self._last_miss_in_b2 = False
        elif key in self._b2:
            self._p = max(0.0, self._p - max(1.0, b1 / b2))
            del self._b2[key]
            self._t2[key] = None
            self._last_miss_in_b2 = True
        else:
            self._t1[key] = None
            self._last_miss_in_b2 = False
            self._trim_ghosts()

    def touch(self, keys: Iterable[BlockKey]) -> None:
        """Move each resident key to T2's most recent end, in order; others are ignored."""
        for key in keys:
            if key in self._t1:
                del self._t1[key]
                self._t2[key] = None
            elif key in self._t2:
                self._t2.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        """Forget ``key`` wherever it is (resident or ghost), leaving no ghost."""
        for lst in (self._t1, self._t2, self._b1, self._b2):
            if key in lst:
                del lst[key]
                return

    def evict(self, can_evict: Callable[[BlockKey], bool]) -> BlockKey | None:
        """REPLACE: take T1's least recent evictable key if ``|T1| > p`` (or ``|T1| == p`` and the
        last miss hit B2), else T2's; fall back to the other list if the chosen one has no
        evictable key (refused keys move to the recent end of their list). The victim becomes the
        most recent entry of B1 resp. B2 (at once trimmed
        away again only if the tier holds more than c keys).
        """
        t1_first = len(self._t1) > self._p or (self._last_miss_in_b2 and len(self._t1) == self._p)
        order = ((self._t1, self._b1), (self._t2, self._b2))
        for resident, ghosts in order if t1_first else order[::-1]:
            victim = first_evictable(resident, can_evict)
            if victim is not None:
                ghosts[victim] = None
                self._trim_ghosts()
                return victim
        return None

    def _trim_ghosts(self) -> None:
        """Drop least recent ghosts until the bounds in the class docstring hold."""
        c = self._c
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        excess = len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) - 2 * c
        while excess > 0 and (self._b1 or self._b2):
            (self._b2 or self._b1).popitem(last=False)
            excess -= 1

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2
