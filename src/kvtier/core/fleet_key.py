"""The fleet key of a disk or Redis tier entry: where it comes from, loaded and checked at start-up.

Keys of a ``secondary_tiers`` entry (``fs`` / ``redis`` of kvtier's connector, ``kvtier_disk`` /
``kvtier_redis`` behind vLLM's offloading)::

    "auth_key_env": "NAME"            the key that signs (and, with encrypt, encrypts) every record
    "auth_key_file": "/path"          ... or the file holding it (exactly one of the two)
    "auth_read_key_envs": ["OLD"]     retired keys still ACCEPTED on read (rotation), never used to write
    "auth_read_key_files": ["/old"]
    "encrypt": true                   payloads encrypted at rest (AES-256-GCM); needs a key

A key is 32 random bytes written as 64 hexadecimal characters (``openssl rand -hex 32``);
surrounding blanks and one trailing newline are ignored. Anything else is a
:class:`~kvtier.core.values.ConfigError` naming the key and the fix. A key is never printed:
:class:`FleetKey`'s ``repr`` shows where it came from and its public :attr:`FleetKey.key_id`
(a one-way digest that names it in records, logs and ``kvtier verify``), never the secret.

Pure data and start-up I/O (reading an environment variable or a file) on the caller's thread;
the objects are immutable and may be shared by any thread. Cryptography on records lives in
:mod:`kvtier.tiers.sealing`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3

from kvtier.core.values import PREFIX, ConfigError, bool_value, key_name

KEY_BYTES = 32
KEY_ID_BYTES = 8
_KEY_ID_CONTEXT = "kvtier 2026-11-26 fleet key id v1"
_HEX_KEY = re.compile(r"^[0-9a-fA-F]{64}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

AUTH_KEYS = frozenset({"auth_key_env", "auth_key_file", "auth_read_key_envs", "auth_read_key_files", "encrypt"})
"""The keys this module reads from a tier entry (each tier's parser accepts them)."""

HOW_TO_MAKE = "a key is 64 hexadecimal characters (32 random bytes), e.g. from `openssl rand -hex 32`"


def key_id_of(secret: bytes) -> bytes:
    """The public name of a key: 8 bytes of BLAKE3 in key-derivation mode (one-way)."""
    return blake3.blake3(secret, derive_key_context=_KEY_ID_CONTEXT).digest(KEY_ID_BYTES)


@dataclass(frozen=True, repr=False)
class FleetKey:
    """One loaded key: ``secret`` (never shown), ``source`` (``env NAME`` or ``file PATH``)."""

    secret: bytes
    source: str

    @property
    def key_id(self) -> bytes:
        return key_id_of(self.secret)

    def __repr__(self) -> str:
        return f"FleetKey(id={self.key_id.hex()}, from {self.source})"


@dataclass(frozen=True, repr=False)
class AuthConfig:
    """A tier entry's fleet key settings: ``write`` signs every record written; records are
    accepted on read under ``write`` or any of ``read`` (retired keys); ``encrypt`` encrypts the
    payloads written (records of either kind are read)."""

    write: FleetKey
    read: tuple[FleetKey, ...] = ()
    encrypt: bool = False

    @property
    def accepted(self) -> tuple[FleetKey, ...]:
        """Every key a record may be under: the write key first, then the retired ones."""
        return (self.write, *self.read)

    def __repr__(self) -> str:
        return f"AuthConfig(write={self.write!r}, read={self.read!r}, encrypt={self.encrypt})"


def parse_auth(raw: Mapping[str, Any], where: str, *, flags: Mapping[str, str] | None = None) -> AuthConfig | None:
    """The fleet key settings of tier entry ``raw`` (at ``where``, e.g. ``secondary_tiers[0]``),
    keys loaded now; None when the entry names no key. Raises ConfigError naming the key, or the
    command-line flag ``flags`` gives for it (``kvtier node --fleet-key-env``: the same settings)."""

    def name(key: str) -> str:
        return flags[key] if flags is not None else key_name(key, where)

    env = _name(raw, "auth_key_env", name)
    path = _path(raw, "auth_key_file", name)
    read_envs = _names(raw, "auth_read_key_envs", name)
    read_files = _paths(raw, "auth_read_key_files", name)
    encrypt = bool_value(raw, "encrypt", default=False, where=where)
    if env is not None and path is not None:
        raise ConfigError(f"{PREFIX}: '{name('auth_key_env')}' and '{name('auth_key_file')}' "
                          "are both set; keep one (the key records are written under).")
    if env is None and path is None:
        for key, present in (("encrypt", encrypt), ("auth_read_key_envs", read_envs),
                             ("auth_read_key_files", read_files)):
            if present:
                raise ConfigError(
                    f"{PREFIX}: '{name(key)}' needs a fleet key: set "
                    f"'{name('auth_key_env')}' (an environment variable's NAME) or "
                    f"'{name('auth_key_file')}' (a file path); {HOW_TO_MAKE}.")
        return None
    write = (load_env(env, name("auth_key_env")) if env is not None else load_file(path, name("auth_key_file")))
    read = [load_env(n, f"{name('auth_read_key_envs')}[{i}]") for i, n in enumerate(read_envs)]
    read += [load_file(p, f"{name('auth_read_key_files')}[{i}]") for i, p in enumerate(read_files)]
    seen = {write.key_id}
    for key in read:
        if key.key_id in seen:
            raise ConfigError(f"{PREFIX}: '{where}': the key from {key.source} is listed twice (or is the write "
                              "key); list each retired key once.")
        seen.add(key.key_id)
    return AuthConfig(write=write, read=tuple(read), encrypt=encrypt)


def load_env(name: str, key: str) -> FleetKey:
    """The key held by environment variable ``name`` (config key ``key``, for messages)."""
    value = os.environ.get(name)
    if value is None:
        raise ConfigError(f"{PREFIX}: '{key}' names the environment variable {name!r}, which is not set in this "
                          "process. Export it where vLLM (or the kvtier command) runs.")
    return FleetKey(_secret(value, f"'{key}' ({name})"), f"env {name}")


def load_file(path: str, key: str) -> FleetKey:
    """The key held by file ``path`` (config key ``key``, for messages)."""
    try:
        with open(Path(path).expanduser(), encoding="ascii", errors="replace") as f:
            value = f.read(4096)
    except OSError as exc:
        raise ConfigError(f"{PREFIX}: '{key}' = {path!r} cannot be read: {exc.strerror or exc}.") from None
    return FleetKey(_secret(value, f"'{key}' ({path})"), f"file {path}")


def _secret(text: str, what: str) -> bytes:
    text = text.strip()
    if not _HEX_KEY.match(text):
        # Never echo the value: it may be a real secret in the wrong format.
        raise ConfigError(f"{PREFIX}: {what} does not hold a valid fleet key ({len(text)} characters); {HOW_TO_MAKE}.")
    secret = bytes.fromhex(text)
    if len(set(secret)) < 8:
        raise ConfigError(f"{PREFIX}: {what} holds a key with almost no distinct bytes; {HOW_TO_MAKE}.")
    return secret


def _name(raw: Mapping[str, Any], key: str, name: Callable[[str], str]) -> str | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not _ENV_NAME.match(value) or _HEX_KEY.match(value):
        # Never echo the value: it may be the key itself, pasted in the wrong place.
        raise ConfigError(f"{PREFIX}: '{name(key)}' must be the NAME of an environment variable holding "
                          "the key (not the key itself).")
    return value


def _path(raw: Mapping[str, Any], key: str, name: Callable[[str], str]) -> str | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{PREFIX}: '{name(key)}' must be a file path string.")
    return value.strip()


def _names(raw: Mapping[str, Any], key: str, name: Callable[[str], str]) -> Sequence[str]:
    return [_name({key: v if v is not None else ""}, key, name) or "" for v in _list(raw, key, name)]


def _paths(raw: Mapping[str, Any], key: str, name: Callable[[str], str]) -> Sequence[str]:
    return [_path({key: v if v is not None else ""}, key, name) or "" for v in _list(raw, key, name)]


def _list(raw: Mapping[str, Any], key: str, name: Callable[[str], str]) -> list[Any]:
    value = raw.get(key, [])
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{PREFIX}: '{name(key)}' must be a list (e.g. [\"OLD_KEY\"]).")
    return list(value)
