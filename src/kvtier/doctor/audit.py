"""``kvtier doctor -- COMMAND``: audit a ``vllm serve`` / ``kvtier serve`` line without running it.

:func:`audit` resolves what the line configures (:func:`kvtier.doctor.setup.resolve_setup`), runs
every check of :data:`kvtier.doctor.checks.CHECKS` on it and returns the findings, errors first.
A ``MultiConnector`` line is audited child by child: each child connector gets every check a
standalone connector gets (its findings titled ``connectors[i] (Name): ...``; what a child shares with
the line, such as the model, is reported once), then :data:`kvtier.doctor.multi_checks.CHECKS` look
at the children together (order, shared roots, the load-failure policy).
Nothing here starts vLLM, imports torch or vLLM, or writes files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from kvtier.doctor import checks, multi_checks
from kvtier.doctor.setup import SEVERITIES, Finding, Setup, resolve_setup
from kvtier.launch.cmdline import CommandLineError

__all__ = ["Finding", "audit"]


def audit(argv: Sequence[str], gpu_memory_gib: float | None = None) -> list[Finding]:
    """Every finding for the command line ``argv``, errors first."""
    try:
        setup = resolve_setup(argv, gpu_memory_gib)
    except CommandLineError as exc:
        return [Finding("command-line", "error", "Not a serve command line", str(exc),
                        "kvtier doctor -- vllm serve MODEL [ARGS...]   or   "
                        "kvtier doctor -- kvtier serve [MODEL] ...")]
    findings = _run(checks.CHECKS, setup)
    for child in setup.children:
        findings.extend(dataclasses.replace(f, title=f"{child.where}: {f.title}")
                        for f in _run(checks.CHECKS, child) if f not in findings)
    if setup.is_multi:
        findings.extend(_run(multi_checks.CHECKS, setup))
    return sorted(findings, key=lambda f: SEVERITIES.index(f.severity))


def _run(checks_to_run: Sequence[Callable[[Setup], list[Finding]]], setup: Setup) -> list[Finding]:
    findings: list[Finding] = []
    for check in checks_to_run:
        try:
            findings.extend(check(setup))
        except Exception as exc:  # a doctor must not crash on an odd command line; say what failed
            findings.append(Finding("doctor-internal", "warning", f"Check {check.__name__} failed",
                                    f"{type(exc).__name__}: {exc}", "Report this command line to kvtier."))
    return findings
