"""The GPU kit (scripts/gpu-check.sh): tests that need a CUDA device, skipped wherever there is none
(this project's CI machines). They import torch and kvtier only: the GPU machine has no vLLM."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

_names = itertools.count()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="the GPU kit needs a CUDA device (scripts/gpu-check.sh)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def shm_region():
    """A factory of pinned host regions in /dev/shm, as the worker makes them: (buffer, pinning)."""
    from kvtier.copy.pinning import pin_host_memory
    from kvtier.tiers.shm import SharedRegion

    made = []

    def make(size: int, slot_bytes: int):
        region = SharedRegion.create(f"kvtier-gpu-kit-{os.getpid()}-{next(_names)}", size)
        buffer = torch.frombuffer(region.view, dtype=torch.uint8)
        pinning = pin_host_memory(buffer, slot_bytes)
        made.append((region, buffer, pinning))
        return buffer, pinning

    yield make
    torch.cuda.synchronize()
    for region, buffer, pinning in made:
        pinning.release()
        del buffer
        region.unlink()
