"""``kvtier inspect``: what a disk tier root holds, from directory entries and ``stat`` alone.

Never opens a block file unless asked to count tails (``count_tails``: one header read of rank 0's
file per block): cost is one ``stat`` per file (about 1 s per 100,000 files with a warm page
cache), whatever the blocks' size. Everything is reached as :mod:`kvtier.cachetools.scan` says (no
symlink followed; headers, ledgers and snapshot headers read only from regular files, bounded). A
directory that cannot be listed is skipped and listed in ``unreadable`` (the figures of its
namespace are then partial).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.cachetools.scan import (CacheNamespace, Kind, Unreadable, discover, iter_files, iter_quarantine,
                                    unreadable_of)
from kvtier.core.keys import describe_config
from kvtier.core.rootfs import RootFS
from kvtier.tiers.blockfile import HEADER_LEN, CorruptBlockError, decode_header
from kvtier.tiers.disk.ledger import ledger_files, peek_bytes
from kvtier.tiers.disk.snapshot import peek_count, snapshot_files

AGE_BUCKETS: tuple[tuple[str, float], ...] = (
    ("<1h", 3600.0),
    ("<1d", 86400.0),
    ("<7d", 7 * 86400.0),
    ("<30d", 30 * 86400.0),
    ("older", float("inf")),
)
"""Age histogram buckets: (label, upper bound in seconds). A block's age is now minus the newest
mtime of its files (the tier refreshes mtimes on every hit, so this is the time since last use)."""

def age_bucket(age_seconds: float) -> str:
    """The :data:`AGE_BUCKETS` label of a block last used ``age_seconds`` ago."""
    for label, bound in AGE_BUCKETS:
        if age_seconds < bound:
            return label
    return AGE_BUCKETS[-1][0]


@dataclass(slots=True)
class NamespaceInventory:
    """One namespace's figures. Blocks count once over ranks; files and bytes count every rank's file."""

    prefix: str
    model: str
    digest16: str
    model_name: str | None  # as in config.json
    layout: dict[str, Any] | None  # :func:`kvtier.core.keys.describe_config` of config.json
    config_problem: str | None
    world: int
    older_spec: bool = False  # written under an older key spec: engines of this kvtier never read it
    groups: list[int] = field(default_factory=list)
    complete_blocks: int = 0  # every rank's file present: a possible hit
    incomplete_blocks: int = 0  # some rank's file missing: never a hit (a writer in progress, or orphans)
    block_files: int = 0
    block_bytes: int = 0
    ages: dict[str, int] = field(default_factory=lambda: dict.fromkeys((label for label, _ in AGE_BUCKETS), 0))
    last_use: float | None = None  # newest mtime of any block file (seconds since the epoch)
    quarantine_files: int = 0
    quarantine_bytes: int = 0
    temp_files: int = 0
    temp_bytes: int = 0
    stray_files: int = 0
    snapshot_blocks: int | None = None  # keys its index snapshot(s) name (None: no usable snapshot)
    snapshot_written: float | None = None  # newest snapshot's mtime (seconds since the epoch)
    ledger_bytes: int | None = None  # what its usage ledgers charge (None: no readable ledger)
    tail_blocks: int | None = None  # complete blocks that are tails (partial blocks); None: not counted
    unreadable: int = 0  # its directories that could not be listed (its figures are partial)


MAX_STRAYS = 1000
"""The most unexpected entries an inventory lists (the rest are only counted, in ``strays_unlisted``):
a prefix or directory full of foreign things costs a bounded report."""


@dataclass(slots=True)
class Inventory:
    """What :func:`inspect_cache` (or the Redis and S3 tools) found at ``root``, a store of kind
    ``store`` (:mod:`kvtier.cachetools.stores`). ``strays``: entries (files, keys, objects) there that
    are not kvtier's, at most :data:`MAX_STRAYS` of them listed (:meth:`add_stray`), the others
    counted in ``strays_unlisted``; ``notes``: how a figure was measured where that is not the
    obvious way (said under the table and in the JSON)."""

    root: str
    scanned_at: float
    namespaces: list[NamespaceInventory]
    quarantine_files: int = 0  # kvtier's quarantined records, including those of no known namespace
    quarantine_bytes: int = 0
    strays: list[tuple[str, str]] = field(default_factory=list)  # (path, reason), top level and rank dirs
    unreadable: list[Unreadable] = field(default_factory=list)  # directories skipped: not counted
    store: str = "disk"
    strays_unlisted: int = 0
    notes: list[str] = field(default_factory=list)

    def add_stray(self, path: str, reason: str) -> None:
        """Note an unexpected entry (listed while fewer than :data:`MAX_STRAYS` are, else counted)."""
        if len(self.strays) < MAX_STRAYS:
            self.strays.append((path, reason))
        else:
            self.strays_unlisted += 1

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``kvtier inspect --json``); times are seconds since the epoch."""
        return {
            "root": self.root,
            "store": self.store,
            "scanned_at": self.scanned_at,
            "namespaces": [asdict(ns) for ns in self.namespaces],
            "quarantine": {"files": self.quarantine_files, "bytes": self.quarantine_bytes},
            "strays": [{"path": path, "reason": reason} for path, reason in self.strays],
            "strays_unlisted": self.strays_unlisted,
            "unreadable": [asdict(u) for u in self.unreadable],
            "notes": self.notes,
        }


def inspect_cache(root_dir: str | Path, *, now: float | None = None, count_tails: bool = False) -> Inventory:
    """Survey every namespace under ``root_dir`` (see :class:`NamespaceInventory`); with
    ``count_tails``, read each block's header (rank 0) to count the tails among them."""
    now = time.time() if now is None else now
    cache = discover(root_dir)
    inventory = Inventory(cache.root, now, [])
    for f in cache.strays:
        inventory.add_stray(f.path, f.reason)
    by_prefix: dict[str, NamespaceInventory] = {}
    for ns in cache.namespaces:
        summary = _summarize(ns, now, inventory, count_tails)
        by_prefix[ns.prefix] = summary
        inventory.namespaces.append(summary)
    for qfile in iter_quarantine(cache, inventory.unreadable):
        if not qfile.ours:
            inventory.add_stray(qfile.path, qfile.why_not_ours or "")
            continue
        inventory.quarantine_files += 1
        inventory.quarantine_bytes += qfile.size
        owner = by_prefix.get(qfile.prefix or "")
        if owner is not None:
            owner.quarantine_files += 1
            owner.quarantine_bytes += qfile.size
    return inventory


def _summarize(ns: CacheNamespace, now: float, inventory: Inventory, count_tails: bool) -> NamespaceInventory:
    unreadable = inventory.unreadable
    config = ns.config or {}
    summary = NamespaceInventory(
        prefix=ns.prefix,
        model=ns.model,
        digest16=ns.digest16,
        model_name=config.get("model_name") if isinstance(config.get("model_name"), str) else None,
        layout=describe_config(config) if ns.config is not None else None,
        config_problem=ns.config_problem,
        older_spec=ns.older_spec,
        world=ns.world,
    )
    blocks: dict[tuple[int, str], list[int]] = {}  # (group, hex key) -> [bit mask of ranks, newest mtime_ns]
    rank0_paths: dict[tuple[int, str], str] = {}
    skipped = len(unreadable)
    for f in iter_files(ns, stat=True, unreadable=unreadable):
        if f.kind is Kind.TEMP:
            summary.temp_files += 1
            summary.temp_bytes += f.size
        elif f.kind is Kind.STRAY:
            summary.stray_files += 1
            inventory.add_stray(f.path, f.reason)
        else:
            summary.block_files += 1
            summary.block_bytes += f.size
            seen = blocks.setdefault((f.group or 0, f.hex_key or ""), [0, 0])
            seen[0] |= 1 << f.rank
            seen[1] = max(seen[1], f.mtime_ns)
            if f.rank == 0:
                rank0_paths[(f.group or 0, f.hex_key or "")] = f.path
    try:  # its ledgers and snapshots are listed quietly: say if they could not be
        ns.fs.listing(ns.ns_dir, stat=False)
    except OSError as exc:
        unreadable.append(unreadable_of(ns.ns_dir, exc, ns.prefix))
    summary.unreadable = len(unreadable) - skipped
    summary.groups = sorted({group for group, _ in blocks})
    newest, all_ranks = 0, (1 << summary.world) - 1
    block_tokens = config.get("block_tokens") if isinstance(config.get("block_tokens"), int) else None
    if count_tails and block_tokens is not None:
        summary.tail_blocks = 0
    for block, (ranks, mtime_ns) in blocks.items():
        if ranks & all_ranks == all_ranks:
            summary.complete_blocks += 1
            if summary.tail_blocks is not None:
                summary.tail_blocks += _is_tail(ns.fs, rank0_paths[block], block_tokens)
        else:
            summary.incomplete_blocks += 1
        summary.ages[age_bucket(now - mtime_ns / 1e9)] += 1
        newest = max(newest, mtime_ns)
    summary.last_use = newest / 1e9 if newest else None
    charged = [peek_bytes(ns.fs, path) for path in ledger_files(ns.fs, ns.ns_dir)]
    if any(c is not None for c in charged):
        summary.ledger_bytes = sum(c for c in charged if c is not None)
    for path in snapshot_files(ns.fs, ns.ns_dir):
        count = peek_count(ns.fs, path)
        if count is not None:
            summary.snapshot_blocks = (summary.snapshot_blocks or 0) + count
            with contextlib.suppress(OSError):
                summary.snapshot_written = max(summary.snapshot_written or 0.0, ns.fs.lstat(path).st_mtime)
    return summary


def _is_tail(fs: RootFS, path: str, block_tokens: int) -> bool:
    """Whether the block file at ``path`` holds a tail (fewer tokens than a block); unreadable: no."""
    try:
        fd = fs.open(path)
        try:
            return decode_header(os.pread(fd, HEADER_LEN, 0)).num_tokens < block_tokens
        finally:
            os.close(fd)
    except (OSError, CorruptBlockError):
        return False
