"""``kvtier doctor`` on a ``MultiConnector`` line: the children together.

Each child is audited like a standalone connector by :func:`kvtier.doctor.audit.audit`; these checks
look at what only the combination can get wrong. What vLLM's MultiConnector does (0.32 and 0.33,
read in ``distributed/kv_transfer/kv_connector/v1/multi_connector.py``; docs/multiconnector.md): it
asks every child for hits, in order, and the first child with hits loads the request; every child
saves every block; vLLM reads ``kv_load_failure_policy`` from the MultiConnector's own config.

- :func:`check_multi_children`: ``connectors`` missing, empty, or an entry naming no connector;
- :func:`check_multi_kvtier_twice`: two KVTierConnector children on one engine id (their host tiers'
  shared-memory regions have the same names: the engine stops at start-up);
- :func:`check_multi_double_store`: two children writing the same directory or Redis server;
- :func:`check_multi_order`: kvtier after another caching child (it loads only that child's misses),
  kvtier before a P/D transfer child such as NixlConnector (a local hit takes a remote-prefill request
  from it), kvtier first before another cache (both store every block);
- :func:`check_multi_load_failures`: the MultiConnector's ``kv_load_failure_policy`` is not
  ``recompute``, so a block kvtier fails to load fails the request (kvtier sets the policy only in its
  own child config, which vLLM does not read).

Operator side: reads the command line only; never imports vLLM, never writes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.doctor.native_checks import KVTIER_TYPES
from kvtier.doctor.setup import KVTIER_CONNECTOR, NATIVE_CONNECTOR, Finding, Setup, multi_children

CACHING_CONNECTORS = frozenset({
    KVTIER_CONNECTOR, NATIVE_CONNECTOR, "LMCacheConnectorV1", "LMCacheMPConnector", "SimpleCPUOffloadConnector",
    "FlexKVConnectorV1", "MooncakeStoreConnector", "HF3FSKVConnector", "ExampleConnector",
})
"""Connectors that keep every block they are given and load it back later (vLLM 0.32/0.33 names)."""
TRANSFER_CONNECTORS = frozenset({"NixlConnector", "NixlPullConnector", "NixlPushConnector", "MooncakeConnector",
                                 "MoRIIOConnector"})
"""Connectors that move one request's KV between prefill and decode instances (disaggregated prefill)."""


def is_kvtier(child: Setup) -> bool:
    """kvtier's connector, or vLLM's OffloadingConnector with one of kvtier's tiers."""
    if child.connector == KVTIER_CONNECTOR:
        return True
    tiers = (child.extra or {}).get("secondary_tiers")
    return child.connector == NATIVE_CONNECTOR and isinstance(tiers, list) and any(
        isinstance(t, dict) and str(t.get("type")) in KVTIER_TYPES for t in tiers)


def check_multi_children(s: Setup) -> list[Finding]:
    connectors = multi_children(s.extra)
    if not connectors:
        return [Finding(
            "multi-connectors", "error", "MultiConnector without child connectors",
            "vLLM's MultiConnector reads its children from kv_connector_extra_config.connectors (a list of "
            "kv-transfer configs, in the order it asks them); without one it stops at start-up or does nothing.",
            "Add \"connectors\": [{\"kv_connector\": \"KVTierConnector\", \"kv_connector_module_path\": "
            "\"kvtier.vllm\", \"kv_role\": \"kv_both\", \"kv_connector_extra_config\": {...}}, ...] to "
            "kv_connector_extra_config.")]
    return [Finding(
        "multi-connectors", "error", f"connectors[{index}] names no connector",
        "Each entry of connectors is a kv-transfer config of its own: a JSON object with kv_connector and "
        "kv_role; vLLM stops at start-up on any other entry.",
        f"Make connectors[{index}] an object such as {{\"kv_connector\": \"KVTierConnector\", "
        "\"kv_connector_module_path\": \"kvtier.vllm\", \"kv_role\": \"kv_both\", ...}, or remove it.")
        for index, child in enumerate(connectors) if not isinstance(child, dict) or not child.get("kv_connector")]


def _engine_id(s: Setup, child: Setup) -> Any:
    """The engine id a child gets: its own, else the MultiConnector's (vLLM's rule), else vLLM's
    one per engine (None here)."""
    return (child.transfer or {}).get("engine_id", (s.transfer or {}).get("engine_id"))


def check_multi_kvtier_twice(s: Setup) -> list[Finding]:
    kvtiers = [c for c in s.children if c.connector == KVTIER_CONNECTOR]
    by_engine: dict[Any, list[Setup]] = defaultdict(list)
    for child in kvtiers:
        by_engine[_engine_id(s, child)].append(child)
    return [Finding(
        "multi-kvtier-twice", "error", f"{', '.join(c.where for c in same)} share one engine id",
        "kvtier names its host tier's shared-memory regions after the engine id, and MultiConnector gives "
        "every child the MultiConnector's engine id unless the child sets one: the second child's workers "
        "find the first's region in use and the engine stops at start-up (RegionInUseError). Two kvtier "
        "children would also store every block twice.",
        "Use one KVTierConnector child (one connector holds host, disk and Redis tiers: secondary_tiers), "
        "or give each its own \"engine_id\".")
        for same in by_engine.values() if len(same) > 1]


def _stores(child: Setup) -> list[tuple[str, str]]:
    """Where a child writes blocks: ("dir", resolved path) and ("redis", url) entries."""
    extra = child.extra or {}
    out: list[tuple[str, str]] = []
    if child.connector == "ExampleConnector" and isinstance(extra.get("shared_storage_path"), str):
        out.append(("dir", str(Path(extra["shared_storage_path"]).expanduser().resolve())))
    tiers = extra.get("secondary_tiers") if child.connector in (KVTIER_CONNECTOR, NATIVE_CONNECTOR) else None
    for tier in tiers if isinstance(tiers, list) else []:
        if not isinstance(tier, dict):
            continue
        if isinstance(tier.get("root_dir"), str) and tier["root_dir"]:
            out.append(("dir", str(Path(tier["root_dir"]).expanduser().resolve())))
        if isinstance(tier.get("url"), str) and tier["url"]:
            out.append(("redis", tier["url"]))
    return out


def check_multi_double_store(s: Setup) -> list[Finding]:
    writers: dict[tuple[str, str], list[Setup]] = defaultdict(list)
    for child in s.children:
        for place in dict.fromkeys(_stores(child)):
            writers[place].append(child)
    out = []
    for (kind, place), children in writers.items():
        if len(children) < 2:
            continue
        names = ", ".join(c.where for c in children)
        shown = place if kind == "dir" else "the Redis server " + place.split("@")[-1]
        out.append(Finding(
            "multi-double-store", "warning", f"{names} all write to {shown}",
            "MultiConnector saves every block to every child, so each block is written there once per child, "
            "under each child's own keys and namespace: twice the writes and the space, and each child's "
            "capacity_bytes bounds only its own records, so together they can fill the disk or server. Only the "
            "first child with a hit ever loads.",
            "Keep one child per directory or server: drop the tier from all but one child (one kvtier connector "
            "holds host, disk and Redis tiers), or give each its own root_dir / database."))
    return out


def check_multi_order(s: Setup) -> list[Finding]:
    out = []
    for index, child in enumerate(s.children):
        if not is_kvtier(child):
            continue
        earlier = [c for c in s.children[:index] if c.connector in CACHING_CONNECTORS]
        later_transfer = [c for c in s.children[index + 1:] if c.connector in TRANSFER_CONNECTORS]
        later_cache = [c for c in s.children[index + 1:] if c.connector in CACHING_CONNECTORS]
        if earlier:
            names = ", ".join(c.where for c in earlier)
            out.append(Finding(
                "multi-kvtier-shadowed", "warning", f"{child.where} comes after {names}",
                "MultiConnector loads from the first child that has hits, and every child stores every block: "
                f"{names} holds whatever kvtier holds (unless it lost it), so kvtier serves only that child's "
                "misses while still storing every block and answering every lookup (for a block only on its "
                "disk or Redis it first promotes it, holding the request a step, even when the earlier child "
                "serves it).",
                f"Put {child.where} first, or keep only one of them."))
        if later_transfer:
            names = ", ".join(c.where for c in later_transfer)
            out.append(Finding(
                "multi-kvtier-before-transfer", "warning", f"{child.where} comes before {names}",
                f"{names} moves a request's KV from its prefill instance; MultiConnector gives the request to the "
                "first child with hits, so a partial local hit in kvtier takes it: the transfer child is told it "
                "has 0 tokens to load, lets the prefill instance free its blocks and moves nothing, and this "
                "instance computes the rest of the prompt itself (correct output, the prefill's work wasted).",
                f"Put {names} first: it claims only requests sent for remote prefill, kvtier serves the others "
                "(docs/multiconnector.md#disaggregated-prefill)."))
        if later_cache and not earlier:
            names = ", ".join(c.where for c in later_cache)
            out.append(Finding(
                "multi-two-caches", "info", f"{child.where} and {names} both store every block",
                "MultiConnector saves every block to every child; the later child loads only what kvtier misses.",
                "None if intended (e.g. a shared store behind kvtier); otherwise keep one of them."))
    return out


def check_multi_load_failures(s: Setup) -> list[Finding]:
    policy = (s.transfer or {}).get("kv_load_failure_policy", "fail")
    kvtier = [c for c in s.children if c.connector == KVTIER_CONNECTOR]
    if not kvtier or policy == "recompute":
        return []
    return [Finding(
        "multi-load-failure-policy", "warning", f"kv_load_failure_policy is {policy!r} for the MultiConnector",
        "vLLM reads the policy from the MultiConnector's own kv-transfer config (default 'fail' in 0.32 and "
        "0.33). kvtier sets 'recompute' when it runs alone, but as a child it can only set its own config, which "
        f"vLLM does not read: a block {kvtier[0].where} fails to load would fail the request instead of being "
        "recomputed.",
        "Add \"kv_load_failure_policy\": \"recompute\" next to \"kv_connector\": \"MultiConnector\" (it applies "
        "to every child's failed loads).")]


CHECKS: tuple[Callable[[Setup], list[Finding]], ...] = (
    check_multi_children, check_multi_kvtier_twice, check_multi_double_store, check_multi_order,
    check_multi_load_failures,
)
