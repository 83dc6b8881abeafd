"""``kvtier purge``: delete blocks by namespace, model or age, and empty the quarantine.

Safe while engines use the root: only block files (and quarantined files) are unlinked, never
renamed or truncated, and writers' temp files are never touched. A quarantined file is one the
tier quarantined: named as it names them, in a directory that is a kvtier root
(:func:`~kvtier.cachetools.scan.iter_quarantine`); anything else in ``quarantine/`` is left in
place and counted (``quarantine_left``), so a folder that is not a kvtier root loses nothing. An
engine whose index still holds a purged block sees a ``NOT_FOUND`` read, which the disk tier
treats as a miss, and forgets it. Emptied directories are removed with ``rmdir`` only (it refuses a directory that a writer
has just filled again; a writer finding its directory gone recreates it). ``config.json`` goes
only with whole namespaces and only if no block or temp file is left in them (the index snapshots
and usage ledgers go with it, and the namespace directory when nothing else is left in it).
Removing blocks also removes the namespace's index snapshots (the next start-up then scans the
files). A namespace with a directory that cannot be listed (``EACCES``, ...) is skipped whole,
nothing removed from it, and reported (``unreadable``); so is a quarantine that cannot be listed.
What is counted as removed is what was removed: an unlink that fails is an error, not a removal.
Block files are unlinked under the lock of their group's usage ledger
(:mod:`kvtier.tiers.disk.ledger`), which gives back exactly the bytes of the files removed, so the
engines sharing the root see the room at once. Everything is reached through the root's
:class:`~kvtier.core.rootfs.RootFS` (:mod:`kvtier.cachetools.scan`): only entries of
directories inside the root are removed (a planted symlink: the link itself, never its target; a
symlinked ``quarantine`` or rank directory is never entered), and headers are read only from
regular files, without waiting.

Called by ``kvtier purge`` (:mod:`kvtier.cli.cache`) in the command's process, one thread.
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.cachetools.scan import (CONFIG_NAME, CacheFile, CacheNamespace, Kind, Unreadable, discover, iter_files,
                                    iter_quarantine, unreadable_of)
from kvtier.cachetools.selection import select
from kvtier.cachetools.stores import DISK, StoreWords
from kvtier.core.rootfs import RootFS
from kvtier.tiers.blockfile import HEADER_LEN, CorruptBlockError, decode_header
from kvtier.tiers.disk.layout import Removal, remove_file, unlink_quiet
from kvtier.tiers.disk.ledger import Ledger, ledger_files
from kvtier.tiers.disk.snapshot import remove_snapshots, snapshot_files

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
MAX_DURATION_S = 1e12
"""The longest ``--older-than`` (about 31,700 years): longer is refused as a typo."""


def parse_duration(text: str) -> float:
    """Seconds in ``text``: numbers with a unit s, m, h, d or w, e.g. ``30m``, ``12h``, ``7d``, ``1d12h``."""
    compact = text.strip().lower().replace(" ", "")
    parts = _DURATION.findall(compact)
    if not compact or "".join(n + u for n, u in parts) != compact:
        raise ValueError(f"bad duration {text!r}: use a number and a unit (s, m, h, d, w), e.g. 30m, 12h, 7d")
    seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    if not math.isfinite(seconds) or seconds > MAX_DURATION_S:
        raise ValueError(f"duration {text[:40]!r}{'...' if len(text) > 40 else ''} is too long "
                         f"(at most {MAX_DURATION_S:.0e} s)")
    return seconds


@dataclass(frozen=True, slots=True)
class PurgeSelection:
    """What to delete. ``namespaces``/``models`` narrow to namespaces (digest or model; any value
    of a kind), ``older_spec`` to namespaces written under another key spec (engines of this
    kvtier never read them), ``older_than`` to blocks last used more than that many seconds ago;
    ``quarantine`` empties the quarantine (of the selected namespaces when narrowed); ``all`` is
    everything, quarantine included, and combines with nothing else. ``retired_except`` (a fleet
    key's id): blocks whose records are NOT sealed under that key (under a retired or unknown key,
    or unauthenticated), read from each record's header (the MAC is ``kvtier verify``'s to check)."""

    namespaces: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    older_than: float | None = None
    quarantine: bool = False
    all: bool = False
    older_spec: bool = False
    retired_except: bytes | None = None

    @property
    def narrowed(self) -> bool:
        """Whether namespace selectors narrow the namespaces (else: all of them)."""
        return bool(self.namespaces or self.models or self.older_spec)

    def validate(self, store: StoreWords = DISK) -> None:
        """Raise ValueError for an empty selection, ``all`` with another selector, or ``quarantine``
        on a ``store`` that has none (Redis, S3: bad records are deleted where they are found)."""
        if self.quarantine and not store.quarantine:
            raise ValueError(f"--quarantine: a {store.title.removeprefix('kvtier ')} has no quarantine (kvtier verify "
                             "deletes a bad record where it finds it), so there is nothing to empty")
        narrowing = self.narrowed or self.older_than is not None or self.quarantine or self.retired_except is not None
        if self.all and narrowing:
            raise ValueError("--all selects everything: do not combine it with other selectors")
        if not (self.all or narrowing):
            raise ValueError(
                "nothing selected: give --namespace, --model, --older-spec, --older-than, --retired, --quarantine or --all")
        if self.older_than is not None and self.older_than < 0:
            raise ValueError("--older-than must not be negative")

    @property
    def blocks(self) -> bool:
        """Whether blocks are deleted (not just the quarantine)."""
        return self.all or self.narrowed or self.older_than is not None or self.retired_except is not None

    @property
    def whole_namespaces(self) -> bool:
        """Whether every block of the selected namespaces goes (then config.json may go too)."""
        return self.blocks and self.older_than is None and self.retired_except is None


@dataclass(slots=True)
class NamespacePurge:
    """What was (or, in a dry run, would be) removed from one namespace."""

    prefix: str
    blocks: int = 0
    files: int = 0
    bytes: int = 0
    skipped: int = 0  # age purges: blocks used again between selection and deletion (kept)
    errors: int = 0  # unlinks that failed (other than "already gone")
    config_removed: bool = False
    namespace_removed: bool = False  # its directories are gone (dry run: would go)
    unreadable: int = 0  # directories that could not be listed: the namespace was skipped, nothing removed
    failed: list[str] = field(default_factory=list)  # the files whose unlink failed (disk roots)


@dataclass(slots=True)
class PurgeReport:
    """What :func:`purge_cache` (or the Redis and S3 tools) removed from ``root``, a store of kind
    ``store`` (``dry_run``: would remove; nothing was touched). ``quarantine_left``: entries of the
    quarantine directory left in place because they are not kvtier's, counted by why
    (:class:`~kvtier.cachetools.scan.QuarantineFile`); ``notes``: how a figure was measured where
    that is not the obvious way."""

    root: str
    dry_run: bool
    namespaces: list[NamespacePurge] = field(default_factory=list)
    quarantine_files: int = 0
    quarantine_bytes: int = 0
    errors: int = 0  # quarantine unlinks that failed
    unreadable: list[Unreadable] = field(default_factory=list)  # directories skipped (disk roots)
    store: str = "disk"
    quarantine_left: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def files(self) -> int:
        return sum(ns.files for ns in self.namespaces) + self.quarantine_files

    @property
    def bytes(self) -> int:
        return sum(ns.bytes for ns in self.namespaces) + self.quarantine_bytes

    def to_json(self) -> dict[str, Any]:
        return {"root": self.root, "store": self.store, "dry_run": self.dry_run, "files": self.files,
                "bytes": self.bytes, "namespaces": [asdict(ns) for ns in self.namespaces],
                "quarantine": {"files": self.quarantine_files, "bytes": self.quarantine_bytes,
                               "left_in_place": self.quarantine_left},
                "errors": self.errors + sum(ns.errors for ns in self.namespaces),
                "unreadable": [asdict(u) for u in self.unreadable], "notes": self.notes}


def purge_cache(
    root_dir: str | Path, selection: PurgeSelection, *, dry_run: bool = False, now: float | None = None
) -> PurgeReport:
    """Delete what ``selection`` selects under ``root_dir`` (see the module docstring).

    Raises ValueError for an invalid selection (:class:`~kvtier.cachetools.selection.SelectionError`
    when a namespace or model selector matches nothing).
    """
    selection.validate()
    now = time.time() if now is None else now
    cache = discover(root_dir)
    chosen = select(cache.namespaces, cache.root, namespaces=selection.namespaces, models=selection.models)
    if selection.older_spec:
        chosen = [ns for ns in chosen if ns.older_spec]
    report = PurgeReport(cache.root, dry_run)
    cutoff_ns = None
    if selection.older_than is not None:  # a cutoff before 1685 (kept within int64 ns): nothing is that old
        cutoff_ns = int(max(now - selection.older_than, -9e9) * 1e9)
    if selection.blocks:
        for ns in chosen:
            report.namespaces.append(_purge_namespace(ns, cutoff_ns, selection.whole_namespaces, dry_run,
                                                      selection.retired_except, report.unreadable))
    if selection.quarantine or selection.all:
        narrowed = selection.narrowed
        prefixes = {ns.prefix for ns in chosen}
        for qfile in iter_quarantine(cache, report.unreadable):
            if not qfile.ours:  # never removed: not kvtier's to remove
                if not narrowed:
                    reason = qfile.why_not_ours or ""
                    report.quarantine_left[reason] = report.quarantine_left.get(reason, 0) + 1
                continue
            if narrowed and qfile.prefix not in prefixes:
                continue
            if not dry_run and not unlink_quiet(cache.fs, qfile.path):
                report.errors += 1
                continue
            report.quarantine_files += 1
            report.quarantine_bytes += qfile.size
    return report


def _purge_namespace(ns: CacheNamespace, cutoff_ns: int | None, whole: bool, dry_run: bool,
                     keep_key_id: bytes | None = None, unreadable: list[Unreadable] | None = None) -> NamespacePurge:
    result = NamespacePurge(ns.prefix)
    skipped: list[Unreadable] = []
    listed = list(iter_files(ns, stat=True, unreadable=skipped))
    try:
        ns.fs.listing(ns.ns_dir, stat=False)
    except OSError as exc:
        skipped.append(unreadable_of(ns.ns_dir, exc, ns.prefix))
    if skipped:  # what is in there is unknown: remove nothing of this namespace
        result.unreadable = len(skipped)
        if unreadable is not None:
            unreadable += skipped
        return result
    blocks: dict[tuple[int, str], list[CacheFile]] = {}  # (group, key) -> its files
    others = 0  # temp files and other entries that keep config.json in place
    for f in listed:
        if f.hex_key is not None and f.kind is not Kind.TEMP:
            blocks.setdefault((f.group or 0, f.hex_key), []).append(f)
        else:
            others += 1
    doomed: list[list[CacheFile]] = []
    for files in blocks.values():
        if cutoff_ns is not None and max(f.mtime_ns for f in files) >= cutoff_ns:
            continue
        if keep_key_id is not None and all(sealed_under(ns.fs, f.path, keep_key_id) for f in files):
            continue
        if not dry_run and cutoff_ns is not None and _used_since(ns.fs, files, cutoff_ns):
            result.skipped += 1
            continue
        doomed.append(files)
    if dry_run:
        for files in doomed:
            result.blocks += 1
            result.files += len(files)
            result.bytes += sum(f.size for f in files)
    else:
        outcomes = _remove_files(ns, [f for files in doomed for f in files])
        for files in doomed:
            removed = [f for f in files if outcomes[f.path].removed]
            failed = [f.path for f in files if outcomes[f.path] is Removal.FAILED]
            result.files += len(removed)
            result.bytes += sum(f.size for f in removed)
            result.blocks += bool(removed) and not failed
            result.failed += failed
        result.errors += len(result.failed)
    leaves = {os.path.dirname(f.path) for files in doomed for f in files} if not dry_run else set()
    for leaf in leaves:
        ns.fs.rmdir_quiet(leaf)
        ns.fs.rmdir_quiet(os.path.dirname(leaf))
    if leaves:  # a restart must not start from a snapshot that names the removed blocks
        remove_snapshots(ns.fs, ns.ns_dir)
    if whole and others == 0 and len(doomed) == len(blocks) and not result.errors:
        if dry_run:
            result.config_removed = _exists(ns.fs, ns.config_path)
            result.namespace_removed = _only_own_files(ns)
        else:
            result.config_removed = _drop_namespace(ns)
            result.namespace_removed = not any(_exists(ns.fs, d) for d in (ns.ns_dir, *ns.rank_dirs.values()))
    return result


def _remove_files(ns: CacheNamespace, files: list[CacheFile]) -> dict[str, Removal]:
    """Unlink ``files``; those the engines' usage ledgers charge (block files in their place, of a
    rank the namespace has) under their group's ledger lock. Returns the outcome of each, by path."""
    charged: dict[int, list[str]] = {}
    outcomes: dict[str, Removal] = {}
    for f in files:
        if f.kind is Kind.BLOCK and f.rank < ns.world:
            charged.setdefault(f.group or 0, []).append(f.path)
        else:
            outcomes[f.path] = remove_file(ns.fs, f.path)
    for group, paths in charged.items():
        outcomes.update(zip(paths, Ledger.for_tool(ns.layout(group)).remove(paths)))
    return outcomes


def sealed_under(fs: RootFS, path: str, key_id: bytes) -> bool:
    """Whether the block file at ``path`` names fleet key ``key_id`` in its header (False for a
    plain record, an unreadable one or one that is not a regular file; a vanished file counts as kept)."""
    try:
        fd = fs.open(path)
        try:
            header = decode_header(os.pread(fd, HEADER_LEN, 0))
        finally:
            os.close(fd)
    except FileNotFoundError:
        return True
    except (OSError, CorruptBlockError):
        return False
    return header.sealed and header.key_id == key_id


def _exists(fs: RootFS, path: str) -> bool:
    try:
        return fs.lexists(path)
    except OSError:
        return False


def _used_since(fs: RootFS, files: list[CacheFile], cutoff_ns: int) -> bool:
    """Whether a file of the block was read or rewritten since it was selected (re-``lstat``)."""
    for f in files:
        try:
            if fs.lstat(f.path).st_mtime_ns >= cutoff_ns:
                return True
        except OSError:
            pass
    return False


def _drop_namespace(ns: CacheNamespace) -> bool:
    """Remove config.json (True if it was there), the index snapshots, the usage ledgers and the
    emptied directories, unless a block or temp file appeared meanwhile (or a directory cannot be
    listed)."""
    unreadable: list[Unreadable] = []
    if next(iter_files(ns, stat=False, unreadable=unreadable), None) is not None or unreadable:
        return False
    fs = ns.fs
    removed = _exists(fs, ns.config_path) and unlink_quiet(fs, ns.config_path)
    remove_snapshots(fs, ns.ns_dir)  # a namespace may hold nothing else (its blocks purged before)
    for path in ledger_files(fs, ns.ns_dir):  # an engine still writing recreates its own from the files
        unlink_quiet(fs, path)
    for rank_dir in ns.rank_dirs.values():
        _remove_empty_dirs(fs, rank_dir)
    fs.rmdir_quiet(ns.ns_dir)
    return removed


def _only_own_files(ns: CacheNamespace) -> bool:
    """Whether the namespace directory holds only what purging the whole namespace removes (its
    config.json, index snapshots and usage ledgers): a dry run's "the directory would go"."""
    try:
        names = {name for name, _ in ns.fs.listing(ns.ns_dir, stat=False) or ()}
    except OSError:
        return False
    own = {CONFIG_NAME, *(os.path.basename(p) for p in (*snapshot_files(ns.fs, ns.ns_dir),
                                                         *ledger_files(ns.fs, ns.ns_dir)))}
    return names <= own


def _remove_empty_dirs(fs: RootFS, directory: str, depth: int = 2) -> None:
    """``rmdir`` the empty directories under ``directory`` (``depth`` levels: a rank directory's
    ``<hhh>/<hh>_g<group>``), then ``directory`` itself; never through a symlink."""
    if depth:
        try:
            listing = fs.listing(directory, stat=False)
        except OSError:  # cannot be listed: left as it is
            return
        if listing is None:
            return
        for name, _ in listing:
            _remove_empty_dirs(fs, f"{directory}/{name}", depth - 1)
    fs.rmdir_quiet(directory)
