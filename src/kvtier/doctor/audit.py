"""``kvtier doctor -- COMMAND``: audit a ``vllm serve`` / ``kvtier serve`` line without running it.

:func:`audit` resolves what the line configures (:func:`kvtier.doctor.setup.resolve_setup`), runs
every check of :data:`kvtier.doctor.checks.CHECKS` on it and returns the findings, errors first.
Nothing here starts vLLM, imports torch or vLLM, or writes files.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.doctor import checks
from kvtier.doctor.setup import SEVERITIES, Finding, resolve_setup
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
    findings: list[Finding] = []
    for check in checks.CHECKS:
        try:
            findings.extend(check(setup))
        except Exception as exc:  # a doctor must not crash on an odd command line; say what failed
            findings.append(Finding("doctor-internal", "warning", f"Check {check.__name__} failed",
                                    f"{type(exc).__name__}: {exc}", "Report this command line to kvtier."))
    return sorted(findings, key=lambda f: SEVERITIES.index(f.severity))
