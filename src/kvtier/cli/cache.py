"""``kvtier inspect | verify | purge DIR_OR_URL``: manage a disk tier root (docs/disk-format.md), a
Redis / Valkey remote tier (docs/distributed.md) or an S3 tier (docs/object-store.md).

The commands themselves: their options, which store they open, the work they call
(:mod:`kvtier.cachetools`), and what becomes of its outcome: ``--json`` or the human-readable
output (:mod:`kvtier.cli.cache_render`, every rich renderer), the exit status (1 where the
figures are partial or something was bad or not removed), and errors as click errors (a usage
error for a bad selection, the target's own failure as :func:`~kvtier.cli.cache_target.failure`
words it). What a command is pointed at, and with which keys: :mod:`kvtier.cli.cache_target`.

Only click and the two modules above (which import nothing heavier at module level) are imported
here at module level; the work (:mod:`kvtier.cachetools`) and rich are imported when a command
runs, so registering these commands keeps ``kvtier --help`` instant. Threading: the ``kvtier``
command's one thread.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import click

from kvtier.cli.cache_render import make_console, render_inventory, render_node, render_purge, render_verify
from kvtier.cli.cache_target import (auth_config, failure, is_objects, is_socket, key_options, open_target,
                                     s3_options, target_errors, target_options)

_PROGRESS_MIN_FILES = 200  # show a progress bar from this many files on (on a terminal)


def _emit_json(data: dict[str, Any]) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False))


# ---------------------------------------------------------------------------- inspect


@click.command("inspect")
@target_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--tails", "count_tails", is_flag=True,
              help="Also count tails (partial blocks a finished request left): reads each block's header "
                   "(rank 0), one small read per block. Directories only.")
def inspect_command(target: str, username: str | None, password_env: str | None, key_prefix: str,
                    endpoint: str | None, region: str | None, ca_bundle: str | None, profile: str | None,
                    as_json: bool, count_tails: bool) -> None:
    """Show the namespaces of a disk tier directory, a Redis remote tier or an S3 tier: model,
    layout, blocks, bytes, ages, last use, and what is there that is not kvtier's; or the pool of a
    running `kvtier node` (its socket's path).

    A directory: reads directory entries, file sizes and mtimes and each namespace's config.json
    only (never a block's payload), so it is fast and safe while engines use it. A block is
    complete when every tensor-parallel rank's file is present; ages are by last use (mtime).
    Directories that cannot be read are skipped and listed (exit status 1: the figures are partial).
    A Redis URL (redis://, rediss://, unix://): SCAN, OBJECT IDLETIME and STRLEN, never KEYS, and
    nothing that counts as a use of a block (CLIENT NO-TOUCH; a server older than 7.2 refuses it:
    sizes are then its MEMORY USAGE, said so). An S3 URL (s3://BUCKET/PREFIX): one LIST of the
    prefix (ages by last write). A node socket: the pool's usage, pins, attached engines and each
    engine's hits and stores.
    """
    if is_socket(target):
        _inspect_node(target, as_json)
        return
    from kvtier.cachetools import inspect_cache

    remote = open_target(target, username, password_env, key_prefix, s3_options(endpoint, region, ca_bundle, profile),
                         node_socket=True)
    failures = target_errors() if remote is not None else (OSError,)
    try:
        if remote is None:
            inventory = inspect_cache(target, count_tails=count_tails)
        elif is_objects(remote):
            from kvtier.cachetools.objects import inspect_objects

            inventory = inspect_objects(remote)
        else:
            from kvtier.cachetools.remote import inspect_remote

            inventory = inspect_remote(remote)
    except failures as exc:
        raise failure(exc, remote) from None
    if as_json:
        _emit_json(inventory.to_json())
    else:
        render_inventory(inventory, make_console())
    if inventory.unreadable:
        sys.exit(1)


REDIS_PROGRAMS = frozenset({"redis-server", "valkey-server", "keydb-server", "dragonfly"})
"""Servers of the Redis protocol, as the kernel names their processes (``/proc/PID/comm``)."""


def _socket_server(path: str) -> tuple[int, str] | None:
    """The pid and program name (``/proc/PID/comm``) of the process serving the Unix socket at
    ``path`` (``SO_PEERCRED`` of a connection opened and closed at once, nothing sent), or None
    where that cannot be told (another PID namespace, a process gone)."""
    import socket

    from kvtier.node.credentials import peer_credentials

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(1.0)
            sock.connect(path)
            pid, _, _ = peer_credentials(sock)
        with open(f"/proc/{pid}/comm", errors="replace") as comm:  # any bytes a process names itself by
            return pid, comm.read(64).strip()
    except OSError:
        return None


def _inspect_node(target: str, as_json: bool) -> None:
    """``kvtier inspect SOCKET``: the stats of a running node service (one request, as an observer).
    A socket served by a Redis server is said to be one at once (it would never answer the node's
    hello), with the URL to give instead."""
    from kvtier.node import NodeClient, NodeError, NodeUnavailable, Role

    as_redis = f"a Redis server's socket is given as unix://{os.path.abspath(target)}"
    server = _socket_server(target)
    if server is not None and server[1] in REDIS_PROGRAMS:
        raise click.UsageError(f"{target} is the socket of a Redis server ({server[1]}, pid {server[0]}), not of a "
                               f"kvtier node: {as_redis}.")
    try:
        with NodeClient(target, engine="kvtier-inspect", role=Role.OBSERVER) as client:
            stats = client.stats()
    except NodeUnavailable as exc:
        program = f" ({server[1]}, pid {server[0]})" if server is not None and server[1] else ""
        raise click.ClickException(f"{exc}: no kvtier node answered on this socket{program}; {as_redis}") from None
    except NodeError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        _emit_json(stats)
        return
    render_node(stats, make_console())


# ---------------------------------------------------------------------------- verify


@click.command("verify")
@target_options
@click.option("--namespace", "selectors", multiple=True, metavar="DIGEST_OR_MODEL",
              help="Only this namespace (digest, at least 4 hex digits, or model name); repeatable. A digest "
                   "that matches several namespaces is refused.")
@click.option("--no-quarantine", is_flag=True,
              help="Only report bad records; do not move them to quarantine/ (on Redis and S3, where there is "
                   "no quarantine: do not delete them).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@key_options
def verify_command(target: str, username: str | None, password_env: str | None, key_prefix: str,
                   endpoint: str | None, region: str | None, ca_bundle: str | None, profile: str | None,
                   selectors: tuple[str, ...], no_quarantine: bool, as_json: bool, auth_key_env: str | None,
                   auth_key_file: str | None, read_key_envs: tuple[str, ...],
                   read_key_files: tuple[str, ...]) -> None:
    """Check every block's header, size and payload checksum, as the tier's reader does.

    With the tier's fleet key (--auth-key-env / --auth-key-file, and its retired keys as
    --read-key-env / --read-key-file): every MAC is checked as the tier does (a record without a
    valid one, plain records included, is bad), and records under retired keys are counted by key
    id (kvtier purge --retired removes them). Without a key, sealed records are checked for
    header and size only, never removed for want of a key.

    A directory: bad files are listed and moved to DIR/quarantine/ (where the tier itself puts
    them) unless --no-quarantine; files that are not kvtier's are reported and left in place, and
    so are namespaces whose config.json is missing or does not match the directory name (their
    files are checked without it); payloads are streamed (bounded memory) and never read beyond
    the namespace's block size; directories that cannot be read are skipped and listed. A Redis
    URL: every value is read (in batches of at most 64 MiB) and bad ones are deleted unless
    --no-quarantine; reading a value is no use of it where the server accepts CLIENT NO-TOUCH
    (Redis / Valkey 7.2 and later; an older server counts every value read as just used, said in a
    note: run purge --older-than before verify there). An S3 URL: every block object is read (GETs
    bounded by the namespace's block size) and bad ones are deleted unless --no-quarantine. Safe
    while engines run. Exit status 1 if anything was bad or skipped.
    """
    from kvtier.cachetools import SelectionError, verify_cache

    auth = auth_config(auth_key_env, auth_key_file, read_key_envs, read_key_files)
    remote = open_target(target, username, password_env, key_prefix, s3_options(endpoint, region, ca_bundle, profile))
    if remote is not None:
        from kvtier.cachetools.objects import verify_objects
        from kvtier.cachetools.remote import verify_remote

        start = time.perf_counter()
        try:
            report = (verify_objects if is_objects(remote) else verify_remote)(
                remote, selectors, delete=not no_quarantine, auth=auth)
        except target_errors() as exc:
            raise failure(exc, remote) from None
        except SelectionError as exc:
            raise click.UsageError(str(exc)) from None
        if as_json:
            _emit_json({**report.to_json(), "seconds": round(time.perf_counter() - start, 3)})
        else:
            render_verify(report, make_console(), time.perf_counter() - start)
        sys.exit(0 if report.ok else 1)
    directory = target
    err = make_console(stderr=True)
    progress_bar = None
    task = None

    def progress(done: int, total: int) -> None:
        nonlocal progress_bar, task
        if progress_bar is None:
            if total < _PROGRESS_MIN_FILES or not err.is_terminal:
                return
            from rich.progress import Progress

            progress_bar = Progress(*Progress.get_default_columns(), console=err, transient=True)
            progress_bar.start()
            task = progress_bar.add_task("verifying", total=total)
        progress_bar.update(task, completed=done)

    start = time.perf_counter()
    try:
        report = verify_cache(directory, selectors=selectors, quarantine=not no_quarantine, progress=progress,
                              auth=auth)
    except SelectionError as exc:
        raise click.UsageError(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        if progress_bar is not None:
            progress_bar.stop()
    if as_json:
        _emit_json({**report.to_json(), "seconds": round(time.perf_counter() - start, 3)})
    else:
        render_verify(report, make_console(), time.perf_counter() - start)
    sys.exit(0 if report.ok else 1)


# ---------------------------------------------------------------------------- purge


def _duration(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    if value is None:
        return None
    from kvtier.cachetools import parse_duration

    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command("purge")
@target_options
@click.option("--namespace", "namespaces", multiple=True, metavar="DIGEST",
              help="Blocks of this namespace (its digest, at least 4 hex digits, or its name: directory, key or "
                   "folder); repeatable. A digest that matches several namespaces is refused.")
@click.option("--model", "models", multiple=True, metavar="NAME", help="Blocks of this model's namespaces; repeatable.")
@click.option("--older-spec", is_flag=True,
              help="Namespaces written under an older key spec (kvtier inspect marks them): never read again.")
@click.option("--older-than", callback=_duration, metavar="DURATION",
              help="Blocks last used longer ago than this (by mtime; on Redis by OBJECT IDLETIME; on S3 by last "
                   "write), e.g. 30m, 12h, 7d.")
@click.option("--retired", is_flag=True,
              help="Blocks not sealed under the current fleet key (--auth-key-env / --auth-key-file): under "
                   "a retired or unknown key, or unauthenticated.")
@click.option("--quarantine", is_flag=True,
              help="Empty the quarantine (of the selected namespaces, if narrowed): the files the tier quarantined, "
                   "by its names, in a kvtier root; nothing else there. Disk only: Redis and S3 have none.")
@click.option("--all", "all_", is_flag=True,
              help="Everything: all namespaces' blocks (and, on disk, the quarantine).")
@click.option("--dry-run", is_flag=True, help="Only list what would be deleted.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@key_options
def purge_command(target: str, username: str | None, password_env: str | None, key_prefix: str,
                  endpoint: str | None, region: str | None, ca_bundle: str | None, profile: str | None,
                  namespaces: tuple[str, ...], models: tuple[str, ...], older_spec: bool,
                  older_than: float | None, retired: bool, quarantine: bool, all_: bool, dry_run: bool,
                  as_json: bool, auth_key_env: str | None, auth_key_file: str | None,
                  read_key_envs: tuple[str, ...], read_key_files: tuple[str, ...]) -> None:
    """Delete blocks by namespace, model, age or fleet key, and/or empty the quarantine.

    --retired (with the current fleet key as --auth-key-env / --auth-key-file): blocks whose
    records are not sealed under it, the last step of a key rotation (kvtier verify with the
    keys lists what is left under retired keys).

    Selectors combine (--model M --older-than 7d: blocks of M unused for 7 days); at least one is
    required. Safe while engines use DIR: only block files are unlinked (a running engine sees a
    miss), writers' temp files are never touched, emptied directories are removed only if still
    empty, and a namespace's config.json goes only with the whole namespace (--all, --namespace,
    --model) when nothing else is left in it (no block, temp or stray file). Only what the tier
    quarantined goes from DIR/quarantine/ (named as it names quarantined records, in a directory
    holding a kvtier namespace); anything else there is left in place and counted. A namespace
    with a directory that cannot be read is skipped whole (nothing removed from it) and listed;
    exit status 1 then, and when a file could not be removed. On a Redis URL the selected keys are
    UNLINKed (SCAN, never KEYS; ages by OBJECT IDLETIME, read before anything else and never
    reset by the command: CLIENT NO-TOUCH, or on a server older than 7.2 no read of a value it
    keeps but --retired's headers); with --older-than each block's age is read again where it is
    unlinked (one server-side script, where the server runs scripts: a block used meanwhile is kept
    and counted, as on disk, where a file's mtime is read again before its unlink); there is no
    quarantine there (--quarantine is refused). On an S3 URL the selected objects are deleted
    (bulk DELETE), --older-than going by last write; no quarantine either. There too a
    namespace's config key (config.json) goes only when nothing else of the namespace is left.
    """
    from kvtier.cachetools import PurgeSelection, purge_cache

    auth = auth_config(auth_key_env, auth_key_file, read_key_envs, read_key_files)
    if retired and auth is None:
        raise click.UsageError("--retired needs the current fleet key: --auth-key-env NAME or --auth-key-file PATH.")
    remote = open_target(target, username, password_env, key_prefix, s3_options(endpoint, region, ca_bundle, profile))
    failures = target_errors() if remote is not None else (OSError,)
    selection = PurgeSelection(namespaces, models, older_than, quarantine, all_, older_spec,
                               auth.write.key_id if retired and auth is not None else None)
    try:
        if remote is None:
            report = purge_cache(target, selection, dry_run=dry_run)
        elif is_objects(remote):
            from kvtier.cachetools.objects import purge_objects

            report = purge_objects(remote, selection, dry_run=dry_run)
        else:
            from kvtier.cachetools.remote import purge_remote

            report = purge_remote(remote, selection, dry_run=dry_run)
    except failures as exc:  # before ValueError: an S3 tier's ConfigError (refused, no bucket) is one
        raise failure(exc, remote) from None
    except ValueError as exc:  # a bad selection, or a selector matching no namespace (SelectionError)
        raise click.UsageError(str(exc)) from None
    if as_json:
        _emit_json(report.to_json())
    else:
        render_purge(report, make_console())
    errors = report.errors + sum(ns.errors for ns in report.namespaces)
    skipped = len(report.unreadable)
    if errors or skipped:
        from kvtier.cachetools.stores import words

        why = [f"{words(report.store).units(errors)} could not be removed"] if errors else []
        why += [f"{skipped} director(ies) could not be read: skipped"] if skipped else []
        raise click.ClickException("; ".join(why) + " (listed " + ("in the JSON)" if as_json else "above)"))


