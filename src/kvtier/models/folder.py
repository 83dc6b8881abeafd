"""The life cycle of a converted model folder in kvtier's cache, shared by every embedded model
(:mod:`~kvtier.models.default`, :mod:`~kvtier.models.gemma`).

Invariants (the same for every model):

* A folder is *ready* only if its marker file (:data:`MARKER`) holds exactly the marker the caller
  expects (format version, dtype, which source file it was made from) and every required file is
  there. The marker is written last, so a folder without a matching marker is incomplete and rebuilt.
* A ready folder is never seen half-written: :func:`build` fills a temporary folder beside the
  target and ``os.rename``\\s it into place. When two processes convert at once, the first rename
  wins and the loser discards its own copy.
* Temporary folders of crashed conversions are removed once they are older than an hour.
* The cache folders it creates above the target (``~/.cache/kvtier``, ``models``) are owner-only
  (``0700``, :func:`kvtier.core.dirs.make_dirs`); a folder that exists is left as it is.

Standard library (and :mod:`kvtier.core.dirs`): importing this module costs nothing.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

from kvtier.core.dirs import OWNER_DIR_MODE, make_dirs

MARKER = "kvtier-model.json"

_STALE_TMP_SECONDS = 3600  # a conversion takes minutes at most; older temp folders are debris

log = logging.getLogger(__name__)


def build(
    target: Path,
    marker: dict,
    convert: Callable[[Path], None],
    required_files: Iterable[str],
    error: type[Exception] = RuntimeError,
) -> Path:
    """Return ``target`` once it is a ready folder for ``marker``, running ``convert(tmp)`` into a
    fresh temporary folder and installing it atomically if it is not ready yet."""
    required = tuple(required_files)
    if is_ready(target, marker, required):
        return target
    make_dirs(target.parent, OWNER_DIR_MODE)  # kvtier's cache and its parents: owner only (core/dirs.py)
    remove_stale_temps(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        log.info("Converting %s into %s (once)", marker.get("model"), target)
        start = time.monotonic()
        convert(tmp)
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")  # last: marks completion
        make_readable(tmp)
        install(tmp, target, marker, required, error)
        log.info("Converted in %.1f s", time.monotonic() - start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op once renamed into place
    if not is_ready(target, marker, required):
        raise error(f"{target} is not complete after conversion")
    return target


def sha256_file(path: Path) -> str:
    """SHA-256 of a file, cached per (path, size, mtime) so repeated checks cost nothing."""
    stat = path.stat()
    return _sha256(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def is_ready(folder: Path, marker: dict, required_files: Iterable[str]) -> bool:
    """True if ``folder`` holds a finished conversion matching ``marker``."""
    try:
        found = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return found == marker and all((folder / name).is_file() for name in required_files)


def install(tmp: Path, target: Path, marker: dict, required_files: Iterable[str],
            error: type[Exception] = RuntimeError) -> None:
    """Rename the finished ``tmp`` to ``target``; if another process got there first, keep its."""
    required = tuple(required_files)
    for _ in range(3):
        try:
            os.rename(tmp, target)  # atomic; succeeds if target is absent or an empty folder
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        if is_ready(target, marker, required):
            return  # a concurrent conversion won; the caller discards tmp
        # An incomplete or outdated folder: move it aside atomically, then delete it.
        aside = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(target, aside)
        except FileNotFoundError:
            continue
        shutil.rmtree(aside, ignore_errors=True)
    raise error(f"could not move the converted model into {target}")


def make_readable(folder: Path) -> None:
    """Give the folder and its files the usual umask permissions (mkdtemp makes them private)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def remove_stale_temps(target: Path) -> None:
    """Delete temporary folders that crashed conversions left beside ``target``."""
    now = time.time()
    for pattern in (f".{target.name}.tmp-*", f".{target.name}.old-*"):
        for path in target.parent.glob(pattern):
            try:
                if now - path.stat().st_mtime > _STALE_TMP_SECONDS:
                    shutil.rmtree(path, ignore_errors=True)
            except OSError:
                pass
