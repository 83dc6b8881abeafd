"""Session-wide test settings: the real-engine harness's shared vLLM cache, shared vLLM-alone
references, and the suite's time budget.

``KVTIER_TEST_VLLM_CACHE_ROOT``: one ``VLLM_CACHE_ROOT`` for every engine of the session
(:mod:`support.offline_run`), under pytest's base temp folder. vLLM keeps there what depends only
on its own code: the model-class inspection it otherwise runs in a fresh subprocess for each engine
(``modelinfos/``: ~8 s of one core per engine start on 2 cores). Nothing an engine computes from
a prompt is cached there, so engines stay independent.

Workers: the README's command runs the suite with pytest-xdist (``-n auto --dist loadfile``: a
file's tests and its module fixtures stay on one worker), one worker per CPU (at most
:data:`MAX_WORKERS`), each pinned to its CPU and leasing it per test; tests marked ``all_cores``
lease every CPU (:mod:`support.cpu_lease`).

Time budget: at the end of a run, the time spent per test file is printed (slowest first; under
xdist these add up over the workers), with the total of the real-engine tests (marked ``e2e``) and
the run's wall time; past :data:`WALL_BUDGET_S` (or ``KVTIER_TEST_BUDGET_S``) a warning says so:
the suite must stay within 30 minutes on 2 cores with its install, so a feature's new end-to-end
cases pay for themselves (share engines, short prompts, one-process mode).
"""

from __future__ import annotations

import collections
import json
import os
import time

import pytest

WALL_BUDGET_S = 26 * 60.0
"""The test run's share of the 30-minute budget on 2 cores: the install takes ~2-3 min on a clean
clone, which leaves a few minutes of margin for a slow day. (One process, 2026-11-28: real-engine
tests 26.2 min, other tests 5.3 min, whole `.ci/run` 34.2 min, over. Two pinned workers,
2026-11-29: 19.0 min of tests, whole `.ci/run` 21.2 min.)"""

MAX_WORKERS = 4
"""``-n auto``'s ceiling: each worker's engines take 1-3 GiB of memory."""

_FILE_SECONDS: collections.Counter[str] = collections.Counter()
_E2E_FILES: set[str] = set()
_LEASE_WAITS: collections.Counter[str] = collections.Counter()  # seconds tests waited for their CPUs
_STARTED = time.monotonic()
_LEASE = None  # this worker's support.cpu_lease.CpuLease (None: not an xdist worker)


def pytest_configure(config: pytest.Config) -> None:
    global _LEASE
    from support import cpu_lease

    if hasattr(config, "workerinput"):
        _LEASE = cpu_lease.pin_worker(config.workerinput["workerid"])
    elif config.getoption("numprocesses", None):
        cpu_lease.prepare_controller()
        config.option.loadscopereorder = False  # (pytest_collection_modifyitems orders the files)


def pytest_unconfigure(config: pytest.Config) -> None:
    from support import cpu_lease

    if not hasattr(config, "workerinput"):
        cpu_lease.finish_controller()


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files whose tests all take every CPU first, then real-engine files, then the rest (stable;
    the workers' collections stay identical): the ``all_cores`` files then run back to back while
    the other workers have nothing of their own to wait out, and the short files fill the end.
    (xdist's own reordering, by number of tests per file, is turned off in the controller.)"""
    files: dict[str, list[pytest.Item]] = collections.defaultdict(list)
    for item in items:
        files[item.nodeid.split("::", 1)[0]].append(item)

    def rank(path: str) -> int:
        tests = files[path]
        if all(t.get_closest_marker("all_cores") for t in tests):
            return 0
        return 1 if any(t.get_closest_marker("e2e") for t in tests) else 2

    items[:] = [item for path in sorted(files, key=rank) for item in files[path]]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    """Each test (its fixtures' set-up and teardown included) holds its CPU lease, or all of them."""
    if _LEASE is None:
        return (yield)
    all_cores = item.get_closest_marker("all_cores") is not None
    asked = time.monotonic()
    _LEASE.begin(all_cores=all_cores)
    item.user_properties.append(("cpu_lease_wait_s", time.monotonic() - asked))
    try:
        return (yield)
    finally:
        _LEASE.end(keep_all=all_cores and nextitem is not None and nextitem.get_closest_marker("all_cores") is not None)


@pytest.fixture(scope="session", autouse=True)
def shared_vllm_cache_root(tmp_path_factory) -> str:
    root = str(tmp_path_factory.getbasetemp() / "vllm-cache")
    os.environ.setdefault("KVTIER_TEST_VLLM_CACHE_ROOT", root)
    return os.environ["KVTIER_TEST_VLLM_CACHE_ROOT"]


@pytest.fixture(scope="session")
def vllm_alone(tmp_path_factory):
    """``vllm_alone(spec) -> result``: vLLM alone (no connector) on an :mod:`support.offline_run`
    spec, run once per session for each distinct spec: tests that compare against the same
    reference (same model, prompts, engine settings and rounds) share one engine run."""
    from support.offline_run import launch

    results: dict[str, dict] = {}

    def run(spec: dict) -> dict:
        assert spec.get("kv_connector_extra_config") is None, "a reference runs vLLM alone"
        key = json.dumps(spec, sort_keys=True)
        if key not in results:
            results[key] = launch(spec, tmp_path_factory.mktemp("alone"))
        return results[key]

    return run


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] += report.duration  # setup, call and teardown (module fixtures included)
    if "e2e" in report.keywords:
        _E2E_FILES.add(path)
    if report.when == "setup":
        _LEASE_WAITS[path] += dict(report.user_properties).get("cpu_lease_wait_s", 0.0)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not _FILE_SECONDS:
        return
    write = terminalreporter.write_line
    terminalreporter.section("seconds per test file")
    for path, seconds in _FILE_SECONDS.most_common():
        if seconds >= 1.0:
            write(f"{seconds:8.1f}  {path}{'  (real engines)' if path in _E2E_FILES else ''}")
    e2e = sum(_FILE_SECONDS[p] for p in _E2E_FILES)
    other = sum(_FILE_SECONDS.values()) - e2e
    wall = time.monotonic() - _STARTED
    workers = getattr(config.option, "numprocesses", None) or 1
    budget = float(os.environ.get("KVTIER_TEST_BUDGET_S", WALL_BUDGET_S))
    write(f"real-engine tests {e2e / 60:.1f} min, other tests {other / 60:.1f} min, over {workers} worker(s); "
          f"wall {wall / 60:.1f} min (budget {budget / 60:.0f} min)")
    if sum(_LEASE_WAITS.values()) >= 1.0:
        waits = ", ".join(f"{path} {seconds:.0f} s" for path, seconds in _LEASE_WAITS.most_common(4) if seconds >= 1.0)
        write(f"waited for CPUs (support/cpu_lease.py): {sum(_LEASE_WAITS.values()) / 60:.1f} min ({waits})")
    if wall > budget:
        write(f"WARNING: the run took {wall / 60:.1f} min, over its budget of {budget / 60:.0f} min: share "
              "engines, shorten prompts or merge cases (tests/conftest.py)", yellow=True, bold=True)
