"""What a disk-tier root holds, read by tests while engines may still write and evict in it.

A live root changes under a walk: a leaf directory emptied by eviction is removed, a record is
published or unlinked between being listed and being stat'ed. ``Path.rglob`` raises when a
directory it listed is gone by the time it descends (seen in CI); these helpers walk with
``os.walk``, which skips such a directory, and skip a file that vanished before its ``stat``.

Sizes meant to be compared with ``capacity_bytes`` are taken under the namespace's usage-ledger
lock (:mod:`kvtier.tiers.disk.ledger`): every writer and remover of block files holds it while the
files change, so a walk under it never counts a record evicted during the walk together with one
written after that eviction.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path


def _files(root: Path, suffix: str) -> list[Path]:
    found = []
    for where, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "quarantine"]
        found.extend(Path(where, name) for name in names if name.endswith(suffix))
    return sorted(found)


def record_files(root: Path) -> list[Path]:
    """Every ``.bin`` record below ``root`` (a root, or one rank's directory), quarantine left out."""
    return _files(Path(root), ".bin")


def temp_files(root: Path) -> list[Path]:
    """Every writer's temp file below ``root``."""
    return _files(Path(root), ".tmp")


def present_bytes(paths: list[Path]) -> int:
    """The bytes of those of ``paths`` that still exist."""
    total = 0
    for path in paths:
        try:
            total += path.stat().st_size
        except FileNotFoundError:
            continue
    return total


def namespace_bytes(root: Path, namespace: str, group: int = 0) -> int:
    """The bytes of namespace ``namespace``'s records (every rank), walked under its ledger's lock
    (0 before the ledger exists). A file unlinked without the lock (an operator's tool) is skipped."""
    ledger_path = Path(root, namespace, f"usage_g{group}")
    try:
        ledger = open(ledger_path, "rb")
    except FileNotFoundError:
        return 0
    with ledger:
        fcntl.flock(ledger, fcntl.LOCK_EX)
        try:
            ranks = [p for p in Path(root).glob(f"{namespace}_r*") if p.is_dir()]
            files = [p for rank in ranks for p in record_files(rank) if p.parent.name.endswith(f"_g{group}")]
            return present_bytes(files)
        finally:
            fcntl.flock(ledger, fcntl.LOCK_UN)


def settle_scan(tier, timeout: float = 30.0) -> None:
    """Wait for a DiskTier's running rescan (the one its start-up begins) to be merged: a later
    ``rescan()`` does nothing while one runs."""
    deadline = time.monotonic() + timeout
    while tier._state.scan_running:  # noqa: SLF001
        assert time.monotonic() < deadline, "rescan did not finish"
        tier.poll()
        time.sleep(0.005)
