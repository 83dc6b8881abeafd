"""The rules between ``kvtier serve``'s own flags, in one place: ``kvtier serve`` (:mod:`kvtier.cli`)
refuses a line by them, and ``kvtier doctor -- kvtier serve ...`` (:mod:`kvtier.doctor`) reports the
same refusal, or audits exactly the configuration serve would run.

Pure functions of the flag values; each problem is a
:class:`~kvtier.launch.serve_args.ServeConfigError` naming the flag at fault (the CLI shows it as
a usage error). Values themselves (sizes, the policy, ``--kv-config``'s keys) are
:func:`~kvtier.launch.command.build_extra_config`'s and
:func:`~kvtier.launch.command.validate_extra_config`'s to check.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.launch.command import ServeOptions
from kvtier.launch.serve_args import ServeConfigError

GIB = 2**30
S3_DETAIL_FLAGS = ("--s3-endpoint", "--s3-region", "--s3-size", "--s3-ca-bundle")
"""The flags that describe ``--s3-url``'s tier (meaningless without it)."""


def s3_entry(url: str | None, endpoint: str | None, region: str | None, size_gib: float | None,
             ca_bundle: str | None) -> dict[str, Any] | None:
    """The S3 tier entry (without ``type``) the ``--s3-*`` flags describe (``kvtier serve`` and
    ``kvtier node`` take the same flags); None without ``--s3-url``."""
    if url is None:
        if any(v is not None for v in (endpoint, region, size_gib, ca_bundle)):
            raise ServeConfigError("--s3-url", "--s3-endpoint, --s3-region, --s3-size and --s3-ca-bundle describe "
                                               "--s3-url: give it too")
        return None
    if size_gib is not None and not size_gib > 0:
        raise ServeConfigError("--s3-size", f"--s3-size {size_gib}: a positive number of GiB")
    entry = {"url": url, "endpoint": endpoint, "region": region, "ca_bundle": ca_bundle,
             "capacity_bytes": int(size_gib * GIB) if size_gib is not None else None}
    return {k: v for k, v in entry.items() if v is not None}


def node_uid(text: str | None) -> int | str | None:
    """``--node-uid``'s value: a uid (digits) or a user name."""
    return None if text is None else int(text) if text.isdigit() else text


def check_flags(options: ServeOptions, *, disk_flags_given: Sequence[str] = (),
                node_pool_gib: float | None = None) -> None:
    """The conflicts and dependencies between the flags: ``disk_flags_given`` are the disk flags
    the user typed (``--disk-dir``, ``--disk-size``: their defaults do not conflict),
    ``node_pool_gib`` the value of ``--node-pool-size`` if given."""
    if options.redis_password_env is not None and options.redis_url is None:
        raise ServeConfigError("--redis-password-env", "--redis-password-env needs --redis-url.")
    if options.node_uid is not None and options.node is None:
        raise ServeConfigError("--node-uid", "--node-uid names the user the kvtier node service of --node may run as: "
                                             "give --node.")
    if options.node is not None and (disk_flags_given or options.no_disk or options.redis_url or options.s3):
        given = " and ".join([*disk_flags_given, *(["--no-disk"] if options.no_disk else []),
                              *(["--redis-url"] if options.redis_url else []), *(["--s3-url"] if options.s3 else [])])
        raise ServeConfigError("--node", f"--node conflicts with {given}: an engine attached to a kvtier node has no "
                                         "disk, Redis or S3 tier of its own (the node's pool is its host tier): give "
                                         "them to the service (kvtier node ... --disk-dir DIR --disk-size GIB "
                                         "--redis-url URL --s3-url s3://BUCKET/PREFIX), or drop --node.")
    if node_pool_gib is not None and (options.node is None or node_pool_gib <= 0):
        raise ServeConfigError("--node-pool-size", "--node-pool-size sizes the kvtier node service started for "
                                                   "--node PATH when none runs there: give --node, and a positive "
                                                   f"size (got {node_pool_gib}).")
    if options.no_disk and disk_flags_given:
        raise ServeConfigError("--no-disk", f"--no-disk conflicts with {' and '.join(disk_flags_given)}: drop one "
                                            "of them.")
