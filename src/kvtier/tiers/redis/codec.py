"""Key names and values of the Redis tier: how a block is stored in ONE Redis string, and how a
reader proves that a string it got back is exactly the block it asked for.

Keys (no hash tags, so blocks spread over every slot of a cluster)::

    {key_prefix}:{engine_digest hex[:16]}:{block key hex}    one block, all ranks
    {key_prefix}:{engine_digest hex[:16]}:config             the namespace's config.json (for operators)

Value of a block: rank by rank, one kvtier block record per rank, each byte for byte the disk
tier's block file of that rank (:mod:`kvtier.tiers.blockfile`)::

    [136-byte header of rank 0 | payload of rank 0][136-byte header of rank 1 | payload of rank 1]...

Every header carries its rank's namespace digest, the block key, the parent key, the token count,
the payload length and checksums of itself and of the payload. So a value is self-describing: an
operator tool can verify it with nothing but the value, and a reader accepts it only if
:func:`verify_value` passes: total length, each header (magic, version, header checksum), the
namespace digest of ITS rank, the key, the payload length and the payload checksum. There is no
pickle or other code-loading format anywhere: a value is bytes that are checked, then copied.

Threading: pure functions and immutable objects, no I/O. Key names are made on the caller's
thread; :func:`encode_value` runs on the write pool, :func:`decode_value` (which calls
:func:`verify_value`) on the read pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.core.keys import KEY_BYTES, BlockKey
from kvtier.tiers.blockfile import (
    HEADER_LEN,
    CorruptBlockError,
    decode_header,
    encode_header,
    payload_checksum,
)

__all__ = [
    "HEADER_LEN",
    "CorruptBlockError",
    "KeySpace",
    "decode_value",
    "encode_value",
    "value_bytes",
    "verify_value",
]

CONFIG_SUFFIX = b"config"


@dataclass(frozen=True, slots=True)
class KeySpace:
    """The Redis key names of one namespace: ``{prefix}:{engine digest hex[:16]}:...``."""

    base: bytes  # b"{key_prefix}:{ns16}:"

    @classmethod
    def of(cls, key_prefix: str, engine_digest: bytes) -> KeySpace:
        if len(engine_digest) < 8:
            raise ValueError(f"engine_digest must be at least 8 bytes, got {len(engine_digest)}")
        return cls(f"{key_prefix}:{engine_digest.hex()[:16]}:".encode())

    def block(self, key: BlockKey) -> bytes:
        """The Redis key of block ``key``."""
        return self.base + key.hex().encode()

    @property
    def config(self) -> bytes:
        """The key holding the namespace's config.json (never a block)."""
        return self.base + CONFIG_SUFFIX

    @property
    def pattern(self) -> bytes:
        """SCAN MATCH pattern of every key of this namespace (the config key included)."""
        return self.base + b"*"

    def block_key_of(self, name: bytes) -> BlockKey | None:
        """The block key named by Redis key ``name``, or None (the config key, or not ours)."""
        if not name.startswith(self.base):
            return None
        tail = name[len(self.base) :]
        if len(tail) != 2 * KEY_BYTES:
            return None
        try:
            return bytes.fromhex(tail.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return None


def value_bytes(world: int, payload_bytes: int) -> int:
    """Length of a valid value: one header and one payload per rank."""
    return world * (HEADER_LEN + payload_bytes)


def encode_value(
    rank_digests: Sequence[bytes],
    key: BlockKey,
    parent: BlockKey,
    num_tokens: int,
    sources: Sequence[memoryview],
) -> list[bytes | memoryview]:
    """The value of a block as its parts, in order: ``[header 0, payload 0, header 1, ...]``.

    The payloads are the caller's buffers themselves (not copied); the write path joins the parts
    into the one bytes value it sends (one copy).
    """
    parts: list[bytes | memoryview] = []
    for namespace, source in zip(rank_digests, sources, strict=True):
        parts.append(
            encode_header(
                namespace=namespace,
                key=key,
                parent=parent,
                num_tokens=num_tokens,
                payload_len=source.nbytes,
                checksum=payload_checksum(source),
            )
        )
        parts.append(source)
    return parts


def verify_value(
    headers: Sequence[bytes | bytearray | memoryview],
    payloads: Sequence[memoryview],
    *,
    rank_digests: Sequence[bytes],
    key: BlockKey,
) -> None:
    """Check a value already split into its records (``headers[r]``, ``payloads[r]``): raise
    :class:`CorruptBlockError` (the reason) unless every record is ``key``'s record of rank r in
    that rank's namespace, with the announced length and checksum. The payloads are checked where
    they are (the caller's buffers, for a read)."""
    if len(headers) != len(rank_digests) or len(payloads) != len(rank_digests):
        raise CorruptBlockError(f"{len(headers)} records, expected {len(rank_digests)}")
    for rank, (raw, payload, namespace) in enumerate(zip(headers, payloads, rank_digests)):
        header = decode_header(raw)
        if header.namespace != namespace:
            raise CorruptBlockError(
                f"rank {rank}: namespace {header.namespace.hex()[:16]}.. is not this rank's"
            )
        if header.key != key:
            raise CorruptBlockError(
                f"rank {rank}: header key {header.key.hex()[:16]}.. is not the key asked for"
            )
        if header.payload_len != payload.nbytes:
            raise CorruptBlockError(
                f"rank {rank}: payload length {header.payload_len}, expected {payload.nbytes}"
            )
        if payload_checksum(payload) != header.checksum:
            raise CorruptBlockError(f"rank {rank}: payload checksum mismatch")


def decode_value(
    value: bytes | bytearray | memoryview,
    dests: Sequence[memoryview],
    *,
    rank_digests: Sequence[bytes],
    key: BlockKey,
) -> None:
    """Verify a whole value (a GET reply) where it is, then copy its payloads into ``dests`` (one
    per rank): the tier's read path, one copy. Raise :class:`CorruptBlockError` (the reason) on
    any mismatch, the total length first; ``dests`` are then untouched."""
    view = memoryview(value).cast("B")
    payload_bytes = dests[0].nbytes if dests else 0
    expected = value_bytes(len(rank_digests), payload_bytes)
    if view.nbytes != expected:
        raise CorruptBlockError(f"value is {view.nbytes} bytes, expected {expected}")
    record = HEADER_LEN + payload_bytes
    headers = [view[r * record : r * record + HEADER_LEN] for r in range(len(dests))]
    payloads = [view[r * record + HEADER_LEN : (r + 1) * record] for r in range(len(dests))]
    verify_value(headers, payloads, rank_digests=rank_digests, key=key)
    for dest, payload in zip(dests, payloads):
        dest[:] = payload
