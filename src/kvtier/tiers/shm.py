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

The region is pre-faulted at creation so the first stores do not pay page faults. On CUDA the
worker additionally page-locks it (``cudaHostRegister``) so copies can run asynchronously; that
lives with the worker's transfer code, not here. This module never imports torch.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def region_name(engine_id: str, rank: int) -> str:
    """File name of rank ``rank``'s region for the engine ``engine_id`` (unique per engine instance)."""
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in engine_id)
    return f"kvtier-{safe}-r{rank}"


class SharedRegion:
    """A mapped shared-memory file of exactly ``size`` bytes. Not thread-safe to close."""

    def __init__(self, path: Path, mapping: mmap.mmap, size: int, owner: bool):
        self.path = path
        self.size = size
        self.owner = owner
        self._mmap: mmap.mmap | None = mapping
        self.view = memoryview(mapping)

    @classmethod
    def create(cls, name: str, size: int, directory: Path = SHM_DIR) -> "SharedRegion":
        """Create (exclusively) and pre-fault a region. Raises FileExistsError if it exists."""
        if size <= 0:
            raise ValueError(f"shared region size must be positive, got {size}")
        path = directory / name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            try:
                os.posix_fallocate(fd, 0, size)  # fail now, not with SIGBUS later, if /dev/shm is too small
            except OSError as exc:
                os.unlink(path)
                raise OSError(
                    exc.errno,
                    f"cannot reserve {size / 2**30:.2f} GiB in {directory} for the kvtier host tier "
                    f"({exc.strerror}); lower cpu_bytes_to_use or enlarge {directory}",
                ) from exc
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(path, mapping, size, owner=True)

    @classmethod
    def attach(
        cls, name: str, size: int, directory: Path = SHM_DIR, timeout_s: float = 120.0
    ) -> "SharedRegion":
        """Map an existing region, waiting up to ``timeout_s`` for its creator to finish sizing it."""
        path = directory / name
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                fd = -1
            if fd >= 0:
                try:
                    if os.fstat(fd).st_size == size:
                        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                        return cls(path, mapping, size, owner=False)
                finally:
                    os.close(fd)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"kvtier host region {path} did not appear with size {size} within {timeout_s:.0f} s; "
                    "the worker that creates it may have failed (see its log)"
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
        try:
            self._mmap.close()
        except BufferError:
            # A tensor still exports the buffer; the OS unmaps it at process exit.
            pass
        self._mmap = None
