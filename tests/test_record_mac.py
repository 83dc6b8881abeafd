"""The MAC of signed records (``checksum_alg`` 2) is the GMAC that docs/disk-format.md describes:
AES-256-GCM, no plaintext, header bytes [0, 120) then the payload as associated data, under a
per-record key, with a fresh random nonce in the header. Computed here independently (AESGCM's
one-shot API over the documented derivation), so a change of algorithm or key derivation fails.

Forgeries that only a GCM-based MAC could invite are misses: a nonce rewritten (header sum
recomputed, as a forger can), an encrypted record relabelled as signed and back (both use AES-GCM,
under different keys), a tag replayed onto another payload. Forgery with another key, copies under
another key, rank or namespace, and wrong keys on the disk tier and on a real redis-server are in
tests/test_sealed_records.py, which runs them for this MAC too.
"""

from __future__ import annotations

import os
import struct

import blake3
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvtier.core.fleet_key import AuthConfig, FleetKey
from kvtier.tiers.blockfile import HEADER_LEN, SEALED_COVERED, decode_header, sealed_header_sum
from kvtier.tiers.sealing import Sealer, UnauthenticatedRecord

K1 = FleetKey(bytes(range(100, 132)), "test K1")
NAMESPACE = bytes([0xA0]) * 32
KEY = bytes(range(32))
MAC_CONTEXT = "kvtier 2026-11-26 record GMAC v2"  # docs/disk-format.md


def seal(sealer: Sealer, payload: bytes) -> tuple[bytes, bytes]:
    header, body = sealer.seal(namespace=NAMESPACE, key=KEY, parent=bytes(32), num_tokens=7,
                               source=memoryview(payload))
    return header, bytes(body)


def opened(sealer: Sealer, header: bytes, body: bytes) -> bytes:
    """The payload ``sealer`` lands from the record, or UnauthenticatedRecord."""
    dest = memoryview(bytearray(len(body)))
    opener = sealer.opener(decode_header(header), header)
    opener.land(memoryview(body), dest)
    opener.finish()
    return bytes(dest)


def resum(header: bytearray) -> bytes:
    struct.pack_into("<Q", header, 92, sealed_header_sum(header))
    return bytes(header)


@pytest.mark.parametrize("size", [0, 1, 4096, (1 << 20) + 7, 3 << 20])
def test_mac_is_gmac_under_the_documented_record_key(size):
    payload = os.urandom(size)
    header, body = seal(Sealer(AuthConfig(K1)), payload)
    assert body == payload and len(header) == HEADER_LEN
    decoded = decode_header(header)
    assert decoded.checksum_alg == 2
    mac_key = blake3.blake3(K1.secret, derive_key_context=MAC_CONTEXT).digest()
    record_key = blake3.blake3(NAMESPACE + KEY, key=mac_key).digest()
    expected = AESGCM(record_key).encrypt(decoded.nonce, b"", header[:SEALED_COVERED] + payload)
    assert decoded.tag == expected  # an empty plaintext: the output is the 16-byte tag alone
    assert opened(Sealer(AuthConfig(K1)), header, body) == payload


def test_every_signed_record_has_a_fresh_nonce():
    sealer = Sealer(AuthConfig(K1))
    payload = os.urandom(4096)
    nonces = {decode_header(seal(sealer, payload)[0]).nonce for _ in range(64)}
    assert len(nonces) == 64 and bytes(12) not in nonces


def test_gcm_specific_forgeries_are_misses():
    payload = os.urandom(4096)
    signed, _ = seal(Sealer(AuthConfig(K1)), payload)
    encrypted, ciphertext = seal(Sealer(AuthConfig(K1, encrypt=True)), payload)
    reader = Sealer(AuthConfig(K1))
    forged = {}
    bad = bytearray(signed)
    bad[85] ^= 1  # the nonce
    forged["nonce rewritten"] = (resum(bad), payload)
    for name, (header, body) in {"encrypted relabelled as signed": (encrypted, ciphertext),
                                 "signed relabelled as encrypted": (signed, payload)}.items():
        bad = bytearray(header)
        struct.pack_into("<H", bad, 108, 5 - struct.unpack_from("<H", bad, 108)[0])  # 2 <-> 3
        forged[name] = (resum(bad), body)
    other, _ = seal(Sealer(AuthConfig(K1)), os.urandom(4096))
    forged["tag of another payload"] = (signed[:SEALED_COVERED] + other[SEALED_COVERED:HEADER_LEN], payload)
    forged["payload of another record"] = (other, payload)
    for name, (header, body) in forged.items():
        with pytest.raises(UnauthenticatedRecord):
            opened(reader, header, body)
            pytest.fail(f"{name}: served")
    assert opened(reader, signed, payload) == payload
