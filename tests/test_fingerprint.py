"""Weight fingerprints (kvtier.runtime.fingerprint) on real files: full hashes, the cache of
results and the folders it creates. The connector's use of them is tested in test_connector.py."""

from __future__ import annotations

import os

import pytest

from kvtier.runtime.fingerprint import FingerprintError, fingerprint_weights


def test_a_changed_weight_changes_the_digest_and_the_cache_is_owner_only(tmp_path, monkeypatch):
    """A fingerprint is cached under ``<kvtier cache>/fingerprints`` (created 0700 with its missing
    parents under the usual umask) and read back while the files are unchanged; one changed byte
    (same size, new mtime) is another digest."""
    cache = tmp_path / "home" / ".cache" / "kvtier"
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(cache))
    weights = tmp_path / "model"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (weights / "config.json").write_text("{}")  # not a weight file
    old = os.umask(0o022)
    try:
        first = fingerprint_weights(weights)
    finally:
        os.umask(old)
    assert first.method == "full" and first.files == 1 and first.bytes == 256 * 64
    for folder in (tmp_path / "home", tmp_path / "home" / ".cache", cache, cache / "fingerprints"):
        assert folder.stat().st_mode & 0o777 == 0o700, folder
    assert len(list((cache / "fingerprints").iterdir())) == 1
    assert fingerprint_weights(weights).digest == first.digest  # from the cache
    data = bytearray((weights / "model.safetensors").read_bytes())
    data[1000] ^= 1
    (weights / "model.safetensors").write_bytes(bytes(data))
    os.utime(weights / "model.safetensors", ns=(1, 1))
    assert fingerprint_weights(weights).digest != first.digest
    with pytest.raises(FingerprintError, match="no weight files"):
        fingerprint_weights(tmp_path / "home")
