"""Which blocks became visible in, or vanished from, a tier: the raw material of KV events.

A tier index owns one :class:`ResidencyLog`. It is off by default (recording costs nothing then);
the orchestrator turns it on when someone consumes the changes (in vLLM: KV events are enabled).

A change means *visibility*, not bytes: ``STORED`` when a block becomes readable from the tier
(a host slot turns READY, a disk block enters the index), ``REMOVED`` when it stops being readable
(evicted, deleted, cleared, found corrupt, or deleted by another process sharing a disk root).
For one tier and one key, changes alternate STORED, REMOVED, STORED, ... in the order they
happened, so a consumer that replays them knows exactly what each tier holds (a block already
present when recording began may first appear as REMOVED).

Threading: recorded and taken on the orchestrator's thread only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier.core.keys import BlockKey


class Medium(enum.Enum):
    """Where a block lives. Values are the medium names KV events and metrics use."""

    HOST = "CPU"
    DISK = "DISK"
    REMOTE = "REMOTE"  # the Redis / Valkey tier
    S3 = "S3"  # the S3-compatible object tier

    @property
    def shared(self) -> bool:
        """A store shared by the fleet (Redis, S3): one engine's reset leaves it alone, and tails
        (partial blocks) stay off it (a lookup there would probe every tail length)."""
        return self is Medium.REMOTE or self is Medium.S3


class ChangeKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class ResidencyChange:
    kind: ChangeKind
    medium: Medium
    key: BlockKey


class ResidencyLog:
    """Changes of one tier since the last :meth:`take`; records nothing until :meth:`enable`."""

    def __init__(self, medium: Medium):
        self.medium = medium
        self._changes: list[ResidencyChange] | None = None

    def enable(self) -> None:
        if self._changes is None:
            self._changes = []

    def stored(self, key: BlockKey) -> None:
        if self._changes is not None:
            self._changes.append(ResidencyChange(ChangeKind.STORED, self.medium, key))

    def removed(self, key: BlockKey) -> None:
        if self._changes is not None:
            self._changes.append(ResidencyChange(ChangeKind.REMOVED, self.medium, key))

    def take(self) -> list[ResidencyChange]:
        """The changes recorded since the last call, oldest first."""
        if not self._changes:
            return []
        changes, self._changes = self._changes, []
        return changes
