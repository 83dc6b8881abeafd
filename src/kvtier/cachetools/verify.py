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
payload is read only as far as its header and the file's size agree, and never beyond the
namespace's block size (:func:`payload_bound`): a record longer than that, or whose header claims
more, is a problem, quarantined without reading its payload. A directory that cannot be listed is
skipped and reported (``unreadable``), and the rest is verified. A namespace whose config.json does
not match its directory name is reported; its records are checked without that config (their
checksums, keys and sizes, not its digests or rank count), so none is quarantined on its account.

Called by ``kvtier verify`` (:mod:`kvtier.cli.cache`) in the command's process, one thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.cachetools.scan import CacheFile, CacheNamespace, Kind, Unreadable, discover, iter_files
from kvtier.core.keys import Namespace
from kvtier.cachetools.selection import select
from kvtier.core.fleet_key import AuthConfig
from kvtier.core.rootfs import READ
from kvtier.tiers.blockfile import HEADER_LEN, CorruptBlockError, decode_header
from kvtier.tiers.disk.files import check_header, not_a_block_file, verify_file
from kvtier.tiers.disk.layout import Removal
from kvtier.tiers.disk.ledger import RECORD_BYTES, Ledger, decode, ledger_path
from kvtier.tiers.sealing import KeyState, Sealer

UNKNOWN_PAYLOAD_MAX = 1 << 30
"""The longest payload (1 GiB) verify reads of a record whose namespace's block size it cannot tell
(no valid config.json and no usage ledger): a longer record is reported and left in place, unread."""

ProgressCallback = Callable[[int, int], None]
"""Called as ``progress(files_done, files_total)`` while verifying."""


@dataclass(frozen=True, slots=True)
class Problem:
    """One bad or unexpected file (Redis: value, S3: object). ``action``: ``quarantined`` (disk),
    ``deleted`` (Redis, S3: no quarantine there), ``left in place`` (not a block file, a namespace
    whose config cannot judge its records, or ``--no-quarantine``) or ``gone`` (removed meanwhile,
    or could not be moved and was removed, as the tier does)."""

    path: str
    reason: str
    action: str
    namespace: str | None = None  # the namespace directory name, if the file is under one


@dataclass(slots=True)
class VerifyReport:
    """What :func:`verify_cache` (or the Redis and S3 tools) checked and found at ``root``, a store
    of kind ``store`` (:mod:`kvtier.cachetools.stores`: it names what a block is held in, files,
    values or objects); ``notes``: what the check did besides, where that is not the obvious way."""

    root: str
    namespaces: list[str]
    files_checked: int = 0
    files_ok: int = 0
    bytes_checked: int = 0
    vanished: int = 0  # removed by an engine while verify ran (not a problem)
    problems: list[Problem] = field(default_factory=list)
    retired: dict[str, int] = field(default_factory=dict)  # key id (hex) -> valid records sealed under it
    sealed_unchecked: int = 0  # sealed records whose MAC was not checked (no keys given)
    unreadable: list[Unreadable] = field(default_factory=list)  # directories skipped: not verified
    store: str = "disk"
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.unreadable

    @property
    def quarantined(self) -> int:
        return sum(p.action == "quarantined" for p in self.problems)

    @property
    def deleted(self) -> int:
        """Bad records deleted where they were (Redis, S3: there is no quarantine there)."""
        return sum(p.action == "deleted" for p in self.problems)

    def to_json(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in ("root", "store", "namespaces", "files_checked", "files_ok",
                                                        "bytes_checked", "vanished", "retired",
                                                        "sealed_unchecked")}
        return {**data, "ok": self.ok, "quarantined": self.quarantined, "deleted": self.deleted,
                "problems": [asdict(p) for p in self.problems],
                "unreadable": [asdict(u) for u in self.unreadable], "notes": self.notes}


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
    directory name (left in place; their files still verified, without that config), records
    longer than the namespace's block size (see :func:`payload_bound`). Writers' temp files are not
    checked. Directories that cannot be listed are skipped and listed in ``unreadable``.
    Raises :class:`~kvtier.cachetools.selection.SelectionError` for a selector matching nothing, or
    a digest matching several namespaces.
    """
    sealer = Sealer(auth) if auth is not None else None
    cache = discover(root_dir)
    chosen = select(cache.namespaces, cache.root, either=selectors)
    report = VerifyReport(cache.root, [ns.prefix for ns in chosen])
    if not selectors:
        report.problems += [Problem(f.path, f.reason, "left in place") for f in cache.strays]
    work: list[tuple[CacheNamespace, CacheFile]] = []
    for ns in chosen:
        files = [f for f in iter_files(ns, stat=False, unreadable=report.unreadable) if f.kind is not Kind.TEMP]
        work += [(ns, f) for f in files]
        blocks = sum(f.hex_key is not None for f in files)
        if ns.config_problem is not None and (blocks or ns.config is not None):
            what = f"its {blocks} block files belong to no namespace" if ns.config is None else "engines refuse it"
            report.problems.append(Problem(ns.config_path, f"{ns.config_problem}: {what}", "left in place", ns.prefix))
    digests = {ns.prefix: ns.rank_digests() for ns in chosen}  # None where config.json is unusable
    bounds: dict[tuple[str, int, int], tuple[int, str | None]] = {}
    for done, (ns, f) in enumerate(work, 1):
        bound_key = (ns.prefix, f.group or 0, f.rank)
        if bound_key not in bounds:
            bounds[bound_key] = payload_bound(ns, f.group or 0, f.rank)
        problem = _check(ns, f, digests[ns.prefix], report, chunk_bytes, sealer, bounds[bound_key])
        if problem is not None:
            reason, movable = problem
            report.problems.append(_settle(ns, f, reason, quarantine and movable))
        if progress is not None:
            progress(done, len(work))
    return report


def payload_bound(ns: CacheNamespace, group: int, rank: int) -> tuple[int, str | None]:
    """The most payload bytes a record of ``rank`` (and KV cache ``group``) of ``ns`` can hold,
    and where that comes from: from config.json when it is a valid namespace matching its directory
    (``layers x ceil(block_tokens / engine_block_tokens) x page_bytes`` of the rank's page format: a
    bound on what every kvtier engine stores per rank), else from the group's usage ledger (the
    size of the files the engines write), else :data:`UNKNOWN_PAYLOAD_MAX` (source None)."""
    if ns.namespace is not None and ns.config_problem is None:
        return config_payload_bound(ns.namespace, rank), "config.json"
    try:
        unit_bytes = decode(ns.fs.read_bytes(ledger_path(ns.layout(group)), RECORD_BYTES))[0]
    except (OSError, ValueError):
        unit_bytes = 0
    if unit_bytes > HEADER_LEN:
        return unit_bytes - HEADER_LEN, "usage ledger"
    return UNKNOWN_PAYLOAD_MAX, None


def config_payload_bound(namespace: Namespace, rank: int) -> int:
    """The most payload bytes a record of ``rank`` of ``namespace`` can hold: ``layers x
    ceil(block_tokens / engine_block_tokens) x page_bytes`` of the rank's page format (a bound on
    what every kvtier engine stores per rank; disk, Redis and S3 records alike)."""
    pages = namespace.ranks
    page = pages[min(rank, len(pages) - 1)]
    per_block = -(-namespace.block_tokens // page.engine_block_tokens)
    return page.num_layers * per_block * page.page_bytes


class _Opened:
    """The one :meth:`open_regular` :func:`verify_file` makes, answered with a file already
    opened and checked here (so the file checked for its size is the file read)."""

    def __init__(self, fd: int, st: os.stat_result) -> None:
        self._fd, self._st = fd, st

    def open_regular(self, path: str, flags: int = READ) -> tuple[int, os.stat_result]:
        return os.dup(self._fd), self._st


def _check(
    ns: CacheNamespace, f: CacheFile, digests: list[bytes] | None, report: VerifyReport, chunk_bytes: int,
    sealer: Sealer | None, bound: tuple[int, str | None],
) -> tuple[str, bool] | None:
    """Why ``f`` is bad and whether it may be quarantined, or None (counted in ``report``)."""
    if f.kind is Kind.STRAY:
        return f.reason, True
    if f.rank >= ns.world:
        return f"rank {f.rank} beyond the namespace's {ns.world} rank(s)", True
    report.files_checked += 1
    namespace = digests[f.rank] if digests is not None else None
    key = bytes.fromhex(f.hex_key or "")
    limit, source = bound
    try:
        fd, st = ns.fs.open_regular(f.path, READ)
        try:
            if st.st_size > HEADER_LEN + limit:
                return _too_long(f"file is {st.st_size} bytes", limit, source)
            header = decode_header(os.pread(fd, HEADER_LEN, 0))
            if header.payload_len > limit:
                return _too_long(f"header claims {header.payload_len} payload bytes", limit, source)
            if sealer is None and header.sealed:  # no key to check its MAC with: its structure only
                check_header(header, st.st_size, namespace=namespace, key=key, rank=f.rank)
                report.sealed_unchecked += 1
            else:
                header = verify_file(_Opened(fd, st), f.path, namespace=namespace, key=key,  # type: ignore[arg-type]
                                     rank=f.rank, chunk_bytes=chunk_bytes,
                                     **({"sealer": sealer} if sealer is not None else {}))
        finally:
            os.close(fd)
        if sealer is not None and sealer.key_state(header) is KeyState.RETIRED:
            report.retired[header.key_id.hex()] = report.retired.get(header.key_id.hex(), 0) + 1
    except FileNotFoundError:
        report.files_checked -= 1
        report.vanished += 1
        return None
    except CorruptBlockError as exc:
        return str(exc), True
    except OSError as exc:
        if not_a_block_file(exc):  # a symlink, a FIFO, a directory...: never followed or read
            return f"not a block file: {exc.strerror}", True
        return f"I/O error: {exc}", False
    report.files_ok += 1
    report.bytes_checked += header.header_len + header.payload_len
    return None


def _too_long(what: str, limit: int, source: str | None) -> tuple[str, bool]:
    """A record longer than the namespace's records can be: quarantined, unread; where the
    namespace's block size is unknown, only refused (left in place)."""
    if source is None:
        return (f"{what}: more than the {limit} payload bytes verify reads without the namespace's block size "
                "(no valid config.json or usage ledger); not read", False)
    return f"{what}: more than the {limit} payload bytes of this namespace's records ({source}); not read", True


def _settle(ns: CacheNamespace, f: CacheFile, reason: str, quarantine: bool) -> Problem:
    """Quarantine a bad block-named file (as the tier names it); leave anything else in place."""
    if not quarantine or f.hex_key is None:
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
