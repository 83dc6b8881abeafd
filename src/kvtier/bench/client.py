"""Async streaming client for an OpenAI-compatible ``/v1/completions`` endpoint (httpx).

Every request is greedy (``temperature: 0``) and streamed, with vLLM's extensions
``ignore_eos`` (so every mode generates exactly ``max_tokens`` tokens) and ``return_token_ids``
(so outputs are compared token by token, not only as text; the first chunk also carries the prompt's
token ids, which ``kvtier bench --save-trace`` writes), and
``stream_options.include_usage`` (the final chunk then carries ``usage``, including
``prompt_tokens_details.cached_tokens`` when the server runs with
``--enable-prompt-tokens-details``).

TTFT is the time from sending the request to the first chunk that carries generated text or token
ids; latency is the time to the end of the stream.

Called by :mod:`kvtier.bench.driver` on the ``kvtier bench`` process's asyncio event loop.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Completion:
    """What one streamed request produced and how long it took (seconds, ``time.perf_counter``)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None  # as the server tokenized the prompt (first chunk)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int = 0
    start: float = 0.0
    first_token: float | None = None
    end: float = 0.0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def latency_s(self) -> float:
        return self.end - self.start


def completion_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """The JSON body of one benchmark request."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "return_token_ids": True,
    }


def apply_chunk(result: Completion, chunk: dict[str, Any], now: float) -> None:
    """Fold one parsed stream chunk into ``result`` (pure apart from mutating ``result``)."""
    for choice in chunk.get("choices") or []:
        text = choice.get("text") or ""
        ids = choice.get("token_ids") or []
        if choice.get("prompt_token_ids") is not None and result.prompt_token_ids is None:
            result.prompt_token_ids = list(choice["prompt_token_ids"])
        if (text or ids) and result.first_token is None:
            result.first_token = now
        result.text += text
        result.token_ids.extend(ids)
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
    usage = chunk.get("usage")
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens")
        result.output_tokens = usage.get("completion_tokens") or 0
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = details.get("cached_tokens")


async def stream_completion(
    client: httpx.AsyncClient, base_url: str, model: str, prompt: str, max_tokens: int
) -> Completion:
    """Send one streamed completion; errors are recorded in ``Completion.error``, never raised."""
    result = Completion(start=time.perf_counter())
    try:
        async with client.stream("POST", f"{base_url}/v1/completions",
                                 json=completion_body(model, prompt, max_tokens)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                apply_chunk(result, json.loads(data), time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.end = time.perf_counter()
    if not result.output_tokens:
        result.output_tokens = len(result.token_ids)
    if result.error is None and result.first_token is None:
        result.error = "the stream ended without any generated token"
    return result


async def served_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id the server lists on ``/v1/models``."""
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return models[0]["id"]
