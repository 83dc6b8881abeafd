"""``kvtier doctor``'s look at a configured S3 tier: can kvtier reach the store, do the credentials
work, may it list, put, get and delete under its prefix, and how long does a request take?

:func:`probe_s3` uses the tier's own client (:mod:`kvtier.tiers.s3.client`: the same credential
chain, endpoint, addressing, CA bundle and timeouts), lists one page of the prefix, then puts, gets,
heads and deletes one small object of its own (``PREFIX/.kvtier-doctor/<random>``), timing each
request. :func:`check_s3` turns that into findings, for a kvtier line's ``s3`` entry and for a
``kvtier_s3`` entry behind vLLM's offloading. Called in the ``kvtier doctor`` process only; never
prints a credential (only where it came from).
"""

from __future__ import annotations

import enum
import os
import time
from dataclasses import dataclass, field
from typing import Any

from kvtier.core.tier_config import S3TierConfig, TierType
from kvtier.core.values import ConfigError
from kvtier.doctor.probes import validate_extra_config
from kvtier.doctor.setup import Finding, Setup, native_entries

SLOW_GET_MS = 50.0
"""Above this a small GET is slow enough that small blocks lose most of the tier's throughput to it."""
OPERATIONS = ("list", "put", "get", "delete")


class Reach(enum.Enum):
    OK = "ok"
    UNREACHABLE = "unreachable"
    REFUSED = "refused"  # the credentials, or a configuration the store refuses (no bucket, TLS)


@dataclass
class S3Probe:
    """What :func:`probe_s3` found: ``denied`` maps each operation refused (401/403) to the store's
    answer, ``failed`` each one that failed otherwise;
    ``ms``: milliseconds of each operation that succeeded (``head`` the median of five HEADs)."""

    reach: Reach
    detail: str = ""
    source: str = ""
    denied: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # answered with another error (5xx, ...)
    ms: dict[str, float] = field(default_factory=dict)


def probe_s3(config: S3TierConfig, where: str) -> S3Probe:
    import obstore

    from kvtier.tiers.s3.client import Access, Fault, check_access, classify, credentials, describe, make_store

    try:
        source = credentials(config, where)
        store = make_store(config, where, source)
        started = time.perf_counter()
        access = check_access(config, where, store, source)
    except ConfigError as exc:
        return S3Probe(Reach.REFUSED, str(exc).removeprefix("kv_connector_extra_config: "))
    if access is Access.UNREACHABLE:
        return S3Probe(Reach.UNREACHABLE, f"no answer within {config.timeout_s:g} s", source.description)
    found = S3Probe(Reach.OK, source=source.description, ms={"list": _ms(started)})
    path = f"{config.prefix}/.kvtier-doctor/{os.urandom(8).hex()}"
    steps: list[tuple[str, Any]] = [
        ("put", lambda: obstore.put(store, path, os.urandom(64 * 1024), use_multipart=False)),
        ("get", lambda: obstore.get(store, path).bytes()),
        ("head", lambda: [obstore.head(store, path) for _ in range(5)]),
        ("delete", lambda: obstore.delete(store, path)),
    ]
    for name, step in steps:
        started = time.perf_counter()
        try:
            step()
        except Exception as exc:  # noqa: BLE001 (sorted: refused, or the store failing)
            fault = classify(exc)
            if fault is Fault.UNREACHABLE:
                return S3Probe(Reach.UNREACHABLE, f"{name}: {describe(exc)}", source.description)
            if fault is Fault.REFUSED:
                found.denied[name] = describe(exc)
            elif not (fault is Fault.NOT_FOUND and "put" in found.denied):  # (nothing to read: not a refusal)
                found.failed[name] = describe(exc)
            continue
        found.ms[name] = _ms(started) / (5 if name == "head" else 1)
    return found


def _ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000


def _configs(s: Setup) -> list[tuple[str, S3TierConfig]]:
    """The S3 tiers of the line: kvtier's connector's ``s3`` entry, vLLM's ``kvtier_s3`` entries."""
    out: list[tuple[str, S3TierConfig]] = []
    if s.is_kvtier and s.extra is not None:
        config, error, _ = validate_extra_config(s.extra)
        if not error and config is not None and config.s3 is not None:
            index = next(i for i, t in enumerate(config.secondary_tiers) if t is config.s3)
            out.append((f"secondary_tiers[{index}]", config.s3))
    out += native_entries(s, TierType.S3, ("kvtier_s3", "KVTierS3Tier"))
    return out


def check_s3(s: Setup) -> list[Finding]:
    """Every S3 tier of the line: reachable, credentials accepted, allowed to list / put / get /
    delete under its prefix, bounded, and how fast."""
    out: list[Finding] = []
    for where, config in _configs(s):
        found = probe_s3(config, where)
        shown = config.location
        if found.reach is Reach.REFUSED:
            out.append(Finding("s3-refused", "error", f"S3 tier {shown} refuses kvtier", found.detail,
                               "Fix what the message names; kvtier stops at start-up on this."))
            continue
        if found.reach is Reach.UNREACHABLE:
            out.append(Finding(
                "s3-unreachable", "warning", f"S3 tier {shown} does not answer",
                f"{found.detail} (credentials from {found.source or 'the AWS chain'}).",
                "Check the endpoint, region, TLS (ca_bundle) and firewall. kvtier starts anyway: the S3 tier counts "
                "misses and connects by itself once the store answers."))
            continue
        if found.denied:
            out.append(Finding(
                "s3-permissions", "error", f"S3 tier {shown}: {', '.join(sorted(found.denied))} refused",
                "; ".join(f"{op}: {why}" for op, why in sorted(found.denied.items()))
                + f" (credentials from {found.source}). The tier then misses forever or never stores.",
                f"Give this identity s3:ListBucket on bucket {config.bucket} and s3:GetObject, s3:PutObject, "
                f"s3:DeleteObject on {config.prefix}/*."))
        if found.failed:
            out.append(Finding(
                "s3-errors", "warning", f"S3 tier {shown}: {', '.join(sorted(found.failed))} failed",
                "; ".join(f"{op}: {why}" for op, why in sorted(found.failed.items())) + ". Such failures cost misses.",
                "Look at the store's health and logs."))
        timings = ", ".join(f"{op} {found.ms[op]:.1f} ms" for op in (*OPERATIONS, "head") if op in found.ms)
        out.append(Finding("s3-ok", "info", f"S3 tier {shown} answers",
                           f"Credentials from {found.source}; {timings} (64 KiB object).", "None needed."))
        if config.capacity_bytes is None:
            out.append(Finding(
                "s3-unbounded", "warning", f"S3 tier {shown} has no capacity_bytes",
                "Without it kvtier never deletes an object: the prefix grows with every block every engine writes.",
                "Set capacity_bytes (every engine sweeps the prefix down to it, least recently written first), or "
                f"add a bucket lifecycle rule expiring objects under {config.prefix}/ after a few days "
                "(docs/object-store.md)."))
        get_ms = found.ms.get("get")
        if get_ms is not None and get_ms > SLOW_GET_MS:
            out.append(Finding(
                "s3-slow", "info", f"S3 tier {shown}: a small GET takes {get_ms:.0f} ms",
                "Each block is one GET; with small blocks the request time, not the bandwidth, bounds how fast "
                "a prefix comes back.",
                "Raise block_size (a multiple of the engine's block) so that a block is several MiB, and keep "
                "max_concurrency at 16 or more."))
    return out
