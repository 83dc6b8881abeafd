"""Choosing namespaces by ``--namespace`` (digest) and ``--model`` selectors.

Called by verify and purge in the ``kvtier`` command's process.
"""

from __future__ import annotations

from kvtier.cachetools.scan import CacheNamespace, CacheRoot


class SelectionError(ValueError):
    """A ``--namespace``/``--model`` selector matched no namespace, or a digest matched several."""


def select(
    cache: CacheRoot,
    *,
    namespaces: tuple[str, ...] = (),
    models: tuple[str, ...] = (),
    either: tuple[str, ...] = (),
) -> list[CacheNamespace]:
    """The namespaces matching every given kind of selector (any one value of each kind): by
    digest, by model, or by either; all namespaces when no selector is given. Raises
    :class:`SelectionError` for a selector that matches no namespace (a typo, usually) and for a
    digest that matches several (a prefix too short to tell them apart: nothing is chosen by a
    guess). A model name may match several namespaces (one model, several configurations)."""
    chosen = list(cache.namespaces)
    known = ", ".join(ns.prefix for ns in cache.namespaces) or "none"
    for selectors, test in (
        (namespaces, CacheNamespace.matches_digest),
        (models, CacheNamespace.matches_model),
        (either, CacheNamespace.matches),
    ):
        for sel in selectors:
            if not any(test(ns, sel) for ns in cache.namespaces):
                raise SelectionError(f"no namespace under {cache.root} matches {sel!r} (namespaces: {known})")
            if test is not CacheNamespace.matches_model:
                by_digest = [ns.prefix for ns in cache.namespaces if ns.matches_digest(sel)]
                if len(by_digest) > 1:
                    raise SelectionError(
                        f"{sel!r} is ambiguous: it matches the digests of {', '.join(by_digest)}; give more "
                        "digits or the directory name")
        if selectors:
            chosen = [ns for ns in chosen if any(test(ns, sel) for sel in selectors)]
    return chosen
