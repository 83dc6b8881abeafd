"""The GPU kit's checks that guard an output-protecting rule, written once for two devices: a real
CUDA device (tests/gpu/test_gpu_copies.py, run by scripts/gpu-check.sh) and the simulated device
(tests/sim_device.py), where tests/test_gpu_kit.py shows on CPU that each check FAILS when the
protection it checks is deleted from kvtier. Imports torch and kvtier only (the GPU machine has no
vLLM).

- :func:`check_a_synchronous_load_lands_before_compute_reads`: the load stream is held behind a
  long kernel, a synchronous load starts, and the compute stream reads the page AT ONCE (no poll,
  no wait): it must read the loaded bytes. Deleting the compute-stream wait on the load's ``end``
  event (src/kvtier/copy/cuda.py) makes it read the old ones.
- :func:`check_batches_were_not_refused`: after copies were made (a refusal happens at a copy,
  never before), the runtime issued every job as one batched call: no refusal counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from kvtier.copy import Direction, PageCopy


class Rig(Protocol):
    """A copy engine on a device, with what the checks do to that device."""

    engine: Any  # CudaCopyEngine
    paged: Any  # PagedKV
    host: Any  # HostSlots

    def hold(self, stream: Any) -> None:
        """Queue a long kernel on ``stream``: work queued there after it waits."""

    def busy(self, stream: Any) -> bool:
        """Whether ``stream`` still has queued work that has not run."""

    def read_on_compute(self, block: int) -> Callable[[], torch.Tensor]:
        """Queue, on the compute stream, now, a read of every layer's page ``block``; the returned
        function waits for the device and gives the bytes read (uint8, on CPU)."""


def check_a_synchronous_load_lands_before_compute_reads(rig: Rig, slot: int = 1, block: int = 7) -> None:
    host, engine = rig.host, rig.engine
    payload = torch.randint(0, 256, (host.layout.slot_bytes,), dtype=torch.uint8)
    host.tensor[slot].view(-1).copy_(payload)
    expected = torch.cat([host.page(slot, layer, 0)[: rig.paged.layer_bytes[layer]]
                          for layer in range(host.layout.num_layers)]).clone()
    load_stream = engine._streams[Direction.LOAD]  # noqa: SLF001 - the kit holds kvtier's load stream
    rig.hold(load_stream)
    engine.start_load(1, [PageCopy(slot, 0, block)], synchronous=True)
    read = rig.read_on_compute(block)
    assert rig.busy(load_stream), "the long kernel finished before the read was queued; the check proves nothing"
    landed = read()
    assert torch.equal(landed, expected), (
        "the compute stream read the page before the synchronous load landed: the compute stream does not wait "
        "for the load's end event")
    done = {d.job_id: d for d in engine.poll()}
    assert done[1].ok


def check_batches_were_not_refused(runtime: Any) -> None:
    """After copies: a runtime with ``cudaMemcpyBatchAsync`` (12.8+) batched every job."""
    assert runtime is not None, "no CUDA runtime library found: every copy went page by page through torch"
    if runtime.version >= 12080:
        assert runtime.batch_refusals == 0 and runtime.batched, (
            f"cudaMemcpyBatchAsync refused {runtime.batch_refusals} job(s) (last: {runtime.last_refusal}; now "
            f"{runtime.batch_state.name}): those went run by run")


class CudaRig:
    """:class:`Rig` on a CUDA device; the compute stream is a non-default stream made current for
    the rig's life (as vLLM's is), entered with ``with``."""

    LONG_KERNEL_CYCLES = 200_000_000  # torch.cuda._sleep: ~0.1 s on an H100

    def __init__(self, engine: Any, paged: Any, host: Any, compute: Any):
        self.engine, self.paged, self.host, self.compute = engine, paged, host, compute

    def hold(self, stream: Any) -> None:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(self.LONG_KERNEL_CYCLES)

    def busy(self, stream: Any) -> bool:
        return not stream.query()

    def read_on_compute(self, block: int) -> Callable[[], torch.Tensor]:
        assert torch.cuda.current_stream() == self.compute
        pages = [self.paged.page(layer, block).reshape(-1) for layer in range(self.paged.num_layers)]
        copied = torch.cat(pages)  # a kernel queued on the compute stream now

        def result() -> torch.Tensor:
            torch.cuda.synchronize()
            return copied.cpu()

        return result


class SimRig:
    """:class:`Rig` on the simulated device (tests/sim_device.py): a kernel is a queued callable."""

    def __init__(self, engine: Any, paged: Any, host: Any, device: Any):
        self.engine, self.paged, self.host, self.device = engine, paged, host, device

    def hold(self, stream: Any) -> None:
        self.device.enqueue(stream, lambda: None, "long kernel")

    def busy(self, stream: Any) -> bool:
        return bool(stream.ops)

    def read_on_compute(self, block: int) -> Callable[[], torch.Tensor]:
        out: list[torch.Tensor] = []
        pages = [self.paged.page(layer, block).reshape(-1) for layer in range(self.paged.num_layers)]
        self.device.enqueue(self.device.compute, lambda: out.append(torch.cat(pages).clone()), "compute reads")

        def result() -> torch.Tensor:
            self.device.run_all()
            return out[0]

        return result
