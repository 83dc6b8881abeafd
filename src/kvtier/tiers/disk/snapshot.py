"""The disk index saved as one file, so a restart serves hits at once instead of after a scan.

Scanning a million block files takes minutes on a cold cache; reading their keys from one file
takes well under a second. The snapshot is only a hint: every block it names is checked when it
is read (a file gone or corrupt since is a miss, counted and forgotten, as for any read), and
the tier starts a background rescan at once that adds the files written after the snapshot and
forgets those removed since. A snapshot that is missing, torn, of another format, world size or
block size is ignored (the tier then scans the files synchronously, as without snapshots), and so
is one that is not a regular file (a planted FIFO, symlink...: never opened for reading, never
waited on) or that names more keys than the tier's capacity holds (never read: the read is
bounded by ``HEADER_BYTES + 32 * capacity_bytes // block bytes``).

Layout (little-endian), at ``<root>/<model>_<digest16>/index_g<group>.snapshot``:

    offset  size  field
         0     8  magic        b"KVTSNAP1"
         8     4  version      u32 = 1
        12     4  world        u32, ranks (one file per rank per block)
        16     8  file_bytes   u64, bytes of one block file (header + payload)
        24     8  count        u64, number of keys
        32     8  keys_sum     u64, xxh3_64 of the keys
        40     8  header_sum   u64, xxh3_64 of bytes [0, 40)
        48  32*n  keys         least recently used first

Written by the tier's scan thread (periodically) and by :meth:`DiskTier.close`, from a copy of
the keys taken on the caller's thread; published with a rename from a unique temp name, so a
reader sees an old or a new snapshot, never a mix (a torn file after a crash fails its sums).
"""

from __future__ import annotations

import logging
import os
import struct
import time

import xxhash

from kvtier.core.keys import KEY_BYTES, BlockKey
from kvtier.core.rootfs import NOT_THERE, RootFS
from kvtier.tiers.disk.layout import DiskLayout, per_group_files, remove_stale_tmp, unlink_quiet

logger = logging.getLogger(__name__)

MAGIC = b"KVTSNAP1"
VERSION = 1
_HEAD = struct.Struct("<8sIIQQQ")
_HEADER_SUM = struct.Struct("<Q")
HEADER_BYTES = _HEAD.size + _HEADER_SUM.size  # 48


_NAME_PREFIX, _NAME_SUFFIX = "index_g", ".snapshot"  # index_g<group>.snapshot


def snapshot_path(layout: DiskLayout) -> str:
    return os.path.join(layout.ns_dir, f"index{layout.group_suffix}{_NAME_SUFFIX}")


def snapshot_files(fs: RootFS, ns_dir: str) -> list[str]:
    """The snapshot files of a namespace directory (one per group), sorted."""
    return per_group_files(fs, ns_dir, _NAME_PREFIX, _NAME_SUFFIX)


def _parse_header(data: bytes) -> tuple[int, int, int, int]:
    """(world, file_bytes, count, keys_sum) of a snapshot's first :data:`HEADER_BYTES` bytes;
    ValueError if they are not a valid header of this version."""
    if len(data) < HEADER_BYTES:
        raise ValueError(f"{len(data)} bytes, shorter than the {HEADER_BYTES}-byte header")
    head = data[: _HEAD.size]
    magic, version, world, file_bytes, count, keys_sum = _HEAD.unpack(head)
    (header_sum,) = _HEADER_SUM.unpack_from(data, _HEAD.size)
    if magic != MAGIC:
        raise ValueError("not a kvtier index snapshot (bad magic)")
    if header_sum != xxhash.xxh3_64_intdigest(head):
        raise ValueError("header checksum mismatch")
    if version != VERSION:
        raise ValueError(f"version {version}, this kvtier reads {VERSION}")
    return world, file_bytes, count, keys_sum


def peek_count(fs: RootFS, path: str) -> int | None:
    """How many keys a snapshot file names, from its (checked) header; None if it is unusable.
    For ``kvtier inspect``: reads 48 bytes, not the keys."""
    try:
        fd = fs.open(path)
        try:
            return _parse_header(os.pread(fd, HEADER_BYTES, 0))[2]
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return None


def remove_snapshots(fs: RootFS, ns_dir: str) -> int:
    """Remove every group's snapshot of a namespace (``kvtier purge`` does after removing blocks,
    so a restart does not promise blocks that are gone); returns how many were removed."""
    return sum(unlink_quiet(fs, path) for path in snapshot_files(fs, ns_dir))


def encode(keys_blob: bytes, world: int, file_bytes: int) -> bytes:
    """The snapshot file's bytes for ``keys_blob`` (the keys concatenated, LRU first)."""
    if len(keys_blob) % KEY_BYTES:
        raise ValueError(f"keys_blob must be a multiple of {KEY_BYTES} bytes, got {len(keys_blob)}")
    head = _HEAD.pack(MAGIC, VERSION, world, file_bytes, len(keys_blob) // KEY_BYTES,
                      xxhash.xxh3_64_intdigest(keys_blob))
    return head + _HEADER_SUM.pack(xxhash.xxh3_64_intdigest(head)) + keys_blob


def decode(data: bytes, world: int, file_bytes: int) -> list[BlockKey]:
    """The keys of a snapshot's bytes; ValueError naming what is wrong (wrong world or block
    size: written by another configuration of this namespace, which cannot happen by design)."""
    snap_world, snap_file_bytes, count, keys_sum = _parse_header(data)
    if (snap_world, snap_file_bytes) != (world, file_bytes):
        raise ValueError(f"written for {snap_world} rank(s) x {snap_file_bytes} B files, "
                         f"this tier has {world} x {file_bytes} B")
    if len(data) != HEADER_BYTES + count * KEY_BYTES:
        raise ValueError(f"{len(data)} bytes for {count} keys (torn or truncated)")
    blob = memoryview(data)[HEADER_BYTES:]
    if xxhash.xxh3_64_intdigest(blob) != keys_sum:
        raise ValueError("keys checksum mismatch")
    return [data[i : i + KEY_BYTES] for i in range(HEADER_BYTES, len(data), KEY_BYTES)]


def read_snapshot(layout: DiskLayout, file_bytes: int, max_keys: int) -> list[BlockKey] | None:
    """The keys of this namespace's snapshot, or None (absent or unusable: said in the log).
    ``max_keys``: the most keys the tier can index (its capacity in blocks); a longer snapshot is
    not read. Also removes the temp files of snapshot writers that died (a crash while writing one)."""
    path = snapshot_path(layout)
    _remove_stale_temps(layout, os.path.basename(path))
    try:
        data = layout.fs.read_bytes(path, HEADER_BYTES + max(0, max_keys) * KEY_BYTES)
    except FileNotFoundError:
        return None
    except OSError as exc:
        logger.warning("kvtier disk: index snapshot %s ignored (%s); scanning the files", path, exc)
        return None
    try:
        return decode(data, layout.world, file_bytes)
    except ValueError as exc:
        logger.warning("kvtier disk: index snapshot %s ignored (%s); scanning the files", path, exc)
        return None


def write_snapshot(layout: DiskLayout, keys_blob: bytes, file_bytes: int) -> bool:
    """Publish a snapshot of ``keys_blob`` (file I/O only: any thread). False if it failed
    (logged; the previous snapshot, if any, stays)."""
    path = snapshot_path(layout)
    try:
        layout.fs.write_atomic(path, encode(keys_blob, layout.world, file_bytes), layout.access.file_mode)
        return True
    except OSError as exc:
        logger.warning("kvtier disk: could not write the index snapshot %s (%s)", path, exc)
        return False


def _remove_stale_temps(layout: DiskLayout, snapshot_name: str) -> None:
    """Remove ``<snapshot_name>.<pid>.<random>.tmp`` files of dead writers (or old ones), as the
    scan does for block temp files (:func:`~kvtier.tiers.disk.layout.remove_stale_tmp`)."""
    try:
        dir_fd = layout.fs.open_dir(layout.ns_dir)
    except OSError as exc:
        if exc.errno not in NOT_THERE:
            logger.warning("kvtier disk: cannot list %s: %s", layout.ns_dir, exc)
        return
    try:
        now = time.time()
        for name in os.listdir(dir_fd):
            if name.startswith(snapshot_name + ".") and name.endswith(".tmp"):
                remove_stale_tmp(dir_fd, name, now)
    finally:
        os.close(dir_fd)
