"""What names the bytes of an engine's chunks, besides their layout: the model and the hash seed.

vLLM's offloading keys are chained block hashes. They are equal across processes only when the
engines hash with the same function and the same seed: vLLM's default (sha256) uses a fixed seed,
``PYTHONHASHSEED`` overrides it, and a non-cryptographic function (xxhash) without it draws fresh
random bytes in every process (:class:`SeedKind`). A namespace therefore carries the hash function
and a digest of the engine's first-block parent hash (:class:`HashSeed`): never the seed, which
must stay secret for xxhash.

The model is identified as kvtier's own connector does it (:mod:`kvtier.runtime.model_identity`):
by its weight files, not its name, so a fine-tune with the same ``config.json`` never matches.
A native tier sees only the model name vLLM loaded (a folder, or a Hugging Face repo id read from
the local cache), not vLLM's whole configuration; ``model_identity`` names the weights instead
where they cannot be read (:func:`model_identity`).

Pure functions except :func:`model_identity`, which reads the weight files once at start-up.
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass
from pathlib import Path

import blake3

from kvtier.core.keys import ModelIdentity
from kvtier.runtime.model_identity import config_digest as stable_config_digest
from kvtier.runtime.model_identity import locate_weights, weights_digest

CRYPTOGRAPHIC_HASHES = frozenset({"sha256", "sha256_cbor"})
"""vLLM's prefix-caching hash functions whose default seed is fixed (the others' is random)."""
_SEED_DOMAIN = b"kvtier/vllm-hash-seed\0"


class SeedKind(enum.Enum):
    """Where the engine's hash seed comes from, and so who else computes the same keys."""

    FIXED = "fixed"  # vLLM's default seed of a cryptographic hash: every process, every restart
    ENVIRONMENT = "pythonhashseed"  # PYTHONHASHSEED: every process that sets the same value
    RANDOM = "random"  # drawn per process: no other process, no restart

    @classmethod
    def of(cls, algorithm: str, pythonhashseed: str | None) -> SeedKind:
        if pythonhashseed is not None:
            return cls.ENVIRONMENT
        return cls.FIXED if algorithm in CRYPTOGRAPHIC_HASHES else cls.RANDOM


@dataclass(frozen=True)
class HashSeed:
    """The engine's block-hash function and seed, as a namespace may record them.

    ``digest`` is a BLAKE3 digest of the hash of the seed (vLLM's ``NONE_HASH``, the parent of
    every first block): equal for engines whose keys are equal, and revealing nothing of the seed.
    """

    algorithm: str
    kind: SeedKind
    digest: str

    @classmethod
    def of(cls, algorithm: str, kind: SeedKind, first_parent: bytes) -> HashSeed:
        digest = blake3.blake3(_SEED_DOMAIN + bytes(first_parent)).hexdigest()[:32]
        return cls(algorithm=algorithm, kind=kind, digest=digest)

    @property
    def shared(self) -> bool:
        """Whether another process (or this engine after a restart) can compute the same keys."""
        return self.kind is not SeedKind.RANDOM

    def to_dict(self) -> dict[str, str]:
        return {"algorithm": self.algorithm, "seed": self.kind.value, "seed_digest": self.digest}


def private_seed_warning(tier: str, seed: HashSeed) -> str:
    """What a tier says at start-up when ``seed`` is drawn per process."""
    return (
        f"kvtier {tier}: vLLM hashes blocks with {seed.algorithm} and a random per-process seed "
        "(PYTHONHASHSEED is not set), so no other engine and no restart of this one can compute the "
        "same keys: this tier cannot outlive this process or be shared. It keeps working for this "
        "process in a namespace of its own, which it removes at shutdown. To keep and share blocks, "
        "set PYTHONHASHSEED to one value on every engine, or use --prefix-caching-hash-algo sha256 "
        "(vLLM's default)."
    )


SETTING = "\"model_identity\" in the tier's entry"
"""Where an operator names the weights of a native tier."""


def weights_folder(model: str) -> Path:
    """Where the weights of ``model`` (what vLLM loaded: a folder, a file, or a Hugging Face repo id
    resolved in the local cache) are. Raises ConfigError naming the fix when none is found."""
    return locate_weights(os.path.expanduser(model), setting=SETTING)


def config_digest(folder: Path) -> str:
    """Digest of the model's ``config.json`` (fields that differ between copies of one model left
    out); "" when the folder has none (a single-file checkpoint)."""
    config_file = (folder if folder.is_dir() else folder.parent) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return ""
    return stable_config_digest(config)


def model_identity(model: str, kv_dtype: str, operator_identity: str | None = None) -> ModelIdentity:
    """The identity of the model vLLM loaded as ``model``: its weights' fingerprint (or
    ``operator:<operator_identity>``), its config and the KV dtype. Reads the weight files (cached
    by size, mtime and inode: a restart reads them again only if they changed). Raises ConfigError
    with the fix when the weights cannot be identified."""
    if operator_identity is not None:
        folder = Path(model).expanduser()
        return ModelIdentity(weights="operator:" + operator_identity,
                             config=config_digest(folder) if folder.exists() else "", dtype=kv_dtype)
    folder = weights_folder(model)
    return ModelIdentity(weights=weights_digest(folder, model, setting=SETTING), config=config_digest(folder),
                         dtype=kv_dtype)


def pythonhashseed() -> str | None:
    """``PYTHONHASHSEED`` as vLLM reads it (set to anything, even "random": vLLM uses the text)."""
    return os.environ.get("PYTHONHASHSEED")
