"""Fingerprints of weight files: the model's and each LoRA adapter's identity in the key spec.

Two checkpoints with the same ``config.json`` and folder name (two fine-tunes, two steps of one
run, ``orgA/X`` and ``orgB/X``) compute different KV, so a cache must tell them apart by the
weights themselves. :func:`fingerprint_weights` digests (BLAKE3) every weight file of a folder:

- up to :data:`FULL_HASH_BYTES` in total, every byte (any changed weight changes the digest);
- beyond that (large checkpoints), a bounded sample per file: the file's size, a safetensors
  file's whole header (tensor names, dtypes, shapes, offsets) and :data:`SAMPLES_PER_FILE` pieces
  of :data:`SAMPLE_BYTES` spread evenly over the file, the last one ending at its end. Two large
  checkpoints that differ only between the samples are then indistinguishable: operators who
  publish such edits set ``model_identity`` in the connector config (docs/disk-format.md).

A result is cached in ``<kvtier cache>/fingerprints/`` under the folder's real path, with the size,
mtime and inode of every file; a restart with unchanged files reads it back instead of hashing
again. Any change of a file's size, mtime or inode recomputes it.

Threading and processes: :func:`fingerprint_weights` blocks on file I/O; the connector calls it
once at start-up in vLLM's scheduler process. :class:`AdapterFingerprints` fingerprints LoRA
adapters on a background thread, so the scheduler's lookups never wait for a file.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import blake3

from kvtier.core.dirs import OWNER_DIR_MODE, make_dirs
from kvtier.core.paths import kvtier_cache_dir

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
"""Files that hold weights (adapters and checkpoints of any format vLLM loads)."""
FULL_HASH_BYTES = 4 * 2**30
"""Checkpoints up to this many bytes are hashed in full."""
SAMPLES_PER_FILE = 64
SAMPLE_BYTES = 64 * 2**10
_CHUNK = 8 * 2**20
_MAX_SAFETENSORS_HEADER = 100 * 2**20
FORMAT = "kvtier-weights/1"
"""The fingerprint's own format: part of every digest, bumped if the method ever changes."""


class FingerprintError(ValueError):
    """The weights cannot be identified (no weight files, unreadable files); the message says which."""


@dataclass(frozen=True)
class Fingerprint:
    """``digest`` is ``blake3:<64 hex>``; ``method`` is ``full`` or ``sampled``."""

    digest: str
    method: str
    files: int
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class _FileSig:
    name: str  # relative to the folder, "/"-separated
    size: int
    mtime_ns: int
    inode: int


def weight_files(path: Path) -> list[Path]:
    """The weight files of ``path`` (a folder, searched recursively, hidden folders skipped; or one
    file), sorted by relative name."""
    if path.is_file():
        return [path]
    found = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found += [Path(dirpath, name) for name in filenames if name.endswith(WEIGHT_SUFFIXES)]
    return sorted(found, key=lambda p: p.relative_to(path).as_posix())


def fingerprint_weights(
    path: str | Path,
    *,
    cache_dir: Path | None = None,
    full_hash_bytes: int = FULL_HASH_BYTES,
    samples_per_file: int = SAMPLES_PER_FILE,
    sample_bytes: int = SAMPLE_BYTES,
) -> Fingerprint:
    """The fingerprint of the weights under ``path`` (blocks on file I/O; see the module docstring).

    Raises :class:`FingerprintError` when there is no weight file or one cannot be read.
    ``cache_dir``: where results are cached (default ``<kvtier cache>/fingerprints``); a cache that
    cannot be read or written is ignored.
    """
    root = Path(path).expanduser().resolve()
    if not root.exists():
        raise FingerprintError(f"{root} does not exist")
    files = weight_files(root)
    if not files:
        raise FingerprintError(
            f"no weight files ({', '.join('*' + s for s in WEIGHT_SUFFIXES)}) under {root}")
    base = root.parent if root.is_file() else root
    try:
        sigs = []
        for file in files:
            st = file.stat()
            sigs.append(_FileSig(file.relative_to(base).as_posix(), st.st_size, st.st_mtime_ns, st.st_ino))
    except OSError as exc:
        raise FingerprintError(f"cannot read {root}: {exc}") from exc
    total = sum(sig.size for sig in sigs)
    method = "full" if total <= full_hash_bytes else "sampled"
    params = {"method": method, "samples": samples_per_file, "sample_bytes": sample_bytes}
    cache_file = (cache_dir or kvtier_cache_dir() / "fingerprints") / (
        blake3.blake3(str(root).encode()).hexdigest()[:32] + ".json")
    signature = {"format": FORMAT, "params": params, "files": [asdict(sig) for sig in sigs]}
    cached = _read_cache(cache_file, signature)
    if cached is not None:
        return cached

    start = time.perf_counter()
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    hasher.update(f"{FORMAT}\0{method}\0".encode())
    try:
        for file, sig in zip(files, sigs):
            hasher.update(sig.name.encode() + b"\0" + struct.pack("<Q", sig.size))
            with open(file, "rb") as fh:
                if method == "full":
                    _hash_all(fh, hasher)
                else:
                    _hash_sampled(fh, file.name, sig.size, hasher, samples_per_file, sample_bytes)
    except OSError as exc:
        raise FingerprintError(f"cannot read {root}: {exc}") from exc
    result = Fingerprint(
        digest="blake3:" + hasher.hexdigest(), method=method, files=len(files), bytes=total,
        seconds=time.perf_counter() - start,
    )
    _write_cache(cache_file, signature, result)
    return result


def _hash_all(fh, hasher) -> None:
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    while True:
        n = fh.readinto(buf)
        if not n:
            return
        hasher.update(view[:n])


def _hash_sampled(fh, name: str, size: int, hasher, samples: int, sample_bytes: int) -> None:
    """A safetensors header in full, then ``samples`` evenly spread pieces (first at 0, last
    ending at the end of the file)."""
    if name.endswith(".safetensors") and size >= 8:
        (header_len,) = struct.unpack("<Q", fh.read(8))
        if header_len <= min(size - 8, _MAX_SAFETENSORS_HEADER):
            hasher.update(fh.read(header_len))
    piece = min(sample_bytes, size)
    span = size - piece
    for i in range(samples):
        offset = span * i // max(samples - 1, 1)
        fh.seek(offset)
        hasher.update(fh.read(piece))


def _read_cache(cache_file: Path, signature: dict) -> Fingerprint | None:
    try:
        data = json.loads(cache_file.read_text())
        if data.get("signature") == signature:
            return Fingerprint(**data["fingerprint"])
    except (OSError, ValueError, TypeError, KeyError):
        pass
    return None


def _write_cache(cache_file: Path, signature: dict, result: Fingerprint) -> None:
    tmp = cache_file.with_name(f"{cache_file.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        make_dirs(cache_file.parent, OWNER_DIR_MODE)  # kvtier's cache and its parents: owner only
        tmp.write_text(json.dumps({"signature": signature, "fingerprint": asdict(result)}))
        os.replace(tmp, cache_file)
    except OSError as exc:
        logger.debug("kvtier: cannot cache the weights fingerprint in %s: %s", cache_file, exc)
        try:
            tmp.unlink()
        except OSError:
            pass


class AdapterFingerprints:
    """LoRA adapter identities for the scheduler's lookups, computed off its thread.

    :meth:`get` never blocks: it returns the adapter's digest once known, None while it is being
    computed (the request is then neither loaded nor stored: a miss, never a wrong hit), and
    None for good once the adapter cannot be fingerprinted (logged once). Each adapter (by
    ``(lora_int_id, lora_path)``) is fingerprinted once per engine lifetime: the engine serves
    the weights it loaded, whatever happens to the files later. Called from the scheduler thread
    only; the computation runs on one daemon thread.
    """

    def __init__(self, compute: Callable[[str], Fingerprint] | None = None):
        self._compute = compute or (lambda path: fingerprint_weights(path))
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-fingerprint")
        self._futures: dict[tuple[int, str], Future] = {}
        self._failed: set[tuple[int, str]] = set()
        self._lock = threading.Lock()

    def get(self, lora_int_id: int, lora_path: str) -> str | None:
        key = (lora_int_id, lora_path)
        future = self._futures.get(key)
        if future is None:
            self._futures[key] = self._pool.submit(self._compute, lora_path)
            return None
        if not future.done() or key in self._failed:
            return None
        try:
            return future.result().digest
        except Exception as exc:  # FingerprintError or an unexpected bug: never a wrong hit
            self._failed.add(key)
            logger.warning(
                "kvtier: LoRA adapter %s (id %d) cannot be identified (%s); its requests are neither "
                "loaded from nor stored in kvtier", lora_path, lora_int_id, exc)
            return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
