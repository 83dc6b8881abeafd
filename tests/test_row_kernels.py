"""Where kvtier's own gather/scatter kernels (kvtier.copy.kernels) cannot be had, staged copies fall
back to torch's ops with the reason logged, never an error. The kernels themselves run only on a
GPU: the kit's round trips (tests/gpu) check every byte they move."""

from __future__ import annotations

import ctypes
import logging
import re
import sys
from pathlib import Path

import pytest

from kvtier.copy import kernels
from kvtier.copy.kernels import RowKernels


def test_pages_that_are_not_whole_words_use_torchs_ops(caplog):
    caplog.set_level(logging.INFO, "kvtier.copy.kernels")
    assert RowKernels.load((9, 0), 13, 8 * 1024 + 4) is None
    assert "not whole 8-byte words" in caplog.text


def test_without_a_driver_library_staged_copies_use_torchs_ops(monkeypatch, caplog):
    caplog.set_level(logging.INFO, "kvtier.copy.kernels")

    def no_library(name, *args, **kwargs):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(kernels.ctypes, "CDLL", no_library)
    assert RowKernels.load((9, 0), 13, 16384) is None
    assert "no CUDA driver library" in caplog.text


def test_without_nvrtc_staged_copies_use_torchs_ops_and_say_where_they_looked(monkeypatch, caplog):
    caplog.set_level(logging.INFO, "kvtier.copy.kernels")
    real = ctypes.CDLL

    def only_the_driver(name, *args, **kwargs):
        if name == "libcuda.so.1":
            return object()
        if "nvrtc" in str(name):
            raise OSError(f"{name}: cannot open shared object file")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(kernels.ctypes, "CDLL", only_the_driver)
    assert RowKernels.load((9, 0), 13, 16384) is None
    assert "no NVRTC of CUDA 13 found (tried libnvrtc.so.13" in caplog.text


def test_kernels_that_do_not_compile_leave_staged_copies_on_torchs_ops(monkeypatch, caplog):
    def compile_fails(self, source, arch):
        raise RuntimeError("NVRTC compiled the row kernels for neither sm_90 nor its PTX")

    monkeypatch.setattr(kernels.ctypes, "CDLL", lambda name, *a, **k: object() if name == "libcuda.so.1" else
                        _FakeNvrtc())
    monkeypatch.setattr(kernels._Nvrtc, "compile", compile_fails)
    assert RowKernels.load((9, 0), 13, 16384) is None
    assert "kernels are unavailable (NVRTC compiled the row kernels for neither" in caplog.text


class _FakeNvrtc:
    """A loaded libnvrtc whose every function returns 0 (only its error-string function is set up)."""

    class _Function:
        restype = argtypes = None

        def __call__(self, *args):
            return 0

    def __getattr__(self, name):
        return self._Function()


class _RecordingDriver:
    """A loaded libcuda whose module hands out one function handle per kernel name and whose
    ``cuLaunchKernel`` records what a launch would run: the kernel, the grid and block, the
    stream and the values the argument pointers point at (read as the kernel's signature says)."""

    def __init__(self):
        self.names: dict[int, str] = {}
        self.launches: list[dict] = []
        # a plain function, as a CDLL's: RowKernels sets argtypes and restype on it
        self.cuLaunchKernel = lambda *args: self._launch(*args)  # noqa: N815 - the driver's name

    def cuModuleGetFunction(self, function, module, name):  # noqa: N802 - the driver's name
        handle = 0x1000 + len(self.names)
        self.names[handle] = name.decode()
        function._obj.value = handle
        return 0

    def _launch(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        name = self.names[function]
        pointers = 3
        values = [ctypes.cast(params[i], ctypes.POINTER(ctypes.c_void_p if i < pointers else ctypes.c_longlong))
                  .contents.value for i in range(8 if "_blocks" in name else 6)]
        self.launches.append({"kernel": name, "grid": (gx, gy, gz), "block": (bx, by, bz), "stream": stream,
                              "args": values})
        return 0


def _signature(kernel: str) -> list[str]:
    """The parameter names of ``kernel`` (e.g. ``kvtier_gather_blocks``) in the kernels' source."""
    source = " ".join(kernels.SOURCE.split())
    params = re.search(re.escape(kernel) + r"##SUFFIX\(\s*(.*?)\)\s*\{", source).group(1)
    return [p.strip().split()[-1] for p in params.split(",")]


def test_a_launch_hands_each_kernel_its_arguments_in_the_order_the_source_declares():
    driver = _RecordingDriver()
    rows = RowKernels(driver, ctypes.c_void_p(1), 16, "test")
    rows.launch("gather", 0xABC, 0x10000, 0x20000, 0x30000, 12, 5, 16384)
    rows.launch("scatter", 0xDEF, 0x10000, 0x20000, 0x30000, 64, 7, 8192, blocks=(32, 520))
    rows.launch("gather", 0xABC, 0x10000, 0x20000, 0x30000, 0, 0, 16384)  # nothing to copy: no launch
    gather, scatter = driver.launches
    assert _signature("kvtier_gather") == ["rows", "staged", "numbers", "words", "pages", "first"]
    assert gather == {"kernel": "kvtier_gather16", "grid": (5, 1, 1), "block": (kernels.THREADS, 1, 1),
                      "stream": 0xABC, "args": [0x10000, 0x20000, 0x30000, 16384 // 16, 5, 12]}
    assert _signature("kvtier_scatter_blocks") == ["rows", "staged", "numbers", "words", "pages", "first", "layers",
                                                   "block_rows"]
    assert scatter["kernel"] == "kvtier_scatter_blocks16" and scatter["grid"] == (7, 1, 1)
    assert scatter["args"] == [0x10000, 0x20000, 0x30000, 8192 // 16, 7, 64, 32, 520] and scatter["stream"] == 0xDEF


def test_capped_kernels_run_a_launch_on_at_most_max_blocks_blocks_and_are_told_every_page():
    driver = _RecordingDriver()
    rows = RowKernels(driver, ctypes.c_void_p(1), 8, "test", max_blocks=3)
    rows.launch("gather", 1, 0x10000, 0x20000, 0x30000, 0, 10, 4096)
    rows.launch("scatter", 1, 0x10000, 0x20000, 0x30000, 0, 2, 4096, blocks=(4, 8))
    many, few = driver.launches
    assert many["grid"] == (3, 1, 1) and many["args"][3:] == [4096 // 8, 10, 0]
    assert few["grid"] == (2, 1, 1) and few["args"][3:6] == [4096 // 8, 2, 0]
    with pytest.raises(ValueError, match="at least 1"):
        RowKernels(driver, ctypes.c_void_p(1), 8, "test", max_blocks=0)


# NVIDIA's NVRTC runs without a GPU: scripts/install.sh --test puts CUDA 13's in the venv, off its
# import path. What the kit would find only on a GPU (a kernel that does not compile, a kernel
# declaring other arguments than a launch fills), these find here.
NVRTC_DIR = Path(sys.prefix) / "kvtier-nvrtc"
KERNELS = [f"kvtier_{kind}{word}" for word in (16, 8) for kind in ("gather", "scatter", "gather_blocks", "scatter_blocks")]


@pytest.fixture(scope="module")
def nvrtc():
    found = [p for p in sorted(NVRTC_DIR.glob("nvidia/cu*/lib/libnvrtc.so*")) if "builtins" not in p.name]
    assert found, f"no NVRTC in {NVRTC_DIR}: scripts/install.sh --test installs it (nvidia-cuda-nvrtc)"
    return kernels._Nvrtc(ctypes.CDLL(str(found[0])))


@pytest.fixture(scope="module")
def ptx(nvrtc) -> dict[str, str]:
    """Each kernel's PTX for compute_90 (Hopper), by name."""
    text = nvrtc.build(kernels.SOURCE, "--gpu-architecture=compute_90", "ptx").decode()
    bodies = re.split(r"\.entry (\w+)\(", text)[1:]
    return dict(zip(bodies[::2], bodies[1::2]))


@pytest.mark.parametrize("arch", [(8, 0), (8, 9), (9, 0), (10, 0), (12, 0)])
def test_the_kernels_compile_to_a_cubin_for_each_gpu_generation(nvrtc, arch):
    image, kind = nvrtc.compile(kernels.SOURCE, arch)
    assert kind == "cubin" and image[:4] == b"\x7fELF"


def test_each_kernel_declares_the_arguments_a_launch_fills(ptx):
    assert sorted(ptx) == sorted(KERNELS)
    driver = _RecordingDriver()
    rows = {word: RowKernels(driver, ctypes.c_void_p(1), word, "test", max_blocks=4) for word in (16, 8)}
    for word, loaded in rows.items():
        loaded.launch("gather", 1, 0x10000, 0x20000, 0x30000, 0, 9, 4096)
        loaded.launch("scatter", 1, 0x10000, 0x20000, 0x30000, 0, 9, 4096)
        loaded.launch("gather", 1, 0x10000, 0x20000, 0x30000, 0, 9, 4096, blocks=(4, 8))
        loaded.launch("scatter", 1, 0x10000, 0x20000, 0x30000, 0, 9, 4096, blocks=(4, 8))
    for launch in driver.launches:
        declared = re.findall(r"\.param \.u64 (\w+)_param_\d+", ptx[launch["kernel"]])
        assert len(declared) == len(launch["args"]) == len(_signature(re.sub(r"(16|8)$", "", launch["kernel"])))


def test_the_kernels_loop_over_pages_and_move_the_widest_words(ptx):
    for name, body in ptx.items():
        assert "%nctaid.x" in body, f"{name} does not step its pages by the grid's size"
        stores = set(re.findall(r"st\.global[.\w]*", body))
        if name.endswith("16"):
            assert stores == {"st.global.v2.u64"}, (name, stores)
            assert any(".v2.u64" in load for load in re.findall(r"ld\.global[.\w]*", body))
        else:
            assert stores == {"st.global.u64"}, (name, stores)
