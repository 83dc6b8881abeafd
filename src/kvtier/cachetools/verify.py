"""``kvtier verify``: check every block file as the disk tier's reader does, quarantine bad ones.

Each file is checked by :func:`kvtier.tiers.disk.files.verify_file` (header, namespace and key,
size, payload checksum; the payload is streamed in chunks, so memory stays bounded whatever the
block size) and a bad one is moved by the tier's own :meth:`DiskLayout.quarantine`, so it lands
where and under the name the tier would have used. Safe while engines use the root: files are
only read (mtimes untouched), a file that vanishes meanwhile (evicted) is skipped, and moving a
file away is what the tier itself does on a bad read (an engine then sees a ``NOT_FOUND`` miss).
A block file moved from its place is moved under the lock of its group's usage ledger
(:mod:`kvtier.tiers.disk.ledger`), which gives its bytes back.

Fleet keys: given the tier's keys (``auth``, a :class:`~kvtier.core.fleet_key.AuthConfig`), every record is
checked as the tier checks it: a record without a valid MAC under one of them (a plain record
included) is a problem, and records sealed under a retired (read-only) key are listed apart
(``retired``: ``kvtier purge --retired`` removes them). Without keys, sealed records are checked
for their header and size only and counted as ``sealed_unchecked``, never quarantined for want
of a key.

Hostile roots: files are reached as :mod:`kvtier.cachetools.scan` says (no symlink followed) and
opened only when regular, never waiting (``O_NONBLOCK``): a planted symlink, FIFO or other object
where a block file should be is a problem, quarantined (the entry itself) like a corrupt file. A
payload is read only as far as its header and the file's size agree.

Called by ``kvtier verify`` (:mod:`kvtier.cli.cache`) in the command's process, one thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.cachetools.scan import CacheFile, CacheNamespace, Kind, discover, iter_files
from kvtier.cachetools.selection import select
from kvtier.core.fleet_key import AuthConfig
from kvtier.core.rootfs import READ
from kvtier.tiers.blockfile import HEADER_LEN, CorruptBlockError, decode_header
from kvtier.tiers.disk.files import check_header, not_a_block_file, verify_file
from kvtier.tiers.disk.layout import Removal
from kvtier.tiers.disk.ledger import Ledger
from kvtier.tiers.sealing import KeyState, Sealer

ProgressCallback = Callable[[int, int], None]
"""Called as ``progress(files_done, files_total)`` while verifying."""


@dataclass(frozen=True, slots=True)
class Problem:
    """One bad or unexpected file. ``action``: ``quarantined``, ``left in place`` (not a block
    file, or ``--no-quarantine``) or ``gone`` (removed meanwhile, or could not be moved and was
    removed, as the tier does)."""

    path: str
    reason: str
    action: str
    namespace: str | None = None  # the namespace directory name, if the file is under one


@dataclass(slots=True)
class VerifyReport:
    """What :func:`verify_cache` checked and found."""

    root: str
    namespaces: list[str]
    files_checked: int = 0
    files_ok: int = 0
    bytes_checked: int = 0
    vanished: int = 0  # removed by an engine while verify ran (not a problem)
    problems: list[Problem] = field(default_factory=list)
    retired: dict[str, int] = field(default_factory=dict)  # key id (hex) -> valid records sealed under it
    sealed_unchecked: int = 0  # sealed records whose MAC was not checked (no keys given)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def quarantined(self) -> int:
        return sum(p.action == "quarantined" for p in self.problems)

    def to_json(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in ("root", "namespaces", "files_checked", "files_ok",
                                                        "bytes_checked", "vanished", "retired",
                                                        "sealed_unchecked")}
        return {**data, "ok": self.ok, "quarantined": self.quarantined,
                "problems": [asdict(p) for p in self.problems]}


def verify_cache(
    root_dir: str | Path,
    *,
    selectors: tuple[str, ...] = (),
    quarantine: bool = True,
    progress: ProgressCallback | None = None,
    chunk_bytes: int = 1 << 20,
    auth: AuthConfig | None = None,
) -> VerifyReport:
    """Verify the block files of the namespaces ``selectors`` name (digest or model; all if empty).

    Problems reported: corrupt files (bad header, namespace or key, size not what the header
    says, payload checksum; with ``auth``: MAC and key, see the module docstring), block files in the wrong directory or of a rank beyond the
    namespace's world size (all quarantined unless ``quarantine`` is False), files that are not
    kvtier's (left in place), namespaces whose config.json is missing or does not match the
    directory name (their files still verified). Writers' temp files are not checked.
    Raises :class:`~kvtier.cachetools.selection.SelectionError` for a selector matching nothing.
    """
    sealer = Sealer(auth) if auth is not None else None
    cache = discover(root_dir)
    chosen = select(cache, either=selectors)
    report = VerifyReport(cache.root, [ns.prefix for ns in chosen])
    if not selectors:
        report.problems += [Problem(f.path, f.reason, "left in place") for f in cache.strays]
    work: list[tuple[CacheNamespace, CacheFile]] = []
    for ns in chosen:
        files = [f for f in iter_files(ns, stat=False) if f.kind is not Kind.TEMP]
        work += [(ns, f) for f in files]
        blocks = sum(f.hex_key is not None for f in files)
        if ns.config_problem is not None and (blocks or ns.config is not None):
            what = f"its {blocks} block files belong to no namespace" if ns.config is None else "engines refuse it"
            report.problems.append(Problem(ns.config_path, f"{ns.config_problem}: {what}", "left in place", ns.prefix))
    digests = {ns.prefix: ns.rank_digests() for ns in chosen}
    for done, (ns, f) in enumerate(work, 1):
        problem = _check(ns, f, digests[ns.prefix], report, chunk_bytes, sealer)
        if problem is not None:
            report.problems.append(_settle(ns, f, problem, quarantine))
        if progress is not None:
            progress(done, len(work))
    return report


def _check(
    ns: CacheNamespace, f: CacheFile, digests: list[bytes] | None, report: VerifyReport, chunk_bytes: int,
    sealer: Sealer | None,
) -> str | None:
    """Why ``f`` is bad, or None (counted in ``report``)."""
    if f.kind is Kind.STRAY:
        return f.reason
    if f.rank >= ns.world:
        return f"rank {f.rank} beyond the namespace's {ns.world} rank(s)"
    report.files_checked += 1
    namespace = digests[f.rank] if digests is not None else None
    key = bytes.fromhex(f.hex_key or "")
    try:
        if sealer is None:
            fd, st = ns.fs.open_regular(f.path, READ)
            try:
                header = decode_header(os.pread(fd, HEADER_LEN, 0))
            finally:
                os.close(fd)
            size = st.st_size
            if header.sealed:  # no key to check its MAC with: its structure only
                check_header(header, size, namespace=namespace, key=key, rank=f.rank)
                report.sealed_unchecked += 1
        if sealer is not None or not header.sealed:
            header = verify_file(ns.fs, f.path, namespace=namespace, key=key, rank=f.rank, chunk_bytes=chunk_bytes,
                                 **({"sealer": sealer} if sealer is not None else {}))
        if sealer is not None and sealer.key_state(header) is KeyState.RETIRED:
            report.retired[header.key_id.hex()] = report.retired.get(header.key_id.hex(), 0) + 1
    except FileNotFoundError:
        report.files_checked -= 1
        report.vanished += 1
        return None
    except CorruptBlockError as exc:
        return str(exc)
    except OSError as exc:
        if not_a_block_file(exc):  # a symlink, a FIFO, a directory...: never followed or read
            return f"not a block file: {exc.strerror}"
        return f"I/O error: {exc}"
    report.files_ok += 1
    report.bytes_checked += header.header_len + header.payload_len
    return None


def _settle(ns: CacheNamespace, f: CacheFile, reason: str, quarantine: bool) -> Problem:
    """Quarantine a bad block-named file (as the tier names it); leave anything else in place."""
    if not quarantine or f.hex_key is None or reason.startswith("I/O error"):
        return Problem(f.path, reason, "left in place", ns.prefix)
    layout = ns.layout(f.group or 0)
    hex_key, rank = f.hex_key, f.rank

    def move(path: str) -> Removal:
        return layout.quarantine(hex_key, rank, src=path)

    if f.kind is Kind.BLOCK and f.rank < ns.world:  # charged by the engines' usage ledger
        (outcome,) = Ledger.for_tool(layout).remove([f.path], move)
    else:
        outcome = move(f.path)
    try:
        still_there = ns.fs.lexists(f.path)
    except OSError:
        still_there = True
    action = "quarantined" if outcome is Removal.MOVED else ("left in place" if still_there else "gone")
    return Problem(f.path, reason, action, ns.prefix)
