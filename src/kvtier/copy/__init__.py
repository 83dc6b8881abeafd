"""Worker-side copies between the engine's paged KV tensors and the host tier's slots.

Runs inside each vLLM worker process (one engine per rank). :mod:`~kvtier.copy.base` is the
contract (:class:`CopyEngine` and its ordering rules), :mod:`~kvtier.copy.pages` the byte-page
views and the batched page copy, :mod:`~kvtier.copy.cpu` the implementation for KV in host memory,
:mod:`~kvtier.copy.cuda` the one for KV on a CUDA device (its device calls behind
:mod:`~kvtier.copy.streams`, its batched copies planned by :mod:`~kvtier.copy.runs` and issued
through :mod:`~kvtier.copy.cudart`), :mod:`~kvtier.copy.pinning` page-locks the host region.
:func:`make_copy_engine` picks the implementation for the KV tensors' device.
"""

from __future__ import annotations

from kvtier.copy.base import CopyDone, CopyEngine, Direction, PageCopy, Pages, SlotRun, page_list, page_table, slot_run_of
from kvtier.copy.pages import BlockCopier, CopyPlan, HostSlots, PagedKV
from kvtier.copy.pinning import HostPinning, pin_host_memory
from kvtier.copy.streams import DeviceStreams

__all__ = [
    "BlockCopier", "CopyDone", "CopyEngine", "CopyPlan", "DeviceStreams", "Direction", "HostPinning", "HostSlots",
    "PageCopy", "PagedKV", "Pages", "SlotRun", "make_copy_engine", "page_list", "page_table", "pin_host_memory",
    "slot_run_of",
]


def make_copy_engine(kv: PagedKV, host: HostSlots, device: DeviceStreams | None = None) -> CopyEngine:
    """The copy engine for the engine's paged KV ``kv`` and one rank's ``host`` slots: the CPU
    engine for KV in host memory, the CUDA engine for KV on a CUDA device (its device calls on
    ``torch.cuda`` unless ``device`` is given: the tests' simulated device). Raises ValueError
    naming the device type for any other device."""
    if kv.device.type == "cpu":
        from kvtier.copy.cpu import CpuCopyEngine

        return CpuCopyEngine(BlockCopier(kv, host))
    if kv.device.type == "cuda":
        from kvtier.copy.cuda import CudaCopyEngine
        from kvtier.copy.streams import TorchCudaStreams

        return CudaCopyEngine(BlockCopier(kv, host), device if device is not None else TorchCudaStreams(kv.device))
    raise ValueError(f"kvtier: no copy engine for device type {kv.device.type!r}")

