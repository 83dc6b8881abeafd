"""``kvtier doctor``'s look at a configured Redis / Valkey remote tier: can kvtier reach and log
into it, and will the server keep kvtier's blocks without evicting other data?

:func:`probe_remote` connects with the tier's own settings (URL, user, password from
``password_env``, short timeouts), runs ``PING``, ``INFO`` and one ``SCAN`` page, and writes
nothing. Called in the ``kvtier doctor`` process only; never logs a password.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvtier.core.tier_config import RedisTierConfig
from kvtier.core.values import ConfigError


class Reach(enum.Enum):
    OK = "ok"
    UNREACHABLE = "unreachable"
    REFUSED = "refused"  # wrong password, unknown user, or no permission


@dataclass
class RemoteProbe:
    """What :func:`probe_remote` found (``detail``: the error, when not reachable)."""

    reach: Reach
    detail: str = ""
    version: str = ""
    maxmemory: int = 0
    policy: str = ""
    used_memory: int = 0
    foreign_keys: list[str] = field(default_factory=list)  # a sample of keys outside key_prefix


PROBE_REPLY_BYTES = 1 << 20
"""The most one of the probe's calls asks for (PING, INFO, one SCAN page): its share of a deadline."""


def probe_remote(config: RedisTierConfig, timeout_s: float = 2.0) -> RemoteProbe:
    import redis

    from kvtier.tiers.redis.deadline import bounded_client

    try:
        password = config.password()
    except ConfigError as exc:
        return RemoteProbe(Reach.REFUSED, str(exc))
    kwargs: dict = {}
    if config.username:
        kwargs["username"] = config.username
    if password is not None:
        kwargs["password"] = password
    try:  # every call bounded: a hung or trickling server is UNREACHABLE, not a doctor that never ends
        client = bounded_client(config.url, connect_timeout_s=timeout_s, timeout_s=timeout_s,
                                reply_bytes=PROBE_REPLY_BYTES, **kwargs)
        client.ping()
        info = client.info()
        _, sample = client.scan(cursor=0, count=200)
    except (redis.AuthenticationError, redis.exceptions.NoPermissionError) as exc:
        return RemoteProbe(Reach.REFUSED, _clean(exc, password))
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        return RemoteProbe(Reach.UNREACHABLE, _clean(exc, password))
    except redis.RedisError as exc:  # e.g. INFO or SCAN refused by an ACL
        return RemoteProbe(Reach.REFUSED, _clean(exc, password))
    prefix = (config.key_prefix + ":").encode()
    foreign = [key.decode(errors="replace") for key in sample if not key.startswith(prefix)]
    return RemoteProbe(
        Reach.OK,
        version=str(info.get("redis_version", "")),
        maxmemory=int(info.get("maxmemory", 0) or 0),
        policy=str(info.get("maxmemory_policy", "")),
        used_memory=int(info.get("used_memory", 0) or 0),
        foreign_keys=foreign[:5],
    )


def _clean(exc: Exception, password: str | None) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text.replace(password, "***") if password else text
