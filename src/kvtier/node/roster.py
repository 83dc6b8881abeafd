"""Which engines the node service keeps per-engine stats of (``kvtier inspect``, ``/metrics`` labels).

Loop thread only (:mod:`kvtier.node.server`, under :attr:`NodeServer.lock`); memory only, never
blocks. An engine's stats live in :attr:`kvtier.node.index.NodeIndex.engines`, made by its
sessions' requests; this module decides when they are forgotten. Engines come and go with fresh
names (pods, restarts), and a hello names any engine it likes, so what is kept must be bounded.

Invariants:

- an engine with a live session (a scheduler connection whose hello named it) is never forgotten;
- an engine with no session is *departed*, remembered in the order it left (the last to leave
  last); a departed engine that attaches again is no longer departed;
- the :data:`KEEP_DEPARTED` engines that left last are kept, whatever they hold;
- an older departed engine is forgotten once it holds nothing in the pool (checked whenever an
  engine leaves and every loop poll, so one whose blocks are evicted later goes too);
- at most :data:`MAX_DEPARTED` departed engines are known: beyond it the oldest is forgotten even
  while it holds blocks (its blocks stay in the pool, charged to its name and counted in the
  pool's totals; only its per-engine stats and labels go).

So the engines in stats and ``/metrics`` are at most the attached ones (bounded by the service's
``--max-connections``), plus :data:`MAX_DEPARTED`, plus the service's own (``node:promoted``).
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice

from kvtier.node.index import NodeIndex

KEEP_DEPARTED = 64
"""Departed engines whose stats are kept even when they hold nothing (the last to leave)."""
MAX_DEPARTED = 256
"""Departed engines known at all, holding blocks or not (a hard bound on labels)."""


class Roster:
    """The departed engines, oldest first. See the module docstring."""

    def __init__(self) -> None:
        self._departed: OrderedDict[str, None] = OrderedDict()
        self.forgotten = 0  # engines whose stats were dropped

    def attached(self, engine: str) -> None:
        """A session of ``engine`` began: it is not departed."""
        self._departed.pop(engine, None)

    def left(self, engine: str, index: NodeIndex | None) -> None:
        """The last session of ``engine`` ended (the caller checked that none is left)."""
        self._departed[engine] = None
        self._departed.move_to_end(engine)
        self.prune(index)

    def prune(self, index: NodeIndex | None) -> None:
        """Forget departed engines beyond the kept ones that hold nothing, then the oldest beyond
        the hard bound. O(departed beyond the kept): at most :data:`MAX_DEPARTED`."""
        departed = self._departed
        excess = len(departed) - KEEP_DEPARTED
        if excess <= 0:
            return
        for engine in list(islice(departed, excess)):
            if index is None or not index.charged.get(engine):
                self._forget(engine, index)
        while len(departed) > MAX_DEPARTED:
            self._forget(next(iter(departed)), index)

    def _forget(self, engine: str, index: NodeIndex | None) -> None:
        del self._departed[engine]
        self.forgotten += 1
        if index is not None:
            index.engines.pop(engine, None)
