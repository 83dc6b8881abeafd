"""``kvtier doctor``: fleet keys. Which tier entries of the line are without one where the store is
shared (a Redis, a group-accessible or world-writable root), whether the keys load here, and
whether the records already in the store agree with this engine (a mixed fleet: some engines with
a key and some without, or under keys this one does not list, refuse, and remove, each other's
records).

Reads: the line's ``secondary_tiers`` (kvtier's ``fs`` / ``redis``, and ``kvtier_disk`` /
``kvtier_redis`` behind vLLM's offloading); the headers (136 bytes) of at most
:data:`SAMPLE` records per store (regular block files under the root, reached without following a
symlink, :class:`~kvtier.core.rootfs.RootFS`; Redis values by ``SCAN`` and ``GETRANGE``, on a
connection with ``CLIENT NO-TOUCH`` where the server has it, 7.2 on: the sample is then no use of
those blocks for the server's eviction; an older server counts each header read as one). Never a
payload, never a key's secret (only its public id), never a write. Caller's
thread; a Redis that does not answer within a second is skipped (``check_remote`` reports it).
"""

from __future__ import annotations

import os
import stat
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from kvtier.core.fleet_key import parse_auth
from kvtier.core.rootfs import RootFS
from kvtier.core.values import ConfigError
from kvtier.doctor.setup import Finding, Setup

HEADER_LEN = 136
"""A record's header (docs/disk-format.md, "Block file v1" and "Sealed records"). The doctor reads
three fields itself (it does not import the tiers): magic (bytes 0-3), checksum algorithm (u16 at
108: 1 plain, 2 MAC, 3 encrypted) and, in a sealed record, the key id (bytes 72-79).
tests/test_sealed_records.py checks this against :mod:`kvtier.tiers.blockfile` on real records."""

SAMPLE = 200
"""Records whose headers are read per store to tell how the fleet writes."""

_DISK_TYPES = ("fs", "kvtier_disk")
_REDIS_TYPES = ("redis", "kvtier_redis")


def check_fleet_keys(s: Setup) -> list[Finding]:
    out: list[Finding] = []
    for index, entry in enumerate((s.extra or {}).get("secondary_tiers") or []):
        if not isinstance(entry, Mapping) or entry.get("type") not in _DISK_TYPES + _REDIS_TYPES:
            continue
        where = f"secondary_tiers[{index}]"
        disk = entry.get("type") in _DISK_TYPES
        try:
            auth = parse_auth(entry, where)
        except ConfigError as exc:
            out.append(Finding(
                "fleet-key-unloadable", "warning", f"The fleet key of {where} does not load here", str(exc),
                "Run kvtier doctor where vLLM runs (with the same environment), or fix the key named above; "
                "vLLM stops at start-up on this."))
            continue
        store = entry.get("root_dir") if disk else _redacted(entry.get("url"))
        if auth is None and disk and isinstance(store, str) and _shared_root(entry):
            out.append(Finding(
                "fleet-key-missing", "warning", f"Disk tier {store} is shared by a group but has no fleet key",
                "Its records carry checksums computed from public facts (the model and the tokens): anyone who "
                "can write there and run the same model can plant KV that every engine on the root serves, for "
                "prompts of other users; anyone who can read there reads every tenant's KV.",
                f"Set auth_key_env (or auth_key_file) on {where} in every engine of the root (a key: "
                "openssl rand -hex 32), and encrypt: true to keep the KV unreadable at rest (docs/security.md)."))
        elif auth is None and not disk:
            out.append(Finding(
                "fleet-key-missing", "warning", f"Redis tier {store} has no fleet key",
                "Every node of the fleet holds the server's credential, so one compromised node (or anyone "
                "with write access) can write KV that every engine serves for other users' prompts, with no "
                "trace; and whoever can read the server reads every tenant's KV.",
                f"Set auth_key_env (or auth_key_file) on {where} in every engine (a key: openssl rand -hex 32), "
                "and encrypt: true to keep the KV unreadable at rest (docs/security.md)."))
        headers = _disk_headers(Path(store)) if disk and isinstance(store, str) else _redis_headers(entry)
        finding = _agreement(where, store, auth, headers)
        if finding is not None:
            out.append(finding)
    return out


def _agreement(where: str, store: Any, auth, headers: Iterator[bytes]) -> Finding | None:
    """A finding when the sampled records of ``store`` were written by engines that ``auth``
    (this engine's keys) refuses, or that refuse this engine's."""
    kinds: Counter[str] = Counter()
    for raw in headers:
        kind = record_kind(raw)
        if kind is not None:
            kinds[kind] += 1
    if not kinds:
        return None
    mine = set() if auth is None else {k.key_id.hex() for k in auth.accepted}
    plain = kinds.pop("plain", 0)
    foreign = {key_id: n for key_id, n in kinds.items() if key_id not in mine}
    sampled = plain + sum(kinds.values())
    if auth is None and kinds:
        return Finding(
            "fleet-mixed", "warning", f"{store}: engines with a fleet key write here, {where} has none",
            f"{sum(kinds.values())} of {sampled} records sampled are sealed (key ids {', '.join(sorted(kinds))}). "
            "This engine cannot check them, so it refuses and removes them (counted as unauthenticated), and "
            "engines with a key refuse and remove this engine's records: the fleet keeps recomputing.",
            f"Give {where} the fleet's key (auth_key_env / auth_key_file) like the other engines.")
    if auth is not None and (plain or foreign):
        parts = ([f"{plain} carry no MAC (written by engines without a fleet key)"] if plain else []) + (
            [f"{sum(foreign.values())} are under key ids {', '.join(sorted(foreign))}, which {where} does not "
             "list"] if foreign else [])
        return Finding(
            "fleet-mixed", "warning", f"{store}: engines disagree on the fleet key",
            f"Of {sampled} records sampled, {' and '.join(parts)}. This engine (key id "
            f"{auth.write.key_id.hex()}) refuses and removes them, and their writers refuse this engine's "
            "records: the fleet keeps recomputing.",
            "Give every engine of the store the same auth key; during a rotation list the old key in "
            "auth_read_key_envs / auth_read_key_files until kvtier verify shows none left under it.")
    return None


def record_kind(raw: bytes) -> str | None:
    """``"plain"``, the key id (hex) of a sealed record, or None (not a kvtier record header)."""
    if len(raw) < HEADER_LEN or raw[:4] != b"KVTB":
        return None
    alg = int.from_bytes(raw[108:110], "little")
    if alg == 1:
        return "plain"
    return raw[72:80].hex() if alg in (2, 3) else None


def _shared_root(entry: Mapping[str, Any]) -> bool:
    """Whether a disk tier's root is open to a group or to everyone (``group_access``, or its mode)."""
    if entry.get("group_access") is True:
        return True
    try:
        mode = os.stat(Path(str(entry["root_dir"])).expanduser()).st_mode
    except OSError:
        return False
    return bool(mode & (stat.S_IWGRP | stat.S_IWOTH))


def _disk_headers(root: Path) -> Iterator[bytes]:
    fs = RootFS(str(root))
    count = 0
    for path in _block_files(fs, fs.root, depth=3):  # <ns>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin
        try:
            fd = fs.open(path)
            try:
                yield os.pread(fd, HEADER_LEN, 0)
            finally:
                os.close(fd)
        except OSError:
            continue
        count += 1
        if count >= SAMPLE:
            return


def _block_files(fs: RootFS, directory: str, depth: int) -> Iterator[str]:
    """Regular ``*.bin`` files at most ``depth`` directories below ``directory`` (``quarantine`` and
    symlinks skipped: never followed)."""
    try:
        entries = fs.listing(directory) or []
    except OSError:
        return
    for name, st in sorted(entries, key=lambda entry: entry[0]):
        if st is None:
            continue
        path = os.path.join(directory, name)
        if stat.S_ISDIR(st.st_mode):
            if depth and name != "quarantine":
                yield from _block_files(fs, path, depth - 1)
        elif stat.S_ISREG(st.st_mode) and name.endswith(".bin"):
            yield path


def _redis_headers(entry: Mapping[str, Any]) -> Iterator[bytes]:
    url = entry.get("url")
    if not isinstance(url, str):
        return
    try:
        from kvtier.tiers.redis.deadline import bounded_client

        password = os.environ.get(entry["password_env"]) if entry.get("password_env") else None
        client = bounded_client(url, connect_timeout_s=1.0, timeout_s=1.0, reply_bytes=1 << 20, no_touch=True,
                                username=entry.get("username"), password=password)
        prefix = str(entry.get("key_prefix") or "kvtier")
        names = []
        for name in client.scan_iter(match=f"{prefix}:*".encode(), count=1000):
            if not name.endswith(b":config"):
                names.append(name)
            if len(names) >= SAMPLE:
                break
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.getrange(name, 0, HEADER_LEN - 1)
        replies = pipe.execute(raise_on_error=False)
        client.close()
    except Exception:  # noqa: BLE001 - unreachable, refused, cluster: check_remote says why
        return
    yield from (r for r in replies if isinstance(r, bytes))


def _redacted(url: Any) -> str:
    from kvtier.core.tier_config import redact_url

    return redact_url(url) if isinstance(url, str) else "?"
