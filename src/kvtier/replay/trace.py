"""Trace files for ``kvtier plan --trace``: one request per line (JSONL), in one of two kinds.

**Requests** as operators log them (OpenAI-style), one object per line with exactly one of:

- ``"prompt_token_ids": [int, ...]`` (what vLLM computed; no tokenizer needed), or ``"prompt"`` as a
  list of token ids;
- ``"prompt": "text"`` (tokenized with the model's tokenizer, no special tokens added, as vLLM's
  completions endpoint does);
- ``"messages": [{"role": ..., "content": ...}, ...]`` (the model's chat template applied, with the
  generation prompt, as vLLM's chat endpoint does);

and optionally ``"timestamp"`` (seconds), ``"cache_salt"`` (a tenant: blocks of different salts are
never shared), ``"max_tokens"`` (the tokens it generates), ``"output_token_ids"`` (the tokens it
generated, e.g. vLLM's ``return_token_ids``; then ``max_tokens`` is their count), ``"max_offload_tokens"``
(or ``"kv_transfer_params": {"max_offload_tokens": N}``). A line may wrap these in ``"body"``.
``kvtier bench --save-trace`` writes this kind, with prompt and output token ids.

**kvtier's access log** (:mod:`kvtier.runtime.access_log`: a connector with ``trace_path`` writes it):
hashes only, read without a tokenizer.

A file holds one kind. Lines are replayed in timestamp order (``timestamp``, or the access log's
``t``; stable for equal times) when every line has one, in file order when none has. Blank lines
are skipped. Anything else is a :class:`TraceError` that names the file, the line and what is wrong.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.runtime.access_log import FORMAT_MARK, FORMAT_VERSION, KEY_HEX_CHARS

MAX_TOKEN_ID = 2**32 - 3
"""Token ids are hashed as u32; 2**32 - 1 marks a tail in kvtier's keys, 2**32 - 2 stands for a token a
trace does not give (:data:`kvtier.replay.identity.UNKNOWN_TOKEN`)."""


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file and line."""


@dataclass(frozen=True)
class AccessRecord:
    """One access-log line: the keys (16-byte prefixes) of the full blocks of its computed tokens,
    the tails it could leave by (block index, tokens), and the tail keys its lookup tried."""

    block_tokens: int
    computed_tokens: int
    keys: tuple[bytes, ...]
    tails: dict[tuple[int, int], bytes] = field(default_factory=dict)
    probe: tuple[int, tuple[bytes, ...]] = (0, ())


@dataclass
class TraceRequest:
    """One request of a trace. ``prompt`` holds token ids (a compact u32 array) once known; a text
    prompt or chat is kept in ``text`` / ``messages`` until :mod:`kvtier.replay.tokens` turns it
    into ids. ``output`` holds the generated ids when the trace has them. ``access`` is set instead
    of tokens for an access-log line."""

    line: int
    timestamp: float | None = None
    salt: str | None = None
    max_tokens: int = 0
    max_offload_tokens: int | None = None
    prompt: array | None = None
    output: array | None = None
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    access: AccessRecord | None = None
    prompt_length: int = 0  # the access log's prompt tokens (token forms: len(prompt))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt) if self.prompt is not None else self.prompt_length

    @property
    def needs_tokenizer(self) -> bool:
        return self.prompt is None and self.access is None


@dataclass(frozen=True)
class Trace:
    """A trace's requests in replay order and what kind of file it was (``requests`` or ``access``)."""

    path: str
    kind: str
    requests: list[TraceRequest]
    ordered_by_time: bool


def read_trace(path: str | Path) -> Trace:
    """Read and check every line of ``path``; raise :class:`TraceError` on the first bad one."""
    path = Path(path)
    try:
        handle = path.open("r", encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{path}: cannot open the trace: {exc.strerror or exc}") from None
    requests: list[TraceRequest] = []
    kind: str | None = None
    first_of_kind = 0
    with handle:
        for number, line in _lines(handle, path):
            request = parse_line(line, number, path)
            this = "access" if request.access is not None else "requests"
            if kind is None:
                kind, first_of_kind = this, number
            elif this != kind:
                raise TraceError(f"{path}:{number}: a {_kind_name(this)} line in a file of {_kind_name(kind)} "
                                 f"(line {first_of_kind}); a trace holds one kind")
            requests.append(request)
    if not requests:
        raise TraceError(f"{path}: the trace holds no request")
    if kind == "access":
        sizes = {r.access.block_tokens for r in requests if r.access is not None}
        if len(sizes) > 1:
            bad = next(r for r in requests if r.access is not None and r.access.block_tokens != requests[0].access.block_tokens)  # type: ignore[union-attr]
            raise TraceError(f"{path}:{bad.line}: block_tokens {bad.access.block_tokens} differs from line "  # type: ignore[union-attr]
                             f"{requests[0].line}'s {requests[0].access.block_tokens}: one engine's log per "  # type: ignore[union-attr]
                             "replay (engines with other block sizes have other keys)")
    timed = [r.timestamp is not None for r in requests]
    if any(timed) and not all(timed):
        missing = requests[timed.index(False)]
        having = requests[timed.index(True)]
        raise TraceError(f"{path}:{missing.line}: no timestamp, but line {having.line} has one: give every "
                         "line a timestamp (then they are replayed in time order) or none (file order)")
    if all(timed):
        requests.sort(key=lambda r: r.timestamp)  # type: ignore[arg-type,return-value]
    return Trace(str(path), kind or "requests", requests, all(timed))


def _kind_name(kind: str) -> str:
    return "kvtier access-log" if kind == "access" else "request"


def _lines(handle, path: Path) -> Iterator[tuple[int, str]]:
    number = 0
    try:
        for number, line in enumerate(handle, 1):
            if line.strip():
                yield number, line
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}:{number + 1}: not UTF-8 text ({exc.reason})") from None


def parse_line(line: str, number: int, path: str | Path = "<trace>") -> TraceRequest:
    """One line as a request; :class:`TraceError` naming ``path:number`` if it is not one."""
    where = f"{path}:{number}"
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(data, dict):
        raise TraceError(f"{where}: expected a JSON object per line, got {type(data).__name__}")
    if FORMAT_MARK in data:
        return _access_line(data, number, where)
    bools = "true" in line or "false" in line
    body = data.get("body")
    if isinstance(body, dict):
        data = {**body, **{k: v for k, v in data.items() if k != "body"}}
    request = TraceRequest(line=number)
    given = [name for name in ("prompt_token_ids", "prompt", "messages") if data.get(name) is not None]
    if not given:
        raise TraceError(f"{where}: no prompt: a request needs 'prompt_token_ids', 'prompt' or 'messages' "
                         f"(or is a kvtier access-log line with '{FORMAT_MARK}')")
    if len(given) > 1:
        raise TraceError(f"{where}: both {given[0]!r} and {given[1]!r}: give one of them")
    name = given[0]
    value = data[name]
    if name == "messages":
        request.messages = _messages(value, where)
    elif isinstance(value, str):
        if name == "prompt_token_ids":
            raise TraceError(f"{where}: 'prompt_token_ids' must be a list of token ids, got a string")
        if not value:
            raise TraceError(f"{where}: 'prompt' is empty")
        request.text = value
    else:
        request.prompt = token_array(value, name, where, bools)
        if not request.prompt:
            raise TraceError(f"{where}: {name!r} is empty")
    request.timestamp = _number(data.get("timestamp"), "timestamp", where)
    request.salt = _text(data.get("cache_salt"), "cache_salt", where)
    output = data.get("output_token_ids")
    if output is not None:
        request.output = token_array(output, "output_token_ids", where, bools)
    max_tokens = _count(data.get("max_tokens"), "max_tokens", where)
    if request.output is not None:
        if max_tokens is not None and max_tokens < len(request.output):
            raise TraceError(f"{where}: 'max_tokens' {max_tokens} is less than the {len(request.output)} "
                             "'output_token_ids'")
        request.max_tokens = len(request.output)
    else:
        request.max_tokens = max_tokens or 0
    params = data.get("kv_transfer_params")
    raw_cap = data.get("max_offload_tokens")
    if isinstance(params, dict) and params.get("max_offload_tokens") is not None:
        raw_cap = params["max_offload_tokens"]
    request.max_offload_tokens = _count(raw_cap, "max_offload_tokens", where)
    return request


def _access_line(data: dict[str, Any], number: int, where: str) -> TraceRequest:
    if data[FORMAT_MARK] != FORMAT_VERSION:
        raise TraceError(f"{where}: access-log format {data[FORMAT_MARK]!r}; this kvtier reads format "
                         f"{FORMAT_VERSION}")
    block = _count(data.get("block_tokens"), "block_tokens", where)
    prompt = _count(data.get("prompt_tokens"), "prompt_tokens", where)
    computed = _count(data.get("tokens"), "tokens", where)
    for name, value in (("block_tokens", block), ("prompt_tokens", prompt), ("tokens", computed)):
        if not value:
            raise TraceError(f"{where}: {name!r} must be a positive integer, got {data.get(name)!r}")
    assert block and prompt and computed is not None
    keys = data.get("keys")
    if not isinstance(keys, list):
        raise TraceError(f"{where}: 'keys' must be a list of hex keys")
    if len(keys) != computed // block:
        raise TraceError(f"{where}: {len(keys)} keys for {computed} tokens in blocks of {block} "
                         f"(expected {computed // block})")
    parsed = _keys(keys, f"{where}: keys")
    tails: dict[tuple[int, int], bytes] = {}
    raw_tails = data.get("tails", [])
    if not isinstance(raw_tails, list):
        raise TraceError(f"{where}: 'tails' must be a list of [block, tokens, key]")
    for i, tail in enumerate(raw_tails):
        if (not isinstance(tail, list) or len(tail) != 3 or not all(_is_count(v) for v in tail[:2])
                or not 0 < tail[1] < block):
            raise TraceError(f"{where}: tails[{i}] must be [block index, tokens 1..{block - 1}, key], got {tail!r}")
        tails[(tail[0], tail[1])] = _key(tail[2], f"{where}: tails[{i}]")
    probe: tuple[int, tuple[bytes, ...]] = (0, ())
    raw_probe = data.get("probe")
    if raw_probe is not None:
        if (not isinstance(raw_probe, list) or len(raw_probe) != 2 or not _is_count(raw_probe[0])
                or not isinstance(raw_probe[1], list) or len(raw_probe[1]) >= block):
            raise TraceError(f"{where}: 'probe' must be [block index, [up to {block - 1} hex keys]]")
        probe = (raw_probe[0], tuple(_key(k, f"{where}: probe key {i}") for i, k in enumerate(raw_probe[1])))
    salt = data.get("salt")
    if salt is not None and not isinstance(salt, str):
        raise TraceError(f"{where}: 'salt' must be a string or null")
    return TraceRequest(
        line=number, timestamp=_number(data.get("t"), "t", where), salt=salt,
        max_offload_tokens=_count(data.get("max_offload_tokens"), "max_offload_tokens", where),
        max_tokens=max(0, computed + 1 - prompt), prompt_length=prompt,
        access=AccessRecord(block, computed, parsed, tails, probe),
    )


def token_array(value: Any, name: str, where: str, maybe_bools: bool = True) -> array:
    """``value`` as u32 token ids; :class:`TraceError` naming the first bad entry if it is not a
    list of ids (checked in bulk: a trace holds millions). ``maybe_bools`` False: the line has no
    ``true``/``false`` at all, so no entry can be a bool."""
    if not isinstance(value, list):
        raise TraceError(f"{where}: {name!r} must be a list of token ids, got {type(value).__name__}")
    try:
        ids = array("I", value)  # refuses floats, strings, negatives and ids past 2**32 - 1
        if ids and int(np.frombuffer(ids, dtype=np.uint32).max()) > MAX_TOKEN_ID or (
                maybe_bools and bool in set(map(type, value))):
            raise TypeError
    except (TypeError, OverflowError):
        bad = next(i for i, v in enumerate(value) if not _is_count(v) or v > MAX_TOKEN_ID)
        raise TraceError(f"{where}: {name}[{bad}] is {value[bad]!r}, not a token id (an integer 0..{MAX_TOKEN_ID})") from None
    return ids


def _messages(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise TraceError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise TraceError(f"{where}: messages[{i}] must be an object with a string 'role'")
        content = message.get("content")
        if not isinstance(content, (str, list)) and content is not None:
            raise TraceError(f"{where}: messages[{i}].content must be a string or a list of parts")
    return value


def _keys(values: list[Any], where: str) -> tuple[bytes, ...]:
    """Hex keys as bytes, checked in bulk (a trace has millions); the first bad one is named."""
    width = KEY_HEX_CHARS
    try:
        if set(map(len, values)) - {width}:
            raise TypeError
        raw = bytes.fromhex("".join(values))
        if len(raw) * 2 != width * len(values):  # fromhex skips blanks
            raise ValueError
    except (TypeError, ValueError):
        for i, value in enumerate(values):
            _key(value, f"{where}[{i}]")
        raise AssertionError("unreachable: a bad key was not found") from None
    size = width // 2
    return tuple(raw[i : i + size] for i in range(0, len(raw), size))


def _key(value: Any, where: str) -> bytes:
    if not isinstance(value, str) or len(value) != KEY_HEX_CHARS or not value.isalnum():
        raise TraceError(f"{where}: expected {KEY_HEX_CHARS} hex digits, got {value!r}")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise TraceError(f"{where}: expected {KEY_HEX_CHARS} hex digits, got {value!r}") from None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _count(value: Any, name: str, where: str) -> int | None:
    if value is None:
        return None
    if not _is_count(value):
        raise TraceError(f"{where}: {name!r} must be a non-negative integer, got {value!r}")
    return value


def _number(value: Any, name: str, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TraceError(f"{where}: {name!r} must be a number of seconds, got {value!r}")
    return float(value)


def _text(value: Any, name: str, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise TraceError(f"{where}: {name!r} must be a string, got {type(value).__name__}")
    return value
