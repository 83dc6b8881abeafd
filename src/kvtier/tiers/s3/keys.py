"""The S3 tier's object keys: where a namespace's blocks and its ``config.json`` live in the bucket.

Under the tier's prefix (``url`` = ``s3://BUCKET/PREFIX``), one folder per namespace, named as
the disk tier names its namespace directories (:func:`~kvtier.tiers.disk.layout.sanitize_model_name`)::

    PREFIX/<model>_<digest16>/config.json           the namespace's config.json (for operators)
    PREFIX/<model>_<digest16>/<block key hex>.bin   one block: every rank's record back to back

``<digest16>``: the first 16 hex digits of the namespace digest; ``<block key hex>``: the 64 hex
digits of the block key. The object's bytes are a block's value (:mod:`kvtier.tiers.value`), the
same bytes as the Redis tier's value of that block: each rank's 136-byte header (its namespace
digest, the key, checksums or the fleet key's MAC) then its payload. The folder name is for people
and for listing one namespace (one ``LIST`` of its folder); the reader trusts only the headers.

The key after the namespace folder begins with the block key's hex, which is uniformly random, so
S3 spreads a namespace's requests over its partitions by itself: no hash-sharded folders are needed.

Threading: pure functions and immutable objects.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvtier.core.keys import BlockKey
from kvtier.tiers.disk.layout import sanitize_model_name

CONFIG_NAME = "config.json"
BLOCK_SUFFIX = ".bin"
_BLOCK_NAME = re.compile(r"^([0-9a-f]{64})\.bin$")
_NAMESPACE_DIR = re.compile(r"^[A-Za-z0-9._-]+_([0-9a-f]{16})$")


@dataclass(frozen=True, slots=True)
class ObjectKeys:
    """The object keys of one namespace: ``{prefix}/{model}_{digest16}/...``."""

    prefix: str  # the tier's key prefix, without leading or trailing "/"
    folder: str  # "<model>_<digest16>"

    @classmethod
    def of(cls, prefix: str, model_name: str, engine_digest: bytes) -> ObjectKeys:
        if len(engine_digest) < 8:
            raise ValueError(f"engine_digest must be at least 8 bytes, got {len(engine_digest)}")
        return cls(prefix.strip("/"), f"{sanitize_model_name(model_name)}_{bytes(engine_digest).hex()[:16]}")

    @property
    def base(self) -> str:
        """Every object of this namespace begins with this (a LIST prefix)."""
        return f"{self.prefix}/{self.folder}/"

    def block(self, key: BlockKey) -> str:
        """The object key of block ``key``."""
        return f"{self.prefix}/{self.folder}/{key.hex()}{BLOCK_SUFFIX}"

    @property
    def config(self) -> str:
        """The object holding the namespace's config.json (never a block)."""
        return f"{self.prefix}/{self.folder}/{CONFIG_NAME}"

    def block_key_of(self, path: str) -> BlockKey | None:
        """The block key object ``path`` holds, or None (the config, or not one of this namespace's)."""
        base = self.base
        if not path.startswith(base):
            return None
        match = _BLOCK_NAME.match(path[len(base):])
        return bytes.fromhex(match.group(1)) if match else None


@dataclass(frozen=True, slots=True)
class BlockPath:
    """An object key of the shape of a block of some namespace under a prefix (:func:`parse_block`)."""

    folder: str  # "<model>_<digest16>"
    digest16: str
    key: BlockKey


def parse_block(path: str, prefix: str) -> BlockPath | None:
    """What ``path`` is, if it has the shape of a block object under ``prefix``
    (``{prefix}/{model}_{digest16}/{64 hex}.bin``), else None (a config.json, or not kvtier's)."""
    head = prefix.strip("/") + "/"
    if not path.startswith(head):
        return None
    folder, _, name = path[len(head):].partition("/")
    folder_match = _NAMESPACE_DIR.match(folder)
    name_match = _BLOCK_NAME.match(name)
    if folder_match is None or name_match is None:
        return None
    return BlockPath(folder, folder_match.group(1), bytes.fromhex(name_match.group(1)))


def namespace_folder(path: str, prefix: str) -> str | None:
    """The ``<model>_<digest16>`` folder ``path`` (a ``config.json``) names under ``prefix``, or None."""
    head = prefix.strip("/") + "/"
    if not path.startswith(head) or not path.endswith("/" + CONFIG_NAME):
        return None
    folder = path[len(head):-len(CONFIG_NAME) - 1]
    return folder if _NAMESPACE_DIR.match(folder) else None


def folder_of(path: str, prefix: str) -> str | None:
    """The ``<model>_<digest16>`` folder under ``prefix`` that ``path`` (any object key) lies in, or
    None (outside every namespace folder)."""
    head = prefix.strip("/") + "/"
    folder, sep, _ = path[len(head):].partition("/") if path.startswith(head) else ("", "", "")
    return folder if sep and _NAMESPACE_DIR.match(folder) else None

