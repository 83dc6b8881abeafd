"""Sealed records: a tier's records signed (and optionally encrypted) with the fleet key.

A tier entry with a fleet key (:mod:`kvtier.core.fleet_key`) writes every record SEALED
(:mod:`kvtier.tiers.blockfile`, ``checksum_alg`` 2 or 3) and accepts on read only records sealed
under one of its keys; a tier without one writes PLAIN records (xxh3 checksums) and accepts only
those. A tier with ``encrypt: true`` accepts only encrypted records (:attr:`Seal.AEAD`): a record
signed but not encrypted, even under its own key, would put plaintext KV in its engines' view of a
store that is meant to hold none, and says that a writer of the fleet runs without ``encrypt``.
Anything else is an :class:`UnauthenticatedRecord` (a :class:`CorruptBlockError`, so every
reader treats it as a miss; the tiers count it under its own reason, ``unauthenticated``).

- :attr:`Seal.MAC`: the tag is a GMAC (AES-256-GCM with an empty plaintext and, as associated
  data, header bytes [0, 120) then the payload; ``cryptography`` package) under a RECORD key derived
  like AEAD's below but from a MAC key of its own, with a random 96-bit nonce per record (in the
  header). A nonce repeated under one key would reveal GMAC's hash key; a record key only ever
  signs the rewrites of one block of one rank, so a repeat is out of reach. Chosen by measurement
  on the read path (copy + check of a 5.9 MB payload, one thread, ``benchmarks/bench_sealing.py``):
  0.02 ns per byte more than a plain record's xxh3, against 0.09 for keyed BLAKE3 (0.11 with its
  threads) and 0.05 for Poly1305.
- :attr:`Seal.AEAD` (``encrypt: true``): the payload is encrypted with AES-256-GCM
  (``cryptography`` package) under a RECORD key derived from the fleet key, the namespace digest
  (which names the rank) and the block key, with a random 96-bit nonce per record; header bytes
  [0, 120) are the associated data; the GCM tag is the MAC. Block keys are chained over the
  request's ``cache_salt`` (kvtier's key chain: its extras; vLLM's block hashes: its extra keys of
  the first block), so two tenants' records are never under the same key; the record carries the
  block key (already its public name) and nothing that reveals the salt.

Binding: the tag covers the namespace digest and the block key in the header, and every reader
also checks that they are the ones it asked for, so a valid record copied under another key,
rank or namespace fails. Which key: the header's ``key_id`` (public, one-way); a record under a
key the tier does not list is unauthenticated, whatever its tag.

Threading: :class:`Sealer` is immutable and shared by every worker thread of a tier; an
:class:`Opener` belongs to the one thread reading one record. :meth:`Sealer.seal` returns the
caller's buffer for PLAIN and MAC records and a NEW buffer (the ciphertext, owned by the caller)
for AEAD records. Nothing here blocks on I/O.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

import blake3
import xxhash
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from kvtier.core.fleet_key import AuthConfig, FleetKey
from kvtier.tiers.blockfile import (
    CHECKSUM_XXH3_64,
    NONCE_BYTES,
    SEAL_AEAD,
    SEAL_MAC,
    SEALED_COVERED,
    BlockHeader,
    CorruptBlockError,
    encode_header,
    encode_sealed_fields,
)

__all__ = ["KeyState", "Opener", "PLAIN", "Seal", "Sealer", "UnauthenticatedRecord"]

_MAC_CONTEXT = "kvtier 2026-11-26 record GMAC v2"
_ENC_CONTEXT = "kvtier 2026-11-26 record encryption v1"
_CHUNK = 1 << 20  # bytes per step of a copy + hash or a decryption (bounded time holding the GIL)
_GCM_SLACK = 15  # cryptography's update_into wants len(buf) >= len(data) + 15


class Seal(enum.Enum):
    """How a tier writes its records (its ``checksum_alg``)."""

    PLAIN = CHECKSUM_XXH3_64  # checksums only: catches accidents, not anyone who means it
    MAC = SEAL_MAC  # signed with the fleet key
    AEAD = SEAL_AEAD  # signed and encrypted


class KeyState(enum.Enum):
    """Which of a reader's keys a record is under (``kvtier verify``)."""

    PLAIN = "plain"  # no MAC at all
    CURRENT = "current"  # the write key
    RETIRED = "retired"  # one of the read-only keys: purge once none is left
    UNKNOWN = "unknown"  # a key this reader does not list: never accepted


class UnauthenticatedRecord(CorruptBlockError):
    """A record that this tier must not serve: no MAC where one is required, a MAC where this tier
    has no key to check it, a key this tier does not list, or a tag that does not match (forged or
    damaged: a MAC cannot tell which). The message says which."""


@dataclass(frozen=True, slots=True, repr=False)
class _Keys:
    key_id: bytes
    mac: bytes
    enc: bytes
    retired: bool


def _derive(key: FleetKey, retired: bool) -> _Keys:
    secret = key.secret
    return _Keys(key.key_id, blake3.blake3(secret, derive_key_context=_MAC_CONTEXT).digest(),
                 blake3.blake3(secret, derive_key_context=_ENC_CONTEXT).digest(), retired)


class Sealer:
    """One tier's sealing: the mode it writes (:attr:`mode`) and the keys it accepts on read."""

    def __init__(self, auth: AuthConfig | None) -> None:
        self.mode = Seal.PLAIN if auth is None else Seal.AEAD if auth.encrypt else Seal.MAC
        self._write = None if auth is None else _derive(auth.write, retired=False)
        self._keys = {} if auth is None else {
            k.key_id: _derive(k, retired=k is not auth.write) for k in auth.accepted
        }

    def __repr__(self) -> str:
        return f"Sealer({self.mode.name}, keys={[k.hex() for k in self._keys]})"

    @property
    def write_key_id(self) -> bytes | None:
        return None if self._write is None else self._write.key_id

    # ------------------------------------------------------------------ writing

    def seal(self, *, namespace: bytes, key: bytes, parent: bytes, num_tokens: int,
             source: memoryview) -> tuple[bytes, memoryview]:
        """``(header, payload)`` of the record of ``source`` (one rank's bytes): ``payload`` is
        ``source`` itself, or for AEAD a new buffer holding the ciphertext."""
        n = source.nbytes
        if self._write is None:
            return encode_header(namespace=namespace, key=key, parent=parent, num_tokens=num_tokens,
                                 payload_len=n, checksum=xxhash.xxh3_64_intdigest(source)), source
        keys = self._write
        nonce = os.urandom(NONCE_BYTES)
        alg, secret = (SEAL_MAC, keys.mac) if self.mode is Seal.MAC else (SEAL_AEAD, keys.enc)
        fields = encode_sealed_fields(alg=alg, namespace=namespace, key=key, key_id=keys.key_id,
                                      nonce=nonce, num_tokens=num_tokens, payload_len=n)
        encryptor = Cipher(algorithms.AES(_record_key(secret, namespace, key)), modes.GCM(nonce)).encryptor()
        encryptor.authenticate_additional_data(fields)
        if self.mode is Seal.MAC:  # GMAC: the payload is associated data, nothing is encrypted
            for start in range(0, n, _CHUNK):
                encryptor.authenticate_additional_data(source[start : start + _CHUNK])
            encryptor.finalize()
            return fields + encryptor.tag, source
        out = memoryview(bytearray(n + _GCM_SLACK))
        for start in range(0, n, _CHUNK):
            stop = min(n, start + _CHUNK)
            encryptor.update_into(source[start:stop], out[start:])
        encryptor.finalize()
        return fields + encryptor.tag, out[:n]

    # ------------------------------------------------------------------ reading

    def opener(self, header: BlockHeader, raw_header: bytes | bytearray | memoryview) -> Opener:
        """The checker of one record whose decoded header is ``header`` (``raw_header``: its 136
        bytes as stored). Raises :class:`UnauthenticatedRecord` if this tier may not accept a
        record of its kind or key at all."""
        if not header.sealed:
            if self._write is not None:
                raise UnauthenticatedRecord("record carries no MAC, and this tier has a fleet key "
                                            "(unauthenticated records are never served)")
            return _PlainOpener(header.checksum)
        if self._write is None:
            raise UnauthenticatedRecord("record is sealed with a fleet key (MAC) and this tier has none to check "
                                        "it: set auth_key_env or auth_key_file as the fleet's writers do")
        keys = self._keys.get(header.key_id)
        if keys is None:
            raise UnauthenticatedRecord(f"record is sealed under key id {header.key_id.hex()}, which is not one "
                                        "of this tier's keys")
        covered = bytes(memoryview(raw_header)[:SEALED_COVERED])
        if header.checksum_alg == SEAL_MAC:
            if self.mode is Seal.AEAD:
                raise UnauthenticatedRecord("record is signed but not encrypted, and this tier has encrypt: true "
                                            "(it serves only encrypted records: a fleet engine without encrypt "
                                            "wrote it; give every writer the same setting)")
            return _MacOpener(_record_key(keys.mac, header.namespace, header.key), header.nonce, header.tag, covered)
        return _AeadOpener(_record_key(keys.enc, header.namespace, header.key), header.nonce, header.tag, covered)

    def key_state(self, header: BlockHeader) -> KeyState:
        """Which of this sealer's keys ``header`` names (its tag unchecked)."""
        if not header.sealed:
            return KeyState.PLAIN
        keys = self._keys.get(header.key_id)
        if keys is None:
            return KeyState.UNKNOWN
        return KeyState.RETIRED if keys.retired else KeyState.CURRENT


PLAIN = Sealer(None)
"""The sealer of a tier without a fleet key."""


def _record_key(secret: bytes, namespace: bytes, key: bytes) -> bytes:
    """The AES-256 key of one record: per fleet key (its MAC or its encryption key, ``secret``),
    namespace (rank) and block key."""
    return blake3.blake3(bytes(namespace) + bytes(key), key=secret).digest()


class Opener:
    """Checks one record as its payload is landed: :meth:`land` (copy ``source`` into ``dest``:
    for AEAD, decrypt) or :meth:`land_in_place` piece by piece in order, then :meth:`finish`,
    which raises :class:`CorruptBlockError` / :class:`UnauthenticatedRecord` on a mismatch; the
    bytes landed must not be used unless it returns."""

    def land(self, source: memoryview, dest: memoryview) -> None:
        raise NotImplementedError

    def land_in_place(self, view: memoryview) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError


class _HashingOpener(Opener):
    _hasher: xxhash.xxh3_64 | _Gmac
    _step = 256 * 1024  # bytes copied, then hashed while still in the core's cache

    def land(self, source: memoryview, dest: memoryview) -> None:
        if source.nbytes != dest.nbytes:
            raise ValueError(f"copy of {source.nbytes} bytes into a buffer of {dest.nbytes}")
        step = self._step
        for start in range(0, source.nbytes, step):
            piece = dest[start : start + step]
            piece[:] = source[start : start + step]
            self._hasher.update(piece)

    def land_in_place(self, view: memoryview) -> None:
        self._hasher.update(view)


class _PlainOpener(_HashingOpener):
    def __init__(self, checksum: int) -> None:
        self._hasher = xxhash.xxh3_64()
        self._expected = checksum

    def finish(self) -> None:
        if self._hasher.intdigest() != self._expected:
            raise CorruptBlockError("payload checksum mismatch")


class _Gmac:
    """GMAC as a hasher: ``update`` feeds associated data to an AES-GCM decryptor of no ciphertext,
    whose ``finalize`` checks the tag (in constant time)."""

    def __init__(self, record_key: bytes, nonce: bytes, tag: bytes, covered: bytes) -> None:
        self._decryptor = Cipher(algorithms.AES(record_key), modes.GCM(nonce, tag)).decryptor()
        self._decryptor.authenticate_additional_data(covered)
        self.update = self._decryptor.authenticate_additional_data

    def finalize(self) -> None:
        self._decryptor.finalize()


class _MacOpener(_HashingOpener):
    _step = _CHUNK  # GMAC with the copy: 19.6 GB/s in 1 MiB steps, 13.8 in 256 KiB steps

    def __init__(self, record_key: bytes, nonce: bytes, tag: bytes, covered: bytes) -> None:
        self._hasher = _Gmac(record_key, nonce, tag, covered)

    def finish(self) -> None:
        try:
            self._hasher.finalize()
        except InvalidTag:
            raise UnauthenticatedRecord("MAC mismatch: not written under this key for this namespace, rank and "
                                        "key, or damaged") from None


class _AeadOpener(Opener):
    def __init__(self, record_key: bytes, nonce: bytes, tag: bytes, covered: bytes) -> None:
        self._decryptor = Cipher(algorithms.AES(record_key), modes.GCM(nonce, tag)).decryptor()
        self._decryptor.authenticate_additional_data(covered)
        self._scratch = bytearray(2 * _GCM_SLACK)

    def land(self, source: memoryview, dest: memoryview) -> None:
        if source.nbytes != dest.nbytes:
            raise ValueError(f"decryption of {source.nbytes} bytes into a buffer of {dest.nbytes}")
        n = source.nbytes
        for start in range(0, n, _CHUNK):
            stop = min(n, start + _CHUNK)
            direct = stop if n - stop >= _GCM_SLACK else max(start, n - _GCM_SLACK)
            if direct > start:  # dest from start on has room for the slack cryptography asks for
                self._decryptor.update_into(source[start:direct], dest[start:])
            if stop > direct:  # the last few bytes go through a small scratch buffer
                done = self._decryptor.update_into(source[direct:stop], self._scratch)
                dest[direct:stop] = memoryview(self._scratch)[:done]

    def land_in_place(self, view: memoryview) -> None:
        self.land(view, view)  # AES-GCM (counter mode) decrypts in place

    def finish(self) -> None:
        try:
            self._decryptor.finalize()
        except InvalidTag:
            raise UnauthenticatedRecord("AES-GCM tag mismatch: not written under this key for this namespace, "
                                        "rank and key, or damaged") from None
