"""Benchmark workloads: seeded, reproducible lists of request specs (pure functions, no I/O).

Three workloads:

* :func:`prefix_repetition` -- ``num_prefixes`` shared documents of about ``prefix_tokens`` tokens,
  each request is one document followed by a unique question. Requests go in *rounds*: the
  documents are put in one seeded order and every round replays that same order, so between two
  uses of a document all the other documents pass through the engine (the longest possible reuse
  distance: the case where vLLM's own prefix cache has lost the document and offloading helps).
* :func:`multi_turn` -- ``sessions`` conversations of ``turns`` turns. Turn ``t`` resends the whole
  transcript so far (turn ``t-1``'s prompt and answer) plus a new user message, as chat clients do.
  It uses ``/v1/completions`` with a plain-text transcript (``User: ...`` / ``Assistant:``), so it
  does not depend on the model's chat template. Requests are ordered turn-major (turn 0 of every
  session, then turn 1 of every session, ...), so sessions interleave.
* :func:`unique` -- every prompt different (no reuse at all): what offloading costs when it cannot
  help.

Sizes are given in tokens and turned into words with :data:`TOKENS_PER_WORD`, measured with
SmolLM2's tokenizer on :func:`kvtier.bench.text.synthetic_text` (1.06 tokens per word).

Called by :mod:`kvtier.bench.command` in the ``kvtier bench`` process.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvtier.bench.text import synthetic_text

TOKENS_PER_WORD = 1.06
"""SmolLM2 tokens per word of :func:`~kvtier.bench.text.synthetic_text` (1.03-1.09 measured)."""

_SEED_STRIDE = 1_000_003  # keeps the text seeds of different workload seeds apart


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload.

    ``prompt`` is the full prompt, except for a request with ``after`` set (a later chat turn):
    then the full prompt is built at run time by :func:`full_prompt` from the previous turn's full
    prompt and answer, followed by ``prompt``.
    """

    id: str
    prompt: str
    max_tokens: int
    group: int  # the prefix (prefix-repetition), session (multi-turn) or prompt (unique) index
    round: int  # the round (prefix-repetition) or turn (multi-turn); 0 for unique
    returning: bool  # True if the request reuses a prefix that an earlier request sent
    after: str | None = None  # id of the request whose answer this one's prompt extends


@dataclass(frozen=True)
class Workload:
    """A named, ordered list of requests and how many may be in flight at once."""

    name: str
    requests: tuple[RequestSpec, ...]
    concurrency: int
    reusable_tokens: int  # approximate tokens of all distinct reusable prefixes together
    params: dict[str, Any] = field(default_factory=dict)

    def footprint_bytes(self, kv_bytes_per_token: int) -> int:
        """KV bytes of all distinct reusable prefixes (what a cache must hold to serve every reuse)."""
        return self.reusable_tokens * kv_bytes_per_token

    def to_json(self) -> dict[str, Any]:
        """Plain data for results.json (prompts are left out: they are reproducible from params)."""
        return {
            "name": self.name,
            "concurrency": self.concurrency,
            "num_requests": len(self.requests),
            "reusable_tokens": self.reusable_tokens,
            "params": dict(self.params),
            "requests": [
                {k: v for k, v in asdict(r).items() if k != "prompt"} | {"prompt_chars": len(r.prompt)}
                for r in self.requests
            ],
        }


def words_for(tokens: int) -> int:
    """Words of synthetic text for about ``tokens`` tokens (at least 1)."""
    return max(1, round(tokens / TOKENS_PER_WORD))


def full_prompt(spec: RequestSpec, previous_prompt: str | None, previous_answer: str | None) -> str:
    """The prompt to send for ``spec``: for a chat turn, the transcript so far plus the new message."""
    if spec.after is None:
        return spec.prompt
    if previous_prompt is None or previous_answer is None:
        raise ValueError(f"request {spec.id} needs the prompt and answer of {spec.after}")
    return previous_prompt + previous_answer + spec.prompt


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1; got {value}")


def _document(seed: int, index: int, tokens: int) -> str:
    return f"Document {index}:\n{synthetic_text(seed * _SEED_STRIDE + index, words_for(tokens))}"


def _question(seed: int, index: int, tokens: int) -> str:
    text = synthetic_text(seed * _SEED_STRIDE + 500_000 + index, words_for(tokens))
    return f"\n\nQuestion {index}: {text}\nAnswer:"


def prefix_repetition(
    num_prefixes: int = 6,
    prefix_tokens: int = 1024,
    suffix_tokens: int = 32,
    output_tokens: int = 16,
    num_prompts: int = 24,
    concurrency: int = 2,
    seed: int = 0,
) -> Workload:
    """``num_prompts`` requests over ``num_prefixes`` shared documents, in rounds (see module doc).

    Request ``i`` uses document ``order[i % num_prefixes]`` (``order`` a seeded permutation) with a
    unique question; it is ``returning`` from round 1 on.
    """
    _check_positive(num_prefixes=num_prefixes, prefix_tokens=prefix_tokens, suffix_tokens=suffix_tokens,
                    output_tokens=output_tokens, num_prompts=num_prompts, concurrency=concurrency)
    order = list(range(num_prefixes))
    random.Random(seed).shuffle(order)
    documents = [_document(seed, k, prefix_tokens) for k in range(num_prefixes)]
    requests = []
    for i in range(num_prompts):
        group, round_ = order[i % num_prefixes], i // num_prefixes
        requests.append(RequestSpec(
            id=f"r{i:04d}", prompt=documents[group] + _question(seed, i, suffix_tokens),
            max_tokens=output_tokens, group=group, round=round_, returning=round_ > 0,
        ))
    used = min(num_prefixes, num_prompts)
    params = dict(num_prefixes=num_prefixes, prefix_tokens=prefix_tokens, suffix_tokens=suffix_tokens,
                  output_tokens=output_tokens, num_prompts=num_prompts, seed=seed)
    return Workload("prefix-repetition", tuple(requests), concurrency, used * prefix_tokens, params)


def unique(
    num_prompts: int = 24,
    prompt_tokens: int = 1056,
    output_tokens: int = 16,
    concurrency: int = 2,
    seed: int = 0,
) -> Workload:
    """``num_prompts`` prompts of about ``prompt_tokens`` tokens that share nothing but a few words."""
    _check_positive(num_prompts=num_prompts, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                    concurrency=concurrency)
    requests = tuple(
        RequestSpec(id=f"u{i:04d}", prompt=_document(seed, i, prompt_tokens) + "\n\nSummary:",
                    max_tokens=output_tokens, group=i, round=0, returning=False)
        for i in range(num_prompts)
    )
    params = dict(num_prompts=num_prompts, prompt_tokens=prompt_tokens, output_tokens=output_tokens, seed=seed)
    return Workload("unique", requests, concurrency, 0, params)


def multi_turn(
    sessions: int = 4,
    turns: int = 4,
    context_tokens: int = 1536,
    message_tokens: int = 48,
    output_tokens: int = 16,
    concurrency: int = 1,
    seed: int = 0,
) -> Workload:
    """``sessions`` x ``turns`` chat turns; each session opens with a ``context_tokens`` document.

    Request ``s{S}t{T}`` depends on ``s{S}t{T-1}`` (its prompt is that turn's prompt + answer + a new
    message), so it can only be sent after that answer arrived.
    """
    _check_positive(sessions=sessions, turns=turns, context_tokens=context_tokens,
                    message_tokens=message_tokens, output_tokens=output_tokens, concurrency=concurrency)
    requests = []
    for t in range(turns):
        for s in range(sessions):
            message = synthetic_text(seed * _SEED_STRIDE + 700_000 + s * turns + t, words_for(message_tokens))
            if t == 0:
                prompt = f"{_document(seed, s, context_tokens)}\n\nUser: {message}\nAssistant:"
            else:
                prompt = f"\nUser: {message}\nAssistant:"
            requests.append(RequestSpec(
                id=f"s{s:03d}t{t:03d}", prompt=prompt, max_tokens=output_tokens, group=s, round=t,
                returning=t > 0, after=f"s{s:03d}t{t - 1:03d}" if t else None,
            ))
    # What a cache must hold to serve every returning turn: each session's transcript before its last turn.
    per_session = context_tokens + (turns - 1) * (message_tokens + 8 + output_tokens)
    params = dict(sessions=sessions, turns=turns, context_tokens=context_tokens, message_tokens=message_tokens,
                  output_tokens=output_tokens, seed=seed)
    return Workload("multi-turn", tuple(requests), concurrency, sessions * per_session, params)


WORKLOADS = ("prefix-repetition", "multi-turn", "unique")


def fleet_workload(workload: Workload) -> Workload:
    """What the ``kvtier-redis`` mode measures on its second engine: the first use of every prefix
    of ``workload`` (round 0 / the first turn of each session), each one ``returning`` because a
    first engine of the fleet already served the whole workload into the shared tier. Their TTFT
    is the TTFT of prompts a new node finds in Redis only."""
    first_uses = tuple(replace(r, returning=True) for r in workload.requests if r.round == 0 and r.after is None)
    return Workload(
        name=workload.name, requests=first_uses, concurrency=workload.concurrency,
        reusable_tokens=workload.reusable_tokens, params={**workload.params, "fleet_first_uses": True},
    )
