"""Where the disk tier's files live, and the directory walk that finds them.

Layout (the one vLLM's fs tier documents, so operators know it)::

    <root>/<model>_<digest16>/config.json                 the namespace, as JSON
    <root>/<model>_<digest16>/usage_g<group>              the usage ledger (kvtier.tiers.disk.ledger)
    <root>/<model>_<digest16>_r<rank>/<hhh>/<hh>_g<group>/<hash_hex>.bin
    <root>/quarantine/<model>_<digest16>_r<rank>__<hash_hex>.bin

``<model>`` is the model name reduced to ``[A-Za-z0-9._-]``, at most 128 characters (:func:`sanitize_model_name`),
``<digest16>`` the first 16 hex digits of the rank-independent namespace digest, ``<hash_hex>``
the block key in hex, ``<hhh>``/``<hh>`` its first 3 and next 2 hex digits. Each ``.bin`` is a
"kvtier block file v1" (:mod:`kvtier.tiers.blockfile`). A block is present only when the file
of every rank exists. Writers publish a file by linking ``<hash_hex>.bin.<pid>.<random>.tmp`` to its
final name (:mod:`kvtier.tiers.disk.writer`).

Access: directories kvtier creates are owner-only (0700) and files 0600, unless the operator
asks for group access (:attr:`Access.GROUP`: 2770 and 0660, the set-gid bit keeping the group of
the root). Whoever else can write the root: every path below it is resolved by the layout's
:class:`~kvtier.core.rootfs.RootFS` (:attr:`DiskLayout.fs`), which follows no symlink at any
component and opens only regular files, without waiting (``O_NONBLOCK``); every read is bounded by
what the format allows. A planted symlink, FIFO, device or directory where kvtier expects one of
its files is a miss (a record: quarantined, i.e. the entry itself renamed into ``quarantine/``),
or is ignored (a directory of the walk); nothing outside the root is read, written or touched.

Threads: :class:`DiskLayout` is immutable and every function here does file-system work only,
never touching the tier's in-memory index, so any thread may call it. The tier calls
:meth:`DiskLayout.create` and the start-up :meth:`DiskLayout.scan` from its constructor, later
scans from its scan thread, and merges each :class:`ScanResult` itself on its caller's thread.
"""

from __future__ import annotations

import enum
import errno
import json
import logging
import os
import re
import stat
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.core.keys import KEY_BYTES, BlockKey
from kvtier.core.rootfs import DIR_OPEN, NOT_THERE, RootFS, lstat_at

logger = logging.getLogger(__name__)

QUARANTINE_DIR = "quarantine"
CONFIG_MAX_BYTES = 1 << 20
"""The longest ``config.json`` read (a namespace's JSON is a few KiB)."""
STALE_TMP_SECONDS = 3600.0  # a temp file this old is removed even if its writer's pid looks alive
ORPHAN_SECONDS = 600.0  # files of a block missing some rank's file, this old, are removed by a scan

class Access(enum.Enum):
    """Who may read and write what the disk tier creates: (directory mode, file mode)."""

    OWNER = (0o700, 0o600)
    GROUP = (0o2770, 0o660)

    @property
    def dir_mode(self) -> int:
        return self.value[0]

    @property
    def file_mode(self) -> int:
        return self.value[1]


class PlantedEntryError(OSError):
    """Something kvtier needs below its root (a namespace or rank directory, ``config.json``) is a
    symlink, a FIFO or another object kvtier never makes there: the tier refuses to start."""


_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]")
MODEL_NAME_CHARS = 128
"""The longest ``<model>`` part: every name built on it (the longest, a quarantined record's
``<model>_<digest16>_r<rank>__<hash_hex>.bin``, adds 93 characters at 4-digit ranks) stays within
the 255 bytes a file name may have (the digest, not the name, tells namespaces apart)."""
_HEX = frozenset("0123456789abcdef")
_BIN_NAME_LEN = 2 * KEY_BYTES + 4  # "<64 hex>.bin"


def sanitize_model_name(model_name: str) -> str:
    """The ``<model>`` part of directory names: only ``[A-Za-z0-9._-]``.

    A filesystem path (absolute, or starting with ``.`` or ``~``) contributes its last
    component (``/models/llama-3/`` -> ``llama-3``); in anything else, such as a Hugging Face
    repo id, separators become ``_`` like every other character outside the set
    (``HuggingFaceTB/SmolLM2-135M`` -> ``HuggingFaceTB_SmolLM2-135M``). At most
    :data:`MODEL_NAME_CHARS` characters (a longer name keeps its first ones).
    """
    name = model_name.strip()
    if name.startswith(("/", ".", "~")) or os.path.isabs(name):
        name = re.split(r"[/\\]", name.rstrip("/\\"))[-1]
    name = _UNSAFE_CHARS.sub("_", name)
    if name.strip(".") == "":
        name = "model" if not name else name.replace(".", "_")
    return name[:MODEL_NAME_CHARS]


def per_group_files(fs: RootFS, ns_dir: str, prefix: str, suffix: str = "") -> list[str]:
    """Files ``<prefix><group digits><suffix>`` of a namespace directory (one per group), sorted;
    none if the directory cannot be listed (or is not a directory)."""
    try:
        names = fs.listdir(ns_dir)
    except OSError:
        return []
    return sorted(
        os.path.join(ns_dir, name) for name in names
        if name.startswith(prefix) and name.endswith(suffix)
        and name[len(prefix) : len(name) - len(suffix)].isdigit()
    )


def unlink_quiet(fs: RootFS, path: str) -> bool:
    """Unlink ``path`` (below ``fs``'s root); False only on an error other than "already gone"."""
    return remove_file(fs, path) is not Removal.FAILED


class Removal(enum.Enum):
    """What removing a block file from its place did. The usage ledger
    (:mod:`kvtier.tiers.disk.ledger`) gives back a file's bytes only when this call removed it."""

    UNLINKED = "unlinked"
    MOVED = "moved"  # renamed into quarantine
    ABSENT = "absent"  # already gone: whoever removed it gave its bytes back
    FAILED = "failed"  # still there (logged)

    @property
    def removed(self) -> bool:
        """Whether this call took the file away from its place."""
        return self is Removal.UNLINKED or self is Removal.MOVED


def remove_file(fs: RootFS, path: str) -> Removal:
    """Unlink the entry at ``path`` (below ``fs``'s root, reached without following a symlink; a
    planted symlink is removed itself): UNLINKED, ABSENT (already gone) or FAILED (logged)."""
    try:
        fs.unlink(path)
    except FileNotFoundError:
        return Removal.ABSENT
    except OSError as exc:
        logger.warning("kvtier disk: cannot remove %s: %s", path, exc)
        return Removal.FAILED
    return Removal.UNLINKED


@dataclass(slots=True)
class ScanResult:
    """What a scan of the rank directories found (built on a worker thread).

    The walk itself removes only dead writers' temp files; the files it found bad are listed in
    ``to_quarantine`` and ``orphans`` and removed afterwards under the usage ledger's lock
    (:func:`kvtier.tiers.disk.files.settle_scan`, which fills in ``quarantined``).
    """

    new: list[tuple[int, str]]  # (newest mtime_ns over ranks, hex key) of complete blocks not known
    vanished: list[str]  # known hex keys not complete on disk any more
    quarantined: int = 0
    io_errors: int = 0
    units: int = 0  # files the usage ledger charges that the walk saw (see DiskLayout.count_units)
    to_quarantine: list[tuple[str, int]] = field(default_factory=list)  # (hex key, rank): wrong size
    orphans: list[str] = field(default_factory=list)  # files of blocks missing a rank for ORPHAN_SECONDS


class DiskLayout:
    """The directories and file names of one namespace, world size and group (see the module
    docstring), and :attr:`fs`, through which every path below the root is reached."""

    __slots__ = ("root", "prefix", "ns_dir", "rank_dirs", "quarantine_dir", "group_suffix", "world", "access", "fs")

    def __init__(
        self, root_dir: Path | str, model_name: str, engine_digest: bytes, world: int, group: int,
        access: Access = Access.OWNER, fs: RootFS | None = None,
    ) -> None:
        self.root = str(Path(root_dir))
        self.access = access
        self.fs = RootFS(self.root) if fs is None else fs  # opens nothing until used
        self.prefix = f"{sanitize_model_name(model_name)}_{bytes(engine_digest).hex()[:16]}"
        self.ns_dir = os.path.join(self.root, self.prefix)
        self.rank_dirs = tuple(os.path.join(self.root, f"{self.prefix}_r{rank}") for rank in range(world))
        self.quarantine_dir = os.path.join(self.root, QUARANTINE_DIR)
        self.group_suffix = f"_g{group}"
        self.world = world

    def path(self, hex_key: str, rank: int) -> str:
        """Where the file of block ``hex_key`` of ``rank`` lives."""
        return f"{self.rank_dirs[rank]}/{hex_key[:3]}/{hex_key[3:5]}{self.group_suffix}/{hex_key}.bin"

    def paths(self, hex_key: str) -> list[str]:
        """The files of block ``hex_key``, one per rank."""
        return [self.path(hex_key, rank) for rank in range(self.world)]

    def make_dir(self, path: str) -> None:
        """Create the directory ``path`` below the root, and its missing parents, with the access mode.
        Raises ``OSError`` (``ELOOP``, ``ENOTDIR``) if a component is a symlink or not a directory:
        nothing is ever created through one. Any thread."""
        self.fs.make_dirs(path, self.access.dir_mode)

    def remove(self, path: str) -> Removal:
        """Unlink the entry at ``path`` (see :func:`remove_file`)."""
        return remove_file(self.fs, path)

    def quarantine_path(self, hex_key: str, rank: int) -> str:
        return f"{self.quarantine_dir}/{self.prefix}_r{rank}__{hex_key}.bin"

    def quarantine(self, hex_key: str, rank: int, src: str | None = None) -> Removal:
        """Move a bad file aside (worker threads): MOVED, or UNLINKED when it cannot be moved,
        ABSENT when it is gone already, FAILED when it stays (logged). The entry itself is moved
        (a planted symlink, FIFO or directory too, never what a symlink points to).

        ``src``: where the file is when not at :meth:`path` (``kvtier verify`` moves misplaced files).
        Callers that remove a file the usage ledger charges do it through
        :meth:`kvtier.tiers.disk.ledger.Ledger.remove`, which gives its bytes back.
        """
        src = self.path(hex_key, rank) if src is None else src
        dst = self.quarantine_path(hex_key, rank)
        fs = self.fs
        try:
            try:
                fs.rename(src, dst)
            except FileNotFoundError:
                if not fs.lexists(src):
                    return Removal.ABSENT
                self.make_dir(self.quarantine_dir)
                fs.rename(src, dst)
        except OSError as exc:
            logger.warning("kvtier disk: cannot quarantine %s: %s; removing it", src, exc)
            return remove_file(fs, src)
        return Removal.MOVED

    def create(self, namespace_json: str) -> None:
        """Create the directories and ``config.json``; refuse a directory of another namespace, and
        one where a symlink or another planted object stands for a directory or ``config.json``
        (:class:`PlantedEntryError`)."""
        path = os.path.join(self.ns_dir, "config.json")
        try:
            self.make_dir(self.ns_dir)
            for rank_dir in self.rank_dirs:
                self.make_dir(rank_dir)
            try:
                existing = self.fs.read_bytes(path, CONFIG_MAX_BYTES).decode("utf-8", errors="replace")
            except FileNotFoundError:
                self.fs.write_atomic(path, namespace_json.encode("utf-8"), self.access.file_mode)
                return  # atomic; a concurrent start-up writes the same bytes
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT):
                raise
            raise PlantedEntryError(
                exc.errno, f"disk tier root {self.root}: {exc.filename or path} is not what kvtier makes there "
                f"({exc.strerror}): a symlink, FIFO or other object planted by someone who can write the root? "
                "kvtier never follows or opens one. Remove it, or use another root_dir.", exc.filename,
            ) from None
        if existing == namespace_json:
            return
        try:
            same = _identity(json.loads(existing)) == _identity(json.loads(namespace_json))
        except (ValueError, AttributeError):
            same = False
        if not same:
            raise ValueError(
                f"disk tier directory {self.ns_dir} holds config.json of a different namespace than "
                f"this engine's, although the directory name (digest {self.prefix[-16:]}) says they are "
                "the same: the directory was modified by hand. Move it away or use another root_dir."
            )

    def leaf_dirs(self, rank_dir: str) -> list[str]:
        """The ``<hhh>/<hh>_g<group>`` directories under ``rank_dir``."""
        return [leaf for leaf, _ in self.leaves(rank_dir)]

    def leaves(self, rank_dir: str) -> list[tuple[str, str]]:
        """``(directory, name prefix)`` of every ``<hhh>/<hh>_g<group>`` directory under ``rank_dir``:
        the files that belong there start with the prefix ``<hhh><hh>``. Symlinks and other
        entries that are not directories are skipped (never followed)."""
        found: list[tuple[str, str]] = []
        for leaf, prefix, _fd in self.walk_leaves(rank_dir):
            found.append((leaf, prefix))
        return found

    def walk_leaves(self, rank_dir: str) -> Iterator[tuple[str, str, int]]:
        """``(directory, name prefix, descriptor)`` of every leaf directory under ``rank_dir`` (see
        :meth:`leaves`), each opened without following a symlink; the descriptor is valid until the
        next item is asked for (closed by the walk)."""
        suffix = self.group_suffix
        sub_len = 2 + len(suffix)
        try:
            rank_fd = self.fs.open_dir(rank_dir)
        except OSError as exc:
            if exc.errno in NOT_THERE:
                return
            raise
        try:
            for top in os.listdir(rank_fd):
                if len(top) != 3:
                    continue
                try:
                    top_fd = os.open(top, DIR_OPEN, dir_fd=rank_fd)
                except OSError as exc:
                    if exc.errno in NOT_THERE:  # gone, a file, or a symlink: nothing of the tier's
                        continue
                    raise
                try:
                    subs = [sub for sub in os.listdir(top_fd) if len(sub) == sub_len and sub.endswith(suffix)]
                    for sub in subs:
                        try:
                            leaf_fd = os.open(sub, DIR_OPEN, dir_fd=top_fd)
                        except OSError as exc:
                            if exc.errno in NOT_THERE:
                                continue
                            raise
                        try:
                            yield f"{rank_dir}/{top}/{sub}", top + sub[:2], leaf_fd
                        finally:
                            os.close(leaf_fd)
                finally:
                    os.close(top_fd)
        finally:
            os.close(rank_fd)

    def count_units(self) -> int:
        """How many files the usage ledger charges are on disk: every ``<hash>.bin`` in its place
        and every block writer's temp file (``<hash>.bin.<pid>.<random>.tmp``), over this layout's
        ranks and group. Names only (no ``stat``): the ledger rebuilds itself from this, under its lock.
        """
        units = 0
        for rank_dir in self.rank_dirs:
            for _leaf, prefix, leaf_fd in self.walk_leaves(rank_dir):
                units += sum(1 for name in os.listdir(leaf_fd) if is_unit(name, prefix))
        return units

    def scan(self, known: Sequence[BlockKey] | None, file_bytes: int) -> ScanResult:
        """Walk the rank directories (file I/O only, no index access).

        ``known``: keys indexed when the scan started; their files are not ``stat``-ed (None:
        start-up, stat everything). Removes stale temp files (:func:`remove_stale_tmp`); lists files
        that are not regular files of ``file_bytes`` (to quarantine: a planted symlink, FIFO or
        directory included) and the files of blocks missing some rank's file for more than
        :data:`ORPHAN_SECONDS` (to remove), and counts the files the usage ledger charges
        (``units``, those listed included). Files not in their place are ignored, and so are
        directories that are symlinks or not directories (never followed).
        """
        known_hex = frozenset(key.hex() for key in known) if known is not None else frozenset()
        result = ScanResult(new=[], vanished=[])
        now = time.time()
        listdir, stat_at, is_reg = os.listdir, os.stat, stat.S_ISREG
        per_rank: list[dict[str, int]] = []  # hex key -> mtime_ns (0 for known keys, not stat-ed)
        units = 0
        for rank, rank_dir in enumerate(self.rank_dirs):
            found: dict[str, int] = {}
            for leaf, prefix, leaf_fd in self.walk_leaves(rank_dir):
                for name in listdir(leaf_fd):
                    if name.endswith(".bin"):
                        if len(name) != _BIN_NAME_LEN or not name.startswith(prefix):
                            continue
                        units += 1
                        hex_key = name[:-4]
                        if hex_key in known_hex:
                            found[hex_key] = 0
                            continue
                        try:
                            st = stat_at(name, dir_fd=leaf_fd, follow_symlinks=False)
                        except FileNotFoundError:
                            units -= 1
                            continue
                        except OSError:
                            result.io_errors += 1
                            continue
                        if st.st_size != file_bytes or not is_reg(st.st_mode):
                            if set(hex_key) <= _HEX:
                                logger.warning(
                                    "kvtier disk: %s/%s is %s, expected a %d-byte file; quarantined", leaf, name,
                                    f"{st.st_size} bytes" if is_reg(st.st_mode) else "not a regular file", file_bytes,
                                )
                                result.to_quarantine.append((hex_key, rank))
                            continue
                        found[hex_key] = st.st_mtime_ns
                    elif name.endswith(".tmp") and not remove_stale_tmp(leaf_fd, name, now):
                        units += is_unit(name, prefix)
            per_rank.append(found)
        result.units = units

        first = per_rank[0]
        if len(per_rank) == 1:
            complete = first.keys()
            result.new = [(mtime, hex_key) for hex_key, mtime in first.items() if hex_key not in known_hex]
        else:
            complete = set(first).intersection(*per_rank[1:])
            result.new = [
                (max(found[hex_key] for found in per_rank), hex_key)
                for hex_key in complete
                if hex_key not in known_hex
            ]
            # Blocks missing some rank's file: completed soon (a writer is between ranks) or orphans.
            partial = set(first).union(*per_rank[1:]) - complete
            for hex_key in partial:
                paths = [self.path(hex_key, rank) for rank, found in enumerate(per_rank) if hex_key in found]
                stamps = self._mtimes(paths)
                if stamps and now - max(stamps) / 1e9 > ORPHAN_SECONDS:
                    result.orphans.extend(paths)
        result.vanished = list(known_hex.difference(complete))
        return result

    def _mtimes(self, paths: Sequence[str]) -> list[int]:
        stamps = []
        for path in paths:
            try:
                stamps.append(self.fs.lstat(path).st_mtime_ns)
            except OSError:
                pass
        return stamps


def is_unit(name: str, prefix: str) -> bool:
    """Whether a file named ``name`` in a leaf directory whose files start with ``prefix`` is one the
    usage ledger charges: a block file in its place, or a block writer's temp file."""
    if not name.startswith(prefix):
        return False
    if len(name) == _BIN_NAME_LEN:
        return name.endswith(".bin")
    return name.endswith(".tmp") and name[_BIN_NAME_LEN - 4 : _BIN_NAME_LEN] == ".bin"


def _identity(config: dict) -> dict:
    """A config.json without its display name (``model_name`` is for operators, not identity)."""
    return {key: value for key, value in config.items() if key != "model_name"}


def remove_stale_tmp(dir_fd: int, name: str, now: float) -> bool:
    """Remove the temp file ``name`` of the directory ``dir_fd`` if its writer died, or if it is older
    than :data:`STALE_TMP_SECONDS`; True if it is gone. The entry itself is removed (a planted
    symlink so named: the link, never its target).

    Temp names are ``<hash>.bin.<pid>.<random>.tmp``. A pid from another PID namespace can
    look dead while its writer lives; removing its temp file then only fails that write.
    """
    parts = name.split(".")
    pid = int(parts[-3]) if len(parts) >= 5 and parts[-3].isdigit() else -1
    if pid <= 0 or _pid_alive(pid):
        try:
            st = lstat_at(dir_fd, name)
        except OSError:
            return False
        if st is None:
            return True
        if now - st.st_mtime <= STALE_TMP_SECONDS:
            return False
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return True
    except OSError as exc:  # name comes from a listing: %r, so a planted name forges no log line
        logger.warning("kvtier disk: cannot remove the stale temp file %r: %s", name, exc)
        return False
    return True


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: exists, owned by someone else
        return True
    return True
