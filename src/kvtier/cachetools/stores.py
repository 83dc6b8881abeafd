"""The words ``kvtier inspect / verify / purge`` use for each kind of store they manage.

A disk tier root keeps a block as one file per rank, a quarantine and writers' temp files; a
Redis / Valkey tier keeps it as one value (all ranks) under a key, its namespace's config under a
config key, and has neither quarantine nor temp files; an S3 tier keeps it as one object beside
the folder's ``config.json``, and has neither either. Every report the tools make names its store
(``store``: :attr:`StoreWords.name`), and :func:`words` gives the renderers the terms that fit it,
so that nothing said about a Redis server or a bucket is in a directory's terms.
"""

from __future__ import annotations

from dataclasses import dataclass

TARGET = "target"
"""The name a command's target (a Redis or S3 URL) and its options are parsed under as a tier entry
(:func:`kvtier.core.tier_config.parse_tier`): a message quotes the entry's keys as ``'target.KEY'``,
which the command line names as the operator gave them (``DIR_OR_URL``, ``--endpoint``...)."""


@dataclass(frozen=True, slots=True)
class StoreWords:
    """How one kind of store is spoken of. ``unit``: what holds a block's records (one per rank on
    disk, all ranks in one otherwise); ``config``: what names a namespace; ``quarantine``: whether
    the store has a quarantine (bad records moved there) and temp files, or bad records are deleted
    where they are found; ``bad_action``: what verify does to a bad record unless told not to."""

    name: str  # "disk", "redis", "s3": the reports' ``store`` field
    title: str  # inspect's heading, before the target
    unit: str
    config: str
    quarantine: bool
    bad_action: str  # Problem.action of a record verify removed from its place
    entries: tuple[str, str]  # what the store lists (singular, plural): inspect's unexpected ones

    def units(self, count: int) -> str:
        """``count`` units, e.g. ``1 value``, ``5 files``."""
        return f"{count:,} {self.unit}{'' if count == 1 else 's'}"


DISK = StoreWords("disk", "kvtier disk cache", "file", "config.json", True, "quarantined", ("entry", "entries"))
REDIS = StoreWords("redis", "kvtier Redis tier", "value", "config key", False, "deleted", ("key", "keys"))
S3 = StoreWords("s3", "kvtier S3 tier", "object", "config.json", False, "deleted", ("object", "objects"))

_BY_NAME = {store.name: store for store in (DISK, REDIS, S3)}


def words(store: str) -> StoreWords:
    """The words of the store named ``store`` (a report's ``store`` field)."""
    return _BY_NAME[store]
