"""kvtier.core.noreplace on this machine's filesystem: a rename that never replaces, never follows."""

from __future__ import annotations

import errno
import os

import pytest

from kvtier.core import noreplace


@pytest.fixture
def folder(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        noreplace.rename_noreplace("absent", "absent-too", src_dir_fd=fd, dst_dir_fd=fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        os.close(fd)
        if exc.errno in noreplace.UNSUPPORTED:
            pytest.skip(f"no renameat2(RENAME_NOREPLACE) here: {exc}")
        raise
    yield tmp_path, fd
    os.close(fd)


def test_renames_to_a_free_name(folder):
    path, fd = folder
    (path / "a").write_bytes(b"1")
    noreplace.rename_noreplace("a", "b", src_dir_fd=fd, dst_dir_fd=fd)
    assert sorted(os.listdir(path)) == ["b"] and (path / "b").read_bytes() == b"1"


def test_a_taken_name_is_file_exists_and_nothing_changes(folder):
    path, fd = folder
    (path / "a").write_bytes(b"new")
    (path / "b").write_bytes(b"old")
    (path / "target").write_bytes(b"outside")
    os.symlink(path / "target", path / "link")
    for taken in ("b", "link"):  # a file, and a symlink (never followed: its target is untouched)
        with pytest.raises(FileExistsError):
            noreplace.rename_noreplace("a", taken, src_dir_fd=fd, dst_dir_fd=fd)
    assert (path / "a").read_bytes() == b"new" and (path / "b").read_bytes() == b"old"
    assert (path / "target").read_bytes() == b"outside" and os.path.islink(path / "link")


def test_errors_carry_their_errno(folder):
    _path, fd = folder
    with pytest.raises(OSError) as caught:
        noreplace.rename_noreplace("missing", "x", src_dir_fd=fd, dst_dir_fd=fd)
    assert caught.value.errno == errno.ENOENT
