"""The model's identity in the key spec: its weights, its config, and options that change the math.

Built once at start-up in vLLM's scheduler process (:func:`model_identity`; may read the weight
files, see :mod:`kvtier.runtime.model_identity`). What it covers, and why:

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

from vllm.config import VllmConfig

from kvtier.core.config import KVTierConfig
from kvtier.core.keys import ModelIdentity
from kvtier.runtime.model_identity import config_digest as stable_config_digest
from kvtier.runtime.model_identity import locate_weights, weights_digest

SETTING = "kv_connector_extra_config 'model_identity'"
"""Where an operator names the weights in the connector's configuration."""


def config_digest(vllm_config: VllmConfig) -> str:
    """Digest of the model's config as loaded, minus volatile fields."""
    return stable_config_digest(vllm_config.model_config.hf_config.to_dict())


def weights_identity(vllm_config: VllmConfig, config: KVTierConfig) -> str:
    if config.model_identity is not None:
        return "operator:" + config.model_identity
    load_format = str(getattr(vllm_config.load_config, "load_format", "auto"))
    if load_format == "dummy":
        return f"dummy:seed={vllm_config.model_config.seed}"
    model_config = vllm_config.model_config
    model = str(model_config.model)
    folder = locate_weights(model, setting=SETTING, revision=model_config.revision)
    return weights_digest(folder, model, setting=SETTING)


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
