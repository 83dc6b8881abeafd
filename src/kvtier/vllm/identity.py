"""The model's identity in the key spec: its weights, its config, and options that change the math.

Built once at start-up in vLLM's scheduler process (:func:`model_identity`; may read the weight
files, see :mod:`kvtier.runtime.fingerprint`). What it covers, and why:

- ``weights``: a fingerprint of the weight files the engine loads: a local folder or file, or the
  Hugging Face cache snapshot of a repo id. ``load_format=dummy`` (random weights from a seed) is
  named by the format and the seed. An operator can name the weights instead
  (``model_identity`` in the connector config), e.g. for weights streamed from object storage.
  Weights that cannot be identified stop the engine at start-up with the fix: never a guess.
- ``config``: the model config as the engine loaded it (overrides applied), minus fields that
  differ between copies of one model (paths, library versions).
- ``dtype``, ``quantization``, ``overrides`` (``hf_overrides``): options that change the numbers.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import blake3
from vllm.config import VllmConfig

from kvtier.core.config import ConfigError, KVTierConfig
from kvtier.core.keys import ModelIdentity
from kvtier.runtime.fingerprint import FingerprintError, fingerprint_weights

logger = logging.getLogger(__name__)

_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation")
"""hf config fields that do not change KV bytes but differ between copies of one model."""


def config_digest(vllm_config: VllmConfig) -> str:
    """Digest of the model's config as loaded, minus volatile fields."""
    hf = vllm_config.model_config.hf_config.to_dict()
    for key in list(hf):
        if key.startswith(_VOLATILE_CONFIG_KEYS):
            del hf[key]
    payload = json.dumps(hf, sort_keys=True, default=str)
    return blake3.blake3(payload.encode()).hexdigest()[:32]


def weights_folder(vllm_config: VllmConfig) -> Path:
    """Where the engine's weights are: the model path itself, or the local Hugging Face snapshot
    of a repo id. Raises ConfigError when neither exists."""
    model_config = vllm_config.model_config
    model = str(model_config.model)
    if os.path.exists(model):
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=model_config.revision, local_files_only=True))
    except Exception as exc:
        raise ConfigError(
            f"kvtier cannot identify the weights of {model!r}: it is neither a local path nor in the "
            f"Hugging Face cache ({exc}). Set kv_connector_extra_config 'model_identity' to a string "
            "that changes whenever the weights change (e.g. the release tag), or serve from a local folder."
        ) from None


def weights_identity(vllm_config: VllmConfig, config: KVTierConfig) -> str:
    if config.model_identity is not None:
        return "operator:" + config.model_identity
    load_format = str(getattr(vllm_config.load_config, "load_format", "auto"))
    if load_format == "dummy":
        return f"dummy:seed={vllm_config.model_config.seed}"
    folder = weights_folder(vllm_config)
    try:
        fingerprint = fingerprint_weights(folder)
    except FingerprintError as exc:
        raise ConfigError(
            f"kvtier cannot fingerprint the weights of {vllm_config.model_config.model!r}: {exc}. "
            "Set kv_connector_extra_config 'model_identity' to a string that changes whenever the "
            "weights change."
        ) from None
    if fingerprint.seconds > 1:
        logger.info("kvtier: fingerprinted %d weight files (%.1f GB, %s) in %.1f s; cached for the next start",
                    fingerprint.files, fingerprint.bytes / 1e9, fingerprint.method, fingerprint.seconds)
    return fingerprint.digest


def model_identity(vllm_config: VllmConfig, config: KVTierConfig) -> ModelIdentity:
    model_config = vllm_config.model_config
    overrides = model_config.hf_overrides
    return ModelIdentity(
        weights=weights_identity(vllm_config, config),
        config=config_digest(vllm_config),
        dtype=str(model_config.dtype).removeprefix("torch."),
        quantization=str(model_config.quantization or ""),
        overrides=json.dumps(overrides, sort_keys=True, default=str) if isinstance(overrides, dict) and overrides
        else ("callable" if callable(overrides) else ""),
    )
