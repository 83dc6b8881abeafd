"""``kvtier doctor``: audit a serve command line (``-- vllm serve ...``) and/or measure this machine.

:func:`run` is the command body: findings from :func:`kvtier.doctor.audit.audit`, measurements from
:mod:`kvtier.doctor.measure` compared with what one context of the model needs
(:func:`kvtier.doctor.measure.compare`), printed as text (rich) or JSON. Returns the exit code: 1 if any finding is an
error. Never imports vLLM; torch only for ``--measure`` on a machine with an NVIDIA device.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.padding import Padding
from rich.text import Text

from kvtier.cli.terminal import console as terminal_console
from kvtier.cli.terminal import printable
from kvtier.doctor.audit import Finding
from kvtier.doctor.measure import MIB, Bandwidth, compare, default_measure_dir, measure

_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def render_findings(findings: Sequence[Finding], console: Console) -> None:
    """Each finding: severity and title, then why and the fix; then a count per severity."""
    for f in findings:
        head = Text(f"{f.severity.upper():8}", style=_STYLE[f.severity])
        head.append(printable(f.title), style="bold").append(f"  ({f.code})", style="dim")
        console.print(head, highlight=False)
        for label, body in (("why", f.why), ("fix", f.fix)):  # (servers' and peers' words: printable)
            console.print(Padding(Text(f"{label}: {printable(body)}"), (0, 0, 0, 8), expand=False), highlight=False)
    counts = {s: sum(f.severity == s for f in findings) for s in _STYLE}
    console.print(", ".join(f"{n} {s}{'s' if n != 1 and s != 'info' else ''}" for s, n in counts.items()),
                  highlight=False)


def render_measurements(
    results: Sequence[Bandwidth], comparison: dict[str, Any] | None, console: Console
) -> None:
    """The measured bandwidths, then what they mean for one context of the model."""
    from kvtier.cli.plan import fmt_bytes, fmt_seconds

    for r in results:
        detail = f"{fmt_bytes(r.bytes)} in {fmt_seconds(r.seconds)}; {r.note}"
        console.print(f"{r.name:28} {r.gbps:8.2f} GB/s  ({detail})", highlight=False, markup=False)
    if not any("device" in r.name for r in results):
        console.print("host<->device               no CUDA device: skipped", highlight=False)
    if comparison is None:
        return
    c = comparison
    console.print(f"one {c['context']}-token context of {c['model']} (tp={c['tp']}, {c['kv_dtype']} KV): "
                  f"{fmt_bytes(c['context_bytes_total'])} total, "
                  f"{fmt_bytes(c['context_bytes_rank'])} per rank",
                  highlight=False, markup=False)
    for name, key in (("load from host", "host_load_s"), ("load from disk", "disk_load_s"),
                      ("recompute (prefill)", "recompute_s")):
        console.print(f"  {name:20} {fmt_seconds(c[key])}", highlight=False)
    console.print(f"  recompute basis: {c['recompute_basis']} "
                  "(kvtier plan --prefill-tps to use a measured rate)", highlight=False, markup=False)
    if c["disk_bw_needed_gbps"] is None:
        console.print("  recomputing is faster on this machine than loading from host memory, so no disk "
                      "bandwidth lets the disk tier beat it", highlight=False)
        return
    verdict = "beats" if c["disk_bw_gbps"] >= c["disk_bw_needed_gbps"] else "does NOT beat"
    console.print(f"  disk tier {verdict} recomputation here: needs {c['disk_bw_needed_gbps']:.2f} GB/s, "
                  f"measured {c['disk_bw_gbps']:.2f} GB/s", highlight=False)


def run(command: Sequence[str], *, do_measure: bool, directory: str | None, gpu_memory: float | None,
        model: str | None, context: int | None, as_json: bool, dram_mib: int = 1024, disk_mib: int = 512,
        console: Console | None = None) -> int:
    """The ``kvtier doctor`` body; returns the exit code (1 if any finding is an error)."""
    import click

    from kvtier.doctor.audit import audit
    from kvtier.doctor.setup import resolve_setup
    from kvtier.planning.sizing import MAX_INPUT

    if gpu_memory is not None and not (math.isfinite(gpu_memory) and gpu_memory <= MAX_INPUT):
        raise click.UsageError(f"--gpu-memory {gpu_memory}: give a finite number of at most {MAX_INPUT:.0e}")
    target = None
    if do_measure:  # every argument checked before anything is printed or measured
        target = _measure_target(command, directory)
        _check_model(model)

    if console is None:  # piped or captured: 120 columns, fewer wrapped lines
        console = terminal_console(piped_width=120)
    out: dict[str, Any] = {}
    findings: list[Finding] = []
    if command:
        findings = audit(command, gpu_memory_gib=gpu_memory)
        out["command"] = list(command)
        out["findings"] = [asdict(f) for f in findings]
        if not as_json:
            console.print(f"kvtier doctor: {shlex.join(command)}", highlight=False, markup=False)
            render_findings(findings, console)
    if target is not None:
        try:
            results = measure(target, dram_mib * MIB, disk_mib * MIB)
        except OSError as exc:  # the disk filled up or went away while measuring
            raise click.ClickException(f"measuring the disk at {target}: {exc.strerror or exc}") from None
        tp, chosen = 1, model
        if command and not any(f.code == "command-line" for f in findings):
            setup = resolve_setup(command)
            tp = setup.line.tp
            chosen = chosen or setup.model or ("default" if setup.line.program == "kvtier" else None)
        comparison = None
        try:
            comparison = compare(results, chosen or "default", tp, context)
        except ValueError as exc:  # the model's config is not readable here
            out["comparison_error"] = str(exc)
        out["measurements"] = [{**asdict(r), "gbps": r.gbps} for r in results]
        out["comparison"] = comparison
        if not as_json:
            console.print(f"kvtier doctor --measure (disk: {target})", highlight=False, markup=False)
            render_measurements(results, comparison, console)
            if "comparison_error" in out:
                console.print(f"comparison skipped: {out['comparison_error']}", highlight=False, markup=False)
    if as_json:
        console.print(json.dumps(out, indent=2), markup=False, highlight=False, soft_wrap=True)
    return 1 if any(f.severity == "error" for f in findings) else 0


def _measure_target(command: Sequence[str], directory: str | None) -> Path:
    """The directory ``--measure`` writes its file in (``--dir``, else the command's disk tier,
    else ``<kvtier cache>/kv``), made ready (:func:`kvtier.doctor.measure.measure_dir_problem`); a
    usage error naming the path and why when it cannot be."""
    import click

    from kvtier.doctor.measure import measure_dir_problem

    target = Path(directory).expanduser() if directory else default_measure_dir(command)
    problem = measure_dir_problem(target)
    if problem is not None:
        if directory:
            raise click.BadParameter(f"{target} {problem}", param_hint="'--dir'")
        raise click.UsageError(f"the directory to measure, {target} (the default of --dir), {problem}: "
                               "give --dir DIR")
    return target


def _check_model(model: str | None) -> None:
    """``--model`` that names nothing (no folder, config.json, cached repo id or 'default') is a
    usage error, as ``kvtier plan`` refuses it; one that is there but unreadable is said in the output
    (``comparison skipped``), like a command line's model."""
    import click

    from kvtier.planning.model_source import ModelNotFound, load_model_config

    if model is None:
        return
    try:
        load_model_config(model)
    except ModelNotFound as exc:
        raise click.BadParameter(str(exc), param_hint="'--model'") from None
    except ValueError:  # ModelConfigError: there, but not readable; compare() says so
        pass
