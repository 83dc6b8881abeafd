"""Run one workload against each mode in turn: start the mode's fresh server, wait for
``/health``, warm up (one short request, not counted), scrape ``/metrics``, run the workload,
scrape again, stop the server. A mode that fails is recorded and the next mode still runs.
Seeded modes (``kvtier-redis``, ``native-*-restart``) first let another engine serve the workload,
then measure a fresh engine (:func:`run_seeded_mode`).

Called by :mod:`kvtier.bench.command` in the ``kvtier bench`` process; the servers are subprocesses.
The ``kvtier-node`` mode is :mod:`kvtier.bench.node_pair`'s; one server's measure is
:func:`kvtier.bench.measure.measure` (:class:`ModeRun` and :class:`RunOptions` are re-exported here).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import replace
from pathlib import Path

import httpx

from kvtier.bench import native
from kvtier.bench.client import served_model
from kvtier.bench.driver import run_workload
from kvtier.bench.measure import ModeRun, RunOptions, measure
from kvtier.bench.progress import Progress
from kvtier.bench.servers import (
    EXTERNAL,
    FLEET_MODE,
    NODE_MODE,
    ServerError,
    ServerSettings,
    launch_spec,
    make_scratch,
    start,
    wait_healthy,
)
from kvtier.bench.workloads import Workload

__all__ = ["ModeRun", "RunOptions", "measure", "run_bench", "run_server_mode", "run_seeded_mode", "is_seeded"]

async def run_server_mode(mode_name: str, workload: Workload, settings: ServerSettings, out_dir: Path,
                          progress: Progress, options: RunOptions, index: int, total: int) -> ModeRun:
    """One mode on its own fresh server, with its scratch folder removed afterwards."""
    scratch = make_scratch(mode_name)
    mode = ModeRun(mode=mode_name, description=mode_name)
    server = redis = None
    try:
        redis = _redis_for(mode_name, scratch, settings)
        spec = launch_spec(mode_name, settings, scratch, redis_url=redis.url if redis else None)
        mode.description, mode.base_url = spec.summary, spec.base_url
        log_path = out_dir / f"server-{mode_name}.log"
        mode.log_path = str(log_path)
        progress.mode_start(mode_name, index, total, spec.summary, mode.log_path)
        server = start(spec, log_path)
        mode.startup_s = await wait_healthy(server, options.startup_timeout_s,
                                            on_wait=lambda s: progress.waiting(mode_name, s))
        progress.ready(mode_name, mode.startup_s)
        await measure(mode, workload, progress, options, metrics_dir=out_dir)
        if not server.alive():
            raise server.failure("exited during the workload")
    except Exception as exc:  # noqa: BLE001 - one failed mode must not stop the others
        message = str(exc) or type(exc).__name__
        if server is not None and not isinstance(exc, ServerError):
            message += f"\nserver log: {server.log_path}\n--- last lines ---\n{server.tail()}"
        mode.error = message
        progress.error(mode_name, message)
    finally:
        if server is not None:
            server.stop(options.stop_grace_s)
        if redis is not None:
            redis.stop()
        if not options.keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    return mode


def _redis_for(mode_name: str, scratch: Path, settings: ServerSettings):
    """A loopback redis-server for a mode whose tier is Redis, else None."""
    if mode_name != FLEET_MODE and not native.needs_redis(mode_name):
        return None
    from kvtier.bench.redis_server import LocalRedis

    return LocalRedis.start(scratch / "redis", int(settings.redis_size_gib * 2**30))


def is_seeded(mode_name: str) -> bool:
    return mode_name == FLEET_MODE or mode_name in native.RESTART_MODES


async def run_seeded_mode(name: str, workload: Workload, settings: ServerSettings, out_dir: Path,
                          progress: Progress, options: RunOptions, index: int, total: int) -> ModeRun:
    """A seeding engine serves ``workload`` and stops (gracefully: its tier writes land); a fresh
    engine is then measured on :func:`~kvtier.bench.workloads.fleet_workload` (the first use of every
    prefix). ``kvtier-redis``: host + Redis tiers, the fresh engine on a scratch folder of its own (a
    new node of a fleet); ``native-*-restart``: the fresh engine on the seeding engine's root and
    server (a restart)."""
    from kvtier.bench.workloads import fleet_workload

    scratches = [make_scratch(f"{name}-seed")]
    scratches.append(make_scratch(name) if name == FLEET_MODE else scratches[0])
    mode = ModeRun(mode=name, description=name)
    redis = server = None
    try:
        redis = _redis_for(name, scratches[0], settings)
        url = redis.url if redis else None
        seed_spec = launch_spec(name, settings, scratches[0], redis_url=url)
        spec = launch_spec(name, settings, scratches[1], redis_url=url)
        mode.description = spec.summary if name != FLEET_MODE else (
            f"{spec.summary}; a fresh engine after a first engine served the workload into a loopback "
            "redis-server: the first use of every prefix comes from Redis")
        mode.base_url = spec.base_url
        mode.log_path = str(out_dir / f"server-{name}.log")
        progress.mode_start(name, index, total, mode.description, mode.log_path)
        server = start(seed_spec, out_dir / f"server-{name}-seed.log")
        await wait_healthy(server, options.startup_timeout_s, on_wait=lambda s: progress.waiting(name, s))
        model = await _served(seed_spec.base_url)
        progress.workload_start(f"{name} (seeding engine)", len(workload.requests))
        seeded = await run_workload(workload, seed_spec.base_url, model, timeout_s=options.request_timeout_s)
        failed = sum(1 for r in seeded.results if r.error)
        if failed:
            raise ServerError(f"the seeding engine failed {failed} requests; log: {server.log_path}")
        server.stop(options.stop_grace_s)
        server = start(spec, Path(mode.log_path))
        mode.startup_s = await wait_healthy(server, options.startup_timeout_s,
                                            on_wait=lambda s: progress.waiting(name, s))
        progress.ready(name, mode.startup_s)
        await measure(mode, fleet_workload(workload), progress, options, metrics_dir=out_dir)
        if not server.alive():
            raise server.failure("exited during the workload")
    except Exception as exc:  # noqa: BLE001 - one failed mode must not stop the others
        mode.error = str(exc) or type(exc).__name__
        progress.error(name, mode.error)
    finally:
        if server is not None:
            server.stop(options.stop_grace_s)
        if redis is not None:
            redis.stop()
        if not options.keep_scratch:
            for scratch in set(scratches):
                shutil.rmtree(scratch, ignore_errors=True)
    return mode


async def _served(base_url: str) -> str:
    async with httpx.AsyncClient(timeout=30.0) as client:
        return await served_model(client, base_url)


async def run_external(base_url: str, workload: Workload, out_dir: Path, progress: Progress,
                       options: RunOptions) -> ModeRun:
    """The workload against an already-running server (mode ``external``)."""
    mode = ModeRun(mode=EXTERNAL, description=f"already-running server at {base_url}", base_url=base_url.rstrip("/"))
    progress.mode_start(EXTERNAL, 1, 1, mode.description, None)
    try:
        await measure(mode, workload, progress, options, metrics_dir=out_dir)
    except Exception as exc:  # noqa: BLE001
        mode.error = str(exc) or type(exc).__name__
        progress.error(EXTERNAL, mode.error)
    return mode


async def run_bench(workload: Workload, modes: list[str], settings: ServerSettings | None, out_dir: Path,
                    progress: Progress, options: RunOptions, base_url: str | None = None,
                    node: str | None = None) -> tuple[list[ModeRun], float]:
    """Every mode in order (or the one external server); returns the mode runs and the wall time.
    ``node``: the running ``kvtier node`` the ``kvtier-node`` mode uses (None: it starts one)."""
    t0 = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    if base_url is not None:
        runs = [await run_external(base_url, workload, out_dir, progress, options)]
    else:
        assert settings is not None
        runs = []
        cache = make_scratch("vllm-cache") if settings.vllm_cache_dir is None else None  # the run's servers share it
        if cache is not None:
            settings = replace(settings, vllm_cache_dir=str(cache))
        try:
            for index, name in enumerate(modes, 1):
                if name == NODE_MODE:
                    from kvtier.bench.node_pair import run_node_mode

                    runs.extend(await run_node_mode(workload, settings, out_dir, progress, options, index,
                                                    len(modes), node))
                elif is_seeded(name):
                    runs.append(await run_seeded_mode(name, workload, settings, out_dir, progress, options, index,
                                                      len(modes)))
                else:
                    runs.append(await run_server_mode(name, workload, settings, out_dir, progress, options, index,
                                                      len(modes)))
        finally:
            if cache is not None and not options.keep_scratch:
                shutil.rmtree(cache, ignore_errors=True)
    return runs, time.perf_counter() - t0
