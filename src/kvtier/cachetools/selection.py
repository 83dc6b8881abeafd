"""Choosing namespaces by ``--namespace`` (digest) and ``--model`` selectors: one rule for a disk
root's, a Redis server's and a bucket's namespaces.

A digest selector is the namespace's name (directory, key or folder name) or at least
:data:`MIN_DIGEST_DIGITS` hex digits of its digest; a model selector is the model's name as in its
config, or as given to vLLM (a repo id or path: its last part). A selector that matches nothing is
refused (a typo, usually; a digest prefix shorter than the minimum is said to be one), and so is a
digest prefix that matches several namespaces (nothing is chosen by a guess).

Called by verify and purge in the ``kvtier`` command's process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from kvtier.tiers.disk.layout import sanitize_model_name

MIN_DIGEST_DIGITS = 4
"""The fewest hex digits of a digest a ``--namespace`` selector may give."""
_HEX = frozenset("0123456789abcdef")


class SelectionError(ValueError):
    """A ``--namespace``/``--model`` selector matched no namespace, or a digest matched several."""


def matches_digest(selector: str, name: str, digest16: str) -> bool:
    """Whether ``selector`` names the namespace called ``name`` (its directory, key or folder name)
    whose digest starts with ``digest16``: that name, or at least :data:`MIN_DIGEST_DIGITS` hex
    digits of the digest (the 16 it is named by, or the full digest)."""
    sel = selector.strip().rstrip("/").lower()
    if sel == name.lower():
        return True
    return len(sel) >= MIN_DIGEST_DIGITS and set(sel) <= _HEX and (digest16.startswith(sel) or sel.startswith(digest16))


def matches_model(selector: str, model_name: str | None, model: str | None = None) -> bool:
    """Whether ``selector`` names a namespace of ``model_name`` (as in its config) or, where its name
    holds one, of the sanitized ``model`` part of that name: as is, or as given to vLLM (a repo id
    or path: its last part, or reduced whole)."""
    sel = selector.strip().rstrip("/")
    base = sel.rsplit("/", 1)[-1]  # a repo id or path names the model by its last part (geometry.model_name)
    if model_name is not None and model_name in (sel, base):
        return True
    return bool(sel) and model is not None and model in (sel, sanitize_model_name(sel), sanitize_model_name(base))


class Selectable(Protocol):
    """A namespace of any store, as selectors see it."""

    @property
    def prefix(self) -> str: ...

    def matches_digest(self, selector: str) -> bool: ...

    def matches_model(self, selector: str) -> bool: ...

    def matches(self, selector: str) -> bool: ...


N = TypeVar("N", bound=Selectable)


def select(
    found: Sequence[N],
    where: str,
    *,
    namespaces: Sequence[str] = (),
    models: Sequence[str] = (),
    either: Sequence[str] = (),
) -> list[N]:
    """The namespaces of ``found`` (those at ``where``) matching every given kind of selector (any
    one value of each kind): by digest, by model, or by either; all of them when no selector is
    given. Raises :class:`SelectionError` for a selector that matches no namespace and for a digest
    that matches several. A model name may match several namespaces (one model, several
    configurations)."""
    chosen = list(found)
    known = ", ".join(ns.prefix for ns in found) or "none"
    for selectors, by_model, by_digest in ((namespaces, False, True), (models, True, False), (either, True, True)):
        def test(ns: N, sel: str) -> bool:
            return (by_digest and ns.matches_digest(sel)) or (by_model and ns.matches_model(sel))

        for sel in selectors:
            if not any(test(ns, sel) for ns in found):
                raise SelectionError(f"no namespace at {where} matches {sel!r}{_too_short(sel)} (namespaces: {known})")
            if by_digest:
                digests = [ns.prefix for ns in found if ns.matches_digest(sel)]
                if len(digests) > 1:
                    raise SelectionError(
                        f"{sel!r} is ambiguous: it matches the digests of {', '.join(digests)}; give more "
                        "digits or the namespace's name")
        if selectors:
            chosen = [ns for ns in chosen if any(test(ns, sel) for sel in selectors)]
    return chosen


def _too_short(selector: str) -> str:
    """What to add when ``selector`` looks like a digest prefix under the minimum ("" otherwise)."""
    sel = selector.strip().lower()
    if sel and len(sel) < MIN_DIGEST_DIGITS and set(sel) <= _HEX:
        return f": a digest prefix needs at least {MIN_DIGEST_DIGITS} hex digits"
    return ""
