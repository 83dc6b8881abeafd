"""What the scheduler side decides for one request, without vLLM: the block keys of its tokens,
the hit it is offered across the tiers (a run of blocks, maybe ending in a tail), how many of its
tokens may be stored, and which tails it leaves when it finishes.

Two callers run these same decisions over the same orchestrator calls: the connector's scheduler
side (:mod:`kvtier.vllm.scheduler_side`, which feeds it vLLM's requests) and ``kvtier plan
--trace`` (:mod:`kvtier.replay`, which feeds it the requests of a recorded trace), over one
:class:`~kvtier.runtime.host_side.HostSide` (the engine's own host tier, or a node service's pool).

Threading: the scheduler's thread only (no locks). A request's keys are derived lazily from its
token ids, extended as its computed tokens grow; they never change once made (vLLM never rewrites
a token a block was keyed by), except that a reset of the cache hangs them under a new root
(:meth:`RequestKeys.restart`).
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field

from kvtier.core.keys import BlockExtras, BlockKey, chain_block_keys, stateless_key, tail_key, tail_keys
from kvtier.runtime.host_side import AcquireStatus, HostSide
from kvtier.tiers.base import Medium


@dataclass(kw_only=True)
class RequestKeys:
    """The key chain of one request's tokens. ``tokens`` is a live view of its token ids (prompt,
    then the tokens it generates); ``root`` the first block's parent: the engine digest, or its
    epoch's root after a reset (:func:`~kvtier.core.keys.epoch_root`)."""

    tokens: Sequence[int]
    root: BlockKey
    block_tokens: int
    extras: BlockExtras | list[BlockExtras]
    keys: list[BlockKey] = field(default_factory=list)

    def extend_keys(self, num_blocks: int) -> None:
        """Make ``keys`` cover the first ``num_blocks`` blocks (tokens permitting)."""
        have = len(self.keys)
        if num_blocks <= have:
            return
        block = self.block_tokens
        tokens = self.tokens[: num_blocks * block]
        extras = self.extras
        if isinstance(extras, list):
            extras = [self.extras_of(index) for index in range(num_blocks)]
        self.keys.extend(chain_block_keys(self.parent_of(have), tokens, block, extras, start_block=have))

    def restart(self, root: BlockKey) -> None:
        """Hang the request's keys under ``root`` from now on (a new key epoch after a reset of the
        cache, :func:`~kvtier.core.keys.epoch_root`): the keys made so far are dropped."""
        self.root = root
        self.keys = []

    def parent_of(self, block_index: int) -> BlockKey:
        """The key block ``block_index`` chains from (``keys`` must cover the block before it)."""
        return self.keys[block_index - 1] if block_index else self.root

    def extras_of(self, block_index: int) -> BlockExtras:
        """Block ``block_index``'s extras (blocks past the per-block list take its last entry)."""
        extras = self.extras
        if isinstance(extras, BlockExtras):
            return extras
        return extras[min(block_index, len(extras) - 1)] if extras else BlockExtras()

    def tail_candidates(self, block_index: int, max_tokens: int) -> list[BlockKey]:
        """Tail keys of every length 1..n of the tokens from block ``block_index`` on, where n is
        at most ``max_tokens`` and less than a block (entry i holds the tail of i + 1 tokens)."""
        start = block_index * self.block_tokens
        tokens = self.tokens[start : start + min(max_tokens, self.block_tokens - 1)]
        return tail_keys(self.parent_of(block_index), tokens, self.extras_of(block_index))

    def tail_key_of(self, block_index: int, end_token: int) -> BlockKey:
        """The tail key of the tokens from block ``block_index`` up to ``end_token``."""
        start = block_index * self.block_tokens
        tokens = self.tokens[start:end_token]
        return tail_key(self.parent_of(block_index), tokens, self.extras_of(block_index))


@dataclass(frozen=True)
class Hit:
    """The answer to one lookup: ``tokens`` beyond the engine's own hit that the tiers serve (0: a
    miss), by the tier they come from (``by_source``), and the tail the run ends with (its key and
    tokens; None: the run ends with a full block). ``tail_probe``: the block index after the run of
    full blocks and the tail keys tried there (empty when tails are off): what a request's access
    log records so that a replay can find the tails this lookup could have found."""

    tokens: int
    by_source: dict[Medium, int] = field(default_factory=dict)
    tail: tuple[BlockKey, int] | None = None
    tail_probe: tuple[int, list[BlockKey]] = (0, [])


MISS = Hit(0)


def tokens_by_source(
    hit_tokens: int, promoted: dict[Medium, int], block_tokens: int, short: tuple[Medium, int] | None = None
) -> dict[Medium, int]:
    """A hit's tokens by the tier they came from: promoted blocks from their source, the rest
    from the host tier (the promoted blocks are the run's last ones). ``short``: a promoted tail's
    source and the tokens it lacks of a whole block."""
    by_source = {medium: count * block_tokens for medium, count in promoted.items()}
    if short is not None:
        by_source[short[0]] -= short[1]
    by_source[Medium.HOST] = max(0, hit_tokens - sum(by_source.values()))
    return by_source


def resumable_run(orchestrator: HostSide, keys: Sequence[BlockKey]) -> list[BlockKey]:
    """For a model with state groups: each block's key if it is stored with its state, else its
    :func:`~kvtier.core.keys.stateless_key` if stored so, up to the first block stored neither way,
    cut after the last block stored with its state (memory only)."""
    run: list[BlockKey] = []
    resumable = 0
    for key in keys:
        if orchestrator.locate(key) is not None:
            run.append(key)
            resumable = len(run)
            continue
        variant = stateless_key(key)
        if orchestrator.locate(variant) is None:
            break
        run.append(variant)
    return run[:resumable]


def find_tail(orchestrator: HostSide, chain: RequestKeys, block_index: int,
              max_tokens: int) -> tuple[tuple[BlockKey, int] | None, list[BlockKey]]:
    """The longest stored tail (key, tokens) that continues the request's tokens at block
    ``block_index`` with at most ``max_tokens`` tokens (memory only), and the candidates tried."""
    if max_tokens <= 0:
        return None, []
    candidates = chain.tail_candidates(block_index, max_tokens)
    for length in range(len(candidates), 0, -1):
        if orchestrator.locate(candidates[length - 1]) is not None:
            return (candidates[length - 1], length), candidates
    return None, candidates


def find_hit(orchestrator: HostSide, owner: str, chain: RequestKeys, num_tokens: int, num_computed_tokens: int, *,
             tails: bool, state_groups: bool = False, storing: Container[BlockKey] = ()) -> Hit | None:
    """Look the request's tokens up beyond the ``num_computed_tokens`` the engine holds itself and
    pin the hit's blocks for ``owner`` (the orchestrator's hold, released by the caller once the
    load is done); None: ask again (blocks are being promoted or probed, or, with ``tails``, the
    run would continue into a block or a longer tail in ``storing``: the engine's own stores in
    flight, which land within a step or two, as vLLM's OffloadingConnector waits for a block
    being stored). At most ``num_tokens - 1`` tokens are offered (vLLM computes at least the last
    one); with ``tails`` the run of full blocks may end in a stored tail; with ``state_groups``
    (Mamba / linear attention) it ends at a block stored with its state. Counts the lookup in the
    orchestrator's stats."""
    block = chain.block_tokens
    max_blocks = (num_tokens - 1) // block  # vLLM must compute at least one token
    first_block = num_computed_tokens // block
    if first_block > max_blocks or (first_block == max_blocks and not tails):
        return MISS
    chain.extend_keys(max_blocks)
    keys = chain.keys[first_block:max_blocks]
    if state_groups:
        keys = resumable_run(orchestrator, keys)
        run_end = first_block + len(keys)
    elif tails:  # where a tail could continue the run (without tails, acquire finds the run)
        run_end = first_block + orchestrator.leading_run(keys)
    else:
        run_end = max_blocks
    tail, tried = (find_tail(orchestrator, chain, run_end, num_tokens - 1 - run_end * block)
                   if tails and not state_groups else (None, []))
    if tried and storing:
        beyond = tried[tail[1]:] if tail is not None else tried  # longer tails than the one found
        if run_end < max_blocks:
            beyond = [*beyond, chain.keys[run_end]]  # the next full block
        if any(key in storing for key in beyond):
            orchestrator.stats.lookups_retried += 1
            return None
    if tail is not None:
        keys = keys[: run_end - first_block] + [tail[0]]
    acquired = orchestrator.acquire(owner, keys, chain.parent_of(first_block), block,
                                    tail_tokens=tail[1] if tail is not None else 0)
    if acquired.status is AcquireStatus.RETRY:
        return None
    num_blocks = acquired.num_blocks
    if state_groups:  # a hit ends at a block stored with its state
        ends = [n for n in range(num_blocks, 0, -1) if keys[n - 1] == chain.keys[first_block + n - 1]]
        num_blocks = ends[0] if ends else 0
        orchestrator.trim_hold(owner, num_blocks)
    stats = orchestrator.stats
    stats.lookups += 1
    servable_end = num_tokens - 1 if tails else max_blocks * block
    stats.lookup_tokens += servable_end - num_computed_tokens
    probe = (run_end, tried)
    if num_blocks == 0:
        orchestrator.release(owner)
        return Hit(0, tail_probe=probe)
    hit_tokens = (first_block + num_blocks) * block - num_computed_tokens
    tail_source = None
    if tail is not None and num_blocks == len(keys):
        hit_tokens -= block - tail[1]  # the run ends with the tail
        tail_source = orchestrator.promoted_source(owner, tail[0])
        if hit_tokens <= 0:  # a tail no longer than what vLLM holds of its block already: nothing to load
            orchestrator.release(owner)
            return Hit(0, tail_probe=probe)
    else:
        tail = None
    short = (tail_source, block - tail[1]) if tail is not None and tail_source is not None else None
    return Hit(hit_tokens, tokens_by_source(hit_tokens, acquired.promoted, block, short), tail, probe)


def offload_limit(computed: int, num_tokens: int, num_prompt_tokens: int, *, prompt_only: bool,
                  max_offload_tokens: int | None) -> int:
    """How many of a request's first tokens may be stored once ``computed`` of its ``num_tokens``
    have their KV: capped by ``offload_prompt_only`` and its ``max_offload_tokens``."""
    limit = min(computed, num_tokens)
    if prompt_only:
        limit = min(limit, num_prompt_tokens)
    if max_offload_tokens is not None:
        limit = min(limit, max_offload_tokens)
    return limit


def tail_ends(limit: int, num_prompt_tokens: int) -> list[int]:
    """Where a finished request's tails end, given the ``limit`` of its tokens that may be stored
    (:func:`offload_limit` of its computed tokens): its stored tokens after their last full block
    (what the next turn of a chat resends), and its prompt but the last token after the prompt's
    last full block (what a resend of the same prompt, a "regenerate", can load: a hit leaves one
    token to compute). A tail is stored only where that end is not on a block boundary."""
    prompt_end = min(limit, num_prompt_tokens - 1)
    return [limit] if prompt_end == limit else [limit, prompt_end]
