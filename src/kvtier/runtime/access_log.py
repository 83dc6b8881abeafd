"""kvtier's access log: one JSON line per finished request, written by the scheduler side when the
connector key ``trace_path`` is set, read back by ``kvtier plan --trace`` (:mod:`kvtier.replay`).

A line holds hashes and counts only, never a token or text: the request's arrival (``t``, wall
seconds of its first lookup), its prompt and computed token counts, the first
:data:`KEY_HEX_CHARS` hex digits of the keys of the full blocks of its computed tokens (prompt
and answer; 16 bytes are as collision-free as the 32 for a replay's purpose), the tails it could
leave (block index, tokens, key: at its computed end, its prompt's end and its prompt but the last
token, wherever one ends inside a block), the tail keys its last lookup tried (``probe``: the
block index after its run of full blocks and the candidates of 1..n tokens there; only when
``offload_partial_blocks`` is on), ``max_offload_tokens`` when the request set one, and an 8-byte
digest of its ``cache_salt`` (tenants can be told apart, the salt itself is not written)::

    {"kvtier_access": 1, "t": 1764100000.25, "block_tokens": 16, "prompt_tokens": 2013,
     "tokens": 2028, "salt": "9f86d081884c7d65", "keys": ["5d0f...", ...],
     "tails": [[125, 12, "a1b2..."], [125, 13, "c3d4..."]], "probe": [125, ["e5f6...", ...]]}

Threading: the scheduler's thread only. A line is one ``write`` on a descriptor opened with
``O_APPEND`` (engines may share one file; lines of about 10 KB at most stay whole on local
filesystems). A failed write is logged once and ends the log: the engine never stops for it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence

import blake3

from kvtier.core.keys import BlockKey
from kvtier.runtime.requests import RequestKeys

logger = logging.getLogger(__name__)

FORMAT_MARK = "kvtier_access"
FORMAT_VERSION = 1
KEY_HEX_CHARS = 32
"""Hex digits of a key written (16 of its 32 bytes)."""


def short_key(key: BlockKey) -> str:
    return key.hex()[:KEY_HEX_CHARS]


def salt_digest(salt: str | None) -> str | None:
    """An 8-byte digest that tells tenants apart without writing their salt."""
    return None if salt is None else blake3.blake3(salt.encode()).hexdigest()[:16]


def access_record(chain: RequestKeys, *, arrival: float, num_prompt_tokens: int, num_computed_tokens: int,
                  salt: str | None, max_offload_tokens: int | None,
                  probe: tuple[int, Sequence[BlockKey]] = (0, ())) -> dict:
    """The line of a finished request whose first ``num_computed_tokens`` have their KV (keys of
    the full blocks among them are computed here if the request's stores did not get that far)."""
    block = chain.block_tokens
    computed = max(0, min(num_computed_tokens, len(chain.tokens)))
    full = computed // block
    chain.extend_keys(full)
    ends = sorted({computed, min(computed, num_prompt_tokens), min(computed, num_prompt_tokens - 1)})
    tails = [[end // block, end % block, short_key(chain.tail_key_of(end // block, end))]
             for end in ends if end % block and end // block <= len(chain.keys)]
    record: dict = {
        FORMAT_MARK: FORMAT_VERSION, "t": round(arrival, 6), "block_tokens": block,
        "prompt_tokens": num_prompt_tokens, "tokens": computed, "salt": salt_digest(salt),
        "keys": [short_key(key) for key in chain.keys[:full]], "tails": tails,
    }
    if probe[1]:
        record["probe"] = [probe[0], [short_key(key) for key in probe[1]]]
    if max_offload_tokens is not None:
        record["max_offload_tokens"] = max_offload_tokens
    return record


class AccessLog:
    """Appends access records to ``path`` (created 0600 if missing, never truncated)."""

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self.written = 0

    def write(self, record: dict) -> None:
        if self._fd is None:
            return
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        try:
            os.write(self._fd, line)
            self.written += 1
        except OSError as exc:
            logger.warning("kvtier: access log %s: %s; no more lines are written to it", self.path, exc)
            self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
