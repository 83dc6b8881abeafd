"""Find a model's ``config.json`` without loading the model: for ``kvtier plan`` and ``doctor``.

A model is named by a Hugging Face folder, a ``config.json`` path, a Hugging Face repo id already
in the local hub cache (never downloaded), or ``default`` / ``SmolLM2-135M-Instruct`` for kvtier's
embedded default model, whose config is the constant :data:`SMOLLM2_CONFIG` (so planning never
triggers the model conversion of :func:`kvtier.models.default.ensure_default_model`).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.planning.geometry import ModelConfigError

class ModelNotFound(ModelConfigError):
    """No config.json where the model's name leads (as opposed to one that cannot be read)."""


DEFAULT_NAMES = ("default", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct", "smollm2")

SMOLLM2_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "rope_theta": 100000.0,
    "torch_dtype": "float32",
    "dtype": "float32",
}
"""The KV- and size-relevant values of the embedded default model's config.json (float32 conversion,
see :mod:`kvtier.models.default`; ``tests/fixtures/model_configs/smollm2-135m-instruct.json`` is the full file)."""


@dataclass(frozen=True)
class ModelSource:
    """A model's config and where it came from."""

    name: str
    config: dict[str, Any]
    folder: Path | None
    """The model folder (for files beside config.json: quantization configs, weight indexes), if any."""
    origin: str


def is_default_name(model: str) -> bool:
    return model.strip().lower() in DEFAULT_NAMES


def hf_cache_config(repo_id: str) -> Path | None:
    """``config.json`` of ``repo_id`` (``org/name``) in the local Hugging Face hub cache, newest
    snapshot first; None if absent. Never touches the network."""
    if repo_id.count("/") != 1 or repo_id.startswith(("/", ".", "~")):
        return None
    roots = [os.environ.get("HF_HUB_CACHE"), os.environ.get("HUGGINGFACE_HUB_CACHE")]
    if os.environ.get("HF_HOME"):
        roots.append(os.path.join(os.environ["HF_HOME"], "hub"))
    roots.append(os.path.join(Path.home(), ".cache", "huggingface", "hub"))
    folder = "models--" + repo_id.replace("/", "--")
    for root in filter(None, roots):
        found = sorted(Path(root, folder, "snapshots").glob("*/config.json"), key=_mtime, reverse=True)
        if found:
            return found[0]
    return None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


_ABSENT = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG})


def _kind(path: Path) -> str | None:
    """``dir``, ``file`` (anything else that exists) or None (absent); ModelConfigError when it
    cannot be told (a folder on the way that cannot be searched: permission denied)."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        if exc.errno in _ABSENT:
            return None
        raise ModelConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    return "dir" if stat.S_ISDIR(mode) else "file"


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path} is not a JSON object")
    return data


def load_model_config(model: str) -> ModelSource:
    """Resolve ``model`` (see the module docstring); raise ModelConfigError naming what was tried."""
    if is_default_name(model):
        from kvtier.models.default import DEFAULT_MODEL_NAME, default_cache_dir

        folder = default_cache_dir() / "models" / f"{DEFAULT_MODEL_NAME}-float32"
        try:
            found = folder.is_dir()
        except OSError:  # cannot be searched: the embedded config serves anyway
            found = False
        return ModelSource(DEFAULT_MODEL_NAME, dict(SMOLLM2_CONFIG), folder if found else None,
                           "embedded default model (kvtier.planning.model_source.SMOLLM2_CONFIG)")
    path = Path(model).expanduser()
    kind = _kind(path)
    if kind == "dir":
        config = path / "config.json"
        if _kind(config) is None:
            raise ModelNotFound(f"{path} has no config.json")
        return ModelSource(path.resolve().name, _read(config), path, str(config))
    if kind == "file":
        name = path.parent.resolve().name if path.name == "config.json" else path.stem
        return ModelSource(name, _read(path), path.parent, str(path))
    cached = hf_cache_config(model)
    if cached is not None:
        name = model.split("/")[-1]
        return ModelSource(name, _read(cached), cached.parent, f"Hugging Face cache: {cached}")
    raise ModelNotFound(
        f"model {model!r}: not a folder with config.json, not a config.json file, not in the local Hugging "
        "Face cache, and not 'default'. Download its config.json and pass that path."
    )


def find_model_config(model: str | None) -> tuple[ModelSource | None, str | None]:
    """Like :func:`load_model_config`, but ``(None, None)`` when there is no config to find and
    ``(None, why)`` when there is one that cannot be read (doctor's "cannot check")."""
    if not model:
        return None, None
    try:
        return load_model_config(model), None
    except ModelNotFound:
        return None, None
    except ModelConfigError as exc:
        return None, str(exc)
