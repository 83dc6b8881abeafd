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
                           help="Redis only: the tier's key_prefix.")(command)
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


def auth_config(auth_key_env: str | None, auth_key_file: str | None, read_key_envs: tuple[str, ...],
          read_key_files: tuple[str, ...]):
    """The :class:`~kvtier.core.fleet_key.AuthConfig` the key options name, or None (no key)."""
    from kvtier.core.fleet_key import parse_auth
    from kvtier.core.values import ConfigError

    raw = {"auth_key_env": auth_key_env, "auth_key_file": auth_key_file,
           "auth_read_key_envs": list(read_key_envs), "auth_read_key_files": list(read_key_files)}
    try:
        return parse_auth({k: v for k, v in raw.items() if v}, "options")
    except ConfigError as exc:
        message = str(exc).replace("kv_connector_extra_config: ", "").replace("'options.", "'--")
        raise click.UsageError(message.replace("_", "-")) from None


def open_target(target: str, username: str | None, password_env: str | None, key_prefix: str, s3: dict | None = None):
    """A :class:`~kvtier.cachetools.remote.RemoteTarget` for a Redis URL, an
    :class:`~kvtier.cachetools.objects.ObjectTarget` for an s3:// URL (``s3``: its options), else None
    (a directory, which must exist). A URL is checked as a tier entry's (a usage error naming it
    with its credentials redacted, never a parser's message or a traceback)."""
    from kvtier.cachetools.objects import ObjectTarget, is_s3
    from kvtier.cachetools.remote import RemoteTarget, is_remote
    from kvtier.core.values import ConfigError

    if is_s3(target):
        try:
            return ObjectTarget.of(target, **(s3 or {}))
        except ConfigError as exc:
            raise click.UsageError(str(exc).replace("kv_connector_extra_config: ", "").replace("'options.", "'--")
                                   .replace("_", "-")) from None
    if is_remote(target):
        _check_redis_url(target)
        password = None
        if password_env is not None:
            password = os.environ.get(password_env)
            if password is None:
                raise click.UsageError(f"--password-env {password_env}: that environment variable is not set.")
        return RemoteTarget(target, username, password, key_prefix)
    if not os.path.isdir(target):
        raise click.UsageError(f"{target!r} is neither a directory nor a redis://, rediss://, unix:// or s3:// URL.")
    return None


def _check_redis_url(target: str) -> None:
    """A usage error unless ``target`` is a Redis URL a ``redis`` tier entry accepts and redis-py can
    use (its query arguments), named redacted."""
    from redis.connection import parse_url

    from kvtier.core.tier_config import TierType, parse_tier, redact_url
    from kvtier.core.values import ConfigError

    try:
        parse_tier({"url": target}, TierType.REDIS, "options")
    except ConfigError as exc:
        message = str(exc).replace("kv_connector_extra_config: ", "").replace("'options.url' ", "DIR_OR_URL ")
        raise click.UsageError(message.replace("password_env", "--password-env")) from None
    try:
        parse_url(target)
    except ValueError as exc:  # only a query argument's value is left to refuse; the message names only its name
        why = str(exc) if str(exc).startswith("Invalid value for '") else "redis-py refuses it"
        raise click.UsageError(f"DIR_OR_URL {redact_url(target)!r}: {why}") from None


def target_errors():
    """redis-py's and obstore's errors and an S3 tier's ConfigError (credentials refused, no such
    bucket), shown as click errors (never a traceback, never a password)."""
    import redis
    from obstore.exceptions import BaseError

    from kvtier.core.values import ConfigError

    return (redis.RedisError, BaseError, ConfigError, OSError)


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
