"""What a ``kvtier inspect | verify | purge`` command is pointed at (a disk tier root, a Redis /
Valkey URL, an s3:// URL or a node service's socket) and the fleet keys it checks records with:
the shared click options, and turning them into targets. Only click is imported at module level
(see :mod:`kvtier.cli.cache`)."""

from __future__ import annotations

import os

import click


def target_options(command):
    """The TARGET argument (a directory, a Redis URL or an s3:// URL) and the options a URL may need."""
    command = click.option("--profile", default=None, metavar="NAME",
                           help="S3 only: the AWS profile of the shared files (default: AWS_PROFILE; credentials "
                                "come from the standard AWS chain, never from options).")(command)
    command = click.option("--ca-bundle", default=None, metavar="PATH",
                           help="S3 only: PEM file of the CA that signs the endpoint's certificate.")(command)
    command = click.option("--region", default=None, metavar="NAME", help="S3 only: the bucket's region.")(command)
    command = click.option("--endpoint", default=None, metavar="URL",
                           help="S3 only: the store's S3 API when it is not AWS (https://host:port).")(command)
    command = click.option("--key-prefix", default="kvtier", show_default=True,
                           help="Redis only: the tier's key_prefix (1-64 characters of [A-Za-z0-9._:-], as the "
                                "tier requires).")(command)
    command = click.option("--password-env", default=None, metavar="NAME",
                           help="Redis only: environment variable holding the password.")(command)
    command = click.option("--username", default=None, help="Redis only: the ACL user.")(command)
    return click.argument("target", metavar="DIR_OR_URL")(command)


def key_options(command):
    """The fleet keys a command checks records with (never the key itself on the command line)."""
    command = click.option("--read-key-file", "read_key_files", multiple=True, metavar="PATH",
                           help="A retired fleet key still accepted (file); repeatable.")(command)
    command = click.option("--read-key-env", "read_key_envs", multiple=True, metavar="NAME",
                           help="A retired fleet key still accepted (environment variable); repeatable.")(command)
    command = click.option("--auth-key-file", default=None, metavar="PATH",
                           help="File holding the tier's fleet key (its auth_key_file).")(command)
    return click.option("--auth-key-env", default=None, metavar="NAME",
                        help="Environment variable holding the tier's fleet key (its auth_key_env).")(command)


TARGET_NAMES = {"url": "DIR_OR_URL", "endpoint": "--endpoint", "region": "--region", "ca_bundle": "--ca-bundle",
                "profile": "--profile", "key_prefix": "--key-prefix", "username": "--username",
                "password_env": "--password-env"}
"""How the command line names each key of the tier entry its target and options make."""
AUTH_FLAGS = {"auth_key_env": "--auth-key-env", "auth_key_file": "--auth-key-file",
              "auth_read_key_envs": "--read-key-env", "auth_read_key_files": "--read-key-file"}


def as_given(message: str, entry: str = "DIR_OR_URL") -> str:
    """A ConfigError's message about the target's entry with its keys named as the operator gave them
    (:data:`TARGET_NAMES`; the entry as a whole as ``entry``)."""
    from kvtier.cachetools.stores import TARGET
    from kvtier.core.values import named_as_given

    return named_as_given(message, TARGET, TARGET_NAMES, entry)


def auth_config(auth_key_env: str | None, auth_key_file: str | None, read_key_envs: tuple[str, ...],
                read_key_files: tuple[str, ...]):
    """The :class:`~kvtier.core.fleet_key.AuthConfig` the key options name, or None (no key); a
    usage error naming the option otherwise."""
    from kvtier.core.fleet_key import parse_auth
    from kvtier.core.values import PREFIX, ConfigError

    raw = {"auth_key_env": auth_key_env, "auth_key_file": auth_key_file,
           "auth_read_key_envs": list(read_key_envs), "auth_read_key_files": list(read_key_files)}
    try:
        return parse_auth({k: v for k, v in raw.items() if v}, "options", flags=AUTH_FLAGS)
    except ConfigError as exc:
        raise click.UsageError(str(exc).removeprefix(f"{PREFIX}: ")) from None


def open_target(target: str, username: str | None, password_env: str | None, key_prefix: str, s3: dict | None = None,
                *, node_socket: bool = False):
    """A :class:`~kvtier.cachetools.remote.RemoteTarget` for a Redis URL, an
    :class:`~kvtier.cachetools.objects.ObjectTarget` for an s3:// URL (``s3``: its options), else None
    (a directory, which must exist). A URL and its options are checked as a tier entry's, by the
    tier's own parser (:func:`~kvtier.core.tier_config.parse_tier`: the same rules, ``--key-prefix``'s
    included); a problem is a usage error naming what the operator typed (redacted: never a
    password), never a parser's message or a traceback. ``node_socket``: the command also takes a
    kvtier node's socket (``inspect``), which the message for a target that is none of these says."""
    from kvtier.cachetools.objects import ObjectTarget, is_s3
    from kvtier.cachetools.remote import RemoteTarget, is_remote
    from kvtier.core.values import ConfigError

    if is_s3(target):
        try:
            return ObjectTarget.of(target, **(s3 or {}))
        except ConfigError as exc:
            raise click.UsageError(as_given(str(exc))) from None
    if is_remote(target):
        key_prefix = _check_redis_url(target, username, password_env, key_prefix)
        password = None
        if password_env is not None:
            password = os.environ.get(password_env)
            if password is None:
                raise click.UsageError(f"--password-env {password_env}: that environment variable is not set.")
        return RemoteTarget(target, username, password, key_prefix)
    if os.path.isdir(target):
        return None
    kinds = ("a disk tier directory, a kvtier node's socket (inspect)," if node_socket else "a disk tier directory,")
    what = f"DIR_OR_URL is {kinds} or a redis://, rediss://, unix:// or s3:// URL"
    if not os.path.lexists(target):
        raise click.UsageError(f"{target!r} does not exist ({what}).")
    if is_socket(target):
        raise click.UsageError(f"{target!r} is a socket: only inspect takes a kvtier node's socket; a Redis server's "
                               f"socket is given as unix://{os.path.abspath(target)}.")
    raise click.UsageError(f"{target!r} is not a directory ({what}).")


def _check_redis_url(target: str, username: str | None, password_env: str | None, key_prefix: str) -> str:
    """The tier's ``key_prefix`` after checking ``target`` and the options as a ``redis`` tier entry
    (by the tier's own parser: a URL it refuses, a ``--key-prefix`` the tier would refuse...) and
    the URL's query arguments as redis-py reads them: a usage error naming what the operator
    typed, the URL redacted."""
    from redis.connection import parse_url

    from kvtier.cachetools.stores import TARGET
    from kvtier.core.tier_config import TierType, parse_tier, redact_url
    from kvtier.core.values import ConfigError

    raw = {"url": target, "key_prefix": key_prefix, "username": username, "password_env": password_env}
    try:
        config = parse_tier({k: v for k, v in raw.items() if v is not None}, TierType.REDIS, TARGET)
    except ConfigError as exc:
        raise click.UsageError(as_given(str(exc))) from None
    try:
        parse_url(target)
    except ValueError as exc:  # only a query argument's value is left to refuse; the message names only its name
        why = str(exc) if str(exc).startswith("Invalid value for '") else "redis-py refuses it"
        raise click.UsageError(f"DIR_OR_URL {redact_url(target)!r}: {why}") from None
    return config.key_prefix


def target_errors():
    """The errors a command on a store ends with, as :func:`failure` says them: redis-py's, obstore's,
    an S3 store that does not answer, an S3 tier's ConfigError (credentials refused, no such bucket),
    and OSError."""
    import redis
    from obstore.exceptions import BaseError

    from kvtier.core.values import ConfigError
    from kvtier.tiers.s3.client import StoreUnreachable

    return (redis.RedisError, BaseError, StoreUnreachable, ConfigError, OSError)


def failure(exc: BaseException, remote) -> click.ClickException:
    """One line for an error of :func:`target_errors` that stopped a command on ``remote`` (a
    RemoteTarget, an ObjectTarget, or None: a directory): what it was pointed at and what went
    wrong; never a traceback, a client's debug dump or a password."""
    import redis
    from obstore.exceptions import BaseError

    from kvtier.core.values import ConfigError
    from kvtier.tiers.s3.client import Fault, StoreUnreachable, classify, describe

    if isinstance(exc, BaseError) and classify(exc) is Fault.UNREACHABLE:
        exc = StoreUnreachable(remote.config, exc)
    if isinstance(exc, StoreUnreachable):
        tls = (remote.config.endpoint or "https://").startswith("https://")
        return click.ClickException(f"{exc} (check --endpoint, --region{', --ca-bundle' if tls else ''} and the "
                                    "network).")
    if isinstance(exc, ConfigError):
        return click.ClickException(as_given(str(exc), "the S3 tier"))
    if isinstance(exc, BaseError):
        return click.ClickException(f"the S3 store of {remote.shown}: {describe(exc)}")
    if isinstance(exc, redis.exceptions.InvalidResponse):
        return click.ClickException(f"{remote.shown} is not a Redis server: its answer is not the Redis protocol "
                                    f"({exc}); check the URL's host and port.")
    if isinstance(exc, redis.RedisError):
        return click.ClickException(f"{remote.shown}: {type(exc).__name__}: {exc}")
    return click.ClickException(str(exc) if remote is None else f"{remote.shown}: {exc}")


def s3_options(endpoint: str | None, region: str | None, ca_bundle: str | None, profile: str | None) -> dict:
    return {"endpoint": endpoint, "region": region, "ca_bundle": ca_bundle, "profile": profile}


def is_objects(remote) -> bool:
    from kvtier.cachetools.objects import ObjectTarget

    return isinstance(remote, ObjectTarget)


def is_socket(target: str) -> bool:
    import stat

    try:
        return stat.S_ISSOCK(os.stat(target).st_mode)
    except OSError:
        return False
