"""Find the namespaces and files of a disk tier root (directory entries and ``stat`` only).

The names are the disk tier's (:mod:`kvtier.tiers.disk.layout`); this module only parses them
back and checks every parse by rebuilding the path with :class:`DiskLayout` itself, so a file
is a block file exactly when the tier would read it from where it lies. Nothing here opens a
block file or changes anything on disk. Everything below the root is listed through the root's
:class:`~kvtier.core.rootfs.RootFS` (:attr:`CacheRoot.fs`, shared by every namespace's
layouts), as the tier reaches it: a symlink is never followed (a symlinked or non-directory entry
where a directory should be is listed as a stray, never descended into), ``config.json`` is read
only if it is a regular file of at most 1 MiB, and the status of an entry is its own (``lstat``).
The tools act on what is listed through the same object, so a path swapped for a symlink after
it was listed is not followed either. A directory that cannot be listed (``EACCES``, ``EIO``...) is
skipped and recorded as :class:`Unreadable` when the caller collects them (the tools report them
and exit non-zero); the walk goes on with the rest.

Called by inspect, verify and purge in the ``kvtier`` command's process, one thread.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from stat import S_ISDIR
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from kvtier.cachetools.selection import matches_digest, matches_model
from kvtier.core.keys import KEY_BYTES, KEY_SPEC_VERSION, Namespace, SpecVersionError, stored_ranks_of
from kvtier.core.rootfs import NOT_THERE, RootFS
from kvtier.tiers.disk.layout import CONFIG_MAX_BYTES, QUARANTINE_DIR, DiskLayout

CONFIG_NAME = "config.json"
_HEX = frozenset("0123456789abcdef")
_DIGEST16 = 16


def _is_hex(text: str) -> bool:
    return bool(text) and set(text) <= _HEX


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A directory (or entry) that could not be listed or stat-ed: skipped, and reported."""

    path: str
    reason: str  # the error, e.g. "Permission denied"
    namespace: str | None = None  # the namespace directory name, if it is one's


def unreadable_of(path: str, exc: OSError, namespace: str | None = None) -> Unreadable:
    return Unreadable(path, exc.strerror or str(exc), namespace)


class Kind(Enum):
    """What a file under a rank directory is."""

    BLOCK = "block"  # <hash>.bin where the tier reads it
    TEMP = "temp"  # a writer's <hash>.bin.<pid>.<random>.tmp (never touched by the tools)
    STRAY = "stray"  # anything else (hex_key set: a block file in the wrong directory)


@dataclass(frozen=True, slots=True)
class CacheFile:
    """One entry under a rank directory (``size``/``mtime_ns`` are 0 unless stat-ed)."""

    path: str
    kind: Kind
    rank: int
    group: int | None = None
    hex_key: str | None = None
    size: int = 0
    mtime_ns: int = 0
    reason: str = ""


@dataclass(slots=True)
class CacheNamespace:
    """One ``<model>_<digest16>`` namespace: its config and the rank directories found."""

    root: str
    prefix: str
    model: str  # the sanitized ``<model>`` part of the name
    digest16: str
    fs: RootFS  # the root's (shared by the namespaces of one CacheRoot)
    config: dict[str, Any] | None = None  # parsed config.json; None when missing or unreadable
    config_problem: str | None = None  # why config.json is unusable, or does not match the name
    namespace: Namespace | None = None  # config.json as a kvtier Namespace, when it is one
    spec_version: str | None = None  # the key spec config.json names (None: none named)
    rank_dirs: dict[int, str] = field(default_factory=dict)
    _layouts: dict[int, DiskLayout] = field(default_factory=dict)

    @property
    def ns_dir(self) -> str:
        return self.layout(0).ns_dir

    @property
    def config_path(self) -> str:
        return os.path.join(self.ns_dir, CONFIG_NAME)

    @property
    def world(self) -> int:
        """Ranks a complete block has: tp_size x pp_size of config.json (1 for a replicated
        namespace: MLA stored once), else (no config.json, or one judged wrong: it does not match
        the directory name) the rank dirs found."""
        if self.config is not None and self.config_problem is None:
            try:
                return stored_ranks_of(self.config)
            except (TypeError, ValueError):
                pass
        return max(self.rank_dirs, default=0) + 1

    def layout(self, group: int) -> DiskLayout:
        """The disk tier's layout of this namespace and KV cache group."""
        layout = self._layouts.get(group)
        if layout is None:
            world = max(self.world, max(self.rank_dirs, default=0) + 1)
            layout = DiskLayout(self.root, self.model, bytes.fromhex(self.digest16), world, group, fs=self.fs)
            self._layouts[group] = layout
        return layout

    def rank_digests(self) -> list[bytes] | None:
        """The namespace digest each rank's headers carry (as ``EngineGeometry.rank_digests``),
        or None when config.json is not a kvtier Namespace or does not match the directory name
        (nothing is judged by a config already judged wrong)."""
        if self.namespace is None or self.config_problem is not None:
            return None
        return self.namespace.rank_digests()

    @property
    def older_spec(self) -> bool:
        """Written under another key spec than this kvtier's: never read by engines running it
        (shown by ``kvtier inspect``; ``kvtier purge --older-spec`` removes it)."""
        return self.spec_version is not None and self.spec_version != KEY_SPEC_VERSION

    def matches_digest(self, selector: str) -> bool:
        """True if ``selector`` is this namespace's directory name or digest
        (:func:`~kvtier.cachetools.selection.matches_digest`)."""
        return matches_digest(selector, self.prefix, self.digest16)

    def matches_model(self, selector: str) -> bool:
        """True if ``selector`` is this namespace's model: as in config.json, the ``<model>`` part
        of the name, or as given to vLLM (:func:`~kvtier.cachetools.selection.matches_model`)."""
        name = (self.config or {}).get("model_name")
        return matches_model(selector, name if isinstance(name, str) else None, self.model)

    def matches(self, selector: str) -> bool:
        """True if ``selector`` names this namespace by digest or by model."""
        return self.matches_digest(selector) or self.matches_model(selector)


@dataclass(slots=True)
class CacheRoot:
    """A directory as a disk tier root: its namespaces (sorted by name) and top-level entries that
    are not kvtier's."""

    root: str
    namespaces: list[CacheNamespace]
    strays: list[CacheFile]
    fs: RootFS

    @property
    def quarantine_dir(self) -> str:
        return os.path.join(self.root, QUARANTINE_DIR)

    @property
    def is_kvtier_root(self) -> bool:
        """Whether the directory is a kvtier root: it holds a namespace (a ``<model>_<digest16>``
        directory or one of its ``_r<rank>`` directories, named exactly as the tier names them, see
        :func:`split_prefix`). Only then is its ``quarantine/`` taken for the tier's: a folder that
        merely has a ``quarantine`` subfolder is not a kvtier root, and nothing in it is kvtier's."""
        return bool(self.namespaces)


def split_prefix(name: str, root: str) -> tuple[str, str] | None:
    """``(model, digest16)`` if ``name`` is a namespace directory name the tier would make."""
    model, sep, digest16 = name.rpartition("_")
    if not sep or not model or len(digest16) != _DIGEST16 or not _is_hex(digest16):
        return None
    if DiskLayout(root, model, bytes.fromhex(digest16), 1, 0).prefix != name:
        return None
    return model, digest16


def discover(root_dir: str | Path) -> CacheRoot:
    """The namespaces under ``root_dir`` (from ``<prefix>`` and ``<prefix>_r<rank>`` directories)."""
    root = str(Path(root_dir))
    fs = RootFS(root)
    found: dict[str, CacheNamespace] = {}
    strays: list[CacheFile] = []

    def namespace(prefix: str, parts: tuple[str, str]) -> CacheNamespace:
        if prefix not in found:
            found[prefix] = CacheNamespace(root, prefix, parts[0], parts[1], fs)
        return found[prefix]

    with os.scandir(root) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            if entry.name == QUARANTINE_DIR and entry.is_dir(follow_symlinks=False):
                continue
            if entry.is_dir(follow_symlinks=False):
                parts = split_prefix(entry.name, root)
                if parts is not None:
                    namespace(entry.name, parts)
                    continue
                prefix, sep, rank = entry.name.rpartition("_r")
                parts = split_prefix(prefix, root) if sep and rank.isdigit() and str(int(rank)) == rank else None
                if parts is not None:
                    namespace(prefix, parts).rank_dirs[int(rank)] = os.path.join(root, entry.name)
                    continue
            strays.append(CacheFile(entry.path, Kind.STRAY, -1, reason="not a kvtier namespace or rank directory"))
    for ns in found.values():
        _load_config(ns)
    return CacheRoot(root, sorted(found.values(), key=lambda n: n.prefix), strays, fs)


def _load_config(ns: CacheNamespace) -> None:
    try:
        raw = ns.fs.read_bytes(ns.config_path, CONFIG_MAX_BYTES)
    except FileNotFoundError:
        ns.config_problem = f"{CONFIG_NAME} missing"
        return
    except (OSError, ValueError) as exc:
        ns.config_problem = f"{CONFIG_NAME} unreadable: {exc}"
        return
    parsed = parse_config(raw, ns.digest16, CONFIG_NAME, "the directory name")
    ns.config, ns.namespace, ns.spec_version, ns.config_problem = (
        parsed.config, parsed.namespace, parsed.spec_version, parsed.problem)


CONFIG_MAX_DEPTH = 32
"""The deepest nesting of arrays and objects a namespace's config may have (kvtier's own has 4)."""


@dataclass(frozen=True, slots=True)
class ParsedConfig:
    """A namespace's config (a disk root's ``config.json``, a Redis config key, an S3 ``config.json``)
    as the tools judge it. ``config``: the JSON object (None when unreadable); ``namespace``: it as a
    kvtier :class:`Namespace` of this key spec (None: another spec, or hand-written); ``problem``: why
    it is unusable or not the config of the namespace it is stored for (None: usable). Nothing is
    judged by a config with a problem."""

    config: dict[str, Any] | None
    namespace: Namespace | None
    spec_version: str | None
    problem: str | None


def parse_config(raw: bytes, digest16: str, name: str = CONFIG_NAME,
                 named_by: str = "the directory name") -> ParsedConfig:
    """``raw`` (at most :data:`CONFIG_MAX_BYTES`, read by the caller) judged as the config of the
    namespace whose digest's first 16 hex digits are ``digest16`` (from ``named_by``: its directory,
    key or folder name). Whatever fails to parse (invalid JSON or UTF-8, nesting deeper than
    :data:`CONFIG_MAX_DEPTH` or than the parser's recursion allows) is a ``problem``, never raised; a
    valid :class:`Namespace` whose digest is not ``digest16`` is one too (another namespace's config:
    kept in ``config`` to be shown, never to judge blocks by)."""
    try:
        config = json.loads(raw)
    except RecursionError:
        return ParsedConfig(None, None, None, f"{name} unreadable: nested too deeply")
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        return ParsedConfig(None, None, None, f"{name} unreadable: {exc}")
    if not isinstance(config, dict):
        return ParsedConfig(None, None, None, f"{name} is not a JSON object")
    if _depth_over(config, CONFIG_MAX_DEPTH):
        return ParsedConfig(None, None, None, f"{name} unreadable: nested more than {CONFIG_MAX_DEPTH} levels deep")
    version = config.get("spec_version")
    spec_version = version if isinstance(version, str) else None
    try:
        namespace = Namespace.from_dict(config)
    except SpecVersionError:
        return ParsedConfig(config, None, spec_version, None)  # an older (or newer) key spec: shown as such
    except (TypeError, ValueError, KeyError, AttributeError):
        return ParsedConfig(config, None, spec_version, None)  # not a kvtier Namespace (hand-written): shown
    if namespace.engine_digest.hex()[:_DIGEST16] != digest16:
        return ParsedConfig(config, namespace, spec_version, f"{name} digest does not match {named_by}")
    return ParsedConfig(config, namespace, spec_version, None)


def _depth_over(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest in ``value`` more than ``limit`` levels deep (no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack += [(child, depth + 1) for child in children]
    return False


def iter_files(ns: CacheNamespace, *, stat: bool = True,
               unreadable: list[Unreadable] | None = None) -> Iterator[CacheFile]:
    """Every entry under the namespace's rank directories, classified (see :class:`Kind`).

    ``stat``: fill in size and mtime (the entry's own ``lstat``, one per file). Entries that vanish
    mid-walk are skipped; unexpected entries where directories should be (a symlink, a file, a
    misnamed directory) are reported as one stray entry each, never descended into.
    ``unreadable``: directories that cannot be listed are appended there and skipped (without
    it, the ``OSError`` is raised).
    """
    fs = ns.fs

    def listing(path: str, with_stat: bool) -> list[tuple[str, os.stat_result | None]] | None | bool:
        """:meth:`RootFS.listing`, or False when the directory cannot be listed (recorded)."""
        try:
            return fs.listing(path, stat=with_stat)
        except OSError as exc:
            if unreadable is None:
                raise
            unreadable.append(unreadable_of(path, exc, ns.prefix))
            return False

    for rank in sorted(ns.rank_dirs):
        rank_dir = ns.rank_dirs[rank]
        for top, _ in listing(rank_dir, False) or ():
            top_path = f"{rank_dir}/{top}"
            subs = listing(top_path, False) if len(top) == 3 and _is_hex(top) else None
            if subs is False:
                continue
            if subs is None:
                yield from _stray(fs, top_path, rank, "unexpected entry in a rank directory", stat, unreadable=unreadable)
                continue
            for sub, _ in subs:
                leaf_path = f"{top_path}/{sub}"
                hh, sep, group = sub[:2], sub[2:4], sub[4:]
                well_named = _is_hex(hh) and sep == "_g" and group.isdigit()
                leaf = listing(leaf_path, stat) if well_named else None
                if leaf is False:
                    continue
                if leaf is None:
                    yield from _stray(fs, leaf_path, rank, "unexpected entry in a rank directory", stat,
                                      unreadable=unreadable)
                    continue
                layout = ns.layout(int(group))
                for name, st in leaf:
                    yield from _classify(fs, leaf_path, name, st, rank, int(group), layout, stat, unreadable)


def _classify(
    fs: RootFS, leaf: str, name: str, st: os.stat_result | None, rank: int, group: int, layout: DiskLayout,
    stat: bool, unreadable: list[Unreadable] | None = None,
) -> Iterator[CacheFile]:
    """The entry ``name`` of a leaf directory, classified (nothing if it vanished meanwhile)."""
    path = f"{leaf}/{name}"
    hex_key = name[:-4] if name.endswith(".bin") else name.partition(".")[0]
    is_key = len(hex_key) == 2 * KEY_BYTES and _is_hex(hex_key)
    if name.endswith(".tmp") and is_key and name.startswith(f"{hex_key}.bin."):
        kind, reason = Kind.TEMP, ""
    elif name.endswith(".bin") and is_key:
        if layout.path(hex_key, rank) == path:
            kind, reason = Kind.BLOCK, ""
        else:
            kind, reason = Kind.STRAY, f"misplaced block file: belongs in {layout.path(hex_key, rank)}"
    else:
        yield from _stray(fs, path, rank, "not a block file", stat, st, unreadable)
        return
    if stat and st is None:
        return  # vanished
    size, mtime_ns = (st.st_size, st.st_mtime_ns) if st is not None else (0, 0)
    yield CacheFile(path, kind, rank, group, hex_key, size, mtime_ns, reason)


def _stray(
    fs: RootFS, path: str, rank: int, reason: str, stat: bool, st: os.stat_result | None = None,
    unreadable: list[Unreadable] | None = None,
) -> Iterator[CacheFile]:
    """The stray entry at ``path`` (none if it vanished, or cannot be stat-ed: recorded in ``unreadable``)."""
    if st is None:
        try:
            st = fs.lstat(path)
        except OSError as exc:
            if exc.errno in NOT_THERE:
                return
            if unreadable is None:
                raise
            unreadable.append(unreadable_of(path, exc))
            return
    is_dir = S_ISDIR(st.st_mode)
    size, mtime_ns = (st.st_size, st.st_mtime_ns) if stat and not is_dir else (0, 0)
    name = path.rpartition("/")[2]
    hex_key = name[:-4]
    if not is_dir and name.endswith(".bin") and len(hex_key) == 2 * KEY_BYTES and _is_hex(hex_key):
        reason = "misplaced block file: not in a <hhh>/<hh>_g<group> directory"
        yield CacheFile(path, Kind.STRAY, rank, 0, hex_key, size, mtime_ns, reason)
        return
    yield CacheFile(path, Kind.STRAY, rank, size=size, mtime_ns=mtime_ns, reason=reason)


@dataclass(frozen=True, slots=True)
class QuarantineFile:
    """An entry of ``<root>/quarantine``. ``prefix``: the namespace its name gives, when that name is
    one the tier gives a quarantined record (:func:`quarantined_prefix`); ``why_not_ours``: why the
    tools do not take it for kvtier's (another name, or a directory that is no kvtier root), None
    when they do. Only entries taken for kvtier's are counted as quarantined or ever removed."""

    path: str
    prefix: str | None
    size: int
    mtime_ns: int
    why_not_ours: str | None = None

    @property
    def ours(self) -> bool:
        return self.why_not_ours is None


NOT_QUARANTINED = "in quarantine/ but not named as kvtier names a quarantined record (<prefix>_r<rank>__<hash>.bin)"
NOT_A_ROOT = "in quarantine/ of a directory that holds no kvtier namespace (not a kvtier root)"


def quarantined_prefix(name: str, root: str) -> str | None:
    """The namespace directory name in ``name`` if it is exactly how the tier names a quarantined
    record (``<prefix>_r<rank>__<64 hex digits>.bin``, :meth:`DiskLayout.quarantine_path`, with
    ``<prefix>`` a namespace name :func:`split_prefix` accepts), else None."""
    stem, dot, ext = name.rpartition(".")
    head, sep, hex_key = stem.rpartition("__")  # the hash has no "__"; a model name may
    prefix, rsep, rank = head.rpartition("_r")
    if not (dot and ext == "bin" and sep and rsep and len(hex_key) == 2 * KEY_BYTES and _is_hex(hex_key)):
        return None
    if not rank.isdigit() or str(int(rank)) != rank:
        return None
    return prefix if split_prefix(prefix, root) is not None else None


def iter_quarantine(cache: CacheRoot, unreadable: list[Unreadable] | None = None) -> Iterator[QuarantineFile]:
    """The entries of the quarantine directory other than directories, each marked kvtier's or not
    (:class:`QuarantineFile`: kvtier's when the directory is a kvtier root, :attr:`CacheRoot.is_kvtier_root`,
    and the entry is named as the tier names a quarantined record, :func:`quarantined_prefix`);
    nothing if ``quarantine`` is a symlink or not a directory (never followed). ``unreadable``:
    where a quarantine that cannot be listed is recorded (else the ``OSError`` is raised)."""
    try:
        listing = cache.fs.listing(cache.quarantine_dir)
    except OSError as exc:
        if unreadable is None:
            raise
        unreadable.append(unreadable_of(cache.quarantine_dir, exc))
        return
    root_ok = cache.is_kvtier_root
    for name, st in listing or ():
        if st is None or S_ISDIR(st.st_mode):
            continue
        owner = quarantined_prefix(name, cache.root)
        if not root_ok:
            why: str | None = NOT_A_ROOT
        elif owner is None:
            why = NOT_QUARANTINED
        else:
            why = None
        yield QuarantineFile(os.path.join(cache.quarantine_dir, name), owner, st.st_size, st.st_mtime_ns, why)
