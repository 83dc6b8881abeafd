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
