"""The pieces of a model's identity that kvtier's connector and its tiers behind vLLM's own
offloading compute alike: where the weights are, their fingerprint, and a digest of the config.

:mod:`kvtier.vllm.identity` (the connector: from vLLM's whole configuration) and
:mod:`kvtier.runtime.chunks.identity` (a native tier: from the model name vLLM loaded) build a
:class:`~kvtier.core.keys.ModelIdentity` from these. ``setting`` in the errors names where the
operator sets ``model_identity`` in that configuration, so the message gives the fix. Weights
that cannot be identified stop the engine at start-up: never a guess.

Start-up only, caller's thread; :func:`weights_digest` may read every weight file
(:mod:`kvtier.runtime.fingerprint`).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import blake3

from kvtier.core.values import ConfigError
from kvtier.runtime.fingerprint import FingerprintError, fingerprint_weights

logger = logging.getLogger(__name__)

VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation")
"""Model config fields that do not change KV bytes but differ between copies of one model."""


def config_digest(config: dict[str, Any]) -> str:
    """Digest of a model config (``config.json``'s fields), volatile fields left out."""
    stable = {key: value for key, value in config.items() if not key.startswith(VOLATILE_CONFIG_KEYS)}
    return blake3.blake3(json.dumps(stable, sort_keys=True, default=str).encode()).hexdigest()[:32]


def locate_weights(model: str, *, setting: str, revision: str | None = None) -> Path:
    """Where the weights of ``model`` are: the path itself, or the local Hugging Face snapshot of a
    repo id (at ``revision``). Raises ConfigError naming the fix when neither exists."""
    if os.path.exists(model):
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception as exc:
        raise ConfigError(
            f"kvtier cannot identify the weights of {model!r}: it is neither a local path nor in the "
            f"Hugging Face cache ({exc}). Set {setting} to a string that changes whenever the weights "
            "change (e.g. the release tag), or serve from a local folder."
        ) from None


def weights_digest(folder: Path, model: str, *, setting: str) -> str:
    """The fingerprint of the weights in ``folder`` (of ``model``); ConfigError naming the fix when
    they cannot be read. Says so in the log when that took more than a second (cached after)."""
    try:
        fingerprint = fingerprint_weights(folder)
    except FingerprintError as exc:
        raise ConfigError(
            f"kvtier cannot fingerprint the weights of {model!r}: {exc}. Set {setting} to a string that "
            "changes whenever the weights change."
        ) from None
    if fingerprint.seconds > 1:
        logger.info("kvtier: fingerprinted %d weight files (%.1f GB, %s) in %.1f s; cached for the next start",
                    fingerprint.files, fingerprint.bytes / 1e9, fingerprint.method, fingerprint.seconds)
    return fingerprint.digest
