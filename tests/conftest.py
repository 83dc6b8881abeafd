"""Session-wide test settings: the real-engine harness's shared vLLM cache, shared vLLM-alone
references, and the suite's time budget.

``KVTIER_TEST_VLLM_CACHE_ROOT``: one ``VLLM_CACHE_ROOT`` for every engine of the session
(:mod:`support.offline_run`), under pytest's base temp folder. vLLM keeps there what depends only
on its own code: the model-class inspection it otherwise runs in a fresh subprocess for each engine
(``modelinfos/``: ~8 s of one core per engine start on 2 cores). Nothing an engine computes from
a prompt is cached there, so engines stay independent.

Time budget: at the end of a run, the time spent per test file is printed (slowest first), with the
total of the real-engine tests (marked ``e2e``); past :data:`E2E_BUDGET_S` (or
``KVTIER_E2E_BUDGET_S``) a warning says so: the suite must stay within 30 minutes on 2 cores, so a
feature's new end-to-end cases pay for themselves (share engines, short prompts, one-process mode).
"""

from __future__ import annotations

import collections
import json
import os

import pytest

E2E_BUDGET_S = 22 * 60.0
"""The real-engine tests' share of the 30-minute budget on 2 cores: the install takes ~2 min on a
clean clone and the other tests ~2 min, which leaves ~4 min of margin for a slow day. (2026-11-27,
clean clone: real-engine tests 23.4 min, other tests 3.9 min, whole `.ci/run` 31.0 min: over.)"""

_FILE_SECONDS: collections.Counter[str] = collections.Counter()
_E2E_FILES: set[str] = set()


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
    budget = float(os.environ.get("KVTIER_E2E_BUDGET_S", E2E_BUDGET_S))
    write(f"real-engine tests {e2e / 60:.1f} min (budget {budget / 60:.0f} min), other tests {other / 60:.1f} min")
    if e2e > budget:
        write(f"WARNING: the real-engine tests took {e2e / 60:.1f} min, over their budget of {budget / 60:.0f} "
              "min: share engines, shorten prompts or merge cases (tests/conftest.py)", yellow=True, bold=True)
