"""``kvtier bench --save-trace FILE``: the workload as it was sent, as a trace ``kvtier plan --trace``
replays (one OpenAI-style request per line, :mod:`kvtier.replay.trace`), so a prediction can be
checked against the bench's own measurement.

Each line holds the prompt's token ids as the server tokenized them (vLLM's ``return_token_ids``
returns them in the first chunk), the tokens it generated, ``max_tokens`` and the time the request
was sent (seconds from the start of the mode's workload), in the order sent. The requests of one mode
are written: ``kvtier``'s if it ran, else the first mode that finished (every mode sends the same
prompts; a chat turn's prompt holds the previous answer, identical in every mode when outputs are).
"""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.bench.measure import ModeRun

PREFERRED_MODE = "kvtier"


def trace_mode(runs: list[ModeRun]) -> ModeRun | None:
    """The mode whose requests are written: kvtier's, else the first that finished with prompt ids."""
    finished = [m for m in runs if m.run is not None and m.error is None
                and all(r.prompt_token_ids is not None for r in m.run.results if not r.error)]
    preferred = [m for m in finished if m.mode == PREFERRED_MODE]
    return (preferred or finished or [None])[0]


def write_trace(path: Path, mode: ModeRun) -> int:
    """Write ``mode``'s requests (the failed ones left out) to ``path``; returns how many. Its folder
    must exist (``kvtier bench`` checks ``--save-trace`` before any server starts): none is created."""
    assert mode.run is not None
    lines = []
    for result in sorted(mode.run.results, key=lambda r: r.start_s):
        if result.error or result.prompt_token_ids is None:
            continue
        lines.append(json.dumps({
            "timestamp": round(result.start_s, 6), "id": result.id, "prompt_token_ids": result.prompt_token_ids,
            "output_token_ids": result.output_token_ids, "max_tokens": len(result.output_token_ids),
        }, separators=(",", ":")))
    path.write_text("".join(line + "\n" for line in lines))
    return len(lines)
