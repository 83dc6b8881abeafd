"""The ``kvtier-node`` mode of ``kvtier bench``: a second replica on the same node.

One ``kvtier node`` service (started here on a scratch socket, or the one ``--node`` names) and,
one after another, these servers and rounds, every round the same workload (:class:`Phase`):

1. server A (``kvtier serve --node SOCKET``): round 1 computes every prompt and stores it in the
   pool (``A-compute``); vLLM's own prefix cache is reset (``POST /reset_prefix_cache``, which
   leaves kvtier's tiers alone) and round 2 is served from the pool (``A-pool-hit``);
2. server B, a fresh process on the same service while A still runs: its first round is served
   from what A stored (``B-from-A``);
3. A and B stopped, an embedded ``kvtier`` server (host tier in the engine, as without a service)
   computes the workload (``embedded-compute``), is reset the same way, and serves it from its host
   tier (``embedded-host-hit``): the reference the issue's 1.1x goal is measured against.

Each round is one entry of the results (``kvtier-node:<phase>``), so the table, the output check
(every round must generate the same tokens) and the figure treat them as modes; the goals are
:func:`kvtier.bench.stats.node_goals`. The service's counters after each node round (blocks held,
per engine stores and duplicates) go in the round's ``extra``: after ``B-from-A`` the pool holds
the blocks once (B's stores of them are duplicates).

Servers run with ``VLLM_SERVER_DEV_MODE=1`` (the reset endpoint). Called by
:mod:`kvtier.bench.runner` in the ``kvtier bench`` process; servers and the service are
subprocesses. Never imports vLLM.
"""

from __future__ import annotations

import asyncio
import enum
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvtier.bench.progress import Progress
from kvtier.bench.measure import ModeRun, RunOptions, measure
from kvtier.bench.servers import NODE_MODE, LaunchSpec, Server, ServerError, ServerSettings, launch_spec, make_scratch, start, wait_healthy
from kvtier.bench.workloads import Workload

RESET_TIMEOUT_S = 60.0
"""vLLM refuses a prefix-cache reset while blocks are held (in-flight offloads): retried this long."""
NODE_START_TIMEOUT_S = 60.0


class Replica(enum.Enum):
    """Which server a round runs on (A and B share the node service; EMBEDDED has its own host tier)."""

    A = "A"
    B = "B"
    EMBEDDED = "embedded"


class Phase(enum.Enum):
    """One round of the mode, in the order they run."""

    A_COMPUTE = "A-compute"
    A_POOL_HIT = "A-pool-hit"
    B_FROM_A = "B-from-A"
    EMBEDDED_COMPUTE = "embedded-compute"
    EMBEDDED_HOST_HIT = "embedded-host-hit"

    @property
    def mode(self) -> str:
        """The round's name in the results (a column of the table)."""
        return f"{NODE_MODE}:{self.value}"

    @property
    def server(self) -> Replica:
        return {Phase.A_COMPUTE: Replica.A, Phase.A_POOL_HIT: Replica.A, Phase.B_FROM_A: Replica.B}.get(
            self, Replica.EMBEDDED)

    @property
    def after_reset(self) -> bool:
        """The round follows a reset of vLLM's own prefix cache on the same server."""
        return self in (Phase.A_POOL_HIT, Phase.EMBEDDED_HOST_HIT)


@dataclass(frozen=True)
class NodePlan:
    """What the mode starts: the service (unless ``external`` names a running one) and three servers."""

    socket: Path
    external: bool
    pool_bytes: int
    specs: dict[Replica, LaunchSpec]

    def node_argv(self) -> list[str]:
        """``kvtier node`` for the run (only when no ``--node`` was given)."""
        return [sys.executable, "-m", "kvtier.cli.main", "node", "--socket", str(self.socket),
                "--pool-bytes", str(self.pool_bytes), "--log-level", "warning"]


def plan(settings: ServerSettings, scratch: Path, node: str | None = None) -> NodePlan:
    """The mode's service and servers. The pool is twice an engine's ``--kv-offloading-size`` (each
    engine's cap in it): room for both, although blocks they share are held once."""
    socket = Path(node).expanduser().resolve() if node else scratch / "node.sock"
    for replica in Replica:
        (scratch / replica.value).mkdir(exist_ok=True)  # each server's TMPDIR
    specs = {replica: launch_spec("kvtier" if replica is Replica.EMBEDDED else NODE_MODE, settings,
                                  scratch / replica.value, node=None if replica is Replica.EMBEDDED else str(socket))
             for replica in Replica}
    for spec in specs.values():
        spec.env["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache
    return NodePlan(socket, node is not None, int(2 * settings.kv_offloading_size_gib * 2**30), specs)


async def reset_prefix_cache(base_url: str, timeout_s: float = RESET_TIMEOUT_S) -> None:
    """Drop vLLM's own prefix cache (not kvtier's tiers), retrying while vLLM refuses."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=30.0) as client:
        while True:
            reply = await client.post(f"{base_url}/reset_prefix_cache")
            if reply.status_code == 404:
                raise ServerError(f"{base_url} has no /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1 not set?)")
            reply.raise_for_status()
            if reply.json().get("success"):
                return
            if time.monotonic() > deadline:
                raise ServerError(f"{base_url} refused to reset its prefix cache for {timeout_s:.0f} s")
            await asyncio.sleep(0.5)


def node_stats(socket: Path) -> dict[str, Any]:
    """The service's pool counters (``kvtier inspect SOCKET --json``), trimmed to what the rounds
    show. Raises :class:`ServerError` when no service answers there."""
    done = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "inspect", str(socket), "--json"],
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise ServerError(f"kvtier inspect {socket}: {(done.stderr or done.stdout).strip()}")
    stats = json.loads(done.stdout)
    keep = ("blocks", "used_slots", "slot_bytes", "pool_bytes", "evictions", "pinned_blocks", "attached_engines")
    return {**{k: stats[k] for k in keep}, "engines": stats["engines"]}


async def _start_node(node_plan: NodePlan, log_path: Path) -> subprocess.Popen:
    """Start ``kvtier node`` and wait until it answers on its socket."""
    with open(log_path, "ab") as log:
        process = subprocess.Popen(node_plan.node_argv(), stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + NODE_START_TIMEOUT_S
    while True:
        try:
            node_stats(node_plan.socket)
            return process
        except ServerError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise ServerError(f"kvtier node did not start; log: {log_path}\n{log_path.read_text()[-2000:]}") from None
            await asyncio.sleep(0.2)


async def run_node_mode(workload: Workload, settings: ServerSettings, out_dir: Path, progress: Progress,
                        options: RunOptions, index: int, total: int, node: str | None = None) -> list[ModeRun]:
    """Every :class:`Phase` in order; one :class:`ModeRun` per phase. A server that fails marks its
    rounds (and, for A, B's) failed; the embedded server still runs."""
    scratch = make_scratch(NODE_MODE)
    node_plan = plan(settings, scratch, node)
    runs = {phase: ModeRun(mode=phase.mode, description=_describe(phase, node_plan)) for phase in Phase}
    progress.mode_start(NODE_MODE, index, total, f"two servers on the kvtier node at {node_plan.socket}, then an "
                        "embedded kvtier server", str(out_dir / "server-kvtier-node-A.log"))
    service = None
    servers: dict[Replica, Server] = {}
    failed: set[Replica] = set()
    try:
        if node_plan.external:
            node_stats(node_plan.socket)  # answers, or says there is no service there
        else:
            service = await _start_node(node_plan, out_dir / "kvtier-node-service.log")
        for phase in Phase:
            run = runs[phase]
            if phase.server is Replica.EMBEDDED:  # the node's servers are done: stop them first
                for replica in (Replica.A, Replica.B):
                    if replica in servers:
                        servers.pop(replica).stop(options.stop_grace_s)
            blocked = failed & ({Replica.A, phase.server} if phase.server is Replica.B else {phase.server})
            if blocked:
                run.error = f"skipped: server {min(r.value for r in blocked)} failed an earlier round"
                continue
            try:
                server = servers.get(phase.server)
                if server is None:
                    server = servers[phase.server] = await _start_server(node_plan, phase, out_dir, progress, options)
                    run.startup_s = server.ready_s
                if phase.after_reset:
                    await reset_prefix_cache(server.spec.base_url)
                run.base_url, run.log_path = server.spec.base_url, str(server.log_path)
                await measure(run, workload, progress, options, metrics_dir=out_dir)
                if not server.alive():
                    raise server.failure("exited during the workload")
                if phase.server is not Replica.EMBEDDED:
                    run.extra = {"node": node_stats(node_plan.socket)}
            except Exception as exc:  # noqa: BLE001 - one failed round must not stop the others
                failed.add(phase.server)
                run.error = str(exc) or type(exc).__name__
                progress.error(phase.mode, run.error)
    except Exception as exc:  # noqa: BLE001 - no service to attach to: the rounds not run failed
        for run in runs.values():
            if run.run is None and not run.error:
                run.error = str(exc) or type(exc).__name__
        progress.error(NODE_MODE, str(exc))
    finally:
        for server in servers.values():
            server.stop(options.stop_grace_s)
        if service is not None:
            service.terminate()
            try:
                service.wait(timeout=30)
            except subprocess.TimeoutExpired:
                service.kill()
        if not options.keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    return [runs[phase] for phase in Phase]


async def _start_server(node_plan: NodePlan, phase: Phase, out_dir: Path, progress: Progress,
                        options: RunOptions) -> Server:
    spec = node_plan.specs[phase.server]
    server = start(spec, out_dir / f"server-{NODE_MODE}-{phase.server.value}.log")
    await wait_healthy(server, options.startup_timeout_s, on_wait=lambda s: progress.waiting(phase.mode, s))
    progress.ready(phase.mode, server.ready_s or 0.0)
    return server


def _describe(phase: Phase, node_plan: NodePlan) -> str:
    where = f"the kvtier node at {node_plan.socket}"
    return {
        Phase.A_COMPUTE: f"server A on {where}: round 1 (computes, stores in the pool)",
        Phase.A_POOL_HIT: f"server A on {where}: round 2 after a reset of vLLM's prefix cache (pool hits)",
        Phase.B_FROM_A: f"server B, a fresh process on {where} while A runs: round 1 (served from A's blocks)",
        Phase.EMBEDDED_COMPUTE: "embedded kvtier server (host tier in the engine): round 1 (computes)",
        Phase.EMBEDDED_HOST_HIT: "embedded kvtier server: round 2 after a reset of vLLM's prefix cache (host-tier hits)",
    }[phase]


TTFT_GOAL_B_VS_HIT = 1.1
"""Issue 33: B's TTFT (served from A's blocks) <= 1.1x A's own pool hit and an embedded host-tier hit."""


def node_goals(per_mode: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """B's TTFT (p50 and p90) over A's pool-hit round's and over the embedded host-tier hit's, each
    with its ``_ok`` (<= :data:`TTFT_GOAL_B_VS_HIT`); empty unless B's round finished."""
    b = per_mode.get(Phase.B_FROM_A.mode)
    out: dict[str, Any] = {}
    if b is None:
        return out
    for name, phase in (("a_pool_hit", Phase.A_POOL_HIT), ("embedded_host_hit", Phase.EMBEDDED_HOST_HIT)):
        other = per_mode.get(phase.mode)
        if other is None:
            continue
        for q in ("p50", "p90"):
            mine, theirs = b.get(f"ttft_{q}_s"), other.get(f"ttft_{q}_s")
            ratio = mine / theirs if mine is not None and theirs else None
            out[f"ttft_node_b_vs_{name}_{q}"] = ratio
            out[f"ttft_node_b_vs_{name}_{q}_ok"] = ratio is not None and ratio <= TTFT_GOAL_B_VS_HIT
    return out
