"""Every host-tier size at once, in one pass: LRU stack distances (Mattson et al., 1970).

An LRU cache of C blocks holds a block exactly when fewer than C other distinct blocks were used
since its last use (its stack distance). So one pass over the trace that records, for every block
a lookup asks about, its stack distance at that moment gives the hit run of every size: a
request's hit at size C is its run of blocks from the engine's hit on whose running maximum of
distances stays below C. The pass records each run's pieces as (that maximum, tokens), and the
curve at any size is a sum over the pieces below it: exact at every slot count, not only at the
sizes asked for, which is how :mod:`kvtier.replay.curve` finds the knee.

The stream of uses: each request uses the full blocks it offers for storage, in block order (its
prompt's when it starts, after its lookup; its answer's when it finishes), as the connector's
stores touch or store them. Where this is the host tier's own LRU order exactly, and where not:

- exact when, within a request, the blocks the host tier already has come before those it stores
  anew (the host index commits a step's new blocks after touching the ones it has), which is how
  prefixes are found (a hit is a leading run), and no request's own stores evict blocks it is
  about to touch (a request of more blocks than the tier has slots);
- the replay through kvtier's own code (:mod:`kvtier.replay.exact`) is used instead wherever the
  policy is not LRU over blocks alone: ARC, ``store_threshold`` >= 2, partial-block tails (evicted
  before blocks), disk and remote tiers. ``tests/test_plan_trace.py`` compares the two;
- the host tier itself continues runs of slots (:mod:`kvtier.tiers.host`), evicting a cold block
  out of LRU order now and then: against that, the curve is an estimate (within 1.3% of prompt
  tokens on the tests' mixed trace, either way).

Cost: per block a few dictionary operations; per run of blocks last used together (a request
usually has one to three) a range update and a query of a Fenwick tree over stream positions.

Distances within a run: if blocks j and j+1 were last used at consecutive positions, block j's
distance is block j+1's plus one (the window that counts j's distance is j+1's window plus j+1
itself), so a run's largest distance is at its first block and one query per run suffices. A
distance counts the positions since the block's last use minus the repeated uses among them
(pairs of a use and the previous use of its block, both inside the window): those pairs are what
the Fenwick tree counts.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import accumulate, repeat
from operator import add, eq

from kvtier.replay.workload import FINISH, START, ReplayRequest, ReplaySettings
from kvtier.runtime.requests import offload_limit

NEVER = 1 << 62
"""More slots than any tier has: the unlimited host tier."""
NEVER_USED = -(1 << 62)
"""Below every stream position: where a block never used before was "last used"."""


class _RangeCounts:
    """Counts over positions 0..n-1: add 1 to a range, count up to a position (two Fenwick trees)."""

    def __init__(self, size: int):
        self.size = size + 2
        self._b1 = array("q", bytes(8 * self.size))
        self._b2 = array("q", bytes(8 * self.size))

    def _add(self, tree: array, index: int, value: int) -> None:
        size = self.size
        while index < size:
            tree[index] += value
            index += index & -index

    def add_range(self, first: int, last: int) -> None:
        """+1 at every position first..last (inclusive, 0-based)."""
        lo, hi = first + 1, last + 2
        self._add(self._b1, lo, 1)
        self._add(self._b1, hi, -1)
        self._add(self._b2, lo, first)
        self._add(self._b2, hi, -(last + 1))

    def count_to(self, position: int) -> int:
        """The sum over positions 0..position."""
        index = position + 1
        s1 = s2 = 0
        b1, b2 = self._b1, self._b2
        while index > 0:
            s1 += b1[index]
            s2 += b2[index]
            index -= index & -index
        return s1 * (position + 1) - s2


@dataclass
class StackCurve:
    """The pass's outcome: per piece of a hit run, the host slots it needs (more than ``need``) and
    its tokens; plus the prompt and engine totals."""

    requests: int = 0
    prompt_tokens: int = 0
    engine: int = 0
    distinct_blocks: int = 0
    needs: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    _sorted: tuple[list[int], list[int]] | None = None

    def host_tokens(self, slots: int) -> int:
        """Prompt tokens the host tier serves with ``slots`` slots (a piece needs more than its distance)."""
        if self._sorted is None:
            order = sorted(range(len(self.needs)), key=self.needs.__getitem__)
            needs = [self.needs[i] for i in order]
            self._sorted = (needs, list(accumulate((self.tokens[i] for i in order), initial=0)))
        needs, cumulative = self._sorted
        return cumulative[bisect_left(needs, slots)]

    def unlimited_tokens(self) -> int:
        return self.host_tokens(NEVER)

    def smallest_slots_for(self, tokens: float) -> int | None:
        """The fewest slots with which the host tier serves at least ``tokens`` (None: never)."""
        self.host_tokens(0)
        assert self._sorted is not None
        needs, cumulative = self._sorted
        index = bisect_left(cumulative, tokens)
        if index >= len(cumulative):
            return None
        return 1 if index == 0 else needs[index - 1] + 1


def stack_applies(settings: ReplaySettings, disk: bool, remote: bool) -> str | None:
    """None when the one-pass LRU is the host tier's policy for these settings, else why not."""
    if settings.eviction_policy.value != "lru":
        return "the eviction policy is ARC"
    if settings.store_threshold >= 2:
        return "store_threshold admits blocks only after repeated offers"
    if settings.tails:
        return "partial-block tails share the host tier (offload_partial_blocks)"
    if disk or remote:
        return "disk or remote tiers are replayed"
    return None


def _runs(prevs: list[int]) -> list[tuple[int, int]]:
    """``(first, end)`` index ranges of ``prevs`` whose values go up by one (blocks last used one
    after another). Found in C: a byte per neighbour pair says whether it continues the run."""
    count = len(prevs)
    if count == 0:
        return []
    continues = bytes(map(eq, prevs[1:], map(add, prevs, repeat(1))))
    runs = []
    first = 0
    while True:
        end = continues.find(0, first)
        if end < 0:
            runs.append((first, count))
            return runs
        runs.append((first, end + 1))
        first = end + 1


def stack_pass(events: Iterable[tuple[str, ReplayRequest]], settings: ReplaySettings, stream_blocks: int) -> StackCurve:
    """One pass over ``events`` (:func:`~kvtier.replay.workload.replay_events`); ``stream_blocks``
    bounds the blocks the requests offer (their computed tokens over the block size)."""
    block = settings.block_tokens
    prompt_only = settings.offload_prompt_only
    curve = StackCurve()
    pairs = _RangeCounts(stream_blocks + 1)
    last: dict[bytes, int] = {}
    offered: dict[int, int] = {}  # running request -> blocks it offered so far
    position = 0
    needs, tokens = curve.needs, curve.tokens

    def previous(keys: list[bytes]) -> list[int]:
        """Where each key was last used; a key never used gets a distinct negative number, one up
        from its neighbour's, so that new blocks form runs of their own."""
        return list(map(last.get, keys, range(NEVER_USED, NEVER_USED + len(keys))))

    def use(keys: list[bytes], prevs: list[int], start: int) -> None:
        """``keys`` (last used at ``prevs``) are used at positions start, start+1, ...: each reused
        run of them is a run of reuse pairs."""
        last.update(zip(keys, range(start, start + len(keys))))
        for first, end in _runs(prevs):
            if prevs[first] >= 0:
                pairs.add_range(prevs[first], prevs[end - 1])

    for kind, request in events:
        keys = request.chain.keys
        if kind == START:
            prompt = request.prompt_tokens
            curve.requests += 1
            curve.prompt_tokens += prompt
            curve.engine += request.engine_hit
            first = request.engine_hit // block
            max_blocks = min((prompt - 1) // block, len(keys))
            limit = offload_limit(prompt, prompt, prompt, prompt_only=prompt_only,
                                  max_offload_tokens=request.max_offload_tokens)
            count = min(limit // block, len(keys))
            prevs = previous(keys[: max(count, max_blocks)])
            if first < max_blocks:
                before = position - 1
                reused = pairs.count_to(before)
                running = -1
                extra = first * block - request.engine_hit  # a kvtier block the engine partly holds
                lookup = prevs[first:max_blocks]
                for start, end in _runs(lookup):
                    prev = lookup[start]
                    if prev < 0:
                        break  # a block never stored before: the run ends at every size
                    running = max(running, (before - prev) - (reused - pairs.count_to(prev)))
                    needs.append(running)
                    tokens.append((end - start) * block + extra)
                    extra = 0
            use(keys[:count], prevs[:count], position)
            position += count
            offered[request.index] = count
        elif kind == FINISH:
            computed = request.computed_tokens
            limit = offload_limit(computed, computed + 1, request.prompt_tokens, prompt_only=prompt_only,
                                  max_offload_tokens=request.max_offload_tokens)
            first_new = offered.pop(request.index)
            count = min(limit // block, len(keys))
            if count > first_new:
                fresh = keys[first_new:count]
                use(fresh, previous(fresh), position)
                position += count - first_new
    curve.distinct_blocks = len(last)
    return curve
