"""Which tier a hit's tokens came from, in kvtier's terms (:class:`Medium`) and vLLM's
(:class:`CacheHitSource`, counted in ``vllm:prompt_tokens_cached_by_source``). Pure functions."""

from __future__ import annotations

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.tiers.base import Medium

VLLM_SOURCE = {
    Medium.HOST: CacheHitSource.HOST,
    Medium.DISK: CacheHitSource.DISK,
    Medium.REMOTE: CacheHitSource.EXTERNAL_UNSPECIFIED,  # vLLM's name for a remote store
    Medium.S3: CacheHitSource.EXTERNAL_UNSPECIFIED,
}


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


def clip_sources(by_source: dict[Medium, int], num_tokens: int) -> dict[Medium, int]:
    """``by_source`` cut to ``num_tokens`` (vLLM may accept fewer than offered): host first."""
    clipped, left = {}, num_tokens
    for medium in (Medium.HOST, Medium.DISK, Medium.REMOTE, Medium.S3):
        take = min(by_source.get(medium, 0), left)
        if take:
            clipped[medium] = take
            left -= take
    if left:
        clipped[Medium.HOST] = clipped.get(Medium.HOST, 0) + left
    return clipped


def vllm_sources(by_source: dict[Medium, int], num_tokens: int) -> dict[CacheHitSource, int]:
    """``by_source`` cut to ``num_tokens``, in vLLM's sources (one per medium; only positive counts)."""
    return {VLLM_SOURCE[medium]: tokens for medium, tokens in clip_sources(by_source, num_tokens).items()}
