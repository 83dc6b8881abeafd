"""One mode's record (:class:`ModeRun`), the runner's options, and :func:`measure`: warm up a
running server (one short request, not counted), scrape ``/metrics``, run the workload, scrape
again once the late transfer counters have settled.

Called by :mod:`kvtier.bench.runner` and :mod:`kvtier.bench.node_pair` in the ``kvtier bench``
process (one asyncio event loop).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvtier.bench.client import served_model, stream_completion
from kvtier.bench.driver import WorkloadRun, run_workload
from kvtier.bench.metrics import CacheSummary, Key, diff, scrape, summarize
from kvtier.bench.progress import Progress
from kvtier.bench.servers import ServerError
from kvtier.bench.workloads import Workload

WARMUP_PROMPT = "Warm-up request: reply with one word."


@dataclass
class ModeRun:
    """What one mode produced (``run`` and ``cache`` are None if the mode failed)."""

    mode: str
    description: str
    base_url: str | None = None
    model: str | None = None
    log_path: str | None = None
    startup_s: float | None = None
    run: WorkloadRun | None = None
    cache: CacheSummary | None = None
    error: str | None = None
    extra: dict | None = None  # mode-specific measures (kvtier-node: the node service's counters)


@dataclass
class RunOptions:
    """How the runner behaves (not what the servers are started with)."""

    startup_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    stop_grace_s: float = 30.0
    keep_scratch: bool = False


async def _settled_counters(client: httpx.AsyncClient, base_url: str, tries: int = 6) -> tuple[str, dict[Key, float]]:
    """Scrape until two scrapes a second apart agree (late transfer stats arrive after the last
    answer), at most ``tries`` times."""
    text, counters = await scrape(client, base_url)
    for _ in range(tries - 1):
        await asyncio.sleep(1.0)
        again_text, again = await scrape(client, base_url)
        if again == counters:
            break
        text, counters = again_text, again
    return text, counters


async def measure(mode: ModeRun, workload: Workload, progress: Progress, options: RunOptions,
                  metrics_dir: Path | None = None) -> None:
    """Warm up, scrape, run ``workload`` against ``mode.base_url``, scrape; fills ``mode``."""
    assert mode.base_url is not None
    async with httpx.AsyncClient(timeout=httpx.Timeout(options.request_timeout_s, connect=30.0)) as client:
        mode.model = mode.model or await served_model(client, mode.base_url)
        warm = await stream_completion(client, mode.base_url, mode.model, WARMUP_PROMPT, 2)
        if warm.error:
            raise ServerError(f"warm-up request failed: {warm.error}")
        before_text, before = await _settled_counters(client, mode.base_url)
    progress.workload_start(mode.mode, len(workload.requests))
    mode.run = await run_workload(
        workload, mode.base_url, mode.model, timeout_s=options.request_timeout_s,
        on_done=lambda r: progress.request_done(mode.mode, len(workload.requests), r),
    )
    async with httpx.AsyncClient(timeout=30.0) as client:
        after_text, after = await _settled_counters(client, mode.base_url)
    mode.cache = summarize(diff(before, after))
    if metrics_dir is not None:
        (metrics_dir / f"metrics-{mode.mode}-before.txt").write_text(before_text)
        (metrics_dir / f"metrics-{mode.mode}-after.txt").write_text(after_text)
    progress.mode_done(mode.mode, mode.run.wall_s, sum(1 for r in mode.run.results if r.error))
