"""``kvtier doctor --measure``: the bandwidths that decide whether loading KV beats recomputing it.

* :func:`dram_copy` - a plain memcpy (``ctypes.memmove``) between two buffers: the host tier's
  put/get speed on vLLM-CPU, and an upper bound for host<->device copies elsewhere.
* :func:`disk_write_read` - a file written with ``fsync`` and read back after
  ``posix_fadvise(DONTNEED)`` (so the read comes from the device, not the page cache) in the disk
  tier's directory.
* :func:`cuda_copies` - pinned vs pageable host<->device copies, only when an NVIDIA device node
  exists (torch is imported lazily, only then).
* :func:`measure` runs them all; :func:`compare` turns the figures into load-vs-recompute times
  for one context of a model.

Each returns :class:`Bandwidth` records; sizes are parameters so tests can use small ones.
"""

from __future__ import annotations

import ctypes
import glob
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIB = 2**20
CHUNK = 8 * MIB


@dataclass(frozen=True)
class Bandwidth:
    """One measurement: ``bytes`` moved in ``seconds`` (best of the repeats)."""

    name: str
    bytes: int
    seconds: float
    note: str = ""

    @property
    def gbps(self) -> float:
        """Decimal GB/s (10**9 bytes per second), as drive and PCIe specs state them."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def dram_copy(size_bytes: int = 1024 * MIB, repeats: int = 3) -> Bandwidth:
    """Best of ``repeats`` memcpy of ``size_bytes`` between two touched buffers."""
    src, dst = bytearray(os.urandom(MIB) * (size_bytes // MIB)), bytearray(size_bytes // MIB * MIB)
    size = len(src)
    src_ptr = ctypes.addressof((ctypes.c_char * size).from_buffer(src))
    dst_ptr = ctypes.addressof((ctypes.c_char * size).from_buffer(dst))
    ctypes.memmove(dst_ptr, src_ptr, size)  # first touch: page faults are not bandwidth
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        ctypes.memmove(dst_ptr, src_ptr, size)
        best = min(best, time.perf_counter() - start)
    return Bandwidth("DRAM copy (memcpy)", size, best, "one thread")


def measure_dir_problem(directory: Path) -> str | None:
    """Make ``directory`` ready for :func:`disk_write_read`: None when it is a directory this process
    can create a file in (made first, with its missing parents, owner-only, where missing: as the
    disk tier makes its root), else why not, in words that follow the path (``cannot be created:
    /etc/hostname is not a directory``; ``cannot hold a file: No such file or directory`` under
    ``/proc``). Creates nothing when a reason shows before creating; a probe file is removed."""
    from kvtier.core.dirs import OWNER_DIR_MODE, ready_dir

    problem = ready_dir(directory, OWNER_DIR_MODE)
    if problem is not None:
        return problem
    probe = _temp_file(Path(directory).expanduser())
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as exc:
        return f"cannot hold a file: {exc.strerror or exc}"
    probe.unlink()
    return None


def _temp_file(directory: Path) -> Path:
    return directory / f".kvtier-measure-{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"


def disk_write_read(directory: Path, size_bytes: int = 512 * MIB) -> tuple[Bandwidth, Bandwidth]:
    """Write ``size_bytes`` to a temporary file in ``directory`` (created if missing, owner-only) in
    8 MiB chunks and ``fsync``; drop it from the page cache; read it back. The file is always removed.
    Raises ``OSError`` where the directory cannot hold it (:func:`measure_dir_problem` says why first)."""
    from kvtier.core.dirs import OWNER_DIR_MODE, make_dirs

    directory = Path(directory).expanduser()
    make_dirs(directory, OWNER_DIR_MODE)
    path = _temp_file(directory)
    chunk = os.urandom(min(CHUNK, size_bytes))  # incompressible, like KV bytes
    count = max(1, size_bytes // len(chunk))
    total = count * len(chunk)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            start = time.perf_counter()
            for _ in range(count):
                os.write(fd, chunk)
            os.fsync(fd)
            write_s = time.perf_counter() - start
        finally:
            os.close(fd)
        cached = _drop_cache(path)
        buf = bytearray(len(chunk))
        view = memoryview(buf)
        with open(path, "rb", buffering=0) as fh:
            start = time.perf_counter()
            while fh.readinto(view):
                pass
            read_s = time.perf_counter() - start
    finally:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
    read_note = "page cache could not be dropped: RAM speed" if cached else "after posix_fadvise(DONTNEED)"
    return (Bandwidth("disk write (fsync)", total, write_s, str(directory)),
            Bandwidth("disk read", total, read_s, read_note))


def _drop_cache(path: Path) -> bool:
    """Ask the kernel to forget ``path``'s pages; True if they may still be cached (tmpfs, no fadvise)."""
    from kvtier.doctor.probes import RAM_FILESYSTEMS, filesystem_type

    if not hasattr(os, "posix_fadvise"):
        return True
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    found = filesystem_type(path)
    return bool(found and found[0] in RAM_FILESYSTEMS)


def cuda_available() -> bool:
    """An NVIDIA device node exists (checked without importing torch)."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def cuda_copies(size_bytes: int = 256 * MIB, repeats: int = 5) -> list[Bandwidth]:
    """Host->device and device->host copies from pinned and pageable memory; [] without CUDA."""
    if not cuda_available():
        return []
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    device = torch.empty(size_bytes, dtype=torch.uint8, device="cuda")
    results = []
    for pinned in (True, False):
        host = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=pinned)
        kind = "pinned" if pinned else "pageable"
        for name, dst, src in (("host->device", device, host), ("device->host", host, device)):
            dst.copy_(src, non_blocking=pinned)
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                dst.copy_(src, non_blocking=pinned)
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - start)
            results.append(Bandwidth(f"{name} ({kind})", size_bytes, best, torch.cuda.get_device_name()))
    return results

def measure(directory: Path, dram_bytes: int = 1024 * MIB, disk_bytes: int = 512 * MIB) -> list[Bandwidth]:
    """DRAM copy, disk write/read at ``directory`` and (with CUDA) pinned/pageable copies."""
    from kvtier.doctor.measure import cuda_copies, disk_write_read, dram_copy

    results = [dram_copy(dram_bytes)]
    results.extend(disk_write_read(directory, disk_bytes))
    results.extend(cuda_copies())
    return results


def compare(results: Sequence[Bandwidth], model: str, tp: int, context: int | None) -> dict[str, Any]:
    """Time to load one context of ``model`` from each tier at the measured bandwidths, against
    recomputing it, and the disk bandwidth needed to beat recomputation (``disk_bw_needed_gbps``
    None, ``recompute_faster`` True: recomputing is faster than loading even from host memory)."""
    from kvtier.planning.model_source import load_model_config
    from kvtier.planning.sizing import PlanInputs, make_plan

    by_name = {r.name: r.gbps for r in results}
    host_bw = by_name.get("host->device (pinned)", by_name["DRAM copy (memcpy)"])
    disk_bw = by_name["disk read"]
    source = load_model_config(model)
    plan = make_plan(source.name, source.config,
                     PlanInputs(tp=tp, context=context, host_bw_gbps=host_bw, disk_bw_gbps=disk_bw))
    # Loading from disk beats recomputing when bytes / disk_bw + host_load < recompute; when even the
    # host step alone is no faster than recomputing, no disk bandwidth is enough (None).
    spare = plan.recompute_s - plan.host_load_s
    needed = plan.offload_sequence_bytes_total / spare / 1e9 if spare > 0 else None
    return {
        "model": plan.model, "tp": tp, "context": plan.context, "kv_dtype": plan.kv_dtype,
        "context_bytes_total": plan.offload_sequence_bytes_total,
        "context_bytes_rank": plan.offload_sequence_bytes_rank,
        "host_bw_gbps": host_bw, "disk_bw_gbps": disk_bw,
        "host_load_s": plan.host_load_s, "disk_load_s": plan.disk_load_s, "recompute_s": plan.recompute_s,
        "recompute_basis": plan.recompute_basis, "disk_bw_needed_gbps": needed,
        "recompute_faster": needed is None,
    }


def default_measure_dir(command: Sequence[str]) -> Path:
    """The disk tier's directory of ``command`` if it has one, else ``<kvtier cache>/kv``."""
    if command:
        try:
            from kvtier.doctor.setup import resolve_setup

            dirs = resolve_setup(command).disk_dirs
            if dirs:
                return dirs[0]
        except ValueError:
            pass
    from kvtier.models.default import default_cache_dir

    return default_cache_dir() / "kv"
