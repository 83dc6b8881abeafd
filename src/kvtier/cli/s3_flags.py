"""The ``--s3-*`` flags of ``kvtier serve`` and ``kvtier node``: one S3 tier entry from five flags.

Both commands take the same flags (:func:`s3_options`) and turn them into the same
``secondary_tiers`` entry (:func:`s3_entry`), checked by the same parser as a JSON config's entry;
an error names the flag the user typed (:func:`flag_names` here, ``_flag_error`` of
:mod:`kvtier.launch.command` for ``kvtier serve``), never an entry key. No
credential is ever a flag: the S3 client reads the standard AWS environment, shared files and
instance role (docs/object-store.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from kvtier.launch.command import S3_FLAG_OF_KEY



def s3_options(below: str) -> Callable:
    """The five ``--s3-*`` options, for a command whose S3 tier sits below ``below`` (help text:
    "the disk and Redis tiers")."""
    options = [
        click.option("--s3-url", default=None, metavar="s3://BUCKET/PREFIX",
                     help=f"An S3 tier (an S3-compatible object store), below {below}. Credentials come from the "
                          "standard AWS environment, shared files (AWS_PROFILE) or instance role, never from flags "
                          "(docs/object-store.md)."),
        click.option("--s3-endpoint", default=None, metavar="URL",
                     help="The store's S3 API when it is not AWS itself (MinIO, Ceph RGW, SeaweedFS...): "
                          "https://host:port; path-style addressing then."),
        click.option("--s3-region", default=None, metavar="NAME",
                     help="The bucket's region (default: AWS_REGION, the profile's, else us-east-1)."),
        click.option("--s3-size", type=float, default=None, metavar="GiB",
                     help="Bound on the objects under the S3 prefix, in GiB, kept by a background sweep (least "
                          "recently written first). Without it, bound the prefix with a bucket lifecycle rule."),
        click.option("--s3-ca-bundle", type=click.Path(dir_okay=False), default=None, metavar="PATH",
                     help="PEM file of the CA certificates that sign --s3-endpoint's certificate."),
    ]

    def decorate(command: Callable) -> Callable:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def s3_entry(url: str | None, endpoint: str | None, region: str | None, size: float | None,
             ca_bundle: str | None) -> dict[str, Any] | None:
    """:func:`kvtier.launch.serve_flags.s3_entry` (the entry the ``--s3-*`` flags describe; None
    without --s3-url), its errors as click usage errors."""
    from kvtier.launch.serve_args import ServeConfigError
    from kvtier.launch.serve_flags import s3_entry as entry_of

    try:
        return entry_of(url, endpoint, region, size, ca_bundle)
    except ServeConfigError as exc:
        raise click.UsageError(str(exc)) from None


def flag_names(message: str) -> str:
    """A tier ConfigError's message with the S3 entry's keys named as the flags that set them."""
    from kvtier.core.values import named_as_given

    return named_as_given(message, "s3", S3_FLAG_OF_KEY, "--s3-url")
