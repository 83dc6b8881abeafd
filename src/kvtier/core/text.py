"""Text chosen outside kvtier made safe for a log line or a terminal.

A hostile writer of a shared store (a file or key name, a model name in a namespace's config), an
engine attached to a node (its name) or a server (its error message) chooses text that kvtier logs
and prints. Raw, a newline in it forges a log line of its own, an ESC or a C1 CSI is a terminal
command (retitle the window, clear the screen, write the clipboard through OSC 52) and a
bidirectional override reorders what the operator reads. :func:`printable` writes each such
character as its Python escape (``\\n``, ``\\x1b``, ``\\u202e``).

Pure functions, any thread.
"""

from __future__ import annotations

_UNSHOWN = frozenset([*range(0x20), 0x7F, *range(0x80, 0xA0),  # C0 (ESC, newline), DEL, C1 (CSI, OSC)
                      0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)])  # bidi marks


def printable(text: object) -> str:
    """``str(text)`` with every control character and bidirectional mark written as its escape
    (a newline too: one field stays one line); any other character, non-ASCII included, as it is."""
    text = str(text)
    if not any(ord(c) in _UNSHOWN for c in text):
        return text
    return "".join(ascii(c)[1:-1] if ord(c) in _UNSHOWN else c for c in text)
