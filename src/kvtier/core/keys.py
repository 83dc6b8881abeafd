"""Content addressing, key spec "kvtier/2".

A *block* is ``block_tokens`` consecutive tokens. Its key chains the key of the block before it,
so a key names the whole prefix up to and including that block::

    k_{-1} = namespace digest            (after a reset of the cache: epoch_root(digest, epoch))
    k_i    = H(k_{i-1} || tokens_i as little-endian u32 || extras_i)

A *tail* is the partial block a finished request leaves after its last full block (``1 ..
block_tokens - 1`` tokens). It hangs under the key of the block before it and is never a parent::

    t(k_{i-1}, tokens) = H(k_{i-1} || u32 0xFFFFFFFF || u32 len(extras) || extras || tokens as u32)

No token id is 0xFFFFFFFF, so a tail's input never equals a block's; the length-prefixed extras
come before the tokens, so tails of different lengths never share an input either, and the
candidate tails of one prefix are hashed incrementally (:func:`tail_keys`).

``H`` is BLAKE3 with a 32-byte output. Nothing here depends on process state (no Python
``hash``, no PYTHONHASHSEED): keys are identical across processes, restarts and machines.
``tests/test_keys.py`` pins known keys for known inputs; any change to this module that moves
those keys is a new spec version, not a bug fix.

The namespace digest covers everything that makes KV bytes incompatible (the weights themselves,
the model config and math-changing options, the byte order of the engine's pages as its workers
saw them, the block size, the parallel rank), so blocks of different namespaces can never match.
Spec history: "kvtier/1" (until 2026-11) named the model by its config and folder name and the
page format by the device type only; roots written by it are never read by this spec.

Pure computation, no I/O: used by the scheduler-side connector (keys of every request) and by
the operator tools (``kvtier inspect/verify`` read namespaces back from ``config.json``).
"""

from __future__ import annotations

import json
import os
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import blake3

KEY_SPEC_VERSION = "kvtier/2"
KEY_BYTES = 32

BlockKey = bytes
"""A 32-byte block key. Raw bytes, never tuples: cheap to hash, compare and store."""


class SpecVersionError(ValueError):
    """A stored namespace was written under another key spec version (named in the message)."""


@dataclass(frozen=True)
class ModelIdentity:
    """What makes a model compute different KV for the same tokens.

    ``weights`` fingerprints the weight files themselves (``blake3:<hex>``, see
    :mod:`kvtier.runtime.fingerprint`), so two checkpoints with the same ``config.json`` and folder
    name differ; an operator-given identity is ``operator:<text>``. ``config`` digests the model
    config as the engine loaded it (overrides applied, paths and versions left out); ``dtype`` is
    the compute dtype, ``quantization`` the weight quantization method ("" for none),
    ``overrides`` the canonical JSON of config overrides ("" for none).
    """

    weights: str
    config: str
    dtype: str
    quantization: str = ""
    overrides: str = ""


@dataclass(frozen=True)
class PageFormat:
    """The byte order of one rank's slot: how the engine's pages hold the numbers.

    Filled in from what the worker of that rank saw when vLLM registered its KV tensors (the
    attention backends it picked, the page shape and dtype of every layer, folded into ``pages``),
    plus the engine's block size, KV dtype and layout. ``kv_scales`` says where quantized KV gets
    its scales: "" (no scaling) or ``checkpoint`` (per-layer scales from the weights, covered by
    :attr:`ModelIdentity.weights`).
    """

    engine_block_tokens: int
    kv_dtype: str
    layout: str
    attention: str
    backends: tuple[str, ...]
    num_layers: int
    num_kv_heads: int
    head_size: int
    page_bytes: int
    pages: str
    kv_scales: str = ""


@dataclass(frozen=True)
class Namespace:
    """Everything that makes two caches' KV bytes incompatible; blocks of different namespaces
    never match. Its :attr:`digest` seeds every key chain (``k_{-1}``) and is stored in every
    block's header, which readers check.

    ``ranks`` holds one :class:`PageFormat` per rank (``tp_size * pp_size``); ``rank`` is the rank
    this namespace names: each tensor-parallel rank holds other KV heads, so every rank has its
    own digest (:meth:`for_rank`); rank 0's is the engine's (its directory name on disk).
    ``replicated``: every rank holds the same KV bytes (MLA's latent under tensor parallelism), so
    one copy is stored, rank 0's: ``ranks`` then holds that one page format. It enters the digest
    only when true, so the digests of per-rank namespaces are those of key spec kvtier/2 as before.
    A display name for operators is kept beside it (config.json's ``model_name``), never in it.
    """

    model: ModelIdentity
    ranks: tuple[PageFormat, ...]
    block_tokens: int
    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0
    spec_version: str = field(default=KEY_SPEC_VERSION)
    replicated: bool = False

    def __post_init__(self) -> None:
        stored = 1 if self.replicated else self.tp_size * self.pp_size
        if len(self.ranks) != stored:
            what = "one replicated copy" if self.replicated else f"{stored} ranks"
            raise ValueError(f"namespace has {len(self.ranks)} page formats for {what}")
        if not 0 <= self.rank < len(self.ranks):
            raise ValueError(f"rank {self.rank} out of range for {len(self.ranks)} ranks")

    def to_dict(self) -> dict:
        data = asdict(self)
        if not self.replicated:
            del data["replicated"]  # per-rank namespaces keep their kvtier/2 digests
        return data

    def canonical_json(self) -> str:
        """Sorted-key, whitespace-free JSON: the exact bytes the digest is taken over."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @property
    def digest(self) -> bytes:
        """32-byte BLAKE3 digest of :meth:`canonical_json`; this is ``k_{-1}``."""
        return blake3.blake3(self.canonical_json().encode()).digest()

    @property
    def page(self) -> PageFormat:
        """The page format of the rank this namespace names."""
        return self.ranks[self.rank]

    @property
    def engine_digest(self) -> bytes:
        """Rank 0's digest: names one engine configuration (its directory on disk)."""
        return self.for_rank(0).digest

    def for_rank(self, rank: int) -> "Namespace":
        return replace(self, rank=rank)

    def config_json(self, model_name: str) -> str:
        """What a disk root's ``config.json`` holds: the namespace and, for operators, a display name
        (``model_name``, not part of the digest)."""
        return json.dumps({"model_name": model_name, **self.to_dict()}, sort_keys=True, indent=1)

    def rank_digests(self) -> list[bytes]:
        """One digest per stored copy: per rank, or rank 0's alone when :attr:`replicated`."""
        return [self.for_rank(rank).digest for rank in range(len(self.ranks))]

    @classmethod
    def from_dict(cls, data: dict) -> "Namespace":
        """The inverse of :meth:`to_dict` (extra keys such as ``model_name`` are ignored).

        Raises :class:`SpecVersionError` for another spec version and ValueError/TypeError/KeyError
        for anything that is not a namespace.
        """
        version = data.get("spec_version")
        if version != KEY_SPEC_VERSION:
            raise SpecVersionError(f"key spec {version!r}, this kvtier reads {KEY_SPEC_VERSION!r}")
        tp_size, pp_size = _count(data["tp_size"], "tp_size", MAX_RANKS), _count(data["pp_size"], "pp_size", MAX_RANKS)
        raw_ranks = data["ranks"]
        if not isinstance(raw_ranks, list | tuple) or len(raw_ranks) > tp_size * pp_size:
            raise ValueError(f"'ranks' must be a list of at most tp_size * pp_size = {tp_size * pp_size} page formats")
        ranks = tuple(_page_format(rank) for rank in raw_ranks)
        return cls(
            model=ModelIdentity(**{name: _text(value, f"model.{name}") for name, value in data["model"].items()}),
            ranks=ranks,
            block_tokens=_count(data["block_tokens"], "block_tokens", MAX_BLOCK_TOKENS),
            tp_size=tp_size,
            pp_size=pp_size,
            rank=_count(data.get("rank", 0), "rank", MAX_RANKS * MAX_RANKS, low=0),
            replicated=bool(data.get("replicated", False)),
        )


def stored_ranks_of(config: dict) -> int:
    """How many rank records a block of the namespace in ``config`` (a namespace's ``to_dict``,
    as a disk root's ``config.json`` holds it) has: ``tp_size * pp_size``, or 1 when replicated.
    Raises TypeError/ValueError for values that are not numbers."""
    if config.get("replicated") is True:
        return 1
    return _count(config.get("tp_size", 1), "tp_size", MAX_RANKS) * _count(config.get("pp_size", 1), "pp_size", MAX_RANKS)


MAX_RANKS = 1024
"""Most tensor-parallel (and pipeline-parallel) ranks a namespace read from outside may name."""
MAX_BLOCK_TOKENS = 1 << 20
"""Most tokens per block a namespace read from outside may name."""
_PAGE_COUNTS = {"engine_block_tokens": MAX_BLOCK_TOKENS, "num_layers": 1 << 16, "num_kv_heads": 1 << 16,
                "head_size": 1 << 16, "page_bytes": 1 << 40}


def _count(value: object, name: str, high: int, *, low: int = 1) -> int:
    """``value`` as a whole number in ``[low, high]``: a namespace read from a file or a frame
    (a JSON number may be 1e999, a bool, a string) is checked before anything computes with it."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name!r} must be a whole number from {low} to {high}, got {value!r:.40}")
    return value


def _text(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name!r} must be a string, got {type(value).__name__}")
    return value


def _page_format(raw: object) -> PageFormat:
    if not isinstance(raw, dict):
        raise TypeError(f"a page format must be an object, got {type(raw).__name__}")
    backends = raw.get("backends")
    if not isinstance(backends, list | tuple):
        raise TypeError("a page format's 'backends' must be a list")
    fields = {name: (_count(value, name, _PAGE_COUNTS[name]) if name in _PAGE_COUNTS else _text(value, name))
              for name, value in raw.items() if name != "backends"}
    return PageFormat(**fields, backends=tuple(_text(b, "backends[]") for b in backends))


@dataclass(frozen=True)
class BlockExtras:
    """Per-block inputs besides tokens that change the KV bytes or must isolate tenants.

    ``lora`` is the fingerprint of the LoRA adapter's weights (not its name: a name re-registered
    with other weights must not hit the old adapter's KV). ``cache_salt`` isolates tenants.
    ``mm_hashes`` are the content hashes of multimodal inputs whose placeholder tokens overlap
    this block. ``lora`` and ``cache_salt`` apply to every block of a request.
    """

    lora: str | None = None
    cache_salt: str | None = None
    mm_hashes: tuple[str, ...] = ()

    def encode(self) -> bytes:
        """Unambiguous encoding: a tag byte and a u32 length before every present field."""
        if self.lora is None and self.cache_salt is None and not self.mm_hashes:
            return b""
        out = bytearray()
        for tag, value in ((b"L", self.lora), (b"S", self.cache_salt)):
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


TAIL_MARK = struct.pack("<I", 0xFFFFFFFF)
"""Starts a tail's hash input where a block's first token would be (no token id is 2**32 - 1)."""


def _tail_hasher(parent: bytes, extras: BlockExtras) -> "blake3.blake3":
    encoded = extras.encode()
    hasher = blake3.blake3(parent)
    hasher.update(TAIL_MARK + struct.pack("<I", len(encoded)) + encoded)
    return hasher


def tail_key(parent: bytes, tokens: Sequence[int], extras: BlockExtras = NO_EXTRAS) -> BlockKey:
    """Key of the tail ``tokens`` (fewer than a block) after the block whose key is ``parent``."""
    if not tokens:
        raise ValueError("a tail holds at least one token")
    hasher = _tail_hasher(parent, extras)
    hasher.update(_u32_le(tokens))
    return hasher.digest()


def tail_keys(parent: bytes, tokens: Sequence[int], extras: BlockExtras = NO_EXTRAS) -> list[BlockKey]:
    """``[tail_key(parent, tokens[:n]) for n in 1..len(tokens)]``, hashed incrementally: the
    candidates a lookup tries, longest first from the end of the list."""
    hasher = _tail_hasher(parent, extras)
    keys: list[BlockKey] = []
    packed = _u32_le(tokens)
    for offset in range(0, len(packed), 4):
        hasher.update(packed[offset : offset + 4])
        keys.append(hasher.copy().digest())
    return keys


EPOCH_MARK = b"kvtier/reset-epoch\0"
EPOCH_BYTES = 16


def epoch_root(digest: bytes, epoch: bytes = b"") -> BlockKey:
    """The root of an engine's key chains (``k_{-1}``) in a cache *epoch*.

    Epoch ``b""`` (an engine from start-up on) is ``digest`` itself, so the keys above are those of
    the spec. A reset of the connector's cache (vLLM's ``reset_prefix_cache(reset_connector=True)``,
    which ``pause_generation`` does before a weight update or a sleep) draws a fresh random epoch of
    :data:`EPOCH_BYTES` bytes, and every key the engine derives after it hangs under
    ``H(EPOCH_MARK || digest || epoch)`` instead: nothing any engine stored before the reset (with
    weights that may since have changed in place) can be offered to it again, and nothing it
    stores after can be offered to an engine of the old weights. The namespace (record headers,
    directories, Redis key names) does not change. Domain-separated from every key (those hash a
    32-byte parent first)."""
    if not epoch:
        return digest
    if len(epoch) != EPOCH_BYTES:
        raise ValueError(f"an epoch is {EPOCH_BYTES} bytes, got {len(epoch)}")
    return blake3.blake3(EPOCH_MARK + bytes(digest) + bytes(epoch)).digest()


def draw_epoch() -> bytes:
    """A fresh random epoch for :func:`epoch_root` (what a reset of the connector's cache draws)."""
    return os.urandom(EPOCH_BYTES)


STATELESS_MARK = b"kvtier/attention-only"


def stateless_key(key: BlockKey) -> BlockKey:
    """Key of block ``key`` stored without the Mamba / linear-attention state at its end (its
    attention pages only: the engine kept no state there). Such a block can sit inside a hit but
    never end one. Domain-separated from block and tail keys (a block key hashes a parent and
    whole u32 tokens, a tail key starts with its mark)."""
    return blake3.blake3(STATELESS_MARK + key).digest()


OLDER_SPEC_FIELDS = ("kv_dtype", "num_layers", "num_kv_heads", "head_size", "block_tokens", "tp_size",
                     "pp_size", "attention_kind", "page_format")
"""The flat fields of a "kvtier/1" config.json that describe its layout."""


def describe_config(config: dict) -> dict:
    """What an operator wants to see of a namespace's ``config.json`` (any spec version): the key
    spec, the KV layout and the model identity in short. Reads this spec's structure and, for older
    roots, the flat fields "kvtier/1" wrote; unknown content gives what it can."""
    try:
        page, model = config["ranks"][0], config["model"]
        return {
            "spec_version": config.get("spec_version"),
            "kv_dtype": page["kv_dtype"], "attention_kind": page["attention"], "num_layers": page["num_layers"],
            "num_kv_heads": page["num_kv_heads"], "head_size": page["head_size"],
            "block_tokens": config["block_tokens"], "engine_block_tokens": page["engine_block_tokens"],
            "tp_size": config["tp_size"], "pp_size": config["pp_size"], "backends": list(page["backends"]),
            "weights": str(model["weights"])[:23], "dtype": model["dtype"],
        }
    except (KeyError, IndexError, TypeError):
        return {"spec_version": config.get("spec_version"), **{k: config[k] for k in OLDER_SPEC_FIELDS if k in config}}
