"""Content addressing, key spec "kvtier/1".

A *block* is ``block_tokens`` consecutive tokens. Its key chains the key of the block before it,
so a key names the whole prefix up to and including that block::

    k_{-1} = namespace digest
    k_i    = H(k_{i-1} || tokens_i as little-endian u32 || extras_i)

``H`` is BLAKE3 with a 32-byte output. Nothing here depends on process state (no Python
``hash``, no PYTHONHASHSEED): keys are identical across processes, restarts and machines.
``tests/test_keys.py`` pins known keys for known inputs; any change to this module that moves
those keys is a new spec version, not a bug fix.

The namespace digest covers everything that makes KV bytes incompatible (model, dtype, layout,
block size, parallel rank), so blocks of different namespaces can never match.
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import blake3

KEY_SPEC_VERSION = "kvtier/1"
KEY_BYTES = 32

BlockKey = bytes
"""A 32-byte block key. Raw bytes, never tuples: cheap to hash, compare and store."""


@dataclass(frozen=True)
class Namespace:
    """Everything that makes two caches' KV bytes incompatible.

    ``page_format`` names the engine's in-memory page layout (e.g. ``"vllm-cpu"``): pages of
    different attention backends hold the same numbers in different orders.
    ``tp_rank``/``tp_size`` matter because each tensor-parallel rank holds different KV heads;
    the namespace of one engine therefore differs per rank (see :meth:`for_rank`).
    """

    model_name: str
    model_digest: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    attention_kind: str
    block_tokens: int
    page_format: str
    tp_size: int = 1
    pp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    spec_version: str = field(default=KEY_SPEC_VERSION)

    def canonical_json(self) -> str:
        """Sorted-key, whitespace-free JSON: the exact bytes the digest is taken over."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @property
    def digest(self) -> bytes:
        """32-byte BLAKE3 digest of :meth:`canonical_json`; this is ``k_{-1}``."""
        return blake3.blake3(self.canonical_json().encode()).digest()

    @property
    def rank_independent_digest(self) -> bytes:
        """Digest with the rank fields zeroed: names one engine configuration on disk."""
        return Namespace(**{**asdict(self), "tp_rank": 0, "pp_rank": 0}).digest

    def for_rank(self, tp_rank: int, pp_rank: int = 0) -> "Namespace":
        return Namespace(**{**asdict(self), "tp_rank": tp_rank, "pp_rank": pp_rank})


@dataclass(frozen=True)
class BlockExtras:
    """Per-block inputs besides tokens that change the KV bytes or must isolate tenants.

    ``mm_hashes`` are the content hashes of multimodal inputs whose placeholder tokens overlap
    this block. ``lora_name`` and ``cache_salt`` apply to every block of a request.
    """

    lora_name: str | None = None
    cache_salt: str | None = None
    mm_hashes: tuple[str, ...] = ()

    def encode(self) -> bytes:
        """Unambiguous encoding: a tag byte and a u32 length before every present field."""
        if self.lora_name is None and self.cache_salt is None and not self.mm_hashes:
            return b""
        out = bytearray()
        for tag, value in ((b"L", self.lora_name), (b"S", self.cache_salt)):
            if value is not None:
                raw = value.encode()
                out += tag + struct.pack("<I", len(raw)) + raw
        for mm_hash in self.mm_hashes:
            raw = mm_hash.encode()
            out += b"M" + struct.pack("<I", len(raw)) + raw
        return bytes(out)


NO_EXTRAS = BlockExtras()


def _u32_le(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian u32 (``array`` is several times faster than ``struct.pack``)."""
    packed = array("I", tokens)
    if packed.itemsize != 4:  # pragma: no cover - no such CPython platform today
        return struct.pack(f"<{len(tokens)}I", *tokens)
    if sys.byteorder == "big":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def block_key(parent: bytes, tokens: Sequence[int], extras: BlockExtras = NO_EXTRAS) -> BlockKey:
    """``H(parent || tokens as u32 LE || extras)``."""
    hasher = blake3.blake3(parent)
    hasher.update(_u32_le(tokens))
    hasher.update(extras.encode())
    return hasher.digest()


def chain_block_keys(
    parent: bytes,
    token_ids: Sequence[int],
    block_tokens: int,
    extras: Sequence[BlockExtras] | BlockExtras = NO_EXTRAS,
    start_block: int = 0,
) -> list[BlockKey]:
    """Keys of the full blocks of ``token_ids`` from ``start_block`` on.

    ``parent`` is the namespace digest when ``start_block == 0``, else the key of block
    ``start_block - 1`` (this lets callers extend a request's key list incrementally).
    A trailing partial block gets no key. ``extras`` is either one value for every block or a
    sequence indexed by absolute block number.
    """
    keys: list[BlockKey] = []
    n_full = len(token_ids) // block_tokens
    for index in range(start_block, n_full):
        block_extras = extras if isinstance(extras, BlockExtras) else extras[index]
        parent = block_key(parent, token_ids[index * block_tokens : (index + 1) * block_tokens], block_extras)
        keys.append(parent)
    return keys
