"""The node's pool: one memfd of ``pool_bytes``, cut into slots of ``slot_stride`` bytes.

Ownership and lifetime:

- The **service** creates the memfd (:func:`create_pool_fd`), sizes it, seals its size
  (:data:`POOL_SEALS`: no process holding it, a client included, can shrink or grow it, so no
  mapping of it ever faults with SIGBUS), pre-faults it and keeps the only descriptor it opened. Nothing is ever named in ``/dev/shm``: the memory lives exactly as
  long as some process holds the descriptor or a mapping, so nothing leaks however processes die.
- Each **client** that copies (a scheduler or a worker rank) gets a duplicate of the descriptor in
  the reply to its hello (``SCM_RIGHTS``), maps it (:class:`PoolMapping`) and closes the
  descriptor (after checking it is sealed and as large as the service said). A client keeps its
  mapping until it closes or reattaches; a restarted service creates a new pool (the old one's
  memory is freed when the last old mapping goes).
- Slot ``i`` starts at byte ``i * slot_stride``. Which slots a well-behaved client writes and reads
  is the index's business (:mod:`kvtier.node.index`): it writes only the slots its session
  reserved, and reads a block's only while it is READY and pinned by the reader. Nothing enforces
  this: every client maps the whole pool writable (zero-copy loads and stores), so every admitted
  client is trusted as a writer of every block (docs/security.md, "admitted node client").

This module imports no torch; :meth:`PoolMapping.slot` returns a memoryview.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import logging
import mmap
import os
import threading
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23
"""Linux >= 5.15: fault a range's pages in, writable, without touching them (not in Python's mmap)."""
POPULATE_STEP = 64 << 20
"""Bytes populated per madvise call: the background thread checks for close() between steps."""
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


POOL_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
"""The pool's memfd cannot change size (``ftruncate`` fails with EPERM, for every holder) and no
holder can add or remove seals. Its bytes stay writable (engines copy into their slots)."""


class PoolSealError(OSError):
    """A pool descriptor that is not the size it should be, or not sealed against resizing."""


def create_pool_fd(pool_bytes: int, *, prefault: bool = True) -> int:
    """A new memfd of ``pool_bytes``, sealed (:data:`POOL_SEALS`) and pre-faulted unless told
    otherwise; the caller owns the fd."""
    fd = os.memfd_create("kvtier-node-pool", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, pool_bytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, POOL_SEALS)
        if prefault:
            with mmap.mmap(fd, pool_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
                np.frombuffer(mm, dtype=np.uint8)[::PAGE] = 0  # one write per page: allocated now
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_pool_fd(fd: int, pool_bytes: int) -> None:
    """Raise :class:`PoolSealError` unless ``fd`` holds at least ``pool_bytes`` and is sealed
    against resizing (a mapping of it could otherwise fault with SIGBUS when it shrinks)."""
    size = os.fstat(fd).st_size
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if size < pool_bytes or seals & POOL_SEALS != POOL_SEALS:
        raise PoolSealError(f"the pool's descriptor holds {size} bytes (the service said {pool_bytes}) and seals "
                            f"{seals:#x} (need {POOL_SEALS:#x}): not a kvtier node pool of this version")


class PoolMapping:
    """A process's mapping of the pool. Owns its mmap; the descriptor it was built from may be closed.

    ``slot(i)`` views are valid until :meth:`close`; the caller must hold a reservation (to write)
    or a pin (to read) on the block whose slot it touches. With ``populate`` (the default) a daemon
    thread maps the pool's pages in after construction (:meth:`_populate`); :meth:`close` stops
    and waits for it.
    """

    def __init__(self, fd: int, pool_bytes: int, slot_bytes: int, stride: int, *, populate: bool = True) -> None:
        check_pool_fd(fd, pool_bytes)
        self.pool_bytes = pool_bytes
        self.slot_bytes = slot_bytes
        self.stride = stride
        self.num_slots = pool_bytes // stride if stride else 0
        self._mm = mmap.mmap(fd, pool_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.view = memoryview(self._mm)
        self._closing = threading.Event()
        self._populator: threading.Thread | None = None
        if populate and pool_bytes:
            self._populator = threading.Thread(target=self._populate, name="kvtier-pool-populate", daemon=True)
            self._populator.start()

    def _populate(self) -> None:
        """Map every page of the pool into this process's page tables, on this thread, so the
        engine's first copies from the pool run at memory speed instead of taking a page fault
        per 4 KiB (a fresh engine's first pool hits copied at 4-6 GB/s instead of 8-12 GB/s:
        docs/benchmarks.md). The pages exist already (the service pre-faults the memfd); this
        costs page tables (~2 MiB per GiB) and ~0.13 ms per MiB of one core, with the GIL
        released (ctypes). Stops at :meth:`close`; a kernel without MADV_POPULATE_WRITE (< 5.15)
        leaves the pages to fault on first touch, as before."""
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        anchor = ctypes.c_char.from_buffer(self._mm)
        base = ctypes.addressof(anchor)
        del anchor  # (the address stays valid until close(), which waits for this thread)
        for start in range(0, self.pool_bytes, POPULATE_STEP):
            if self._closing.is_set():
                return
            length = min(POPULATE_STEP, self.pool_bytes - start)
            if libc.madvise(ctypes.c_void_p(base + start), length, MADV_POPULATE_WRITE) != 0:
                logger.debug("kvtier: pool mapping not populated (madvise: %s)", os.strerror(ctypes.get_errno()))
                return

    def wait_populated(self, timeout_s: float | None = None) -> bool:
        """Whether the background population has ended (done, stopped or refused)."""
        if self._populator is not None:
            self._populator.join(timeout_s)
            return not self._populator.is_alive()
        return True

    def slot(self, index: int) -> memoryview:
        if not 0 <= index < self.num_slots:
            raise IndexError(f"slot {index} outside the pool's {self.num_slots} slots")
        start = index * self.stride
        return self.view[start:start + self.slot_bytes]

    def close(self) -> None:
        self._closing.set()
        if self._populator is not None:
            self._populator.join()  # at most one POPULATE_STEP: the mapping must outlive its madvise
        self.view.release()
        self._mm.close()
