"""Seeded, reproducible synthetic prompts for tests and benchmarks.

Text is drawn from a fixed list of common English words with :class:`random.Random` seeded by the
caller, so the same seed gives the same prompt on every machine and Python version.

Called by the bench workloads, and by tests and benchmarks; any process, no state.
"""

from __future__ import annotations

import random

_WORDS = (
    "the of and to in is was for on that with as by at from his her they this which are be have had "
    "not but were their one all there been has when who will more would into time only about other "
    "new some could these two may first then do any like my now over such our man me even most made "
    "after also did many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men work long get "
    "here between both life being under never day same another know while last might us great old year "
    "off come since against go came right used take three river garden engine market window letter "
    "mountain station doctor teacher history science music village harbor kitchen forest island bridge "
    "machine library museum winter summer morning evening question answer problem system program number"
).split()


def synthetic_text(seed: int, num_words: int) -> str:
    """``num_words`` words of seeded pseudo-prose, with a period every 12-20 words."""
    rng = random.Random(seed)
    words: list[str] = []
    until_period = rng.randint(12, 20)
    for index in range(num_words):
        word = rng.choice(_WORDS)
        if index == 0 or words[-1].endswith("."):
            word = word.capitalize()
        until_period -= 1
        if until_period == 0:
            word += "."
            until_period = rng.randint(12, 20)
        words.append(word)
    return " ".join(words)


def long_prompts(count: int, num_words: int, seed: int = 0) -> list[str]:
    """``count`` distinct documents, each followed by the same short instruction."""
    return [
        f"Document {index}:\n{synthetic_text(seed * 1_000_003 + index, num_words)}\n\nSummarize the document above in one sentence:"
        for index in range(count)
    ]
