"""How the Redis / Valkey operator tools find and measure a remote tier's keys (:mod:`kvtier.cachetools.remote`).

A namespace is the ``<key_prefix>:<digest16>:config`` key and the block keys beside it
(:mod:`kvtier.tiers.redis.codec`'s names): :func:`_discover` lists them with ``SCAN`` (never
``KEYS``) and reads each config key with one bounded ``GETRANGE`` (at most
:data:`~kvtier.tiers.disk.layout.CONFIG_MAX_BYTES`, judged by
:func:`~kvtier.cachetools.scan.parse_config`); any other key under the prefix is a stray, handed to
the caller's :data:`Stray`. :class:`_RemoteNamespace` is what it finds (the S3 tools' namespaces
extend it), :func:`purged_namespaces` / :func:`verified_namespaces` narrow a list of them by the
operator's selectors (shared with :mod:`kvtier.cachetools.objects`). :func:`_idle_seconds` and
:func:`_sizes` read ages (``OBJECT IDLETIME``, never a use of a key) and sizes (``STRLEN``, or
``MEMORY USAGE`` where reads touch: see :mod:`kvtier.cachetools.remote`), pipelined in batches of
:data:`BATCH` keys. Nothing here writes or deletes.

Called by the tools in the ``kvtier`` command's process, one thread, on a client of
:func:`~kvtier.tiers.redis.deadline.bounded_client` (every call has a deadline).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.cachetools.purge import PurgeSelection
from kvtier.cachetools.scan import parse_config
from kvtier.cachetools.selection import matches_digest, matches_model, select
from kvtier.cachetools.verify import config_payload_bound
from kvtier.core.keys import KEY_SPEC_VERSION, Namespace, stored_ranks_of
from kvtier.tiers.blockfile import HEADER_LEN
from kvtier.tiers.disk.layout import CONFIG_MAX_BYTES
from kvtier.tiers.redis.codec import KeySpace

BATCH = 256
"""Keys per pipelined batch of STRLEN / MEMORY USAGE / OBJECT IDLETIME / UNLINK (and of purge's re-check script)."""

_HEX = frozenset(b"0123456789abcdef")


@dataclass
class _RemoteNamespace:
    """One namespace found under the key prefix, by its config key or by its blocks alone (the S3
    tools' folders extend it); built by :func:`_discover`, read-only after."""

    space: KeySpace
    digest16: str
    config: dict[str, Any] | None  # the config as stored (None: missing or unreadable)
    namespace: Namespace | None  # the config as a Namespace of this key spec (see config_problem)
    spec_version: str | None
    blocks: list[Any]  # the blocks' key names (bytes; S3: object paths)
    config_problem: str | None = None  # why the config is unusable or not this namespace's (None: usable)
    config_key: Any = None  # the config's key name (S3: object path); None: there is none
    others: int = 0  # keys (objects) of the namespace that are neither its config nor a block: strays

    @property
    def prefix(self) -> str:
        return self.space.base.decode().rstrip(":")

    @property
    def model(self) -> str | None:
        """The model part of the namespace's name, where its name holds one (S3 folders; not Redis keys)."""
        return None

    @property
    def model_name(self) -> str | None:
        name = (self.config or {}).get("model_name")
        return name if isinstance(name, str) else None

    @property
    def world(self) -> int:
        """Ranks a block value holds records of: from the config unless it is judged wrong, else 1."""
        try:
            return stored_ranks_of(self.config or {}) if self.config_problem is None else 1
        except (TypeError, ValueError):
            return 1

    @property
    def unchecked(self) -> str | None:
        """Why its values cannot be checked (no usable config of this key spec), or None."""
        if self.config_problem is not None:
            return self.config_problem
        if self.namespace is None:
            return "written under an older key spec" if self.older_spec else "its config is not a kvtier namespace"
        return None

    def value_bound(self) -> int:
        """The most bytes a block value of this namespace can have: ``world`` records of at most
        the payload its config allows a rank (:func:`~kvtier.cachetools.verify.config_payload_bound`:
        call it only when :attr:`unchecked` is None, so that its config is a valid namespace)."""
        return self.world * (HEADER_LEN + self.payload_bound())

    def payload_bound(self) -> int:
        """The longest payload a record of any of its ranks can have (see :meth:`value_bound`)."""
        assert self.namespace is not None
        return max(config_payload_bound(self.namespace, rank) for rank in range(self.world))

    @property
    def older_spec(self) -> bool:
        return self.spec_version is not None and self.spec_version != KEY_SPEC_VERSION

    def matches_digest(self, selector: str) -> bool:
        return matches_digest(selector, self.prefix, self.digest16)

    def matches_model(self, selector: str) -> bool:
        return matches_model(selector, self.model_name, self.model)

    def matches(self, selector: str) -> bool:
        return self.matches_digest(selector) or self.matches_model(selector)


Stray = Callable[[str, str], None]
"""Where discovery reports a key (or object) under the prefix that is not kvtier's: ``(name, why)``."""


def _scan(client, pattern: bytes) -> Iterator[bytes]:
    yield from client.scan_iter(match=pattern, count=1000)


def _discover(client, key_prefix: str, stray: Stray | None = None) -> list[_RemoteNamespace]:
    """Every namespace under ``key_prefix`` (by its config key, or by its blocks alone); keys under
    the prefix that are neither a namespace's config nor its blocks go to ``stray``."""
    by_digest: dict[str, list[bytes]] = defaultdict(list)
    configs: dict[str, bytes] = {}
    others: dict[str, int] = defaultdict(int)
    spaces: dict[bytes, KeySpace] = {}
    head = (key_prefix + ":").encode()
    for name in _scan(client, head + b"*"):
        parts = name[len(head) :].split(b":", 1)
        if len(parts) != 2 or len(parts[0]) != 16 or not set(parts[0]) <= _HEX:
            if stray is not None:
                stray(name.decode(errors="replace"), "not a kvtier key: no namespace digest after the key prefix")
            continue
        digest16 = parts[0].decode("ascii")
        if parts[1] == b"config":
            configs[digest16] = name
        elif spaces.setdefault(parts[0], KeySpace(head + parts[0] + b":")).block_key_of(name) is not None:
            by_digest[digest16].append(name)
        else:
            others[digest16] += 1
            if stray is not None:
                stray(name.decode(errors="replace"), "not a block key of its namespace")
    found = []
    for digest16 in sorted(set(by_digest) | set(configs)):
        space = KeySpace(head + digest16.encode() + b":")
        config = namespace = version = None
        problem: str | None = "config key missing"
        if digest16 in configs:
            raw = client.getrange(configs[digest16], 0, CONFIG_MAX_BYTES) or b""  # one byte more shows a longer one
            if len(raw) > CONFIG_MAX_BYTES:
                problem = f"config key longer than {CONFIG_MAX_BYTES} bytes (not read)"
            else:
                parsed = parse_config(raw, digest16, "config key", "its key name")
                config, namespace, version, problem = parsed.config, parsed.namespace, parsed.spec_version, parsed.problem
        blocks = sorted(by_digest.get(digest16, []))
        found.append(_RemoteNamespace(space, digest16, config, namespace, version, blocks, problem,
                                      configs.get(digest16), others.get(digest16, 0)))
    return found


def purged_namespaces(spaces: Sequence[_RemoteNamespace], selection: PurgeSelection,
                      where: str) -> list[_RemoteNamespace]:
    """The namespaces of ``spaces`` whose blocks ``selection`` purges (none when it selects no
    blocks); SelectionError when a selector matches none or a digest several
    (:func:`~kvtier.cachetools.selection.select`). Shared with the S3 tools."""
    chosen = select(spaces, where, namespaces=selection.namespaces, models=selection.models)
    if selection.older_spec:
        chosen = [ns for ns in chosen if ns.older_spec]
    return chosen if selection.blocks else []


def verified_namespaces(spaces: Sequence[_RemoteNamespace], selectors: Sequence[str],
                        where: str) -> list[_RemoteNamespace]:
    """The namespaces ``selectors`` (digests or models) name, all without one (as a disk root's).
    Shared with the S3 tools."""
    return select(spaces, where, either=selectors)


def _batches(items: Sequence[bytes], size: int = BATCH) -> Iterator[Sequence[bytes]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _idle_seconds(client, names: Sequence[bytes]) -> list[int | None]:
    """``OBJECT IDLETIME`` of each key (None where the server refuses it, e.g. under LFU). It never
    counts as a use of the key, on any server."""
    out: list[int | None] = []
    for batch in _batches(names):
        pipe = client.pipeline(transaction=False)
        for name in batch:
            pipe.object("idletime", name)
        out += [value if isinstance(value, int) else None for value in pipe.execute(raise_on_error=False)]
    return out


def _sizes(client, names: Sequence[bytes], exact: bool) -> list[int]:
    """The size of each key's value (0 where it is gone or the server refuses): ``STRLEN`` when
    ``exact``, else the server's memory for the key (``MEMORY USAGE``), which never counts as a use
    of it (for a server whose reads touch: see the module docstring)."""
    out: list[int] = []
    for batch in _batches(names):
        pipe = client.pipeline(transaction=False)
        for name in batch:
            if exact:
                pipe.strlen(name)
            else:
                pipe.memory_usage(name)
        out += [n if isinstance(n, int) else 0 for n in pipe.execute(raise_on_error=False)]
    return out
