"""``kvtier node``: run the node service (one cache per node) in the foreground.

Argument parsing only; the service is :mod:`kvtier.node` (imported when the command runs).
"""

from __future__ import annotations

import re

import click

from kvtier.cli.s3_flags import flag_names, s3_entry, s3_options

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class ByteSize(click.ParamType):
    """A byte count of at least one byte: 8000000000, 8G (10^9), 8GiB (2^30); K, M, T likewise.
    Anything else, 0 (or a fraction below one byte) included, is a usage error naming the flag."""

    name = "BYTES"

    def convert(self, value, param, ctx):  # noqa: ANN001 (click's signature)
        if isinstance(value, int):
            size = value
        else:
            match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt](?:ib)?)?b?\s*", str(value), re.IGNORECASE)
            if not match:
                self.fail(f"{value!r} is not a byte count (examples: 8000000000, 8G, 8GiB)", param, ctx)
            number, unit = match.groups()
            size = int(float(number) * _UNITS[(unit or "").lower()])
        if size < 1:
            self.fail(f"{value!r} is {size} bytes: give at least one byte (examples: 8000000000, 8G, 8GiB)", param, ctx)
        return size


@click.command("node", short_help="Run the node service: one KV cache pool shared by every engine on this machine.",
               epilog="\b\nExamples:\n"
                      "  kvtier node --socket /run/kvtier/node.sock --pool-bytes 64GiB\n"
                      "  kvtier node --socket /run/kvtier/node.sock --pool-bytes 64GiB --group kvtier \\\n"
                      "      --eviction-policy arc --metrics-port 9400\n"
                      "  kvtier node --socket /run/kvtier/node.sock --pool-bytes 64GiB \\\n"
                      "      --disk-dir /var/cache/kvtier --disk-size 500 --redis-url redis://cache:6379/0\n"
                      "  kvtier node --socket /run/kvtier/node.sock --pool-bytes 64GiB \\\n"
                      "      --disk-dir /var/cache/kvtier --disk-size 500 --s3-url s3://kv-bucket/prod --s3-size 20000")
@click.option("--socket", "socket_path", required=True, type=click.Path(dir_okay=False), metavar="PATH",
              help="Unix socket the engines attach to; its directory must exist. Created owner-only (0600), or "
                   "0660 for --group. A second service on the same socket is refused.")
@click.option("--pool-bytes", required=True, type=ByteSize(),
              help="The pool: shared memory held by this process for every engine's blocks (8000000000, 8G or "
                   "8GiB). Refused if larger than the node's available memory (or the cgroup's memory.max).")
@click.option("--slot-bytes", type=ByteSize(), default=None,
              help="Bytes of one block of one rank (one slot). Default: set by the first engine that attaches; "
                   "one service serves one block size (engines with another one are refused).")
@click.option("--eviction-policy", type=click.Choice(["lru", "arc"]), default="lru", show_default=True,
              help="Which unpinned block leaves a full pool first.")
@click.option("--group", default=None, metavar="GROUP",
              help="Also admit this group's members (the socket becomes 0660 owned by GROUP). Without it only "
                   "root and the service's own user may attach; every peer's credentials are checked.")
@click.option("--metrics-port", type=int, default=None,
              help="Serve Prometheus metrics (pool usage, hits per engine, pins, attached engines) on this port.")
@click.option("--metrics-host", default="127.0.0.1", show_default=True, help="Address for --metrics-port.")
@click.option("--max-connections", type=click.IntRange(min=1), default=256, show_default=True,
              help="Connections served at once; beyond them a new one is closed at once (counted in "
                   "kvtier_node_refused_connections_total). An engine holds 1 + its tensor-parallel size "
                   "(its scheduler's and one per worker rank). Bounds the service's memory per client too.")
@click.option("--no-prefault", is_flag=True,
              help="Do not touch every page of the pool at start-up (faster start, first stores pay the faults).")
@click.option("--disk-dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="The node's disk tier, owned by this service (one writer per root): blocks committed to the "
                   "pool are written here too, and lookups promote them back into the pool. Survives a restart: "
                   "the first lookups after one are disk hits.")
@click.option("--disk-size", type=float, default=None, metavar="GiB",
              help="Capacity of --disk-dir in GiB (2^30 bytes); required with --disk-dir.")
@click.option("--redis-url", default=None, metavar="URL",
              help="The node's Redis / Valkey tier (one connection pool for the node), below the disk tier: "
                   "redis://host:6379/0, rediss://... (TLS) or unix:///path.sock.")
@s3_options(below="the disk and Redis tiers")
@click.option("--fleet-key-env", default=None, metavar="NAME",
              help="Environment variable holding the fleet key (docs/security.md): every record the service "
                   "writes to --disk-dir / --redis-url / --s3-url is signed with it, and only records signed with it (or a "
                   "--read-key-env / --read-key-file key) are read back; others are counted misses.")
@click.option("--fleet-key-file", default=None, metavar="PATH", help="... or the file holding it.")
@click.option("--read-key-env", multiple=True, metavar="NAME",
              help="A retired fleet key still accepted for reading (repeatable), while records rotate.")
@click.option("--read-key-file", multiple=True, metavar="PATH", help="... or the file holding one (repeatable).")
@click.option("--encrypt", is_flag=True,
              help="Encrypt records at rest (AES-256-GCM under keys derived from --fleet-key-env).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning"]), default="info", show_default=True)
def node_command(socket_path: str, pool_bytes: int, slot_bytes: int | None, eviction_policy: str,
                 group: str | None, metrics_port: int | None, metrics_host: str, max_connections: int,
                 no_prefault: bool,
                 disk_dir: str | None, disk_size: float | None, redis_url: str | None, s3_url: str | None,
                 s3_endpoint: str | None, s3_region: str | None, s3_size: float | None, s3_ca_bundle: str | None,
                 fleet_key_env: str | None,
                 fleet_key_file: str | None, read_key_env: tuple[str, ...], read_key_file: tuple[str, ...],
                 encrypt: bool, log_level: str) -> None:
    """Run kvtier's node service in the foreground until SIGTERM or Ctrl-C.

    \b
    One process per machine owns a pool of slots in shared memory and
    its index (LRU/ARC): every engine on the machine that is configured
    with "node": "PATH" (kvtier's connector, or `kvtier serve --node PATH`)
    shares it. A block one engine stored is a hit for every engine of the
    same model and layout, and is held once however many engines store it.
    Engines map the pool and copy their pages themselves; the socket
    carries control only (lookups, reservations, pins, commits).

    \b
    An engine's cpu_bytes_to_use caps what it may hold in the pool.
    Everything an engine holds is released when its connection drops
    (SIGKILL included). The pool lives as long as this process: after a
    restart it is empty and engines reattach by themselves; while it is
    down they only miss. Inspect a running service: kvtier inspect PATH.

    \b
    With --disk-dir / --redis-url / --s3-url the service owns the node's
    disk, Redis and S3 tiers (engines attached with "node" have none of their own):
    every block committed to the pool is written below it, and a lookup
    whose run continues there promotes those blocks into the pool (the
    engine asks again a moment later). The disk root outlives the
    service: after a restart, lookups are served from disk.
    --fleet-key-env (or --fleet-key-file) signs (with --encrypt,
    encrypts) their records.
    """
    import logging
    import os
    from pathlib import Path

    from kvtier.core.config import PolicyName
    from kvtier.node.pool import PoolTooLargeError
    from kvtier.node.listener import NodeAlreadyRunning, NodeConfigError
    from kvtier.node.server import NodeOptions
    from kvtier.node.service import run

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s kvtier node: %(message)s")
    options = NodeOptions(Path(socket_path), pool_bytes, slot_bytes, PolicyName(eviction_policy), group,
                          prefault=not no_prefault, max_connections=max_connections,
                          tiers=_tier_configs(disk_dir, disk_size, redis_url, _fleet_keys(
                              {"auth_key_env": fleet_key_env, "auth_key_file": fleet_key_file, "encrypt": encrypt,
                               "auth_read_key_envs": read_key_env, "auth_read_key_files": read_key_file}),
                              s3=s3_entry(s3_url, s3_endpoint, s3_region, s3_size, s3_ca_bundle)))

    def ready(server) -> None:  # noqa: ANN001 (a NodeServer; imported lazily above)
        click.echo(f"kvtier node: serving {socket_path} (pool {pool_bytes} bytes, pid {os.getpid()})", err=True)

    try:
        run(options, metrics_port=metrics_port, metrics_host=metrics_host, ready=ready)
    except (NodeAlreadyRunning, NodeConfigError, PoolTooLargeError) as exc:
        raise click.ClickException(str(exc)) from None


_KEY_FLAGS = {"auth_key_env": "--fleet-key-env", "auth_key_file": "--fleet-key-file", "encrypt": "--encrypt",
              "auth_read_key_envs": "--read-key-env", "auth_read_key_files": "--read-key-file"}
"""The fleet key flags, by the tier entry key each sets (the same settings as a tier's auth_key_env...)."""


def _fleet_keys(raw: dict):
    """The fleet key settings of every tier of the service (an AuthConfig, keys loaded now), or
    None without a key; :func:`kvtier.core.fleet_key.parse_auth` reads them as it reads a tier
    entry's. Raises ClickException naming the flag."""
    from kvtier.core.fleet_key import parse_auth
    from kvtier.core.values import PREFIX, ConfigError

    try:
        return parse_auth({k: v for k, v in raw.items() if v}, "kvtier node", flags=_KEY_FLAGS)
    except ConfigError as exc:
        raise click.ClickException(str(exc).removeprefix(f"{PREFIX}: ")) from None


def _tier_configs(disk_dir: str | None, disk_size: float | None, redis_url: str | None, auth=None,
                  s3: dict | None = None) -> tuple:
    """The service's tiers from its flags (cascade order: disk, then Redis, then S3), checked now: a
    root this user cannot write, credentials Redis or S3 refuse or a fleet key that does not load
    stop the service with the flag named. ``auth``: :func:`_fleet_keys`, the same for every tier;
    ``s3``: :func:`kvtier.cli.s3_flags.s3_entry`."""
    from dataclasses import replace
    from pathlib import Path

    from kvtier.core.dirs import OWNER_DIR_MODE, ready_dir
    from kvtier.core.tier_config import DiskTierConfig, TierType, parse_tier
    from kvtier.core.values import ConfigError
    from kvtier.tiers.factory import check_tier

    if (disk_dir is None) != (disk_size is None):
        raise click.UsageError("--disk-dir and --disk-size go together: give the directory and its capacity in GiB")
    if auth is not None and disk_dir is None and redis_url is None and s3 is None:
        raise click.UsageError("--fleet-key-env signs the records of the service's tiers: give --disk-dir, "
                               "--redis-url and/or --s3-url, or drop it (the pool itself is memory, never a record)")
    tiers: list = []
    try:
        if disk_dir is not None:
            if disk_size is None or disk_size <= 0:
                raise click.BadParameter(f"{disk_size}: a positive number of GiB", param_hint="--disk-size")
            root = Path(disk_dir).expanduser()
            problem = ready_dir(root, OWNER_DIR_MODE)  # owner-only, as every directory kvtier creates
            if problem is not None:
                raise click.BadParameter(f"{root} {problem}", param_hint="--disk-dir")
            tiers.append(DiskTierConfig(root_dir=root, capacity_bytes=int(disk_size * 2**30), auth=auth))
            check_tier(tiers[-1], where="--disk-dir")
        if redis_url is not None:
            tiers.append(replace(parse_tier({"url": redis_url}, TierType.REDIS, "--redis-url"), auth=auth))
            check_tier(tiers[-1], where="--redis-url")
        if s3 is not None:
            tiers.append(replace(parse_tier(s3, TierType.S3, "s3"), auth=auth))
            check_tier(tiers[-1], where="s3")
    except ConfigError as exc:
        raise click.ClickException(flag_names(str(exc))) from None
    return tuple(tiers)
