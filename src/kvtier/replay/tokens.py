"""Token ids for traces of text prompts and chats: the model's own tokenizer, as vLLM applies it.

A text ``prompt`` is encoded without special tokens added beyond what the tokenizer's defaults add
(vLLM's completions endpoint: ``add_special_tokens=True``); ``messages`` go through the model's chat
template with the generation prompt (vLLM's chat endpoint). The tokenizer is loaded with
``transformers`` (a vLLM dependency, not kvtier's) from the model's folder, or from ``--tokenizer``;
only when a trace has such lines. Never downloads: a folder, or a repo id already in the local
Hugging Face cache.
"""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import Any

from kvtier.replay.trace import MAX_TOKEN_ID, TraceError, TraceRequest

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class TokenizerMissing(ValueError):
    """No tokenizer for a trace that needs one; the message says how to give one."""


def load_tokenizer(source: str | Path | None, model_name: str) -> Any:
    """The tokenizer in ``source`` (a folder or a locally cached repo id); TokenizerMissing says
    how to give one when there is none."""
    how = ("give one with --tokenizer PATH (a folder with tokenizer.json / tokenizer_config.json, or a "
           "Hugging Face repo id already in the local cache), or record token ids instead "
           "('prompt_token_ids', e.g. vLLM's return_token_ids, or a kvtier access log: connector key trace_path)")
    if source is None:
        raise TokenizerMissing(f"the trace has text prompts or chats, and no tokenizer was found for {model_name}: {how}")
    folder = Path(source).expanduser()
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise TokenizerMissing(f"{folder} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): {how}")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TokenizerMissing(f"tokenizing text prompts needs the transformers package (pip install "
                               f"transformers); else {how}") from None
    try:
        return AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise TokenizerMissing(f"cannot load a tokenizer from {source}: {exc}; {how}") from None


def tokenize(requests: list[TraceRequest], tokenizer: Any, path: str) -> None:
    """Give every request that has a text prompt or chat its token ids (in place)."""
    for request in requests:
        if not request.needs_tokenizer:
            continue
        where = f"{path}:{request.line}"
        try:
            if request.messages is not None:
                ids = tokenizer.apply_chat_template(request.messages, tokenize=True, add_generation_prompt=True)
                if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer transformers: a BatchEncoding
                    ids = ids["input_ids"]
            else:
                ids = tokenizer(request.text)["input_ids"]
        except Exception as exc:  # noqa: BLE001 - a template or tokenizer error is this line's error
            raise TraceError(f"{where}: the tokenizer refused it: {exc}") from None
        if not ids:
            raise TraceError(f"{where}: the prompt has no tokens")
        request.prompt = array("I", (min(int(i), MAX_TOKEN_ID) for i in ids))
        request.text = request.messages = None
