"""Start-up cost of the weights identity (key spec kvtier/2) on a 100 GB checkpoint.

Builds a synthetic checkpoint of ``--files`` safetensors files totalling ``--gb`` GB without
writing 100 GB: each file is sparse except for a real safetensors header and random bytes
wherever the fingerprint samples (so every read the fingerprint makes hits written data, never a
hole). The files' pages are dropped from the page cache (``posix_fadvise(DONTNEED)``) before the
cold run, so the sampled reads come from the disk. Then it times, and prints as one JSON line:

- ``cold_s``: the first fingerprint (sampling: checkpoint > 4 GiB);
- ``cached_s``: a restart with the files unchanged (the cached result is read back);
- ``smollm2_full_s``: the full hash of the embedded SmolLM2 (538 MB), when it is converted.

    python benchmarks/bench_fingerprint.py [--gb 100] [--files 20] [--dir /path/on/the/disk/to/test]
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import tempfile
import time
from pathlib import Path

from kvtier.runtime.fingerprint import SAMPLE_BYTES, SAMPLES_PER_FILE, fingerprint_weights


def make_file(path: Path, size: int) -> None:
    header = json.dumps({"__metadata__": {"format": "pt"},
                         "w": {"dtype": "BF16", "shape": [(size - 4096) // 2], "data_offsets": [0, size - 4096]}})
    header_bytes = header.encode().ljust(4096 - 8)
    with open(path, "wb") as fh:
        fh.truncate(size)
        fh.write(struct.pack("<Q", len(header_bytes)) + header_bytes)
        piece = min(SAMPLE_BYTES, size)
        for i in range(SAMPLES_PER_FILE):
            fh.seek((size - piece) * i // (SAMPLES_PER_FILE - 1))
            fh.write(os.urandom(piece))
        fh.flush()
        os.fsync(fh.fileno())
    drop_cache(path)


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=100.0)
    parser.add_argument("--files", type=int, default=20)
    parser.add_argument("--dir", default=None, help="where to build the checkpoint (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp, "checkpoint")
        folder.mkdir()
        size = int(args.gb * 1e9 / args.files)
        for i in range(args.files):
            make_file(folder / f"model-{i:05d}-of-{args.files:05d}.safetensors", size)
        cache = Path(tmp, "cache")
        start = time.perf_counter()
        cold = fingerprint_weights(folder, cache_dir=cache)
        cold_s = time.perf_counter() - start
        start = time.perf_counter()
        again = fingerprint_weights(folder, cache_dir=cache)
        cached_s = time.perf_counter() - start
        assert again.digest == cold.digest
        result = {"checkpoint_gb": args.gb, "files": args.files, "method": cold.method,
                  "read_mb": round(args.files * (SAMPLES_PER_FILE * SAMPLE_BYTES + 4096) / 1e6, 1),
                  "cold_s": round(cold_s, 3), "cached_s": round(cached_s, 4)}
    smollm2 = Path(os.environ.get("KVTIER_CACHE_DIR", Path.home() / ".cache" / "kvtier"),
                   "models", "SmolLM2-135M-Instruct-float32")
    if (smollm2 / "model.safetensors").exists():
        drop_cache(smollm2 / "model.safetensors")
        with tempfile.TemporaryDirectory() as cache:
            start = time.perf_counter()
            full = fingerprint_weights(smollm2, cache_dir=Path(cache))
            result["smollm2_full_s"] = round(time.perf_counter() - start, 3)
            result["smollm2_method"] = full.method
    print(json.dumps(result))


if __name__ == "__main__":
    main()
