"""What the scheduler side keeps per request: its block keys, engine blocks and copy jobs.

Runs in vLLM's scheduler process, on the scheduler's thread only (no locks). The key chain and
what is decided from it are vLLM-free (:class:`kvtier.runtime.requests.RequestKeys`, shared with
``kvtier plan --trace``); this module adds what only a vLLM request has.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from vllm.v1.request import Request

from kvtier.core.keys import BlockExtras, BlockKey
from kvtier.runtime.requests import RequestKeys
from kvtier.tiers.base import Medium


class Uncacheable(enum.Enum):
    """Why a request bypasses kvtier (its token ids do not say what its KV holds)."""

    PROMPT_EMBEDS = "requests with prompt embeddings (their token ids are placeholders)"
    LORA_UNIDENTIFIED = "requests of a LoRA adapter whose weights are not (yet) fingerprinted"


@dataclass(kw_only=True)
class RequestState(RequestKeys):
    """One request's view for kvtier: its key chain over ``request.all_token_ids`` (``tokens``,
    a live view) and what the connector tracks of it."""

    request: Request
    max_offload_tokens: int | None
    block_ids: list[list[int]] = field(default_factory=lambda: [[]])  # engine blocks, one list per KV cache group
    next_store_block: int = 0
    jobs: set[int] = field(default_factory=set)
    load_first_token: int = 0  # locally computed tokens when the hit was counted
    # Under vLLM's MultiConnector: tokens another connector may have loaded (see
    # note_loaded_elsewhere). lookup_computed: vLLM's own (block-aligned) hit at
    # the last lookup, until the request is scheduled; own_load_end: where kvtier's own load for
    # that scheduling ends (0: none); loaded_elsewhere: token ranges [start, end) another loaded.
    lookup_computed: int | None = None
    own_load_end: int = 0
    loaded_elsewhere: list[tuple[int, int]] = field(default_factory=list)
    hit_tokens_from: dict[Medium, int] = field(default_factory=dict)  # the hit's tokens by source tier
    finished: bool = False
    load_failed: bool = False  # a load of it failed: it is not offered loads again (vLLM recomputes it)
    cacheable: bool = True  # False: never loaded nor stored (see KVTierScheduler._request_identity)
    arrival: float = 0.0  # wall time of its first lookup (the access log's "t")
    tail_probe: tuple[int, list] = (0, [])  # its last lookup's tail candidates (for the access log)

    def restart(self, root: BlockKey) -> None:
        """A new key epoch (see :meth:`RequestKeys.restart`): the request's blocks are stored again
        from its first, under the new keys, as vLLM computes them again (a reset of the cache
        finds no request running: vLLM recomputes every request it kept)."""
        super().restart(root)
        self.next_store_block = 0
        self.tail_probe = (0, [])

    def note_loaded_elsewhere(self, computed: int, min_tokens: int, *, record: bool = True) -> None:
        """At the request's first scheduling after a lookup (``computed``: the tokens vLLM counts as
        computed then), find what another connector loaded, so that kvtier does not store it
        (``record`` False: the connector stores it anyway, ``store_loaded_elsewhere: true``).

        Inside vLLM's MultiConnector, every child is asked for hits and the first that has some
        loads them (``MultiConnector.get_num_new_matched_tokens``); the others see
        ``update_state_after_alloc`` with 0 tokens. vLLM then counts as computed its own hit (the
        block-aligned one kvtier was asked beyond, :attr:`lookup_computed`: vLLM drops a sub-block
        tail of its own hit whenever a connector loads) plus the loader's tokens. So tokens beyond
        both that and kvtier's own load (:attr:`own_load_end`) came from another child. kvtier
        stores none of its blocks (nor tails) that hold such tokens: the engine did not compute
        them, the other child holds them, and storing them twice would only double the writes (on
        a disaggregated decode instance: every prompt NIXL brought). Blocks the engine computed
        before them (vLLM's own hit) or computes after them are stored. (A request may be scheduled
        afresh after a preemption: each such range is kept in :attr:`loaded_elsewhere`.)

        Less than ``min_tokens`` (an engine block) beyond is not told apart from vLLM's own
        sub-block hit (a partial-hash hit, vLLM keeps it when no connector loads): treated as not
        loaded elsewhere. A standalone kvtier never sees more (vLLM's hit and kvtier's load are
        everything)."""
        if self.lookup_computed is None:
            return
        known = max(self.lookup_computed, self.own_load_end)
        self.lookup_computed = None
        if computed - known < min_tokens or not record:
            return
        self.loaded_elsewhere.append((known, computed))

    def loaded_elsewhere_overlaps(self, start: int, end: int) -> bool:
        """Whether tokens ``[start, end)`` hold any that another connector loaded."""
        return any(first < end and start < last for first, last in self.loaded_elsewhere)


def computed_kv_tokens(request: Request) -> int:
    """The request's first tokens whose KV the steps vLLM has delivered computed (vLLM's
    "processed" tokens). ``num_computed_tokens`` also counts the tokens of steps still in flight
    (``num_in_flight_tokens``: under async scheduling, between scheduling a step and delivering
    it); a request preempted while a step of it ran has none computed and that step's tokens still
    in flight (vLLM 0.32 ``v1/core/sched/scheduler.py:1596-1607``): 0 then, never negative, as vLLM
    counts it itself (``:3024-3030``)."""
    return max(0, request.num_computed_tokens - request.num_in_flight_tokens)


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
