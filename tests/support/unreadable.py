"""Directories a command cannot read, for the operator tools' tests, as root or not.

Root reads everything (``CAP_DAC_OVERRIDE``), so as root the command runs under ``setpriv`` without
the capabilities that bypass file permissions, on objects given to another uid with mode 000; as
another user, mode 000 on one's own directory is enough. :func:`runner_prefix` says how (None:
neither works here, and the test skips).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
ENV = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
OTHER_UID = 12345
_CAPS = "-dac_override,-dac_read_search,-fowner"
SETPRIV = ["setpriv", "--bounding-set", _CAPS, "--inh-caps", _CAPS]


def make_unreadable(path: Path) -> None:
    if os.getuid() == 0:
        os.chown(path, OTHER_UID, -1)
    os.chmod(path, 0)


def make_readable(path: Path) -> None:
    os.chmod(path, 0o700)
    if os.getuid() == 0:
        os.chown(path, 0, -1)


@functools.cache
def runner_prefix() -> tuple[str, ...] | None:
    """The command prefix under which :func:`make_unreadable` objects cannot be read, or None."""
    if os.getuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        return None
    probe = Path(tempfile.mkdtemp(prefix="kvtier-unreadable-"))
    try:
        make_unreadable(probe)
        denied = subprocess.run([*SETPRIV, "ls", str(probe)], capture_output=True, timeout=30).returncode != 0
    except (OSError, subprocess.SubprocessError):
        denied = False
    finally:
        make_readable(probe)
        probe.rmdir()
    return tuple(SETPRIV) if denied else None


def kvtier(*args: object, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``kvtier ARGS`` in a process that cannot read :func:`make_unreadable` objects (call
    :func:`runner_prefix` first and skip when it is None)."""
    prefix = runner_prefix()
    assert prefix is not None
    command = [*prefix, sys.executable, "-m", "kvtier.cli.main", *(str(a) for a in args)]
    return subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=timeout)
