"""Block identities of a trace's requests, and the key chains the replay hands kvtier's own code.

A replay needs to know which blocks are the same, not the engine's exact keys (it has no namespace
to seed them with), so a block of a token trace is named by a fast chain hash, XXH3-128 of its
parent's name and its tokens (the same partition of blocks into equal and different as kvtier's
BLAKE3 keys: both chain every token before the block), seeded per ``cache_salt`` so that tenants
never share a block (kvtier puts the salt in every key; vLLM in the first block's hash). Names are
16 bytes, as in kvtier's access log, whose logged keys are used as they are.

Tokens a trace does not give (a request with ``max_tokens`` but no ``output_token_ids``) are
:data:`UNKNOWN_TOKEN`, and every full block holding one is made unique to its request (its answer
is unknown, so it never matches another request's); partial-block tails over them never match a
prompt either (no prompt holds that id).

:class:`ReplayChain` and :class:`AccessChain` are :class:`~kvtier.runtime.requests.RequestKeys`
whose keys are these names (tails are hashed from them by kvtier's own tail keys, or, for an access
log, looked up in what the log recorded).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import xxhash

from kvtier.core.keys import BlockKey, BlockExtras
from kvtier.replay.trace import TraceRequest
from kvtier.runtime.requests import RequestKeys

UNKNOWN_TOKEN = 2**32 - 2
KEY_BYTES = 16
_SEED = b"kvtier plan --trace\0"


def root_of(salt: str | None) -> bytes:
    """The first block's parent for requests of ``salt`` (None: no salt)."""
    return xxhash.xxh3_128_digest(_SEED + (b"\1" + salt.encode() if salt is not None else b"\0"))


def request_tokens(request: TraceRequest) -> tuple[array, int]:
    """The request's tokens (prompt, then its answer: given, or :data:`UNKNOWN_TOKEN` for each of
    ``max_tokens``) and where the unknown ones start (its length if none)."""
    assert request.prompt is not None, "tokenize the trace first"
    if request.output is not None:
        return request.prompt + request.output, len(request.prompt) + len(request.output)
    if not request.max_tokens:
        return request.prompt, len(request.prompt)
    return request.prompt + array("I", [UNKNOWN_TOKEN]) * request.max_tokens, len(request.prompt)


def computed_tokens(request: TraceRequest) -> int:
    """Tokens with KV when the request finishes: its prompt and answer but the answer's last token
    (never fed back); at least its prompt (a prefill computes every prompt token)."""
    if request.access is not None:
        return request.access.computed_tokens
    return request.num_prompt_tokens + max(request.max_tokens, 1) - 1


def chain_keys(tokens: array, block: int, root: bytes, num_tokens: int, unknown_from: int,
               nonce: bytes = b"") -> list[bytes]:
    """Names of the full blocks of ``tokens[:num_tokens]``; a block reaching past ``unknown_from``
    is salted with ``nonce`` (the request's own, so it matches no other request's)."""
    raw = tokens[: num_tokens - num_tokens % block].tobytes()
    step = 4 * block
    digest = xxhash.xxh3_128_digest
    keys: list[bytes] = []
    parent = root
    first_unknown = unknown_from // block  # the first block holding an unknown token
    for index, start in enumerate(range(0, len(raw), step)):
        chunk = raw[start : start + step]
        parent = digest(parent + chunk + nonce) if index >= first_unknown else digest(parent + chunk)
        keys.append(parent)
    return keys


@dataclass(kw_only=True)
class ReplayChain(RequestKeys):
    """A request's key chain with every key it can need made in advance (``keys``); tails are
    kvtier's own tail keys of its tokens under these names."""

    def extend_keys(self, num_blocks: int) -> None:
        """Nothing to do: ``keys`` already covers every full block of the computed tokens."""


@dataclass(kw_only=True)
class AccessChain(ReplayChain):
    """A request of kvtier's access log: no tokens, only the keys, tails and tail probe it logged."""

    logged_tails: dict[tuple[int, int], bytes]
    probe: tuple[int, tuple[bytes, ...]]

    def tail_candidates(self, block_index: int, max_tokens: int) -> list[BlockKey]:
        """The tail keys the engine tried at ``block_index`` (none if it looked elsewhere)."""
        at, keys = self.probe
        return list(keys[:max_tokens]) if at == block_index else []

    def tail_key_of(self, block_index: int, end_token: int) -> BlockKey:
        return self.logged_tails[(block_index, end_token - block_index * self.block_tokens)]


def chain_of(request: TraceRequest, index: int, block: int) -> ReplayChain:
    """The key chain of ``request`` (the ``index``-th of its trace) in blocks of ``block`` tokens."""
    if request.access is not None:
        record = request.access
        return AccessChain(tokens=array("I"), root=root_of(request.salt), block_tokens=block, extras=BlockExtras(),
                           keys=list(record.keys), logged_tails=record.tails, probe=record.probe)
    tokens, unknown_from = request_tokens(request)
    computed = computed_tokens(request)
    root = root_of(request.salt)
    keys = chain_keys(tokens, block, root, computed, unknown_from, nonce=index.to_bytes(8, "little"))
    return ReplayChain(tokens=tokens, root=root, block_tokens=block, extras=BlockExtras(), keys=keys)


def engine_keys(request: TraceRequest, index: int, block: int, chain: ReplayChain) -> list[bytes]:
    """The names of the request's full engine blocks of ``block`` tokens (vLLM's prefix cache keys
    them so): ``chain.keys`` when kvtier's blocks are the engine's."""
    if block == chain.block_tokens or request.access is not None:
        return chain.keys
    tokens, unknown_from = request_tokens(request)
    return chain_keys(tokens, block, chain.root, computed_tokens(request), unknown_from,
                      nonce=index.to_bytes(8, "little"))
