"""Page-locking ("pinning") a rank's host region for asynchronous device copies, as vLLM does it.

The host region is a shared-memory mapping (:class:`~kvtier.tiers.shm.SharedRegion`), so it cannot
come from the CUDA pinned allocator: it is registered afterwards with ``cudaHostRegister``, the way
vLLM's own offloading registers its region (``v1/kv_offload/cpu/gpu_worker.py:197-239``):

- in chunks of at most :data:`MAX_REGISTER_CHUNK_BYTES` (64 GiB: larger single registrations hit
  driver limits), each a whole number of host slots and of memory pages, so no slot (and no copy
  run, :mod:`kvtier.copy.runs`) straddles two registrations;
- a refused chunk's error is drained at once (``cudaGetLastError``): torch does not clear it, and
  the next kernel launch would raise it as its own; the chunks already registered are undone, and
  the region stays pageable (copies are still right, only slower and synchronous);
- undoing checks every ``cudaHostUnregister`` result (drained and logged, never raised).

Pinning is a bandwidth optimization, never a condition for correctness: every failure here is a
warning. Called on the worker's main thread (register_kv_caches, sleep mode's hooks, shutdown).
"""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Callable

import torch

from kvtier.copy.cudart import SUCCESS, CudaRuntime, LoadedCudart

logger = logging.getLogger(__name__)

MAX_REGISTER_CHUNK_BYTES = 64 * 2**30


def register_chunk_bytes(slot_bytes: int, limit: int = MAX_REGISTER_CHUNK_BYTES) -> int:
    """The size of each registration: the most whole slots (and memory pages) within ``limit``,
    at least one such granule."""
    granule = math.lcm(slot_bytes, mmap.PAGESIZE)
    return max(limit // granule, 1) * granule


class HostPinning:
    """The registrations of one host region; :meth:`release` undoes them (idempotent)."""

    def __init__(self, runtime: CudaRuntime | None, addresses: list[int]):
        self._runtime = runtime
        self.addresses = addresses

    @property
    def pinned(self) -> bool:
        return bool(self.addresses)

    def release(self) -> None:
        runtime, addresses, self.addresses = self._runtime, self.addresses, []
        for address in reversed(addresses):
            assert runtime is not None
            code = runtime.host_unregister(address)
            if code != SUCCESS:
                runtime.get_last_error()
                logger.warning("kvtier: cudaHostUnregister(0x%x) failed: %s", address, runtime.error_name(code))


def pin_host_memory(buffer: torch.Tensor, slot_bytes: int, runtime: CudaRuntime | None = None,
                    cuda_available: Callable[[], bool] = torch.cuda.is_available,
                    chunk_limit: int = MAX_REGISTER_CHUNK_BYTES) -> HostPinning:
    """Register ``buffer`` (a host region of whole ``slot_bytes`` slots) chunk by chunk (see the
    module docstring); nothing to do without CUDA. ``runtime``: the tests' stand-in (default: the
    process's libcudart); ``chunk_limit``: the tests' smaller bound."""
    if runtime is None:
        if not cuda_available():
            return HostPinning(None, [])
        runtime = LoadedCudart.find(torch.version.cuda)
        if runtime is None:
            logger.warning("kvtier: no CUDA runtime library found to pin the host tier; copies stay pageable")
            return HostPinning(None, [])
    base, total = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    chunk = register_chunk_bytes(slot_bytes, chunk_limit)
    pinning = HostPinning(runtime, [])
    for offset in range(0, total, chunk):
        size = min(chunk, total - offset)
        code = runtime.host_register(base + offset, size)
        if code == SUCCESS:
            pinning.addresses.append(base + offset)
            continue
        runtime.get_last_error()  # drained: torch would raise it at its next kernel launch
        logger.warning(
            "kvtier: cudaHostRegister of %d bytes at offset %d of the %d-byte host tier failed (%s); "
            "it stays pageable (copies are synchronous and slower)", size, offset, total, runtime.error_name(code))
        pinning.release()
        return pinning
    return pinning
