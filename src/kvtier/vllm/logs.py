"""kvtier's log records printed the way vLLM prints its own.

vLLM configures only the "vllm" logger, and only once the engine starts; kvtier's code that vLLM
loads (the connector, the native tiers and spec) calls :func:`share_vllm_log_handlers` from its
constructor so that kvtier's INFO lines appear in vLLM's log. Idempotent; any process.
"""

from __future__ import annotations

import logging


def share_vllm_log_handlers() -> None:
    """Give the "kvtier" logger vLLM's handlers and level (once, if vLLM has configured them)."""
    ours, theirs = logging.getLogger("kvtier"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False
