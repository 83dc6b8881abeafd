"""Namespaces that belong to one process, and their reclaiming once that process is gone.

Behind vLLM's own offloading, an engine that hashes blocks with xxhash and no ``PYTHONHASHSEED``
draws a random seed per process: no other process, and no restart, can ever compute its keys, so
its namespace on a disk root is worth nothing once it exits. It is removed at shutdown and at
interpreter exit; a process killed with SIGKILL (or by the OOM killer) does neither. So such a
namespace carries an owner file (:data:`OWNER_FILE`, beside its ``config.json``) naming the process
that owns it: host, boot, pid and the process's start time (pids are reused). Whoever opens a
native tier on the root next (:func:`reclaim_orphans`) removes every namespace whose owner ran on
this host and boot and is no longer alive (``kvtier purge --namespace`` removes one by hand). An
owner on another host (a root shared over the network) is never judged from here.

The owner file is read and written through the root's :class:`~kvtier.core.rootfs.RootFS`
(no symlink followed; read only if a regular file of at most :data:`OWNER_MAX_BYTES`), and
namespaces are removed with ``shutil.rmtree``, which never follows a symlink.

Caller's thread; I/O on the root (a directory listing, one small file per namespace, removals).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier.core.rootfs import RootFS

logger = logging.getLogger(__name__)

OWNER_FILE = "owner.json"
OWNER_MAX_BYTES = 64 << 10
"""The longest owner file read (one is about 150 bytes)."""
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class Owner:
    """The process a namespace belongs to."""

    host: str
    boot: str
    pid: int
    started: str  # the process's start time in clock ticks since boot ("" where /proc has none)

    @classmethod
    def this_process(cls) -> Owner:
        return cls(host=socket.gethostname(), boot=_boot_id(), pid=os.getpid(), started=_start_time(os.getpid()))

    def is_gone(self) -> bool | None:
        """True when this owner is known to have exited; False while it runs; None when that cannot
        be told from here (another host)."""
        if self.host != socket.gethostname():
            return None
        if self.boot and self.boot != _boot_id():
            return True  # the machine rebooted since
        started = _start_time(self.pid)
        if not started and not _alive(self.pid):
            return True
        return bool(self.started) and bool(started) and started != self.started  # pid reused


def _owner_path(ns_dir: str | os.PathLike[str]) -> tuple[RootFS, str]:
    """The root's file system (a namespace directory's parent is the root) and the owner file's path."""
    ns = Path(ns_dir)
    return RootFS(str(ns.parent)), str(ns / OWNER_FILE)


def mark_owned(ns_dir: str | os.PathLike[str], owner: Owner | None = None) -> None:
    """Record that the namespace in ``ns_dir`` belongs to ``owner`` (default: this process)."""
    fs, path = _owner_path(ns_dir)
    fs.write_atomic(path, json.dumps(asdict(owner or Owner.this_process())).encode(), 0o644)  # any user may judge it


def owner_of(ns_dir: str | os.PathLike[str]) -> Owner | None:
    """The owner recorded in ``ns_dir``; None for a namespace that any process may use (or an
    unreadable owner file, a planted one that is not a regular file or too long: never judged,
    never removed)."""
    try:
        fs, path = _owner_path(ns_dir)
        raw = json.loads(fs.read_bytes(path, OWNER_MAX_BYTES))
        return Owner(host=str(raw["host"]), boot=str(raw["boot"]), pid=int(raw["pid"]), started=str(raw["started"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def orphans(root: str | os.PathLike[str]) -> list[Path]:
    """Namespace directories under ``root`` whose owner is gone."""
    found: list[Path] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return found
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            continue
        owner = owner_of(entry.path)
        if owner is not None and owner.is_gone():
            found.append(Path(entry.path))
    return found


def remove_namespace(ns_dir: Path) -> None:
    """Remove a namespace whole: its directory (config.json, ledger, owner) and every rank's."""
    for rank_dir in sorted(ns_dir.parent.glob(f"{ns_dir.name}_r*")):
        suffix = rank_dir.name[len(ns_dir.name) + 2:]
        if suffix.isdigit() and rank_dir.is_dir() and not rank_dir.is_symlink():
            shutil.rmtree(rank_dir, ignore_errors=True)
    shutil.rmtree(ns_dir, ignore_errors=True)


def reclaim_orphans(root: str | os.PathLike[str]) -> list[Path]:
    """Remove every namespace under ``root`` whose owner is gone; the ones removed."""
    removed = orphans(root)
    for ns_dir in removed:
        remove_namespace(ns_dir)
        logger.info("kvtier disk: removed %s, the per-process namespace of a process that is gone", ns_dir)
    return removed


def _boot_id() -> str:
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after the command name


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
