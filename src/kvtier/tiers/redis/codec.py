"""Key names and values of the Redis tier: how a block is stored in ONE Redis string, and how a
reader proves that a string it got back is exactly the block it asked for.

Keys (no hash tags, so blocks spread over every slot of a cluster)::

    {key_prefix}:{engine_digest hex[:16]}:{block key hex}    one block, all ranks
    {key_prefix}:{engine_digest hex[:16]}:config             the namespace's config.json (for operators)

Value of a block: rank by rank, one kvtier block record per rank, each byte for byte the disk
tier's block file of that rank (:mod:`kvtier.tiers.value`, shared with the S3 tier)::

    [136-byte header of rank 0 | payload of rank 0][136-byte header of rank 1 | payload of rank 1]...

Every header carries its rank's namespace digest, the block key, the parent key, the token count,
the payload length and checksums of itself and of the payload. So a value is self-describing: an
operator tool can verify it with nothing but the value, and a reader accepts it only if
:func:`verify_value` passes: total length, each header (magic, version, header checksum), the
namespace digest of ITS rank, the key, the payload length and the payload checksum. There is no
pickle or other code-loading format anywhere: a value is bytes that are checked, then copied.
A tier with a fleet key seals each record (:mod:`kvtier.tiers.sealing`: the header's checksums
replaced by a MAC, the payload encrypted with ``encrypt``): every function here takes the tier's
:class:`~kvtier.tiers.sealing.Sealer` and accepts only what it accepts.

A big single-rank value may be read in pieces (``GETRANGE``) and landed piece by piece
(:class:`PieceLander`, the same checks as :func:`decode_value`).

Threading: pure functions and immutable objects (and one :class:`PieceLander` per read, used by
one thread at a time), no I/O. Key names are made on the caller's
thread; :func:`encode_value` runs on the write pool, :func:`decode_value` (which calls
:func:`verify_value`) on the read pool.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.core.keys import KEY_BYTES, BlockKey
from kvtier.tiers.blockfile import HEADER_LEN, CorruptBlockError
from kvtier.tiers.sealing import PLAIN, Opener, Sealer
from kvtier.tiers.value import check_headers, decode_value, encode_value, value_bytes, verify_value

__all__ = [
    "HEADER_LEN",
    "CorruptBlockError",
    "KeySpace",
    "PieceLander",
    "check_headers",
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


class PieceLander:
    """Lands ONE single-rank value read as consecutive pieces (``GETRANGE``): :meth:`feed` each
    piece in order as it arrives, then :meth:`finish`. The header is checked as soon as its 136
    bytes are in (namespace, key, payload length: :func:`check_headers`); the payload is copied
    into ``dest`` and checked as it lands (the record's :class:`~kvtier.tiers.sealing.Opener`: hashed,
    or for an encrypted record decrypted), and
    :meth:`finish` checks the total length and the checksum or MAC. Any mismatch raises
    :class:`CorruptBlockError`; ``dest`` then holds bytes that must not be used.

    Pieces are not one atomic read: the value may be replaced between two of them. A payload
    that mixes two writes, or that is not the one its header describes, fails the checksum
    (the header's checksum is of one write's payload), so no mix is ever landed as good; the
    reader re-reads such a value whole (one ``GETRANGE``, bounded like every read) before it calls it corrupt. Single rank only:
    with several ranks each could pass its own checks while coming from a different write.

    Owned by the read thread that feeds it; ``dest`` is the caller's buffer, borrowed."""

    def __init__(self, dest: memoryview, *, rank_digest: bytes, key: BlockKey, sealer: Sealer = PLAIN) -> None:
        self.dest = dest
        self.rank_digest = rank_digest
        self.key = key
        self.sealer = sealer
        self.expected = HEADER_LEN + dest.nbytes
        self.received = 0
        self.done = False
        self._header_bytes = bytearray()
        self._opener: Opener | None = None

    def feed(self, piece: bytes | bytearray | memoryview) -> None:
        """Land the value's next piece (its bytes from offset :attr:`received` on)."""
        view = memoryview(piece).cast("B")
        if self.received + view.nbytes > self.expected:
            raise CorruptBlockError(f"value is longer than the {self.expected} bytes expected")
        if self._opener is None:
            take = min(view.nbytes, HEADER_LEN - len(self._header_bytes))
            self._header_bytes += view[:take]
            self.received += take
            view = view[take:]
            if len(self._header_bytes) < HEADER_LEN:
                return
            (self._opener,) = check_headers(
                [self._header_bytes], [self.dest.nbytes], rank_digests=[self.rank_digest], key=self.key,
                sealer=self.sealer,
            )
        if view.nbytes:
            start = self.received - HEADER_LEN
            self._opener.land(view, self.dest[start : start + view.nbytes])
            self.received += view.nbytes

    def finish(self) -> None:
        """Check that the whole value came in and that its payload is the one its header names."""
        if self.received != self.expected:
            raise CorruptBlockError(f"value is {self.received} bytes, expected {self.expected}")
        assert self._opener is not None  # received == expected > HEADER_LEN
        try:
            self._opener.finish()
        except CorruptBlockError as exc:
            raise type(exc)(f"rank 0: {exc}") from None
        self.done = True
