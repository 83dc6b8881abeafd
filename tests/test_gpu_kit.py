"""The GPU kit's own checks, on CPU: each one that guards an output-protecting rule passes on kvtier
as it is and FAILS when that protection is deleted (tests/gpu/kit_checks.py; the real device runs
them in tests/gpu/test_gpu_copies.py), so a green GPU run means something.

- the synchronous-load ordering check, on the simulated device (tests/sim_device.py), against the
  engine as shipped and against a copy of src/kvtier/copy/cuda.py with the compute-stream wait on
  the load's ``end`` event deleted;
- the refused-batch check, against the stand-in libcudart of tests/test_cudart_binding.py that
  accepts or refuses batches: the kit's old check (``batched`` before any copy) passed either way;
- the kit's verdict (tests/gpu/summarize.py, scripts/gpu-check.sh's one JSON and exit code) on
  results made by the benchmark's own report functions: it fails on a failed or skipped GPU test, a
  refused batch, a missed goal; and scripts/gpu-check.sh without a GPU says it skipped, exit 0.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from sim_device import SimDevice
from test_cudart_binding import buffers, compile_standin

import kvtier.copy.cuda as shipped_cuda
from kvtier.copy import BlockCopier, HostSlots, PagedKV
from kvtier.copy.cudart import LoadedCudart, SourceOrder
from kvtier.copy.staging import CopyMethod
from kvtier.core.slots import HostSlotLayout

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from gpu_layouts import CASES, build  # noqa: E402
from kit_checks import SimRig, check_a_synchronous_load_lands_before_compute_reads, check_batches_were_not_refused  # noqa: E402

NUM_BLOCKS = 12
COMPUTE_WAIT = "            if direction is Direction.LOAD and synchronous:\n                device.wait(compute, end)\n"


def cuda_module_without(protection: str, name: str):
    """src/kvtier/copy/cuda.py with ``protection`` deleted, imported as a module of its own."""
    source = Path(shipped_cuda.__file__).read_text()
    assert source.count(protection) == 1, "the protection to delete is no longer in cuda.py: update this test"
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    exec(compile(source.replace(protection, ""), f"<cuda.py without the protection: {name}>", "exec"),
         module.__dict__)
    return module


def sim_rig(cuda_module=shipped_cuda, method=CopyMethod.AUTO) -> SimRig:
    kv = build(CASES["LBNHC-attention"], NUM_BLOCKS, "cpu")
    kv.raw.copy_(torch.randint(-128, 128, kv.raw.shape, dtype=torch.int8))
    paged = PagedKV(kv.views, NUM_BLOCKS)
    layout = HostSlotLayout(paged.num_layers, 1, paged.page_bytes, 1, 2)
    host = HostSlots(torch.zeros(layout.region_bytes, dtype=torch.uint8), layout)
    device = SimDevice()
    engine = cuda_module.CudaCopyEngine(BlockCopier(paged, host), device, method)
    return SimRig(engine, paged, host, device)


METHODS = pytest.mark.parametrize("method", [CopyMethod.RUNS, CopyMethod.STAGED], ids=lambda m: m.value)


@METHODS
def test_the_synchronous_load_ordering_check_passes_on_the_engine_as_shipped(method):
    check_a_synchronous_load_lands_before_compute_reads(sim_rig(method=method))


@METHODS
def test_the_synchronous_load_ordering_check_fails_without_the_compute_stream_wait(method):
    broken = cuda_module_without(COMPUTE_WAIT, "kvtier_cuda_without_compute_wait")
    with pytest.raises(AssertionError, match="before the synchronous load landed"):
        check_a_synchronous_load_lands_before_compute_reads(sim_rig(broken, broken.CopyMethod(method.value)))


def test_the_refused_batch_check_passes_when_every_batch_went_out(tmp_path):
    runtime = LoadedCudart(ctypes.CDLL(compile_standin(tmp_path, 13000, name="libkit13000.so")))
    src, dst, dsts, srcs, sizes = buffers()
    runtime.memcpy_batch(dsts, srcs, sizes, 0x10, SourceOrder.STREAM)
    check_batches_were_not_refused(runtime)
    assert np.array_equal(dst, src)


def test_the_refused_batch_check_fails_when_a_batch_was_refused(tmp_path):
    lib = ctypes.CDLL(compile_standin(tmp_path, 13000, name="libkit13000r.so"))
    lib.standin_configure(1)
    runtime = LoadedCudart(lib)
    assert runtime.batched  # the kit's old check, made before any copy: it passed
    src, dst, dsts, srcs, sizes = buffers()
    runtime.memcpy_batch(dsts, srcs, sizes, 0x10, SourceOrder.ANY)
    assert np.array_equal(dst, src)  # every round trip still passes: the copy went run by run
    with pytest.raises(AssertionError, match="refused 1 job"):
        check_batches_were_not_refused(runtime)


# ---- the kit's verdict (tests/gpu/summarize.py) ------------------------------------------------

GPU_TESTS = ["test_round_trip_is_bit_exact_and_matches_the_cpu_engine[LBNHC-attention]",
             "test_a_synchronous_load_lands_before_the_compute_stream_reads_the_page"]


def write_results(directory, outcomes=None, fraction=0.96, issue_ms=0.1, refusals=0, runtime=12080,
                  layouts=("LBNHC", "BLNHC"), slow=("LBNHC", "store", "8KiB"), store_slowdown=1.01, load_slowdown=1.1,
                  staged_moved_as=("staged",), forward_added_ms=0.05):
    """A results directory as scripts/gpu-check.sh leaves it, the bench JSON made by the bench's own
    report functions from synthetic timings: ``fraction`` of the single copy for ``auto`` at ``slow``
    (0.97 elsewhere); GEMM slowdowns beside a store and a load (a plain load copy: 1.1x)."""
    from argparse import Namespace

    from bench_copies import bench_report, direction_report

    outcomes = outcomes or {name: "passed" for name in GPU_TESTS}
    cases = []
    for name, outcome in outcomes.items():
        inner = {"passed": "", "failed": "<failure message='x'/>", "skipped": "<skipped message='x'/>"}[outcome]
        cases.append(f"<testcase classname='tests.gpu.test_gpu_copies' name='{name}'>{inner}</testcase>")
    (directory / "pytest.xml").write_text(f"<testsuites><testsuite>{''.join(cases)}</testsuite></testsuites>")
    (directory / "device.txt").write_text("NVIDIA Test | torch 2.9 | CUDA 12.8")

    class Runtime:
        version, batched, path = runtime, True, "libcudart.so.12"

    for layout in layouts:
        sizes = {}
        for kib in (8, 16, 64):
            size: dict = {"batch_refusals": refusals}
            for direction in ("store", "load"):
                auto = 1.0 / (fraction if (layout, direction, f"{kib}KiB") == slow else 0.97)
                timing = {"single_s": 1.0, "issue_ms": issue_ms, "issue_ms_max": issue_ms, "repeated": 6, "jobs": 7}
                size[direction] = direction_report(2**30, {m: {"device_s": s, **timing, "methods": list(moved)}
                                                           for m, s, moved in (("runs", 2.0, ["runs"]),
                                                                               ("staged", auto, staged_moved_as),
                                                                               ("auto", auto, ["staged"]))})
                size[direction]["auto"]["forward"] = {"step_ms": 6.0, "step_with_job_ms": 6.0 + forward_added_ms,
                                                      "added_ms": forward_added_ms,
                                                      "call_after_host_work_ms": 0.04}
            if kib == 16:
                size["contention"] = {"gemm_ms": 5.8, "slowdown_store": store_slowdown, "slowdown_single_store": 1.0,
                                      "slowdown_load": load_slowdown, "slowdown_single_load": 1.1}
                size["kernel_blocks_sweep"] = {
                    "sms": 132, "page": {"store_fraction": 0.97, "load_fraction": 0.97, "slowdown_load": 1.2},
                    "132": {"store_fraction": 0.97, "load_fraction": 0.96, "slowdown_load": 1.1},
                    "33": {"store_fraction": 0.97, "load_fraction": 0.96, "slowdown_load": 1.1},
                    "8": {"store_fraction": 0.97, "load_fraction": 0.90, "slowdown_load": 1.0}}
            sizes[f"{kib}KiB"] = size
        args = Namespace(layout=layout, blocks=512, layers=32, repeats=7, chunk_mib=32, buffers=2, kernel_blocks=None)
        bench = bench_report(sizes, Runtime(), args)
        (directory / f"bench-{layout}.json").write_text(json.dumps(bench))
    return directory


def verdict(directory):
    run = subprocess.run([sys.executable, str(Path(__file__).parent / "gpu" / "summarize.py"), str(directory)],
                         capture_output=True, text=True)
    return run.returncode, json.loads(run.stdout)


def test_the_kit_verdict_passes_when_every_check_passed_and_every_goal_was_met(tmp_path):
    code, summary = verdict(write_results(tmp_path))
    assert (code, summary["ok"], summary["failed"]) == (0, True, [])
    assert set(summary["checks"].values()) == {"passed"}
    assert summary["bandwidth"]["LBNHC"]["load 16KiB"]["auto"] == 0.97
    assert set(summary["issue_ms"]["BLNHC"]) == {f"{d} {k}KiB" for d in ("store", "load") for k in (8, 16, 64)}
    assert summary["issue_ms"]["BLNHC"]["load 8KiB"] == {"call": 0.1, "forward_added": 0.05,
                                                          "call_after_host_work": 0.04, "repeated": "6 of 7"}
    assert summary["contention"]["LBNHC"]["16KiB"]["slowdown_store"] == 1.01
    sweep = summary["kernel_blocks_sweep"]["BLNHC"]["16KiB"]  # reported, not judged
    assert sweep["page"]["slowdown_load"] == 1.2
    assert sweep["least_load_slowdown"] == "132"  # 8 blocks slowed it less but missed the bandwidth goal


@pytest.mark.parametrize("results, reason", [
    (dict(outcomes={GPU_TESTS[0]: "passed", GPU_TESTS[1]: "failed"}), "GPU test test_a_synchronous_load"),
    (dict(outcomes={GPU_TESTS[0]: "passed", GPU_TESTS[1]: "skipped"}), "skipped"),
    (dict(fraction=0.94), "LBNHC store 8KiB: 0.94 of one cudaMemcpyAsync"),
    (dict(fraction=0.94, slow=("BLNHC", "load", "64KiB")), "BLNHC load 64KiB: 0.94 of one cudaMemcpyAsync"),
    (dict(fraction=1.2), "1.2 of one cudaMemcpyAsync is a measurement error"),
    (dict(issue_ms=0.2), "ms to issue a 512-block job"),
    (dict(forward_added_ms=0.3), "a 512-block job costs the forward's thread 0.3 ms"),
    (dict(refusals=1), "refused 3 job(s)"),
    (dict(layouts=("LBNHC",)), "no benchmark of the goal layout BLNHC"),
    (dict(store_slowdown=1.06), "a store slows the GEMM 1.06x"),
    (dict(load_slowdown=1.13), "a load slows the GEMM 1.13x, one cudaMemcpyAsync of the same bytes 1.1x"),
    (dict(staged_moved_as=("runs",)), "the staged method moved as ['runs']: staging is off"),
])
def test_the_kit_verdict_fails_on_a_failed_check_or_a_missed_goal(tmp_path, results, reason):
    code, summary = verdict(write_results(tmp_path, **results))
    assert code == 1 and not summary["ok"]
    assert any(reason in failure for failure in summary["failed"]), summary["failed"]


def test_a_missed_goal_on_a_layout_that_is_only_reported_does_not_fail_but_a_measurement_error_does(tmp_path):
    layouts = ("LBNHC", "BLNHC", "LBHNC")
    code, summary = verdict(write_results(tmp_path, layouts=layouts, fraction=0.5, slow=("LBHNC", "load", "64KiB")))
    assert code == 0 and summary["bandwidth"]["LBHNC"]["load 64KiB"]["auto"] == 0.5
    code, summary = verdict(write_results(tmp_path, layouts=layouts, fraction=1.5, slow=("LBHNC", "load", "64KiB")))
    assert code == 1 and "measurement error" in " ".join(summary["failed"])


def test_gpu_check_without_a_gpu_says_it_skipped_and_exits_0():
    script = Path(__file__).parents[1] / "scripts" / "gpu-check.sh"
    run = subprocess.run(["bash", str(script)], capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable})
    assert run.returncode == 0 and json.loads(run.stdout)["skipped"].startswith("no GPU to check here")


def test_gpu_check_refuses_an_unknown_argument_before_doing_anything_and_explains_help():
    """A lent GPU's time is scarce: a mistyped option must not start the whole kit."""
    script = Path(__file__).parents[1] / "scripts" / "gpu-check.sh"
    env = {**os.environ, "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(script), "--fetch-wheel"], capture_output=True, text=True, env=env)
    assert run.returncode == 2 and run.stdout == "" and "unknown argument '--fetch-wheel'" in run.stderr
    run = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, env=env)
    assert run.returncode == 0 and "scripts/gpu-check.sh --fetch-wheels" in run.stdout and "{" not in run.stdout
