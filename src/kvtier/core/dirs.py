"""Directories an operator names (a disk tier's ``root_dir``, ``kvtier doctor --measure --dir``, the
folder of an output file such as ``kvtier plan --png``): can this process use one, create it, or
write a file in it, told without creating anything; and creating one owner-only.

- :func:`dir_problem` only stats: the path and, where it is missing, its nearest existing ancestor.
  It never creates, opens or changes anything, so a command can check every setting before it
  makes its first directory. A refusal that permissions do not show (a ``/proc`` or ``/sys``
  path, a full or read-only filesystem that ``os.access`` does not report) shows only when the
  directory is created: callers of :func:`make_dirs` still handle ``OSError``.
- :func:`output_file_problem` is the check for a file an operator names for output: its folder must
  already be a directory this process writes in (nothing is created for it, as ``cp`` or a shell
  redirection would not), checked before the work whose result it holds.
- :func:`make_dirs` creates the missing directories of a path, each with exactly the mode asked
  (the umask neither narrows nor widens it): a directory kvtier creates is :data:`OWNER_DIR_MODE`
  (``0700``), or :data:`GROUP_DIR_MODE` (``2770``) for a root shared by a group, never the
  umask's ``0755`` (docs/security.md). :func:`ready_dir` is the two in one: check, then create.

Standard library only; any process.
"""

from __future__ import annotations

import os
from pathlib import Path

OWNER_DIR_MODE = 0o700
"""Directories kvtier creates: owner only (``kvtier.tiers.disk.layout.Access.OWNER``'s, the same number)."""
GROUP_DIR_MODE = 0o2770
"""Directories of a ``group_access`` root: the group too, set-gid so the root's group is kept
(``kvtier.tiers.disk.layout.Access.GROUP``'s)."""


def existing_ancestor(path: str | Path) -> Path:
    """``path`` itself if it exists, else its nearest existing parent (absolute, symlinks resolved)."""
    current = Path(os.path.abspath(Path(path).expanduser()))
    while not current.exists() and current != current.parent:
        current = current.parent
    return current.resolve()


def dir_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be a directory this process writes in, as words that follow the path
    (``is not a directory``, ``cannot be created: /etc/hostname is not a directory``), or None: it
    is a directory this process may write and search, or it is missing and its nearest existing
    ancestor is one (so it can be created there, with its missing parents). Creates nothing."""
    target = Path(os.path.abspath(Path(path).expanduser()))
    if target.exists():  # symlinks followed: the directory the path names
        if not target.is_dir():
            return "is not a directory"
        if not os.access(target, os.W_OK | os.X_OK):
            return "is not a writable directory (this user cannot create files in it)"
        return None
    if target.is_symlink():
        return "cannot be created: it is a symlink to nothing"
    ancestor = target.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        if ancestor.is_symlink():
            return f"cannot be created: {ancestor} is a symlink to nothing"
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"cannot be created: {ancestor} is not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"cannot be created: {ancestor} is not writable by this user"
    return None


def output_file_problem(path: str | Path) -> str | None:
    """Why a file cannot be written at ``path`` into a folder that exists, as words that follow the
    path (``cannot be written: /nonexistent/dir does not exist``, ``cannot be written:
    /etc/hostname is not a directory``, ``is a directory``), or None: its folder is a directory this
    process may write in, and ``path`` is not a directory (nor a file it may not replace). Creates
    nothing, and never a missing folder: the caller writes the file there or refuses."""
    target = Path(os.path.abspath(Path(path).expanduser()))
    if target.is_dir():
        return "is a directory"
    folder = target.parent
    if not folder.exists():
        return f"cannot be written: {folder} does not exist (create it first)"
    if not folder.is_dir():
        return f"cannot be written: {folder} is not a directory"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot be written: {folder} is not writable by this user"
    if target.exists() and not os.access(target, os.W_OK):
        return "is not writable by this user"
    return None


def make_dirs(path: str | Path, mode: int) -> list[str]:
    """Create ``path`` and its missing parents, each with exactly ``mode``; returns the directories
    it created, outermost first ([] when ``path`` was already a directory). One created meanwhile by
    another process is left as it is (and not listed). Raises ``OSError`` as ``os.mkdir`` does
    (``ENOTDIR`` where a component is a file, ``EACCES``, ``ENOENT`` under ``/proc``...)."""
    missing = []
    current = os.path.abspath(os.fspath(Path(path).expanduser()))
    while current not in ("", "/") and not os.path.isdir(current):
        missing.append(current)
        current = os.path.dirname(current)
    created = []
    for directory in reversed(missing):
        try:
            os.mkdir(directory, mode)
        except FileExistsError:
            continue
        os.chmod(directory, mode)  # the umask must not narrow (or widen) it
        created.append(directory)
    return created


def ready_dir(path: str | Path, mode: int) -> str | None:
    """Make ``path`` a directory this process can write: None when it is one now (created, with its
    missing parents, each with exactly ``mode``, where it was missing), else why not, as
    :func:`dir_problem` words it (``cannot be created: No such file or directory`` for a refusal
    only creating shows). Nothing is created when :func:`dir_problem` finds a reason first."""
    problem = dir_problem(path)
    if problem is None:
        try:
            make_dirs(path, mode)
        except OSError as exc:
            return f"cannot be created: {exc.strerror or exc}"
    return problem
