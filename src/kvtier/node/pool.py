"""The node's pool: one memfd of ``pool_bytes``, cut into slots of ``slot_stride`` bytes.

Ownership and lifetime:

- The **service** creates the memfd (:func:`create_pool_fd`), sizes it, pre-faults it and keeps
  the only descriptor it opened. Nothing is ever named in ``/dev/shm``: the memory lives exactly as
  long as some process holds the descriptor or a mapping, so nothing leaks however processes die.
- Each **client** that copies (a scheduler or a worker rank) gets a duplicate of the descriptor in
  the reply to its hello (``SCM_RIGHTS``), maps it (:class:`PoolMapping`) and closes the
  descriptor. A client keeps its mapping until it closes or reattaches; a restarted service
  creates a new pool (the old one's memory is freed when the last old mapping goes).
- Slot ``i`` starts at byte ``i * slot_stride``. Which process may write a slot is the index's
  business (:mod:`kvtier.node.index`): a slot is written only by the session that reserved it, and
  read only while its block is READY and pinned by the reader.

This module imports no torch; :meth:`PoolMapping.slot` returns a memoryview.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

PAGE = mmap.PAGESIZE
SLOT_ALIGN = 4096
"""Slots start on this boundary (page-aligned: what a page-locking CUDA copy wants)."""


class PoolTooLargeError(ValueError):
    """``--pool-bytes`` asks for more memory than the node can give."""


def slot_stride(slot_bytes: int) -> int:
    """Bytes between slot starts: ``slot_bytes`` rounded up to :data:`SLOT_ALIGN`."""
    return -(-slot_bytes // SLOT_ALIGN) * SLOT_ALIGN


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def _cgroup_limit() -> int | None:
    """This process's cgroup v2 memory limit (bytes), or None when unlimited or unknown."""
    try:
        rel = Path("/proc/self/cgroup").read_text().strip().splitlines()[0].split("::", 1)[1]
        text = (Path("/sys/fs/cgroup") / rel.lstrip("/") / "memory.max").read_text().strip()
    except (OSError, IndexError):
        return None
    return None if text == "max" else int(text)


def node_memory() -> tuple[int, str]:
    """How many bytes a pool may take on this node, and where that number comes from."""
    info = _meminfo()
    available = info.get("MemAvailable", info.get("MemTotal", 0))
    limit = _cgroup_limit()
    if limit is not None and limit < available:
        return limit, f"this cgroup's memory.max ({limit} bytes)"
    return available, f"MemAvailable in /proc/meminfo ({available} bytes of MemTotal {info.get('MemTotal', 0)})"


def check_pool_size(pool_bytes: int) -> None:
    """Refuse a pool the node cannot hold (it would be killed by the OOM killer, or SIGBUS, later)."""
    if pool_bytes <= 0:
        raise PoolTooLargeError(f"--pool-bytes must be positive, got {pool_bytes}")
    limit, source = node_memory()
    if pool_bytes > limit:
        raise PoolTooLargeError(
            f"--pool-bytes {pool_bytes} is more than this node can hold: {source}. "
            f"Give a smaller --pool-bytes (at most {limit}, less what the engines themselves need)."
        )


def create_pool_fd(pool_bytes: int, *, prefault: bool = True) -> int:
    """A new memfd of ``pool_bytes`` (pre-faulted unless told otherwise); the caller owns the fd."""
    fd = os.memfd_create("kvtier-node-pool", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, pool_bytes)
        if prefault:
            with mmap.mmap(fd, pool_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
                np.frombuffer(mm, dtype=np.uint8)[::PAGE] = 0  # one write per page: allocated now
    except BaseException:
        os.close(fd)
        raise
    return fd


class PoolMapping:
    """A process's mapping of the pool. Owns its mmap; the descriptor it was built from may be closed.

    ``slot(i)`` views are valid until :meth:`close`; the caller must hold a reservation (to write)
    or a pin (to read) on the block whose slot it touches.
    """

    def __init__(self, fd: int, pool_bytes: int, slot_bytes: int, stride: int) -> None:
        self.pool_bytes = pool_bytes
        self.slot_bytes = slot_bytes
        self.stride = stride
        self.num_slots = pool_bytes // stride if stride else 0
        self._mm = mmap.mmap(fd, pool_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.view = memoryview(self._mm)

    def slot(self, index: int) -> memoryview:
        if not 0 <= index < self.num_slots:
            raise IndexError(f"slot {index} outside the pool's {self.num_slots} slots")
        start = index * self.stride
        return self.view[start:start + self.slot_bytes]

    def close(self) -> None:
        self.view.release()
        self._mm.close()
