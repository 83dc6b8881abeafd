"""Text from outside kvtier made safe to print on the operator's terminal.

A hostile writer of a shared store (a model name in a namespace's config, a key, a file name), an
engine attached to a node (its name) or a server (its error message) chooses the text that
``kvtier inspect / verify / purge`` and ``kvtier doctor`` print. Printed raw, an ESC or a C1 CSI
in it is a terminal command (retitle the window, clear the screen, move the cursor, write the
clipboard through OSC 52) and a bidirectional override reorders what the operator reads; in rich
markup, ``[...]`` would restyle or hide the rest of the line. :func:`printable` writes each such
character as its Python escape (``\\x1b``, ``\\u202e``; from :mod:`kvtier.core.text`, which logs use
too); :func:`shown` also escapes rich markup. :func:`console` is the rich console every ``kvtier``
command prints to: emoji codes off, so a name such as ``kvtier:a`` followed by a colon stays text
instead of becoming a symbol.

Pure functions, any thread; rich is imported only when called.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from kvtier.core.text import printable

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["console", "printable", "shown"]


def shown(text: object) -> str:
    """:func:`printable` of ``text``, rich markup escaped: for an f-string printed as markup."""
    from rich.markup import escape

    return escape(printable(text))


def console(*, piped_width: int | None = None, stderr: bool = False, **options: Any) -> Console:
    """A rich console on stdout (or stderr) with emoji codes off; ``piped_width``: its width when
    that stream is not a terminal (a pipe, a log, a test), instead of rich's default; ``options``:
    more of rich's ``Console`` arguments."""
    from rich.console import Console

    width = None if piped_width is None or (sys.stderr if stderr else sys.stdout).isatty() else piped_width
    return Console(stderr=stderr, width=width, emoji=False, **options)
