"""Where kvtier keeps its own files on this machine (converted models, weight fingerprints, the
default disk tier): ``$KVTIER_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvtier``, else ``~/.cache/kvtier``.

Pure path arithmetic, any process: the connector (fingerprint cache) and the operator tools
(model conversion, ``kvtier serve``'s default disk directory) agree through it.
"""

from __future__ import annotations

import os
from pathlib import Path


def kvtier_cache_dir() -> Path:
    """``$KVTIER_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvtier``, else ``~/.cache/kvtier``."""
    if os.environ.get("KVTIER_CACHE_DIR"):
        return Path(os.environ["KVTIER_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "kvtier"
    return Path.home() / ".cache" / "kvtier"
