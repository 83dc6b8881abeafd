"""``kvtier doctor``'s look at a configured ``kvtier node`` service: does one answer on the socket,
would the engine accept it (the user it runs as), how big is its pool?

:func:`probe_node` says hello as an observer (:class:`~kvtier.node.protocol.Role` ``OBSERVER``: no
pool mapped, nothing reserved or pinned) with the engine's own client and its check of who serves
the socket (:mod:`kvtier.node.client`, :func:`kvtier.node.credentials.check_service`), within
:data:`PROBE_TIMEOUT_S`. :func:`check_node` turns that into findings, for a kvtier line's ``node``
key (``kvtier serve --node``) and for each ``kvtier_node`` entry behind vLLM's offloading. Called
in the ``kvtier doctor`` process only; it neither starts nor changes a service.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from kvtier.core.tier_config import TierType
from kvtier.core.values import ConfigError
from kvtier.doctor.probes import validate_extra_config
from kvtier.doctor.setup import Finding, Setup, native_entries
from kvtier.planning.sizing import GIB

PROBE_TIMEOUT_S = 2.0


class Answer(enum.Enum):
    OK = "ok"
    NONE = "none"  # nothing listens (no socket, refused, no answer in time)
    REFUSED = "refused"  # it answers, and it or the engine refuses the other (its user, a bad hello)


@dataclass
class NodeProbe:
    answer: Answer
    detail: str = ""
    pool_bytes: int = 0
    num_slots: int = 0


@dataclass(frozen=True)
class _Attach:
    """One engine's attachment as its configuration gives it."""

    where: str  # the config key, as findings name it
    socket: Path
    node_uid: int | None
    cap_bytes: int | None  # the most of the pool the engine may hold (None: no cap of its own)
    started_by_serve: bool  # kvtier serve starts a service where none answers


def probe_node(socket: Path, node_uid: int | None) -> NodeProbe:
    """Who serves ``socket`` (checked as an engine checks it: an observer's own hello does not),
    then an observer's hello for the pool's size."""
    from kvtier.node import NodeClient, NodeError, NodeUnavailable, Role

    refusal = _untrusted(socket, node_uid)
    if refusal is not None:
        return NodeProbe(Answer.REFUSED, refusal)
    try:
        with NodeClient(socket, engine="kvtier-doctor", role=Role.OBSERVER, timeout_s=PROBE_TIMEOUT_S,
                        node_uid=node_uid) as client:
            attached = client.connect()
    except NodeUnavailable as exc:
        return NodeProbe(Answer.NONE, str(exc))
    except (NodeError, ConfigError) as exc:
        return NodeProbe(Answer.REFUSED, str(exc))
    return NodeProbe(Answer.OK, pool_bytes=attached.pool_bytes, num_slots=attached.num_slots)


def _untrusted(path: Path, node_uid: int | None) -> str | None:
    """Why an engine would refuse the service at ``path`` for the user it runs as (None: it would
    not, or nothing answers there: the hello says what)."""
    import socket as sockets

    from kvtier.node.credentials import UntrustedService, check_service

    with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as sock:
        sock.settimeout(PROBE_TIMEOUT_S)
        try:
            sock.connect(str(path))
        except OSError:
            return None
        try:
            check_service(sock, path, node_uid)
        except UntrustedService as exc:
            return str(exc)
    return None


def check_node(s: Setup) -> list[Finding]:
    """Every node attachment of the line: a service answers and would be accepted; the engine's
    cap fits its pool."""
    out: list[Finding] = []
    for attach in _attachments(s):
        found = probe_node(attach.socket, attach.node_uid)
        shown = f"kvtier node at {attach.socket}"
        if found.answer is Answer.REFUSED:
            out.append(Finding(
                "node-refused", "error", f"{shown} and this engine refuse each other", found.detail,
                f"Fix what the message names ({attach.where}, node_uid); the engine stops at start-up on this."))
        elif found.answer is Answer.NONE and attach.started_by_serve:
            out.append(Finding(
                "node-started-by-serve", "info", f"No {shown} answers: kvtier serve will start one",
                f"{found.detail}. kvtier serve starts kvtier node there (its pool: --node-pool-size, default "
                "--kv-offloading-size), in its own session: it keeps running after the server stops.",
                "None needed; for the node's own disk, Redis or S3 tiers or metrics, start the service yourself "
                "(docs/node.md)."))
        elif found.answer is Answer.NONE:
            out.append(Finding(
                "node-not-running", "warning", f"No {shown} answers", f"{found.detail}. The engine starts anyway "
                "and misses (lookups find nothing, stores are dropped, counted in kvtier_node_unavailable) until a "
                "service answers there; vllm serve starts none.",
                f"Start it first: kvtier node --socket {attach.socket} --pool-bytes SIZE (docs/node.md)."))
        else:
            out.append(Finding(
                "node-ok", "info", f"{shown} answers",
                f"Pool {_size(found.pool_bytes)} in {found.num_slots} slots; this engine would be accepted.",
                "None needed."))
            if attach.cap_bytes is not None and attach.cap_bytes > found.pool_bytes:
                out.append(Finding(
                    "node-cap-above-pool", "info",
                    f"This engine's cap ({_size(attach.cap_bytes)}) is more than the pool ({_size(found.pool_bytes)})",
                    "The pool is shared by every engine of the node; the engine can never hold more than all of it.",
                    "None needed if intended; a bigger pool is kvtier node's --pool-bytes."))
    return out


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def _attachments(s: Setup) -> list[_Attach]:
    """kvtier's connector's ``node`` key, and vLLM's ``kvtier_node`` entries."""
    out: list[_Attach] = []
    if s.is_kvtier and s.extra is not None and s.extra.get("node") is not None:
        config, error, _ = validate_extra_config(s.extra)
        if not error and config is not None and config.node is not None:
            out.append(_Attach("node", Path(config.node), config.node_uid, config.cpu_bytes_to_use,
                               s.line.program == "kvtier"))
    for where, config in native_entries(s, TierType.NODE, ("kvtier_node", "KVTierNodeTier")):
        out.append(_Attach(f"{where}.socket", config.socket, config.node_uid, config.cap_bytes, False))
    return out
