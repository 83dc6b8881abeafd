"""A trace as the replay runs it: requests with their key chains and the engine's own hit, in the
order their events happen.

Requests run ``concurrency`` at a time: request ``i`` starts when request ``i - concurrency``
finishes (with 1, one after the other, as ``kvtier bench``'s chat sessions run). At its start a
request is looked up (the engine's prefix cache, then kvtier) and its prompt is computed and
offered for storage; at its finish its answer's blocks and tails are offered and the engine frees
its blocks. The engine's hit does not depend on kvtier's sizes (a block kvtier loads is cached by
the engine as one it computed), so :func:`replay_events` computes it once, in the same pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvtier.core.config import PolicyName
from kvtier.replay.engine import EnginePoolTooSmall, EnginePrefixCache
from kvtier.replay.identity import ReplayChain, chain_of, computed_tokens, engine_keys
from kvtier.replay.trace import Trace, TraceError
from kvtier.tiers.host import RUN_COLDNESS


@dataclass(frozen=True)
class ReplaySettings:
    """What the replay models: kvtier's block and policies (the connector keys of the same names),
    the engine's block and KV cache, and how many requests run at once. ``run_coldness``: the host
    tier's (:data:`kvtier.tiers.host.RUN_COLDNESS`, no connector key; None replays the policy's
    order exactly)."""

    block_tokens: int
    engine_block_tokens: int
    engine_blocks: int
    concurrency: int = 1
    eviction_policy: PolicyName = PolicyName.LRU
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    offload_prompt_only: bool = False
    tails: bool = True
    run_coldness: float | None = RUN_COLDNESS


@dataclass
class ReplayRequest:
    """One request of the trace, ready to replay. ``engine_hit``: prompt tokens vLLM's own cache
    serves (set when it starts); ``computed_tokens``: its tokens with KV at its finish."""

    index: int
    line: int
    chain: ReplayChain
    prompt_tokens: int
    computed_tokens: int
    max_offload_tokens: int | None
    salt: str | None
    engine_hit: int = 0


START, FINISH = "start", "finish"


def replay_events(trace: Trace, settings: ReplaySettings) -> Iterator[tuple[str, ReplayRequest]]:
    """The trace's events in order, ``(START | FINISH, request)``, each request's engine hit set at
    its START. Streams: a request's tokens are hashed when it starts and its chain is dropped by the
    caller when it no longer needs it. Raises TraceError when the engine could not run a request."""
    engine = EnginePrefixCache(settings.engine_blocks, settings.engine_block_tokens)
    running: list[ReplayRequest] = []
    for index, source in enumerate(trace.requests):
        if len(running) >= settings.concurrency:
            done = running.pop(0)
            engine.finish(done.index)
            yield FINISH, done
        chain = chain_of(source, index, settings.block_tokens)
        prompt = source.num_prompt_tokens
        computed = computed_tokens(source)
        request = ReplayRequest(index, source.line, chain, prompt, computed, source.max_offload_tokens, source.salt)
        try:
            request.engine_hit = engine.start(index, engine_keys(source, index, settings.engine_block_tokens, chain),
                                              prompt, computed)
        except EnginePoolTooSmall as exc:
            raise TraceError(f"{trace.path}:{source.line}: {exc}: give the engine more KV cache "
                             "(--kv-cache-gib) or a lower --concurrency") from None
        running.append(request)
        yield START, request
    for done in running:
        engine.finish(done.index)
        yield FINISH, done
