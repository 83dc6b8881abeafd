"""KV events for kvtier's tiers: vLLM ``BlockStored`` / ``BlockRemoved`` with the tier's medium.

vLLM publishes what :meth:`KVTierConnector.take_events` returns on its KV-event publisher
(``--kv-events-config``, e.g. ZMQ) next to its own device-cache events, so a KV-aware router learns
which prefixes an instance can serve from host memory (medium ``CPU``) or disk (``STORAGE``), the
fleet's Redis (``REMOTE``) or an S3 bucket (``STORAGE`` with locality ``REMOTE``, as vLLM's own
object-store tier announces its blocks).

Hashes. Routers index vLLM's block hashes, not kvtier's keys, so events carry vLLM's hashes of the
engine blocks a kvtier block covers (as vLLM's own OffloadingConnector does). kvtier learns them
from the request when it stores a block or serves a hit (:meth:`KVEventTranslator.learn`). Blocks
it never saw with a request (found on disk at start-up, or written by another engine sharing the
root) have no vLLM hashes here: their events are withheld until a request teaches them, and then
every tier that holds the block is announced at once.

Payloads. By default a ``BlockStored`` carries one hash per kvtier block (vLLM's hash of its last
engine block, the key vLLM's OffloadingConnector announces) and no tokens. With
``self_describing_kv_events: true`` it carries every engine block's hash, the parent hash, the
token ids, the engine block size and the LoRA adapter, like vLLM's self-describing offload events.

Groups. Under vLLM's hybrid allocator a kvtier block holds the pages of every KV cache group, so
each event is published once per group (``group_idx``, with that group's ``kv_cache_spec_kind``),
as vLLM announces a block of each group; with one group, once, as group 0.

Invariant (what a consumer may rely on): for one hash, medium and locality, ``BlockStored`` and
``BlockRemoved`` alternate, starting with ``BlockStored``; a block is announced in a medium only
while it is readable there.

Threading: everything runs on vLLM's scheduler thread (the orchestrator's thread).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
from vllm.v1.request import Request

from kvtier.core.keys import BlockKey
from kvtier.core.residency import ChangeKind
from kvtier.runtime.orchestrator import Orchestrator
from kvtier.tiers.base import Medium

MEDIUM_REMOTE = "REMOTE"
"""kvtier's medium name for its shared remote tier (vLLM defines none): the block is in the fleet's
Redis, readable by any engine of the same namespace."""
EVENT_MEDIUM = {Medium.HOST: MEDIUM_CPU, Medium.DISK: MEDIUM_STORAGE, Medium.REMOTE: MEDIUM_REMOTE,
                Medium.S3: MEDIUM_STORAGE}
"""kvtier tier -> the medium name in vLLM's KV events. The S3 tier is announced as vLLM announces its
own object-store tier (``obj``): medium ``STORAGE``, locality ``REMOTE`` (:data:`EVENT_LOCALITY`)."""

LOCALITY = "LOCAL"  # host memory and the disk directory are this instance's own
EVENT_LOCALITY = {Medium.S3: "REMOTE"}
"""kvtier tier -> the locality of its KV events where it is not :data:`LOCALITY`: an object store is
shared by the fleet, so a block there is remote to every instance (vLLM's ``Locality.REMOTE``)."""


@dataclass(slots=True)
class _Announced:
    """What kvtier knows of one block in vLLM's terms, and where it has announced it."""

    hashes: tuple[BlockHash, ...]  # the hashes to publish (default payload: the last one only)
    parent: BlockHash | None = None  # the rest only for self-describing payloads
    token_ids: array | None = None
    lora_id: int | None = None
    lora_name: str | None = None
    media: set[Medium] = field(default_factory=set)


class KVEventTranslator:
    """Turns the orchestrator's residency changes into vLLM KV events (see the module doc)."""

    def __init__(
        self,
        orchestrator: Orchestrator,
        *,
        block_tokens: int,
        engine_block_tokens: int,
        self_describing: bool,
        group_kinds: Sequence[str],
    ):
        self._orchestrator = orchestrator
        self._block_tokens = block_tokens
        self._engine_block_tokens = engine_block_tokens
        self._pages = block_tokens // engine_block_tokens
        self._self_describing = self_describing
        self._group_kinds = tuple(group_kinds)  # a kvtier block holds every group's pages
        self._known: dict[BlockKey, _Announced] = {}
        self._events: list[KVCacheEvent] = []
        orchestrator.track_residency()

    def learn(self, request: Request, blocks: Iterable[tuple[int, BlockKey]]) -> None:
        """``blocks``: ``(index, key)`` of kvtier blocks of ``request`` (block ``index`` covers its
        tokens ``index * block_tokens`` onwards).

        Call after they were stored (the store job finished) or served as a hit; blocks not
        readable from any tier now are not remembered.
        """
        self._drain()  # older changes first, so the media found below are current
        hashes = request.block_hashes
        for index, key in blocks:
            if key in self._known:
                continue
            media = self._orchestrator.media_of(key)
            if not media:
                continue
            start, end = index * self._pages, (index + 1) * self._pages
            if len(hashes) < end:
                continue  # vLLM has not hashed these tokens (cannot happen for full blocks)
            block = self._snapshot(request, index, tuple(hashes[start:end]), hashes[start - 1] if start else None)
            self._known[key] = block
            for medium in media:
                self._announce(block, medium)

    def take_events(self) -> list[KVCacheEvent]:
        """Events since the last call, in order (vLLM publishes them after each step)."""
        self._drain()
        events, self._events = self._events, []
        return events

    def forget_all(self) -> None:
        """The engine moved to a new key epoch (a reset of its cache): no block announced so far can
        be loaded by it any more, from any tier. Each is announced removed from every medium it
        was announced in, and forgotten (what it stores from now on is announced afresh)."""
        self._drain()
        for key, block in list(self._known.items()):
            for medium in list(block.media):
                self._remove(block, medium)
            del self._known[key]

    @property
    def num_known(self) -> int:
        return len(self._known)

    # --- internals ---------------------------------------------------------------------------
    def _drain(self) -> None:
        for change in self._orchestrator.take_residency_changes():
            block = self._known.get(change.key)
            if block is None:
                continue  # never seen with a request: no vLLM hashes to announce
            if change.kind is ChangeKind.STORED:
                if change.medium not in block.media:
                    self._announce(block, change.medium)
            elif change.medium in block.media:
                self._remove(block, change.medium)
                if not block.media:
                    del self._known[change.key]

    def _remove(self, block: _Announced, medium: Medium) -> None:
        block.media.discard(medium)
        self._events.extend(
            BlockRemoved(
                block_hashes=self._published_hashes(block),
                medium=EVENT_MEDIUM[medium],
                group_idx=group,
                locality=EVENT_LOCALITY.get(medium, LOCALITY),
            )
            for group in range(len(self._group_kinds))
        )

    def _announce(self, block: _Announced, medium: Medium) -> None:
        block.media.add(medium)
        described = self._self_describing  # else vLLM's placeholder payload: no tokens, block size 0
        self._events.extend(
            BlockStored(
                block_hashes=self._published_hashes(block),
                parent_block_hash=maybe_convert_block_hash(block.parent) if block.parent is not None else None,
                token_ids=list(block.token_ids) if block.token_ids is not None else [],
                block_size=self._engine_block_tokens if described else 0,
                lora_id=block.lora_id,
                medium=EVENT_MEDIUM[medium],
                lora_name=block.lora_name,
                group_idx=group,
                kv_cache_spec_kind=kind if described else None,
                locality=EVENT_LOCALITY.get(medium, LOCALITY),
            )
            for group, kind in enumerate(self._group_kinds)
        )

    @staticmethod
    def _published_hashes(block: _Announced) -> list:
        return [maybe_convert_block_hash(h) for h in block.hashes]

    def _snapshot(
        self, request: Request, index: int, hashes: tuple[BlockHash, ...], parent: BlockHash | None
    ) -> _Announced:
        if not self._self_describing:
            return _Announced(hashes=hashes[-1:])
        lora = request.lora_request
        start = index * self._block_tokens
        return _Announced(
            hashes=hashes,
            parent=parent,
            token_ids=array("l", request.all_token_ids[start : start + self._block_tokens]),
            lora_id=lora.adapter_id if lora is not None else None,
            lora_name=lora.name if lora is not None else None,
        )
