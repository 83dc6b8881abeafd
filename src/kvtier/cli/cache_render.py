"""The human-readable output of ``kvtier inspect | verify | purge`` (:mod:`kvtier.cli.cache`): the
rich console they print to (:func:`make_console`) and one renderer per report:
:func:`render_inventory` (inspect), :func:`render_node` (inspect of a node socket),
:func:`render_verify` and :func:`render_purge`, each in the words of the store the report is
about (:mod:`kvtier.cachetools.stores`: files and a quarantine on disk, values on Redis, objects
on S3).

Invariants:

- A renderer only prints, to the console it is given: it never touches a store, never changes the
  report, never exits and never raises a click error. Exit statuses, ``--json`` and the errors of
  a command are :mod:`kvtier.cli.cache`'s.
- Text that comes from a store or a node's peers (names, paths, keys, layouts, reasons, notes,
  engine names) goes through :func:`kvtier.cli.terminal.shown` before it is printed: markup escaped, control
  characters and bidirectional overrides written as escapes (a hostile writer of a shared store
  cannot send the operator's terminal commands), and the console has emoji codes off (a key ``kvtier:a`` followed by a
  colon prints as it is, not as an emoji).
- Only the standard library is imported at module level: rich and :mod:`kvtier.cachetools` are
  imported when something is rendered, so importing this module (as registering the commands
  does) costs nothing.

Threading: the ``kvtier`` command's one thread.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from kvtier.cli.terminal import console as terminal_console
from kvtier.cli.terminal import shown

if TYPE_CHECKING:
    from rich.console import Console

    from kvtier.cachetools import Inventory, NamespaceInventory, PurgeReport, VerifyReport
    from kvtier.cachetools.stores import StoreWords


def fmt_bytes(n: float) -> str:
    """``n`` bytes in binary units (``1.5 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_ago(seconds: float) -> str:
    """A duration in the past, coarsely (``42s ago``, ``5m ago``, ``3h ago``, ``2d ago``)."""
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def make_console(stderr: bool = False) -> Console:
    """The console a command prints to: stdout, or stderr (progress bars)."""
    # Not a terminal (a pipe, a log): do not squeeze the table into 80 columns unless COLUMNS says so.
    # No emoji codes (kvtier.cli.terminal.console): markup in names is escaped where they are printed.
    return terminal_console(piped_width=None if "COLUMNS" in os.environ else 160, stderr=stderr, highlight=False,
                            soft_wrap=True)


def _relative(path: str, root: str) -> str:
    """``path`` relative to the root directory (shorter lines); as is if outside it."""
    prefix = root.rstrip("/") + "/"
    return path[len(prefix):] if path.startswith(prefix) else path


_TABLE_MIN_WIDTH = 120  # narrower consoles get one block of lines per namespace instead of the table


def _layout_text(layout: dict[str, Any] | None, sep: str = "\n") -> str:
    if layout is None:
        return "-"
    def get(key: str, default: str) -> str:
        return shown(layout.get(key, default))

    return sep.join((f"{get('spec_version', '?')} · {get('kv_dtype', '?')} · {get('attention_kind', '?')}",
                     f"{get('num_layers', '?')} layers · {get('num_kv_heads', '?')}×{get('head_size', '?')}",
                     f"{get('block_tokens', '?')} tok/block · tp {get('tp_size', '?')}"))


def _cells(ns: NamespaceInventory, now: float, store: StoreWords) -> dict[str, str]:
    """One namespace's figures as rich markup, keyed by column."""
    name = f"{shown(ns.model_name or ns.model)}\n[dim]{ns.digest16}[/dim]"
    if ns.config_problem:
        name += f"\n[red]{shown(ns.config_problem)}[/red]"
    if ns.older_spec:
        name += "\n[yellow]older key spec: never read (kvtier purge --older-spec)[/yellow]"
    if ns.unreadable:
        name += f"\n[red]{ns.unreadable} unreadable dir(s): figures partial[/red]"
    incomplete = f"\n[yellow]+{ns.incomplete_blocks:,} incomplete[/]" if ns.incomplete_blocks else ""
    if ns.snapshot_blocks is not None:
        incomplete += f"\n[dim]snapshot {ns.snapshot_blocks:,}[/dim]"
    if ns.tail_blocks is not None:
        incomplete += f"\n[dim]of which tails {ns.tail_blocks:,}[/dim]"
    ledger = f"\n[dim]ledger {fmt_bytes(ns.ledger_bytes)}[/dim]" if ns.ledger_bytes is not None else ""
    units = f"\n[dim]{store.units(ns.block_files)}[/dim]" if store.quarantine else ""  # one a block elsewhere
    return {
        "namespace": name,
        "blocks": f"{ns.complete_blocks:,}{incomplete}",
        "size": f"{fmt_bytes(ns.block_bytes)}{units}{ledger}",
        **{label: str(count or "-") for label, count in ns.ages.items()},
        "last use": fmt_ago(now - ns.last_use) if ns.last_use is not None else "-",
        "quarantine": f"{ns.quarantine_files} · {fmt_bytes(ns.quarantine_bytes)}" if ns.quarantine_files else "-",
        "temp": f"{ns.temp_files}" if ns.temp_files else "-",
    }


def render_inventory(inventory: Inventory, console: Console) -> None:
    """The human-readable ``kvtier inspect`` output: a table (or, on a narrow console, one block
    of lines per namespace), totals, the first unexpected entries and the notes; in the words of
    the store (:mod:`kvtier.cachetools.stores`: no quarantine or temp files but on disk)."""
    from rich.table import Table

    from kvtier.cachetools import AGE_BUCKETS
    from kvtier.cachetools.stores import words

    store = words(inventory.store)
    rows = [(ns, _cells(ns, inventory.scanned_at, store)) for ns in inventory.namespaces]
    last = ("last use", "quarantine", "temp") if store.quarantine else ("last use",)
    if console.width >= _TABLE_MIN_WIDTH:
        columns = ("namespace", "layout", "blocks", "size", *(label for label, _ in AGE_BUCKETS), *last)
        table = Table(title=f"{store.title} {shown(inventory.root)}", title_justify="left", show_lines=True)
        for column in columns:
            table.add_column(column, justify="left" if column in ("namespace", "layout") else "right")
        for ns, cells in rows:
            table.add_row(*(_layout_text(ns.layout) if c == "layout" else cells[c] for c in columns))
        console.print(table)
    else:
        console.print(f"[bold]{store.title} {shown(inventory.root)}[/bold]")
        for ns, cells in rows:
            incomplete = f" (+{ns.incomplete_blocks:,} incomplete)" if ns.incomplete_blocks else ""
            console.print(cells["namespace"].replace("\n", "  "))
            console.print(f"  layout      {_layout_text(ns.layout, ' · ')}")
            units = f" · {store.units(ns.block_files)}" if store.quarantine else ""
            console.print(f"  blocks      {ns.complete_blocks:,} complete{incomplete}{units} · "
                          f"{fmt_bytes(ns.block_bytes)}")
            console.print("  ages        " + " · ".join(f"{label} {count}" for label, count in ns.ages.items()))
            console.print("  last use    " + " · ".join(cells[c] if c == "last use" else f"{c} {cells[c]}"
                                                      for c in last))
            if ns.tail_blocks is not None:
                console.print(f"  tails       {ns.tail_blocks:,} of the complete blocks are tails (partial blocks)")
            if ns.snapshot_blocks is not None:
                console.print(f"  snapshot    index of {ns.snapshot_blocks:,} blocks (a restart serves from it)")
            if ns.ledger_bytes is not None:
                console.print(f"  ledger      {fmt_bytes(ns.ledger_bytes)} charged (bounded by capacity_bytes)")
    total_blocks = sum(ns.complete_blocks for ns in inventory.namespaces)
    total_bytes = sum(ns.block_bytes for ns in inventory.namespaces)
    quarantine = (f"; quarantine: {inventory.quarantine_files} file(s), {fmt_bytes(inventory.quarantine_bytes)}"
                  if store.quarantine else "")
    console.print(f"{len(inventory.namespaces)} namespace(s), {total_blocks:,} complete blocks, "
                  f"{fmt_bytes(total_bytes)}{quarantine}")
    strays = len(inventory.strays) + inventory.strays_unlisted
    if strays:
        see = " (see `kvtier verify`)" if store.quarantine else ", not kvtier's (left alone)"
        console.print(f"[yellow]{strays:,} unexpected {store.entries[strays != 1]}{see}:[/yellow]")
        for path, reason in inventory.strays[:10]:
            console.print(f"  {shown(_relative(path, inventory.root))}: {shown(reason)}")
        if strays > 10:
            listed = "--json lists all" if not inventory.strays_unlisted else f"--json lists {len(inventory.strays)}"
            console.print(f"  ... and {strays - 10} more ({listed})")
    for note in inventory.notes:
        console.print(f"[dim]note: {shown(note)}[/dim]")
    _render_unreadable(inventory.unreadable, inventory.root, console, "not counted")


def _render_unreadable(unreadable: list[Any], root: str, console: Console, consequence: str) -> None:
    """The directories a command could not read (skipped), the first 10 of them."""
    if not unreadable:
        return
    console.print(f"[red]{len(unreadable)} director{'y' if len(unreadable) == 1 else 'ies'} could not be read "
                  f"and {'was' if len(unreadable) == 1 else 'were'} skipped ({consequence}):[/red]")
    for u in unreadable[:10]:
        console.print(f"  [red]SKIPPED[/red] {shown(_relative(u.path, root))}: {shown(u.reason)}")
    if len(unreadable) > 10:
        console.print(f"  ... and {len(unreadable) - 10} more (--json lists all)")


def render_verify(report: VerifyReport, console: Console, seconds: float) -> None:
    """The human-readable ``kvtier verify`` output, in the words of the store (block files
    quarantined on disk, values or objects deleted on Redis and S3)."""
    from kvtier.cachetools.stores import words

    store = words(report.store)
    for problem in report.problems:
        path = shown(_relative(problem.path, report.root))
        console.print(f"[red]BAD[/red] {path}: {shown(problem.reason)} [dim]({problem.action})[/dim]")
    bad = len(report.problems)
    removed = f"{report.quarantined} quarantined" if store.quarantine else f"{report.deleted} deleted"
    console.print(
        f"checked {report.files_checked:,} block {store.unit}s ({fmt_bytes(report.bytes_checked)}) in "
        f"{len(report.namespaces)} namespace(s) in {seconds:.1f}s: {report.files_ok:,} ok, "
        + (f"[red]{bad} problem(s)[/red], {removed}" if bad else "no problems")
        + (f"; {report.vanished} removed meanwhile by an engine" if report.vanished else "")
    )
    for note in report.notes:
        console.print(f"[dim]note: {shown(note)}[/dim]")
    _render_unreadable(report.unreadable, report.root, console, "not verified")
    for key_id, count in report.retired.items():
        console.print(f"[yellow]{count:,} records under retired key {key_id}[/yellow] (still accepted while "
                      "listed; kvtier purge --retired removes them)")
    if report.sealed_unchecked:
        console.print(f"{report.sealed_unchecked:,} sealed records: MACs not checked (give --auth-key-env or "
                      "--auth-key-file to check them)")


def render_purge(report: PurgeReport, console: Console) -> None:
    """The human-readable ``kvtier purge`` output, in the words of the store (files, a quarantine
    and directories on disk; values and config keys on Redis; objects and config.json on S3)."""
    from kvtier.cachetools.stores import words

    store = words(report.store)
    verb = "would remove" if report.dry_run else "removed"
    for ns in report.namespaces:
        if ns.unreadable:
            console.print(f"[red]{shown(ns.prefix)}: skipped[/red], {ns.unreadable} of its directories could not be "
                          "read; nothing removed from it")
            continue
        if not (ns.files or ns.skipped or ns.config_removed or ns.errors or ns.namespace_removed):
            continue
        units = f", {store.units(ns.files)}" if store.quarantine else ""  # elsewhere one unit a block
        line = f"{shown(ns.prefix)}: {verb} {ns.blocks:,} blocks{units}, {fmt_bytes(ns.bytes)}"
        if ns.skipped:
            line += f" (kept {ns.skipped} used meanwhile)"
        if ns.errors:
            line += f" [red]({ns.errors} could not be removed)[/red]"
        if ns.config_removed:
            line += f"; {store.config} " + ("would go too" if report.dry_run else "removed")
        if ns.namespace_removed:
            line += "; its directories " + ("would go" if report.dry_run else "removed")
        console.print(line)
        for path in ns.failed[:10]:
            console.print(f"  [red]NOT REMOVED[/red] {shown(_relative(path, report.root))}")
        if len(ns.failed) > 10:
            console.print(f"  ... and {len(ns.failed) - 10} more (--json lists all)")
    if store.quarantine and (report.quarantine_files or report.quarantine_left or not report.namespaces):
        console.print(f"quarantine: {verb} {report.quarantine_files:,} files, {fmt_bytes(report.quarantine_bytes)}")
    for reason, count in report.quarantine_left.items():
        console.print(f"[yellow]quarantine: left in place {store.units(count)}[/yellow], not kvtier's: "
                      f"{shown(reason)}")
    total = f"{store.units(report.files)}, {fmt_bytes(report.bytes)}"
    console.print(f"[bold]dry run: would remove {total}; nothing was deleted[/bold]" if report.dry_run
                  else f"[bold]removed {total}[/bold]")
    for note in report.notes:
        console.print(f"[dim]note: {shown(note)}[/dim]")
    _render_unreadable(report.unreadable, report.root, console, "nothing removed there")


def render_node(stats: dict[str, Any], console: Console) -> None:
    """The human-readable ``kvtier inspect SOCKET`` output: a node service's stats (its pool,
    engines and tiers) as :meth:`~kvtier.node.NodeClient.stats` gives them."""
    from rich.table import Table

    stride = stats["slot_stride"] or 0
    console.print(f"kvtier node at {shown(stats['socket'])} (pid {stats['service_pid']}, up {stats['uptime_s']:.0f} s, "
                  f"{stats['policy']})")
    if stats["slot_bytes"] is None:  # the first engine's hello sizes the slots
        console.print(f"pool {fmt_bytes(stats['pool_bytes'])}: no engine attached yet (the first engine's block "
                      "size sets its slots)")
    else:
        console.print(f"pool {fmt_bytes(stats['pool_bytes'])}: {stats['used_slots']} of {stats['num_slots']} slots "
                      f"used ({fmt_bytes(stats['used_slots'] * stride)}), {stats['blocks']} blocks, "
                      f"{stats['pinned_blocks']} pinned, {stats['evictions']} evicted "
                      f"({stats.get('run_evictions', 0)} to continue runs); slots of {stats['slot_bytes']} bytes")
    console.print(f"{stats['attached_engines']} engines attached, {stats['connections']} connections, "
                  f"{stats['rejected_peers']} peers refused")
    if stats.get("tiers") is not None:  # --disk-dir / --redis-url: cascades, promotions, failures
        console.print("tiers: " + ", ".join(f"{k} {v}" for k, v in sorted(stats["tiers"].items()) if isinstance(v, int)))
    if stats["engines"]:
        table = Table("engine", "sessions", "held", "lookups", "blocks asked", "hits", "stored", "duplicates",
                      "refused")
        for name, e in stats["engines"].items():
            table.add_row(shown(name), str(e["sessions"]), fmt_bytes(e["held_slots"] * stride), str(e["lookups"]),
                          str(e["lookup_blocks"]), str(e["hit_blocks"]), str(e["stored_blocks"]),
                          str(e["duplicate_blocks"]), str(e["refused_blocks"]))
        console.print(table)
