"""Launch and stop the server of one benchmark mode (a ``vllm serve`` subprocess).

Modes:

* ``vllm`` -- plain ``vllm serve``, no KV connector;
* ``example`` -- vLLM's ExampleConnector (safetensors files per prompt) on a scratch folder;
* ``kvtier`` -- the command of ``kvtier serve`` (:func:`kvtier.launch.command.build_serve_command`) with
  host + disk tiers, the disk tier on a scratch folder;
* ``floor`` -- a timing reference, not a competitor: vLLM alone with a KV space that holds the whole
  workload (:data:`FLOOR_KV_BYTES`) and the smallest block vLLM-CPU takes (:data:`FLOOR_BLOCK_SIZE`),
  so its own prefix cache keeps every transcript and a returning turn recomputes only its new
  tokens plus less than one small block: about the physical floor of a returning turn. Its block
  size differs from the other modes', so its outputs are not compared with theirs;
* ``kvtier-redis`` -- ``kvtier serve`` with host + Redis tiers (no disk): a new node joining a fleet.
  The runner starts a loopback redis-server (:mod:`kvtier.bench.redis_server`), lets a first engine
  serve the workload into it, then measures a second, fresh engine whose only warm tier is Redis
  (:func:`kvtier.bench.workloads.fleet_workload`);
* ``kvtier-node`` -- two ``kvtier serve --node`` servers on one ``kvtier node`` service (a second
  replica on the same node) and an embedded ``kvtier`` server for reference, run by
  :mod:`kvtier.bench.node_pair`; :func:`launch_spec` gives one attached server's command;
* ``native-*`` -- vLLM's own OffloadingConnector with kvtier's KVTierOffloadingSpec: its CPU tier
  alone, + its fs tier, + kvtier_disk, + kvtier_redis; ``native-*-restart``: a fresh engine on the
  root a first engine warmed (:mod:`kvtier.bench.native`).

Every mode gets the same vLLM arguments (:func:`common_vllm_args`) and environment
(:func:`base_env`). The server runs in its own process group, so stopping it (SIGINT, then SIGKILL
after a grace period) reaches vLLM's engine and worker processes too. This module never imports
vLLM: the server is a subprocess.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from kvtier.bench import native

NODE_MODE = "kvtier-node"
MODES = ("vllm", "example", "kvtier", "kvtier-redis", NODE_MODE, "floor", *native.NATIVE_MODES, *native.RESTART_MODES)
FLEET_MODE = "kvtier-redis"
FLOOR_MODE = "floor"
FLOOR_KV_BYTES = 2 * 2**30
"""The floor mode's KV space: all of the default workloads' transcripts (SmolLM2: 46 KB per token)."""
FLOOR_BLOCK_SIZE = 32
"""The smallest block vLLM-CPU takes (a multiple of 32): the floor mode recomputes < 32 cached tokens."""
EXTERNAL = "external"


class ServerError(RuntimeError):
    """A server did not start, or died; the message names its log file and shows its last lines."""


@dataclass(frozen=True)
class ServerSettings:
    """What every mode's server is started with."""

    model: str
    kv_cache_memory_bytes: int = 128 * 2**20
    max_model_len: int = 2048
    kv_offloading_size_gib: float = 1.0  # kvtier host tier
    disk_size_gib: float = 2.0  # kvtier disk tier
    redis_size_gib: float = 2.0  # kvtier-redis mode: the redis-server's maxmemory
    eviction_policy: str = "lru"
    seed: int = 0
    block_size: int | None = None  # vLLM's --block-size for every mode (None: vLLM's default)
    kv_config: Mapping[str, Any] | None = None  # kvtier modes: more kvtier keys (kvtier serve --kv-config)
    extra_vllm_args: tuple[str, ...] = ()
    vllm_cache_dir: str | None = None  # VLLM_CACHE_ROOT shared by the run's servers (None: one per scratch)


@dataclass
class LaunchSpec:
    """The command of one mode: argv, the full environment, and a one-paragraph description."""

    mode: str
    argv: list[str]
    env: dict[str, str]
    summary: str
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def common_vllm_args(settings: ServerSettings, port: int) -> list[str]:
    """``vllm serve`` arguments shared by every mode (after the model)."""
    return [
        "--enforce-eager", "--max-model-len", str(settings.max_model_len), "--dtype", "float32",
        "--seed", str(settings.seed), "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--host", "127.0.0.1", "--port", str(port),
        "--kv-cache-memory-bytes", str(settings.kv_cache_memory_bytes),
        *(("--block-size", str(settings.block_size)) if settings.block_size else ()),
        *settings.extra_vllm_args,
    ]


MAX_SOCKET_PATH_CHARS = 107
"""vLLM puts ZeroMQ IPC sockets (``<TMPDIR>/<uuid4>``, a 36-character name) in ``TMPDIR``; a socket
path may not exceed 107 bytes (``sockaddr_un``), so the scratch folder, which becomes the server's
``TMPDIR``, must leave room for it."""


def socket_path_chars(scratch: str) -> int:
    """Length of a vLLM IPC socket path in the folder ``scratch``."""
    return len(scratch) + 1 + 36


def make_scratch(mode: str, base: str | None = None) -> Path:
    """A new scratch folder for ``mode``'s server, in the temp folder, or in ``/tmp`` if a folder
    there would make vLLM's IPC socket paths too long."""
    base = base or tempfile.gettempdir()
    prefix = f"kvtier-bench-{mode}-"
    longest = os.path.join(base, prefix + "x" * 8)  # mkdtemp adds 8 random characters
    if socket_path_chars(longest) > MAX_SOCKET_PATH_CHARS and os.access("/tmp", os.W_OK):
        base = "/tmp"
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def base_env(scratch: Path, environ: Mapping[str, str] | None = None, vllm_cache_dir: str | None = None) -> dict[str, str]:
    """The environment of every mode's server: ``environ`` plus vLLM-CPU settings and scratch folders.

    ``VLLM_CACHE_ROOT``: ``vllm_cache_dir`` when given (the bench run shares one between its
    servers: vLLM keeps there only what depends on its own code, such as the model-class inspection
    it otherwise repeats in a subprocess at every start), else a folder in ``scratch``.

    ``VLLM_CPU_KVCACHE_SPACE`` is removed: on vLLM-CPU it *overrides* ``--kv-cache-memory-bytes``
    (vllm/platforms/cpu.py), which would give vLLM 1 GiB or more of KV space instead of the
    benchmark's small one.
    """
    env = dict(os.environ if environ is None else environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    env["VLLM_CACHE_ROOT"] = vllm_cache_dir or str(scratch / "vllm-cache")
    env["TMPDIR"] = str(scratch)
    return env


def launch_spec(mode: str, settings: ServerSettings, scratch: Path, port: int | None = None,
                redis_url: str | None = None, node: str | None = None) -> LaunchSpec:
    """The command that starts ``mode``'s server; ``scratch`` holds its temporary files (and a native
    mode's root); ``redis_url`` is the shared tier of the ``kvtier-redis`` and ``native-kvtier-redis*`` modes;
    ``node`` the socket of the ``kvtier node`` service a ``kvtier-node`` server attaches to."""
    from kvtier.launch.command import ServeOptions, build_serve_command
    from kvtier.launch.vllm_entry import vllm_entrypoint  # the same vLLM CLI as kvtier serve runs

    port = port or free_port()
    env = base_env(scratch, vllm_cache_dir=settings.vllm_cache_dir)
    args = common_vllm_args(settings, port)
    plain = [sys.executable, "-m", vllm_entrypoint(), "serve", settings.model]
    if mode == "vllm":
        return LaunchSpec(mode, plain + args, env, "vLLM alone (no KV connector)", port)
    if mode == FLOOR_MODE:
        floor = replace(settings, kv_cache_memory_bytes=max(settings.kv_cache_memory_bytes, FLOOR_KV_BYTES),
                        block_size=FLOOR_BLOCK_SIZE)
        return LaunchSpec(mode, plain + common_vllm_args(floor, port), env,
                          f"vLLM alone, {floor.kv_cache_memory_bytes / 2**30:.0f} GiB KV space, block "
                          f"{FLOOR_BLOCK_SIZE} (reference: a returning turn computes only its new tokens)", port)
    if mode == "example":
        folder = scratch / "example-connector"
        transfer = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(folder)}}
        argv = plain + ["--kv-transfer-config", json.dumps(transfer)] + args
        return LaunchSpec(mode, argv, env, f"vLLM + ExampleConnector on {folder}", port)
    if mode == "kvtier":
        options = ServeOptions(
            kv_offloading_size_gib=settings.kv_offloading_size_gib, disk_dir=str(scratch / "kvtier-disk"),
            disk_size_gib=settings.disk_size_gib, no_disk=False, eviction_policy=settings.eviction_policy,
            kv_config=settings.kv_config,
        )
        command = build_serve_command(settings.model, options, args, environ=env)
        return LaunchSpec(mode, command.argv, {**env, **command.env}, command.summary, port)
    if mode == NODE_MODE:
        if node is None:
            raise ValueError("the kvtier-node mode needs the socket of its kvtier node service")
        options = ServeOptions(kv_offloading_size_gib=settings.kv_offloading_size_gib, node=node,
                               eviction_policy=settings.eviction_policy, kv_config=settings.kv_config)
        command = build_serve_command(settings.model, options, args, environ=env)
        return LaunchSpec(mode, command.argv, {**env, **command.env}, command.summary, port)
    if mode == FLEET_MODE:
        if redis_url is None:
            raise ValueError("the kvtier-redis mode needs the URL of its redis-server")
        options = ServeOptions(
            kv_offloading_size_gib=settings.kv_offloading_size_gib, no_disk=True, redis_url=redis_url,
            eviction_policy=settings.eviction_policy, kv_config=settings.kv_config,
        )
        command = build_serve_command(settings.model, options, args, environ=env)
        return LaunchSpec(mode, command.argv, {**env, **command.env}, command.summary, port)
    if mode in native.NATIVE_MODES or mode in native.RESTART_MODES:
        root = scratch / "native-root"
        extra = native.extra_config(mode, cpu_bytes=int(settings.kv_offloading_size_gib * 2**30),
                                    disk_bytes=int(settings.disk_size_gib * 2**30), root=root, redis_url=redis_url)
        transfer = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
        argv = plain + ["--kv-transfer-config", json.dumps(transfer)] + args
        return LaunchSpec(mode, argv, env, native.describe(mode, root), port)
    raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")


@dataclass
class Server:
    """A running (or exited) server process of one mode."""

    spec: LaunchSpec
    log_path: Path
    process: subprocess.Popen
    started_at: float = field(default_factory=time.perf_counter)
    ready_s: float | None = None

    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self, lines: int = 30) -> str:
        """The last lines of the server log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def failure(self, what: str) -> ServerError:
        return ServerError(f"{self.spec.mode} server {what}; log: {self.log_path}\n--- last lines ---\n{self.tail()}")

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGINT the process group, SIGKILL it after ``grace_s``; returns the exit code."""
        if self.alive():
            _signal_group(self.process, signal.SIGINT)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.process, signal.SIGKILL)
                self.process.wait(timeout=30)
        _signal_group(self.process, signal.SIGKILL)  # leftover children of the group, if any
        return self.process.returncode


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)  # the server is the leader of its own process group
    except (ProcessLookupError, PermissionError):
        pass


def start(spec: LaunchSpec, log_path: Path) -> Server:
    """Start ``spec``'s server in a new process group, its output to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(spec.argv)}\n{spec.summary}\n".encode())
        log.flush()
        process = subprocess.Popen(spec.argv, env=spec.env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    return Server(spec, log_path, process)


async def wait_healthy(server: Server, timeout_s: float = 600.0,
                       on_wait: Callable[[float], None] | None = None) -> float:
    """Poll ``/health`` until it answers 200; returns the start-up time in seconds.

    Raises :class:`ServerError` (with the log's tail) if the process exits or ``timeout_s`` passes.
    """
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            elapsed = time.perf_counter() - server.started_at
            if not server.alive():
                raise server.failure(f"exited with code {server.process.returncode} during start-up")
            try:
                if (await client.get(f"{server.spec.base_url}/health")).status_code == 200:
                    server.ready_s = elapsed
                    return elapsed
            except httpx.HTTPError:
                pass
            if elapsed > timeout_s:
                raise server.failure(f"did not answer /health within {timeout_s:.0f} s")
            if on_wait is not None:
                on_wait(elapsed)
            await asyncio.sleep(1.0)
