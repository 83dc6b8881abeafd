"""Reading one value of ``kv_connector_extra_config``: type and range checks whose errors name the
key (with its path, e.g. ``secondary_tiers[1].ttl_seconds``) and the fix.

Used at start-up by :mod:`kvtier.core.config` and :mod:`kvtier.core.tier_config`, in every vLLM
process that builds the connector; pure functions, no state.
"""

from __future__ import annotations

import enum
import math
import pwd
from collections.abc import Mapping
from typing import Any


class ConfigError(ValueError):
    """A start-up configuration error. The message names the key and how to fix it."""


PREFIX = "kv_connector_extra_config"
_NO_DEFAULT: Any = object()


def key_name(key: str, where: str = "") -> str:
    return f"{where}.{key}" if where else key


def named_as_given(message: str, where: str, names: Mapping[str, str], entry: str) -> str:
    """A ConfigError's ``message`` about the entry parsed at ``where``, with its keys (quoted as
    ``'WHERE.KEY'``) named as the user gave them, ``names[KEY]`` (a command-line flag, an argument),
    the entry itself (``'WHERE'``) as ``entry``, and without the ``kv_connector_extra_config``
    prefix: for a command whose options were turned into a tier entry. Only whole quoted names
    are replaced; values quoted in the message are left as they are."""
    for key, name in names.items():
        message = message.replace(f"'{where}.{key}'", name)
    return message.replace(f"'{where}'", entry).removeprefix(f"{PREFIX}: ")


def int_value(raw: Mapping[str, Any], key: str, minimum: int, default: Any = _NO_DEFAULT, where: str = "") -> Any:
    """An integer >= ``minimum`` (a float that is a whole number is accepted); ``default`` if absent."""
    name = key_name(key, where)
    if key not in raw or raw[key] is None:
        if default is _NO_DEFAULT:
            raise ConfigError(f"{PREFIX}: '{name}' is required.")
        return default
    value = raw[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{PREFIX}: '{name}' must be an integer, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ConfigError(f"{PREFIX}: '{name}' must be >= {minimum}, got {value}.")
    return value


def float_value(raw: Mapping[str, Any], key: str, default: float, *, where: str = "", positive: bool = True) -> float:
    """A finite number (> 0 when ``positive``); ``default`` if absent."""
    name = key_name(key, where)
    if key not in raw or raw[key] is None:
        return default
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{PREFIX}: '{name}' must be a number, got {value!r}.")
    if positive and value <= 0:
        raise ConfigError(f"{PREFIX}: '{name}' must be > 0, got {value}.")
    return float(value)


def text_value(raw: Mapping[str, Any], key: str, where: str = "", required: bool = False) -> str | None:
    """A non-empty string (surrounding blanks removed); None if absent and not ``required``."""
    name = key_name(key, where)
    value = raw.get(key)
    if value is None:
        if required:
            raise ConfigError(f"{PREFIX}: '{name}' is required.")
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{PREFIX}: '{name}' must be a non-empty string, got {value!r}.")
    return value.strip()


def uid_value(raw: Mapping[str, Any], key: str, where: str = "") -> int | None:
    """A user: a uid (an integer >= 0) or a user name of this node, as its uid; None if absent."""
    name = key_name(key, where)
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, str) and value.strip():
        try:
            return pwd.getpwnam(value.strip()).pw_uid
        except KeyError:
            raise ConfigError(f"{PREFIX}: '{name}' = {value!r}: no such user on this node.") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{PREFIX}: '{name}' must be a uid (an integer >= 0) or a user name, got {value!r}.")
    return value


def bool_value(raw: Mapping[str, Any], key: str, default: bool, where: str = "") -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{PREFIX}: '{key_name(key, where)}' must be true or false, got {value!r}.")
    return value


def enum_value(raw: Mapping[str, Any], key: str, enum_type: type[enum.Enum], default: enum.Enum, where: str = "") -> Any:
    if key not in raw:
        return default
    try:
        return enum_type(raw[key])
    except ValueError:
        allowed = [member.value for member in enum_type]
        raise ConfigError(f"{PREFIX}: '{key_name(key, where)}' is {raw[key]!r}; allowed values: {allowed}.") from None


def check_keys(raw: Any, known: frozenset[str], where: str, example: str) -> Mapping[str, Any]:
    """``raw`` as a mapping with no unknown key."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{PREFIX}: '{where}' must be an object like {example}")
    unknown = sorted(set(raw) - known)
    if unknown:
        label = f" in '{where}'" if where else ""
        raise ConfigError(f"{PREFIX}: unknown key(s) {unknown}{label}. Known keys: {sorted(known)}.")
    return raw
