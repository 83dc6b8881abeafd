"""The ``secondary_tiers`` entries: ``type: fs`` (disk), ``type: redis`` (Redis / Valkey) and
``type: s3`` (an S3-compatible object store); and ``kvtier_node`` (the pool of a ``kvtier node``
service), behind vLLM's own offloading only.

Validated at start-up (:func:`parse_secondary_tiers`), in every vLLM process that builds the
connector: unknown keys, wrong types and impossible values raise
:class:`~kvtier.core.values.ConfigError` naming the key. A disk tier's directory is created
here if missing (with its missing parents, owner-only: :func:`kvtier.core.dirs.make_dirs`), unless
the caller only checks (``create_dirs=False``: ``kvtier serve`` before vLLM starts, ``kvtier
doctor``), when a missing one must only be creatable and nothing is made; a Redis server is not contacted here (the tier connects when it starts, in the scheduler
process). Fleet keys (``auth_key_env`` / ``auth_key_file``, retired ``auth_read_key_*``, ``encrypt``)
are loaded and checked here too (:mod:`kvtier.core.fleet_key`); a key is never printed. Secrets: a Redis password may come from the URL or from an environment variable named
by ``password_env``; it is never printed (:meth:`RedisTierConfig.redacted_url`, the config's
``repr``). S3 credentials are never in the configuration at all: the S3 tier reads them where every
AWS tool does (environment, shared credentials file and profile, container or instance role;
:mod:`kvtier.tiers.s3.client`); an entry that holds one is refused.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvtier.core.dirs import GROUP_DIR_MODE, OWNER_DIR_MODE, dir_problem, existing_ancestor, ready_dir
from kvtier.core.fleet_key import AUTH_KEYS, AuthConfig, parse_auth
from kvtier.core.values import (
    PREFIX,
    ConfigError,
    bool_value,
    check_keys,
    float_value,
    int_value,
    text_value,
    uid_value,
)

logger = logging.getLogger(__name__)


class TierType(str, enum.Enum):
    FS = "fs"
    REDIS = "redis"
    S3 = "s3"
    NODE = "node"  # only behind vLLM's own offloading (``kvtier_node``); kvtier's connector uses ``"node"``


NATIVE_TIER_KEYS = ("type", "module_path", "backpressure", "locality", "model_identity", "keep_on_reset")
"""Keys of a kvtier tier's entry behind vLLM's offloading besides those of kvtier's own tier of its
kind: vLLM's (its type, module, back-pressure) and the native adapter's (``kvtier.vllm.native.tiers``)."""

DEFAULT_DISK_FRACTION = 0.5
"""Without ``capacity_bytes``, a disk tier may use this fraction of the free space at start-up."""


@dataclass(frozen=True)
class DiskTierConfig:
    """``secondary_tiers`` entry of ``type: fs``."""

    root_dir: Path
    capacity_bytes: int
    n_read_threads: int = 16
    n_write_threads: int = 16
    max_pending_writes: int = 256
    group_access: bool = False  # directories 2770 / files 0660 instead of 0700 / 0600
    auth: AuthConfig | None = None  # fleet key: records signed (and encrypted) with it; None: unauthenticated


REDIS_SCHEMES = ("redis", "rediss", "unix")
_KEY_PREFIX = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


@dataclass(frozen=True, repr=False)
class RedisTierConfig:
    """``secondary_tiers`` entry of ``type: redis``: a Redis / Valkey server or cluster shared by
    engines. ``url`` may hold credentials; ``repr`` and :meth:`redacted_url` never show them."""

    url: str
    username: str | None = None
    password_env: str | None = None
    key_prefix: str = "kvtier"
    ttl_seconds: int | None = None
    cluster: bool = False
    nodes: tuple[str, ...] = ()
    max_connections: int = 8
    connect_timeout_s: float = 1.0
    timeout_s: float = 2.0
    max_pending_writes: int = 64
    reconnect_max_s: float = 30.0  # longest wait between tries of a server that stopped answering
    auth: AuthConfig | None = None  # fleet key: records signed (and encrypted) with it; None: unauthenticated

    def redacted_url(self) -> str:
        """``url`` with any password replaced by ``***``."""
        return redact_url(self.url)

    def password(self) -> str | None:
        """The password from ``password_env`` (read now), else None (the URL's, if any, applies)."""
        if self.password_env is None:
            return None
        value = os.environ.get(self.password_env)
        if value is None:
            raise ConfigError(
                f"{PREFIX}: Redis 'password_env' names the environment variable {self.password_env!r}, "
                "which is not set in this process. Export it where vLLM runs."
            )
        return value

    def __repr__(self) -> str:
        return (f"RedisTierConfig(url={self.redacted_url()!r}, username={self.username!r}, "
                f"password_env={self.password_env!r}, key_prefix={self.key_prefix!r}, "
                f"ttl_seconds={self.ttl_seconds!r}, cluster={self.cluster!r}, nodes={self.nodes!r}, auth={self.auth!r})")


S3_URL_SCHEMES = ("s3", "s3a")
DEFAULT_S3_PREFIX = "kvtier"
"""The key prefix of an ``s3://BUCKET`` URL that names none (never the bucket's root)."""
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_S3_PREFIX = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$")
CREDENTIAL_KEYS = frozenset({"access_key_id", "secret_access_key", "session_token", "aws_access_key_id",
                             "aws_secret_access_key", "aws_session_token", "password", "token"})
"""Keys an S3 entry refuses with a message of their own: credentials never go in the configuration."""


@dataclass(frozen=True)
class S3TierConfig:
    """``secondary_tiers`` entry of ``type: s3``: one bucket prefix of an S3-compatible object store
    shared by engines (AWS S3, GCS's S3 API, MinIO, Ceph RGW, SeaweedFS). Holds no credential (see
    :mod:`kvtier.tiers.s3.client`). ``capacity_bytes`` None: no bound of kvtier's (a bucket lifecycle
    rule expires objects instead, docs/object-store.md)."""

    url: str  # s3://BUCKET/PREFIX, as given
    bucket: str
    prefix: str  # without leading or trailing "/"
    endpoint: str | None = None  # None: AWS S3 itself
    region: str | None = None  # None: AWS_REGION / AWS_DEFAULT_REGION / the profile's, else us-east-1
    path_style: bool = False  # https://ENDPOINT/BUCKET/KEY instead of https://BUCKET.ENDPOINT/KEY
    ca_bundle: Path | None = None  # PEM file of CA certificates trusted besides the system's
    profile: str | None = None  # the shared-files profile (default: AWS_PROFILE, else "default")
    capacity_bytes: int | None = None
    max_concurrency: int = 16
    max_pending_writes: int = 64
    connect_timeout_s: float = 2.0
    timeout_s: float = 10.0
    reconnect_max_s: float = 30.0
    list_interval_s: float = 60.0
    auth: AuthConfig | None = None  # fleet key: records signed (and encrypted) with it; None: unauthenticated

    @property
    def location(self) -> str:
        """``s3://BUCKET/PREFIX`` (at ENDPOINT): where the tier's objects are, for messages."""
        where = f"s3://{self.bucket}/{self.prefix}"
        return f"{where} at {self.endpoint}" if self.endpoint else where


SecondaryTierConfig = DiskTierConfig | RedisTierConfig | S3TierConfig

UNIX_PATH_MAX = 107
"""The longest path a Unix socket can bind or connect to (``sun_path`` less its NUL), in bytes."""


@dataclass(frozen=True)
class NodeTierConfig:
    """A ``kvtier_node`` entry (vLLM's own offloading): the pool of the ``kvtier node`` service at
    ``socket``. ``cap_bytes``: the most of the pool this engine may hold (None: no cap of its own);
    ``timeout_s``: the longest one round trip may take; ``retry_interval_s``: how often a service
    that is gone is tried again; ``max_pending_writes``: chunks copied into the pool at once;
    ``node_uid``: the user the service may run as besides root and the engine's own."""

    socket: Path
    cap_bytes: int | None = None
    timeout_s: float = 2.0
    retry_interval_s: float = 1.0
    max_pending_writes: int = 256
    node_uid: int | None = None


_QUERY_PASSWORD = re.compile(r"([?&;#]password=)[^&;#]*", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` as it may be shown in a message or a log: whatever lies between its ``//`` and its last
    ``@`` (user and password) replaced by ``***``, whatever it holds (a password with an unescaped
    ``/``, ``?``, ``#`` or ``@`` ends the URL's authority early for a parser, so none is used), and
    the value of a ``password=`` query parameter (redis-py reads one) too. Never raises."""
    scheme, sep, rest = url.partition("//")
    if not sep:
        scheme, rest = "", url
    _, at, host = rest.rpartition("@")
    if at:
        rest = "***@" + host
    return scheme + sep + _QUERY_PASSWORD.sub(r"\1***", rest)


def _split(url: str):
    """``urlsplit(url)`` with its port checked, or None where either raises (never quoted: a parser's
    message may hold part of a password)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018
    except ValueError:
        return None
    return parts


def _url_error(url: str, key: str) -> str | None:
    """Why the Redis ``url`` (at ``key``) cannot be parsed unambiguously, or None: an ``@`` after the
    end a parser sees to its authority (an unescaped ``/ ? #`` in a password: the host would be taken
    from the password, and a connection error would quote it), a host or port that does not parse.
    The message names the URL redacted and never quotes the parser (whose errors may hold a password)."""
    shown = f"{PREFIX}: '{key}' {redact_url(url)!r}"
    rest = url.partition("//")[2]
    end = re.search(r"[/?#]", rest)  # where a parser ends the authority
    if end is not None and end.start() > 0 and "@" in rest[end.start():]:
        return (f"{shown} has an '@' after its host: a user or password holding '/', '?', '#' or '@' must be "
                "percent-encoded (%2F, %3F, %23, %40), or the password given through password_env.")
    if _split(url) is None:
        return (f"{shown} is not a valid URL: its host or port does not parse (a port is a number up to 65535; a "
                "password holding '/', '?', '#' or '@' must be percent-encoded).")
    return None


_NODE_KEYS = frozenset({"type", "socket", "cap_bytes", "timeout_s", "retry_interval_s", "max_pending_writes",
                        "node_uid"})
_FS_KEYS = frozenset({
    "type", "root_dir", "capacity_bytes", "n_read_threads", "n_write_threads", "max_pending_writes", "group_access",
}) | AUTH_KEYS
_REDIS_KEYS = frozenset({
    "type", "url", "username", "password_env", "key_prefix", "ttl_seconds", "cluster", "nodes",
    "max_connections", "connect_timeout_s", "timeout_s", "max_pending_writes", "reconnect_max_s",
}) | AUTH_KEYS
_S3_KEYS = frozenset({
    "type", "url", "endpoint", "region", "path_style", "ca_bundle", "profile", "capacity_bytes", "max_concurrency",
    "max_pending_writes", "connect_timeout_s", "timeout_s", "reconnect_max_s", "list_interval_s",
}) | AUTH_KEYS
_ORDER = {DiskTierConfig: 0, RedisTierConfig: 1, S3TierConfig: 2}
"""Cascade order of the tier types: the local disk, then the fleet's Redis, then the object store."""


def parse_secondary_tiers(raw: Any, *, create_dirs: bool = True) -> tuple[SecondaryTierConfig, ...]:
    """The validated ``secondary_tiers`` list: at most one tier of each type, in the order disk,
    Redis, S3 (fastest first: blocks are looked up and promoted in that order). ``create_dirs``:
    a missing disk root is created (True) or only checked to be creatable (False, nothing made)."""
    if not isinstance(raw, list | tuple):
        raise ConfigError(
            f"{PREFIX}: 'secondary_tiers' must be a list of tier objects, e.g. "
            '[{"type": "fs", "root_dir": "/var/cache/kvtier"}, {"type": "redis", "url": "redis://host:6379"}]'
        )
    tiers: list[SecondaryTierConfig] = []
    for index, entry in enumerate(raw):
        where = f"secondary_tiers[{index}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{PREFIX}: '{where}' must be an object like " '{"type": "fs", ...}')
        tier_type = entry.get("type")
        if tier_type == TierType.FS.value:
            tiers.append(_disk_tier(entry, where, create_dirs=create_dirs))
        elif tier_type == TierType.REDIS.value:
            tiers.append(_redis_tier(entry, where))
        elif tier_type == TierType.S3.value:
            tiers.append(_s3_tier(entry, where))
        else:
            raise ConfigError(
                f"{PREFIX}: '{where}.type' is {tier_type!r}; kvtier supports 'fs' (local or shared "
                "filesystem), 'redis' (Redis or Valkey) and 's3' (an S3-compatible object store). Set \"type\" "
                "to one of them."
            )
    kinds = [type(t) for t in tiers]
    if any(kinds.count(kind) > 1 for kind in _ORDER):
        raise ConfigError(f"{PREFIX}: 'secondary_tiers' holds more than one tier of a type; kvtier supports one "
                          "disk tier, one Redis tier and one S3 tier. Keep one of each.")
    ranks = [_ORDER[kind] for kind in kinds]
    if ranks != sorted(ranks):
        raise ConfigError(f"{PREFIX}: 'secondary_tiers' lists its tiers as {[t.value for t in _types(kinds)]}; put "
                          "them in the order fs, redis, s3 (the local disk is looked up before the shared remote, "
                          "Redis before the object store).")
    return tuple(tiers)


def _types(kinds: list[type]) -> list[TierType]:
    return [_TYPES[kind] for kind in kinds]


_TYPES = {DiskTierConfig: TierType.FS, RedisTierConfig: TierType.REDIS, S3TierConfig: TierType.S3}


def tier_type(config: SecondaryTierConfig) -> TierType:
    """The ``type`` of a ``secondary_tiers`` entry, from its parsed config."""
    return _TYPES[type(config)]


def parse_tier(raw: Mapping[str, Any], tier_type: TierType, where: str) -> SecondaryTierConfig | NodeTierConfig:
    """One tier entry of ``tier_type`` given without its ``type`` key (vLLM's secondary-tier
    factory passes the other keys to a tier's constructor): the same keys and checks as a
    ``secondary_tiers`` entry of kvtier's connector (``node``: see :func:`_node_tier`)."""
    entry = {**raw, "type": tier_type.value}
    if tier_type is TierType.NODE:
        return _node_tier(entry, where)
    if tier_type is TierType.S3:
        return _s3_tier(entry, where)
    return _disk_tier(entry, where) if tier_type is TierType.FS else _redis_tier(entry, where)


def _node_tier(raw: Mapping[str, Any], where: str) -> NodeTierConfig:
    """A ``kvtier_node`` entry. The service is not contacted here: one that is not running yet only
    costs misses until it answers (the tier attaches by itself)."""
    check_keys(raw, _NODE_KEYS, where, '{"type": "kvtier_node", "socket": "/run/kvtier/node.sock"}')
    path = text_value(raw, "socket", where=where)
    if not path:
        raise ConfigError(f"{PREFIX}: '{where}.socket' is required: the path of the kvtier node service's socket "
                          "(the --socket of `kvtier node`), e.g. /run/kvtier/node.sock.")
    sock = Path(path).expanduser()
    if len(os.fsencode(str(sock))) > UNIX_PATH_MAX:
        raise ConfigError(f"{PREFIX}: '{where}.socket' {str(sock)!r} is {len(os.fsencode(str(sock)))} bytes long; a "
                          f"Unix socket path may have at most {UNIX_PATH_MAX}. Start the service on a shorter path.")
    return NodeTierConfig(
        socket=sock,
        cap_bytes=int_value(raw, "cap_bytes", minimum=1, default=None, where=where),
        timeout_s=float_value(raw, "timeout_s", 2.0, where=where),
        retry_interval_s=float_value(raw, "retry_interval_s", 1.0, where=where),
        max_pending_writes=int_value(raw, "max_pending_writes", minimum=1, default=256, where=where),
        node_uid=uid_value(raw, "node_uid", where=where),
    )


def _disk_tier(raw: Mapping[str, Any], where: str, *, create_dirs: bool = True) -> DiskTierConfig:
    check_keys(raw, _FS_KEYS, where, '{"type": "fs", "root_dir": "/var/cache/kvtier"}')
    root = text_value(raw, "root_dir", where=where)
    if root is None:
        raise ConfigError(f"{PREFIX}: '{where}.root_dir' is required: a directory path string.")
    root_dir = Path(root).expanduser()
    group_access = bool_value(raw, "group_access", default=False, where=where)
    _check_writable_dir(root_dir, f"{where}.root_dir", GROUP_DIR_MODE if group_access else OWNER_DIR_MODE,
                        create=create_dirs)
    if "capacity_bytes" in raw:
        capacity = int_value(raw, "capacity_bytes", minimum=1, where=where)
    else:  # the free space where the root is, or (not created yet) where it will be
        capacity = int(shutil.disk_usage(existing_ancestor(root_dir)).free * DEFAULT_DISK_FRACTION)
        logger.info("kvtier: %s.capacity_bytes not set; using %.1f GiB (%.0f%% of the free space of %s)",
                    where, capacity / 2**30, DEFAULT_DISK_FRACTION * 100, root_dir)
    return DiskTierConfig(
        root_dir=root_dir,
        capacity_bytes=capacity,
        n_read_threads=int_value(raw, "n_read_threads", minimum=1, default=16, where=where),
        n_write_threads=int_value(raw, "n_write_threads", minimum=1, default=16, where=where),
        max_pending_writes=int_value(raw, "max_pending_writes", minimum=1, default=256, where=where),
        group_access=group_access,
        auth=parse_auth(raw, where),
    )


def _check_writable_dir(path: Path, key: str, mode: int, *, create: bool) -> None:
    """Raise ConfigError naming ``key`` unless ``path`` is a directory this user can write, or is
    missing and can be created (:func:`kvtier.core.dirs.dir_problem`). With ``create``, a missing
    one is then created with its missing parents, each with exactly ``mode``; without, nothing is."""
    problem = ready_dir(path, mode) if create else dir_problem(path)
    if problem is not None:
        raise ConfigError(f"{PREFIX}: '{key}' = {str(path)!r} {problem}. Point it at a directory this user can "
                          "write, or one it can create.")


def _redis_tier(raw: Mapping[str, Any], where: str) -> RedisTierConfig:
    check_keys(raw, _REDIS_KEYS, where, '{"type": "redis", "url": "redis://host:6379/0"}')
    url = text_value(raw, "url", where=where)
    if url is None:
        raise ConfigError(f"{PREFIX}: '{where}.url' is required, e.g. redis://host:6379/0, rediss://host:6380 "
                          "(TLS) or unix:///run/redis.sock.")
    problem = _url_error(url, f"{where}.url")
    if problem is not None:
        raise ConfigError(problem)
    parts = urlsplit(url)
    if url.partition("://")[0] not in REDIS_SCHEMES:
        raise ConfigError(f"{PREFIX}: '{where}.url' {redact_url(url)!r} must start with redis://, rediss:// (TLS) "
                          "or unix:// (a socket path).")
    if parts.scheme == "unix" and not parts.path:
        raise ConfigError(f"{PREFIX}: '{where}.url' {redact_url(url)!r} names no socket path (unix:///path/redis.sock).")
    if parts.scheme != "unix" and not parts.hostname:
        raise ConfigError(f"{PREFIX}: '{where}.url' {redact_url(url)!r} names no host (redis://host:6379/0).")
    prefix = text_value(raw, "key_prefix", where=where) or "kvtier"
    if not _KEY_PREFIX.match(prefix):
        raise ConfigError(f"{PREFIX}: '{where}.key_prefix' {prefix!r} must be 1-64 characters of [A-Za-z0-9._:-].")
    nodes = raw.get("nodes", [])
    if not isinstance(nodes, Sequence) or isinstance(nodes, str) or not all(
            isinstance(n, str) and re.match(r"^[^\s:]+:\d+$", n) for n in nodes):
        raise ConfigError(f"{PREFIX}: '{where}.nodes' must be a list of \"host:port\" strings (Redis Cluster nodes).")
    cluster = bool_value(raw, "cluster", default=bool(nodes), where=where)
    if nodes and not cluster:
        raise ConfigError(f"{PREFIX}: '{where}.nodes' lists cluster nodes but 'cluster' is false; drop one of them.")
    if cluster and parts.scheme == "unix":
        raise ConfigError(f"{PREFIX}: '{where}': Redis Cluster needs TCP nodes, not a unix socket URL.")
    password_env = text_value(raw, "password_env", where=where)
    if password_env is not None and not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", password_env):
        raise ConfigError(f"{PREFIX}: '{where}.password_env' must be the NAME of an environment variable "
                          "holding the password (not the password itself).")
    return RedisTierConfig(
        url=url,
        username=text_value(raw, "username", where=where),
        password_env=password_env,
        key_prefix=prefix,
        ttl_seconds=int_value(raw, "ttl_seconds", minimum=1, default=None, where=where),
        cluster=cluster,
        nodes=tuple(nodes),
        max_connections=int_value(raw, "max_connections", minimum=1, default=8, where=where),
        connect_timeout_s=float_value(raw, "connect_timeout_s", 1.0, where=where),
        timeout_s=float_value(raw, "timeout_s", 2.0, where=where),
        max_pending_writes=int_value(raw, "max_pending_writes", minimum=1, default=64, where=where),
        reconnect_max_s=float_value(raw, "reconnect_max_s", 30.0, where=where),
        auth=parse_auth(raw, where),
    )


def _s3_tier(raw: Mapping[str, Any], where: str) -> S3TierConfig:
    """A ``type: s3`` entry. Nothing is contacted here (the tier checks the credentials when it opens:
    :func:`kvtier.tiers.factory.check_tier`)."""
    credentials = sorted(CREDENTIAL_KEYS & set(raw) if isinstance(raw, Mapping) else ())
    if credentials:
        raise ConfigError(f"{PREFIX}: '{where}.{credentials[0]}': S3 credentials never go in the configuration. "
                          "kvtier reads them where every AWS tool does: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
                          "(/ AWS_SESSION_TOKEN) in the environment, the shared credentials file and profile "
                          "(~/.aws/credentials, AWS_PROFILE or 'profile'), or the container's or instance's role. "
                          "Remove the key.")
    check_keys(raw, _S3_KEYS, where, '{"type": "s3", "url": "s3://bucket/kvcache"}')
    url = text_value(raw, "url", where=where)
    if url is None:
        raise ConfigError(f"{PREFIX}: '{where}.url' is required: s3://BUCKET/PREFIX, the bucket and the key "
                          "prefix under which kvtier keeps its objects.")
    parts = _split(url)
    if (parts is None or parts.scheme not in S3_URL_SCHEMES or not parts.netloc or parts.query or parts.fragment
            or "@" in url):
        raise ConfigError(f"{PREFIX}: '{where}.url' {redact_url(url)!r} must be s3://BUCKET/PREFIX (the endpoint, if "
                          "not AWS itself, goes in 'endpoint'; credentials never go in the URL).")
    bucket = parts.netloc
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise ConfigError(f"{PREFIX}: '{where}.url' names the bucket {bucket!r}: a bucket name is 3-63 characters "
                          "of lowercase letters, digits, '.' and '-'.")
    prefix = parts.path.strip("/") or DEFAULT_S3_PREFIX
    if not _S3_PREFIX.match(prefix) or any(part in (".", "..") for part in prefix.split("/")):
        raise ConfigError(f"{PREFIX}: '{where}.url' has the key prefix {prefix!r}: use '/'-separated names of "
                          "[A-Za-z0-9._-] (e.g. s3://bucket/kvcache/prod).")
    endpoint = text_value(raw, "endpoint", where=where)
    if endpoint is not None:
        ends = _split(endpoint)
        if (ends is None or ends.scheme not in ("http", "https") or not ends.hostname or ends.query or ends.fragment
                or "@" in endpoint):
            raise ConfigError(f"{PREFIX}: '{where}.endpoint' {redact_url(endpoint)!r} must be http(s)://HOST[:PORT], "
                              "the S3 API of the store (e.g. https://minio.internal:9000), without credentials.")
        endpoint = endpoint.rstrip("/")
    ca_bundle = text_value(raw, "ca_bundle", where=where)
    if ca_bundle is not None:
        bundle = Path(ca_bundle).expanduser()
        if not bundle.is_file() or not os.access(bundle, os.R_OK):
            raise ConfigError(f"{PREFIX}: '{where}.ca_bundle' {str(bundle)!r} is not a readable file: give the PEM "
                              "file of the CA certificates that sign the endpoint's certificate.")
    return S3TierConfig(
        url=url,
        bucket=bucket,
        prefix=prefix,
        endpoint=endpoint,
        region=text_value(raw, "region", where=where),
        path_style=bool_value(raw, "path_style", default=endpoint is not None, where=where),
        ca_bundle=Path(ca_bundle).expanduser() if ca_bundle is not None else None,
        profile=text_value(raw, "profile", where=where),
        capacity_bytes=int_value(raw, "capacity_bytes", minimum=1, default=None, where=where),
        max_concurrency=int_value(raw, "max_concurrency", minimum=1, default=16, where=where),
        max_pending_writes=int_value(raw, "max_pending_writes", minimum=1, default=64, where=where),
        connect_timeout_s=float_value(raw, "connect_timeout_s", 2.0, where=where),
        timeout_s=float_value(raw, "timeout_s", 10.0, where=where),
        reconnect_max_s=float_value(raw, "reconnect_max_s", 30.0, where=where),
        list_interval_s=float_value(raw, "list_interval_s", 60.0, where=where),
        auth=parse_auth(raw, where),
    )
