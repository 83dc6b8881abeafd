"""A block's value in a shared store: every rank's record back to back, as ONE string or object.

Used by the Redis tier (one Redis string per block, :mod:`kvtier.tiers.redis.codec`) and the S3
tier (one object per block, :mod:`kvtier.tiers.s3`)::

    [136-byte header of rank 0 | payload of rank 0][136-byte header of rank 1 | payload of rank 1]...

Each record is byte for byte the disk tier's block file of that rank (:mod:`kvtier.tiers.blockfile`).
Every header carries its rank's namespace digest, the block key, the parent key, the token count,
the payload length and checksums of itself and of the payload. So a value is self-describing: an
operator tool can verify it with nothing but the value, and a reader accepts it only if
:func:`verify_value` / :func:`decode_value` pass: total length, each header (magic, version, header
checksum), the namespace digest of ITS rank, the key, the payload length and the payload checksum.
There is no pickle or other code-loading format anywhere: a value is bytes that are checked, then
copied. A tier with a fleet key seals each record (:mod:`kvtier.tiers.sealing`: the header's
checksums replaced by a MAC, the payload encrypted with ``encrypt``): every function here takes
the tier's :class:`~kvtier.tiers.sealing.Sealer` and accepts only what it accepts.

Threading: pure functions, no I/O; :func:`encode_value` runs on a tier's write threads,
:func:`decode_value` on its read threads.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.core.keys import BlockKey
from kvtier.tiers.blockfile import HEADER_LEN, CorruptBlockError, decode_header
from kvtier.tiers.sealing import PLAIN, Opener, Sealer

__all__ = ["HEADER_LEN", "CorruptBlockError", "check_headers", "decode_value", "encode_value", "value_bytes",
           "verify_value"]


def value_bytes(world: int, payload_bytes: int) -> int:
    """Length of a valid value: one header and one payload per rank."""
    return world * (HEADER_LEN + payload_bytes)


def encode_value(
    rank_digests: Sequence[bytes],
    key: BlockKey,
    parent: BlockKey,
    num_tokens: int,
    sources: Sequence[memoryview],
    sealer: Sealer = PLAIN,
) -> list[bytes | memoryview]:
    """The value of a block as its parts, in order: ``[header 0, payload 0, header 1, ...]``.

    The payloads are the caller's buffers themselves (not copied; encrypted records: new buffers
    holding the ciphertext); the write path sends the parts back to back as one value
    (:class:`~kvtier.tiers.redis.wire.ValueParts`), uncopied.
    """
    parts: list[bytes | memoryview] = []
    for namespace, source in zip(rank_digests, sources, strict=True):
        header, payload = sealer.seal(namespace=namespace, key=key, parent=parent, num_tokens=num_tokens,
                                      source=source)
        parts.append(header)
        parts.append(payload)
    return parts


def check_headers(
    headers: Sequence[bytes | bytearray | memoryview],
    payload_lens: Sequence[int],
    *,
    rank_digests: Sequence[bytes],
    key: BlockKey,
    sealer: Sealer = PLAIN,
) -> list[Opener]:
    """Decode a value's headers (``headers[r]``, followed by ``payload_lens[r]`` payload bytes)
    and raise :class:`CorruptBlockError` (the reason) unless each is ``key``'s record of rank r in
    that rank's namespace with that payload length, of a kind and key ``sealer`` accepts
    (:class:`~kvtier.tiers.sealing.UnauthenticatedRecord` otherwise). Returns each record's
    :class:`~kvtier.tiers.sealing.Opener`: the payloads are the caller's to land through it."""
    if len(headers) != len(rank_digests) or len(payload_lens) != len(rank_digests):
        raise CorruptBlockError(f"{len(headers)} records, expected {len(rank_digests)}")
    decoded = []
    for rank, (raw, payload_len, namespace) in enumerate(zip(headers, payload_lens, rank_digests)):
        header = decode_header(raw)
        if header.namespace != namespace:
            raise CorruptBlockError(
                f"rank {rank}: namespace {header.namespace.hex()[:16]}.. is not this rank's"
            )
        if header.key != key:
            raise CorruptBlockError(
                f"rank {rank}: header key {header.key.hex()[:16]}.. is not the key asked for"
            )
        if header.payload_len != payload_len:
            raise CorruptBlockError(
                f"rank {rank}: payload length {header.payload_len}, expected {payload_len}"
            )
        try:
            decoded.append(sealer.opener(header, raw))
        except CorruptBlockError as exc:
            raise type(exc)(f"rank {rank}: {exc}") from None
    return decoded


def verify_value(
    headers: Sequence[bytes | bytearray | memoryview],
    payloads: Sequence[memoryview],
    *,
    rank_digests: Sequence[bytes],
    key: BlockKey,
    sealer: Sealer = PLAIN,
) -> None:
    """Check a value already split into its records (``headers[r]``, ``payloads[r]``): raise
    :class:`CorruptBlockError` (the reason) unless every record is ``key``'s record of rank r in
    that rank's namespace, with the announced length and checksum or MAC (:func:`check_headers`,
    then the payloads, where they are; an encrypted payload is decrypted into a scratch copy)."""
    openers = check_headers(
        headers, [payload.nbytes for payload in payloads], rank_digests=rank_digests, key=key, sealer=sealer
    )
    for rank, (opener, payload) in enumerate(zip(openers, payloads)):
        _finish(rank, opener, payload, memoryview(bytearray(payload.nbytes)))


def decode_value(
    value: bytes | bytearray | memoryview,
    dests: Sequence[memoryview],
    *,
    rank_digests: Sequence[bytes],
    key: BlockKey,
    sealer: Sealer = PLAIN,
) -> None:
    """Check a whole value (a GETRANGE reply of it all) and copy its payloads into ``dests`` (one per rank): the
    tier's read path, one pass over the bytes. The total length and every header are checked
    before anything is copied; each payload's checksum is computed as it is copied
    (:func:`~kvtier.tiers.blockfile.copy_with_checksum`). Raise :class:`CorruptBlockError` (the
    reason) on any mismatch; ``dests`` then hold bytes that must not be used (the tier reports
    the read failed, and the caller discards its buffers)."""
    view = memoryview(value).cast("B")
    payload_bytes = dests[0].nbytes if dests else 0
    expected = value_bytes(len(rank_digests), payload_bytes)
    if view.nbytes != expected:
        raise CorruptBlockError(f"value is {view.nbytes} bytes, expected {expected}")
    record = HEADER_LEN + payload_bytes
    headers = [view[r * record : r * record + HEADER_LEN] for r in range(len(dests))]
    openers = check_headers(headers, [payload_bytes] * len(dests), rank_digests=rank_digests, key=key,
                            sealer=sealer)
    for rank, (opener, dest) in enumerate(zip(openers, dests)):
        _finish(rank, opener, view[rank * record + HEADER_LEN : (rank + 1) * record], dest)


def _finish(rank: int, opener: Opener, payload: memoryview, dest: memoryview) -> None:
    """Land ``payload`` into ``dest`` through ``opener`` and check it; errors name the rank."""
    opener.land(payload, dest)
    try:
        opener.finish()
    except CorruptBlockError as exc:
        raise type(exc)(f"rank {rank}: {exc}") from None
