"""The host tier's bytes: one fixed-size region per rank in shared memory (``/dev/shm``).

Ownership and lifetime:

- The **worker** of rank ``r`` creates its region (:meth:`SharedRegion.create`) when vLLM
  registers the KV caches: it is the first process that knows the exact geometry.
- The **scheduler** process attaches every rank's region (:meth:`SharedRegion.attach`) and then
  unlinks the names: from then on the memory lives exactly as long as some process maps it,
  so nothing leaks in ``/dev/shm`` even if the engine is killed. A worker also unlinks its own
  name at exit in case no scheduler ever attached.
- With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` both roles are one process and map the file twice;
  that is harmless.
- The creator holds an exclusive ``flock`` on the file for as long as it lives (released by the
  kernel when it dies, however it dies). A name whose file nobody holds locked is a leftover of a
  dead engine (killed between creating the region and the scheduler attaching it, with a fixed
  ``engine_id`` so the restart picks the same name): :meth:`SharedRegion.create` removes it and
  creates the region anew (never a start-up failure), and :meth:`SharedRegion.attach` never maps
  it (it would see the dead engine's slots, not the live worker's). A name a live process holds
  is another running engine with the same ``engine_id``: :class:`RegionInUseError`.

The region is pre-faulted at creation so the first stores do not pay page faults. On CUDA the
worker additionally page-locks it (``cudaHostRegister``) so copies can run asynchronously; that
lives with the worker's copy code, not here. This module never imports torch.

The file starts with a header of :data:`HEADER_BYTES`: the creator publishes
a description there (the worker: what its KV pages look like, which the scheduler folds into the
namespace), and :meth:`~SharedRegion.attach` returns only once it is published. The slots follow
(:attr:`SharedRegion.view` covers them only, page-aligned).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
HEADER_BYTES = 64 * 2**10
"""Bytes before the slots: the published description (a multiple of the page size)."""
_MAGIC = b"KVTR"
_LENGTH = struct.Struct("<I")


class RegionInUseError(FileExistsError):
    """The region's name is held by a live process: another engine runs with the same engine_id."""


def _locked_by_someone(fd: int) -> bool:
    """Whether some open file description (a live creator) holds a ``flock`` on ``fd``'s file."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return True
        raise
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def remove_if_abandoned(path: Path) -> bool:
    """Unlink the region file ``path`` if no live process holds it; True if it was removed (or
    already gone). Raises :class:`RegionInUseError` if a live process holds it."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        if _locked_by_someone(fd):
            raise RegionInUseError(
                errno.EEXIST,
                f"kvtier host region {path} is held by a running process: another engine uses the same "
                "kv_transfer_config.engine_id; give each engine instance its own engine_id (or leave it "
                "unset: vLLM then picks a unique one)",
            )
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # hold it while unlinking: no new owner meanwhile
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return True
    finally:
        os.close(fd)


def region_name(engine_id: str, rank: int) -> str:
    """File name of rank ``rank``'s region for the engine ``engine_id`` (unique per engine instance)."""
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in engine_id)
    return f"kvtier-{safe}-r{rank}"


class SharedRegion:
    """A mapped shared-memory file: a header, then exactly ``size`` bytes of slots (:attr:`view`).
    Not thread-safe to close."""

    def __init__(self, path: Path, mapping: mmap.mmap, size: int, owner: bool, lock_fd: int = -1):
        self.path = path
        self.size = size
        self.owner = owner
        self._lock_fd = lock_fd  # the creator's: holds the flock that marks the region live
        self._mmap: mmap.mmap | None = mapping
        self._whole = memoryview(mapping)
        self.view = self._whole[HEADER_BYTES:]

    @classmethod
    def create(cls, name: str, size: int, directory: Path = SHM_DIR) -> "SharedRegion":
        """Create (exclusively) and pre-fault a region, replacing a dead engine's leftover of the
        same name. Raises :class:`RegionInUseError` if a live process holds that name."""
        if size <= 0:
            raise ValueError(f"shared region size must be positive, got {size}")
        path = directory / name
        total = HEADER_BYTES + size
        for attempt in range(3):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                break
            except FileExistsError:
                if attempt == 2:
                    raise
                remove_if_abandoned(path)
        fcntl.flock(fd, fcntl.LOCK_EX)  # ours alone: O_EXCL created it; held until close() or death
        try:
            os.ftruncate(fd, total)
            try:
                os.posix_fallocate(fd, 0, total)  # fail now, not with SIGBUS later, if /dev/shm is too small
            except OSError as exc:
                os.unlink(path)
                raise OSError(
                    exc.errno,
                    f"cannot reserve {total / 2**30:.2f} GiB in {directory} for the kvtier host tier "
                    f"({exc.strerror}); lower cpu_bytes_to_use or enlarge {directory}",
                ) from exc
            mapping = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, mapping, size, owner=True, lock_fd=fd)

    def publish(self, description: bytes) -> None:
        """Write ``description`` into the header (the creator, once, before anyone may attach)."""
        room = HEADER_BYTES - len(_MAGIC) - _LENGTH.size
        if len(description) > room:
            raise ValueError(f"region description is {len(description)} bytes; the header holds {room}")
        header = self._whole[:HEADER_BYTES]
        start = len(_MAGIC) + _LENGTH.size
        header[start : start + len(description)] = description
        _LENGTH.pack_into(header, len(_MAGIC), len(description))
        header[: len(_MAGIC)] = _MAGIC  # last: an attacher that sees the magic sees the rest

    @property
    def description(self) -> bytes:
        """What the creator published (empty before)."""
        header = self._whole[:HEADER_BYTES]
        if bytes(header[: len(_MAGIC)]) != _MAGIC:
            return b""
        (length,) = _LENGTH.unpack_from(header, len(_MAGIC))
        start = len(_MAGIC) + _LENGTH.size
        return bytes(header[start : start + length])

    @classmethod
    def attach(
        cls, name: str, size: int, directory: Path = SHM_DIR, timeout_s: float = 120.0
    ) -> "SharedRegion":
        """Map an existing region, waiting up to ``timeout_s`` for its live creator to size it and
        publish its description (a file no live process holds is a dead engine's: never mapped)."""
        path = directory / name
        total = HEADER_BYTES + size
        deadline = time.monotonic() + timeout_s
        region: SharedRegion | None = None
        while True:
            if region is None:
                try:
                    fd = os.open(path, os.O_RDWR)
                except FileNotFoundError:
                    fd = -1
                if fd >= 0:
                    try:
                        if os.fstat(fd).st_size == total and _locked_by_someone(fd):
                            mapping = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                            region = cls(path, mapping, size, owner=False)
                    finally:
                        os.close(fd)
            if region is not None and region.description:
                return region
            if time.monotonic() > deadline:
                if region is not None:
                    region.close()
                raise TimeoutError(
                    f"kvtier host region {path} did not appear with size {total} and a published "
                    f"description within {timeout_s:.0f} s; the worker that creates it may have "
                    "failed (see its log)"
                )
            time.sleep(0.05)

    def unlink(self) -> None:
        """Remove the name; the mapping stays valid. Idempotent."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmap. Callers must drop every view of the buffer first. Idempotent."""
        if self._mmap is None:
            return
        self.view.release()
        self._whole.release()
        try:
            self._mmap.close()
        except BufferError:
            # A tensor still exports the buffer; the OS unmaps it at process exit.
            pass
        self._mmap = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock: the region no longer counts as live
            self._lock_fd = -1
