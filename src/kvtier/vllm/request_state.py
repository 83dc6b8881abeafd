"""What the scheduler side keeps per request: its block keys, engine blocks and copy jobs.

Runs in vLLM's scheduler process, on the scheduler's thread only (no locks). A request's keys
are derived lazily from its token ids, extended as its computed tokens grow; they never change
once made (vLLM never rewrites a token a block was keyed by).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from vllm.v1.request import Request

from kvtier.core.keys import BlockExtras, BlockKey, chain_block_keys, tail_key, tail_keys
from kvtier.tiers.base import Medium


class Uncacheable(enum.Enum):
    """Why a request bypasses kvtier (its token ids do not say what its KV holds)."""

    PROMPT_EMBEDS = "requests with prompt embeddings (their token ids are placeholders)"
    LORA_UNIDENTIFIED = "requests of a LoRA adapter whose weights are not (yet) fingerprinted"


@dataclass
class RequestState:
    """One request's view for kvtier. ``root`` is the engine digest (the first block's parent)."""

    request: Request
    root: BlockKey
    block_tokens: int
    extras: BlockExtras | list[BlockExtras]
    max_offload_tokens: int | None
    keys: list[BlockKey] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=lambda: [[]])  # engine blocks, one list per KV cache group
    next_store_block: int = 0
    jobs: set[int] = field(default_factory=set)
    load_first_token: int = 0  # locally computed tokens when the hit was counted
    # Under vLLM's MultiConnector: tokens another connector may have loaded (see
    # KVTierScheduler._note_loaded_elsewhere). lookup_computed: vLLM's own (block-aligned) hit at
    # the last lookup, until the request is scheduled; own_load_end: where kvtier's own load for
    # that scheduling ends (0: none); loaded_elsewhere: token ranges [start, end) another loaded.
    lookup_computed: int | None = None
    own_load_end: int = 0
    loaded_elsewhere: list[tuple[int, int]] = field(default_factory=list)
    hit_tokens_from: dict[Medium, int] = field(default_factory=dict)  # the hit's tokens by source tier
    finished: bool = False
    load_failed: bool = False  # a load of it failed: it is not offered loads again (vLLM recomputes it)
    cacheable: bool = True  # False: never loaded nor stored (see KVTierScheduler._request_identity)

    def loaded_elsewhere_overlaps(self, start: int, end: int) -> bool:
        """Whether tokens ``[start, end)`` hold any that another connector loaded."""
        return any(first < end and start < last for first, last in self.loaded_elsewhere)

    def extend_keys(self, num_blocks: int) -> None:
        """Make ``keys`` cover the first ``num_blocks`` blocks (tokens permitting)."""
        have = len(self.keys)
        if num_blocks <= have:
            return
        block = self.block_tokens
        tokens = self.request.all_token_ids[: num_blocks * block]
        extras = self.extras
        if isinstance(extras, list):
            extras = [self.extras_of(index) for index in range(num_blocks)]
        self.keys.extend(chain_block_keys(self.parent_of(have), tokens, block, extras, start_block=have))

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
        tokens = self.request.all_token_ids[start : start + min(max_tokens, self.block_tokens - 1)]
        return tail_keys(self.parent_of(block_index), tokens, self.extras_of(block_index))

    def tail_key_of(self, block_index: int, end_token: int) -> BlockKey:
        """The tail key of the tokens from block ``block_index`` up to ``end_token``."""
        start = block_index * self.block_tokens
        tokens = self.request.all_token_ids[start:end_token]
        return tail_key(self.parent_of(block_index), tokens, self.extras_of(block_index))


def block_extras(request: Request, block_tokens: int, lora: str | None) -> BlockExtras | list[BlockExtras]:
    """Per-block key extras: the adapter's fingerprint and the cache salt on every block,
    multimodal hashes where their placeholder tokens overlap the block."""
    salt = getattr(request, "cache_salt", None)
    features = getattr(request, "mm_features", None) or []
    if not features:
        return BlockExtras(lora=lora, cache_salt=salt)
    num_blocks = len(request.all_token_ids) // block_tokens + 1
    extras: list[BlockExtras] = []
    for index in range(num_blocks):
        start, end = index * block_tokens, (index + 1) * block_tokens
        hashes = tuple(
            f.identifier
            for f in features
            if f.mm_position.offset < end and f.mm_position.offset + f.mm_position.length > start
        )
        extras.append(BlockExtras(lora=lora, cache_salt=salt, mm_hashes=hashes))
    return extras
