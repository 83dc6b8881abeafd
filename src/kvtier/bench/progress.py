"""Progress lines while the benchmark runs: one line per server event and per completed request,
and a line every few seconds while a server starts (so a log or a terminal both show what is
going on).

Called by the runner and the driver in the ``kvtier bench`` process (its one thread).
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from kvtier.bench.driver import RequestResult


class Progress:
    """Prints progress to a rich console (stdout by default)."""

    def __init__(self, console: Console | None = None, wait_every_s: float = 10.0):
        self.console = console or Console(highlight=False)
        self.wait_every_s = wait_every_s
        self._next_wait_line = 0.0
        self._done = 0

    def mode_start(self, mode: str, index: int, total: int, summary: str, log: str | None) -> None:
        self.console.rule(f"[bold]mode {index}/{total}: {mode}")
        for line in summary.splitlines():
            self.console.print(f"  {escape(line)}")
        if log:
            self.console.print(f"  server log: {escape(log)}")
        self._next_wait_line = self.wait_every_s

    def waiting(self, mode: str, elapsed_s: float) -> None:
        if elapsed_s >= self._next_wait_line:
            self.console.print(f"  {_tag(mode)} waiting for the server to start ... {elapsed_s:.0f} s")
            self._next_wait_line = elapsed_s + self.wait_every_s

    def ready(self, mode: str, startup_s: float) -> None:
        self.console.print(f"  {_tag(mode)} server ready after {startup_s:.1f} s; warming up")

    def workload_start(self, mode: str, total: int) -> None:
        self._done = 0
        self.console.print(f"  {_tag(mode)} running {total} requests")

    def request_done(self, mode: str, total: int, result: RequestResult) -> None:
        self._done += 1
        width = len(str(total))
        if result.error:
            what = f"[red]error: {escape(result.error[:200])}[/red]"
        else:
            cached = "-" if result.cached_tokens is None else str(result.cached_tokens)
            what = (f"ttft {result.ttft_s:6.3f} s  latency {result.latency_s:6.3f} s  "
                    f"prompt {result.prompt_tokens} tok, cached {cached}")
        self.console.print(f"  {_tag(mode)} {self._done:>{width}}/{total} {result.id} "
                           f"{'returning' if result.returning else 'first    '}  {what}")

    def mode_done(self, mode: str, wall_s: float, errors: int) -> None:
        self.console.print(f"  {_tag(mode)} done in {wall_s:.1f} s" + (f", [red]{errors} errors[/red]" if errors else ""))

    def error(self, mode: str, message: str) -> None:
        self.console.print(f"[red]  {_tag(mode)} failed: {escape(message)}[/red]")


def _tag(mode: str) -> str:
    """``[mode]``, escaped so rich prints it instead of reading it as markup."""
    return escape(f"[{mode}]")
