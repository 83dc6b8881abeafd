"""Where kvtier's own gather/scatter kernels (kvtier.copy.kernels) cannot be had, staged copies fall
back to torch's ops with the reason logged, never an error. The kernels themselves run only on a
GPU: the kit's round trips (tests/gpu) check every byte they move."""

from __future__ import annotations

import ctypes
import logging

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
