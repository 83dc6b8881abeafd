"""Drive one workload against one server: at most ``concurrency`` requests in flight, in the
workload's order, a chat turn only after the turn it extends has answered.

Called by :mod:`kvtier.bench.runner` in the ``kvtier bench`` process (one asyncio event loop).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from kvtier.bench.client import Completion, stream_completion
from kvtier.bench.workloads import RequestSpec, Workload, full_prompt


@dataclass
class RequestResult:
    """One request's outcome in one mode (times in seconds; ``start_s`` from the workload start)."""

    id: str
    group: int
    round: int
    returning: bool
    prompt_chars: int
    prompt_tokens: int | None
    cached_tokens: int | None
    output_tokens: int
    output_text: str
    output_token_ids: list[int]
    start_s: float
    ttft_s: float | None
    latency_s: float
    error: str | None
    prompt_token_ids: list[int] | None = None  # the server's tokens of the prompt (not in results.json)

    @property
    def output_tokens_per_s(self) -> float | None:
        """Output tokens over the end-to-end latency of this request."""
        return self.output_tokens / self.latency_s if self.latency_s > 0 and not self.error else None

    def to_json(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        del data["prompt_token_ids"]
        data["output_tokens_per_s"] = self.output_tokens_per_s
        return data


@dataclass
class WorkloadRun:
    """All requests of one workload against one server, in workload order."""

    results: list[RequestResult]
    wall_s: float


def _result(spec: RequestSpec, prompt: str, done: Completion, t0: float) -> RequestResult:
    return RequestResult(
        id=spec.id, group=spec.group, round=spec.round, returning=spec.returning, prompt_chars=len(prompt),
        prompt_tokens=done.prompt_tokens, cached_tokens=done.cached_tokens, output_tokens=done.output_tokens,
        output_text=done.text, output_token_ids=list(done.token_ids), start_s=done.start - t0,
        ttft_s=done.ttft_s, latency_s=done.latency_s, error=done.error, prompt_token_ids=done.prompt_token_ids,
    )


async def run_workload(
    workload: Workload,
    base_url: str,
    model: str,
    on_done: Callable[[RequestResult], None] | None = None,
    timeout_s: float = 600.0,
    transport: httpx.AsyncBaseTransport | None = None,
) -> WorkloadRun:
    """Send every request of ``workload``; ``on_done`` is called as each one completes.

    Workers take requests in order; a chat turn waits for the turn it extends (always earlier in
    the order, so taken already: no deadlock). A failed turn fails the turns after it.
    ``transport`` replaces the network (tests).
    """
    specs = list(workload.requests)
    finished: dict[str, asyncio.Event] = {s.id: asyncio.Event() for s in specs}
    transcripts: dict[str, tuple[str, str] | None] = {}  # id -> (full prompt, answer), None if failed
    results: dict[str, RequestResult] = {}
    next_index = 0
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=workload.concurrency + 2)

    async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:
        t0 = time.perf_counter()

        async def worker() -> None:
            nonlocal next_index
            while next_index < len(specs):
                spec = specs[next_index]
                next_index += 1
                previous: tuple[str, str] | None = None
                if spec.after is not None:
                    await finished[spec.after].wait()
                    previous = transcripts.get(spec.after)
                if spec.after is not None and previous is None:
                    done = Completion(start=time.perf_counter())
                    done.end, done.error = done.start, f"skipped: {spec.after} failed"
                    prompt = spec.prompt
                else:
                    prompt = full_prompt(spec, *(previous or (None, None)))
                    done = await stream_completion(client, base_url, model, prompt, spec.max_tokens)
                transcripts[spec.id] = None if done.error else (prompt, done.text)
                results[spec.id] = _result(spec, prompt, done, t0)
                finished[spec.id].set()
                if on_done is not None:
                    on_done(results[spec.id])

        await asyncio.gather(*(worker() for _ in range(workload.concurrency)))
        wall = time.perf_counter() - t0
    return WorkloadRun([results[s.id] for s in specs], wall)
