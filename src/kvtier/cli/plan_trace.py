"""``kvtier plan MODEL --trace FILE``: read the trace, size the replay from the model, replay it
(:mod:`kvtier.replay`) and print a table and a PNG, or JSON. Argument handling and output only."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from kvtier.cli.plan import fmt_bytes, fmt_seconds
from kvtier.cli.terminal import console as terminal_console
from kvtier.core.config import KVTierConfig
from kvtier.launch.command import SERVE_DEFAULTS
from kvtier.planning.sizing import PlanInputs, make_plan

REPLAY_KEYS = ("store_threshold", "max_tracker_size", "offload_prompt_only", "offload_partial_blocks", "block_size",
               "eviction_policy")
"""The connector keys a replay models (``--kv-config``); kvtier serve's defaults otherwise."""


@dataclass(frozen=True)
class TraceOptions:
    trace: str
    host_sizes: str | None = None
    disk_sizes: str | None = None
    remote_sizes: str | None = None
    eviction_policy: str | None = None
    kv_config: str | None = None
    tokenizer: str | None = None
    method: str = "auto"
    png: str | None = None
    remote_bw: float | None = None
    concurrency: int = 1


def replay_config(kv_config: str | None, eviction_policy: str | None) -> KVTierConfig:
    """kvtier serve's defaults, ``--eviction-policy`` and ``--kv-config``, validated as the connector does."""
    extra: dict[str, Any] = {}
    if kv_config:
        try:
            extra = json.loads(kv_config)
        except json.JSONDecodeError as exc:
            raise click.BadParameter(f"not JSON: {exc}", param_hint="--kv-config") from None
        if not isinstance(extra, dict):
            raise click.BadParameter("must be a JSON object, e.g. '{\"store_threshold\": 2}'", param_hint="--kv-config")
        other = sorted(set(extra) - set(REPLAY_KEYS))
        if other:
            raise click.BadParameter(f"{other}: a replay models only {', '.join(REPLAY_KEYS)} (tier sizes are "
                                     "--host-sizes, --disk-sizes, --remote-sizes)", param_hint="--kv-config")
    if eviction_policy is not None:
        extra["eviction_policy"] = eviction_policy
    from kvtier.core.values import ConfigError

    try:
        return KVTierConfig.from_extra_config({"cpu_bytes_to_use": 1, **SERVE_DEFAULTS, **extra})
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--kv-config") from None


def run(model: str, inputs: PlanInputs, options: TraceOptions, as_json: bool) -> None:
    """The body of ``kvtier plan --trace``; errors become click errors naming what to fix."""
    from kvtier.planning.geometry import ModelConfigError
    from kvtier.planning.model_source import load_model_config
    from kvtier.replay.curve import CurveRun, ReplayGeometry, parse_sizes
    from kvtier.replay.engine import EnginePoolTooSmall
    from kvtier.replay.tokens import TokenizerMissing, load_tokenizer, tokenize
    from kvtier.replay.trace import TraceError, read_trace
    from kvtier.replay.workload import ReplaySettings

    err = terminal_console(stderr=True, highlight=False)
    png = figure_path(options) if not as_json else None  # checked before the replay, which can take minutes
    config = replay_config(options.kv_config, options.eviction_policy)
    try:
        sizes = {name: parse_sizes(text, f"--{name}-sizes") if text else None
                 for name, text in (("host", options.host_sizes), ("disk", options.disk_sizes),
                                    ("remote", options.remote_sizes))}
        source = load_model_config(model)
        trace = read_trace(options.trace)
        notes: list[str] = []
        if any(r.needs_tokenizer for r in trace.requests):
            folder = options.tokenizer or (str(source.folder) if source.folder else None)
            tokenize(trace.requests, load_tokenizer(folder, source.name), trace.path)
        engine_block = inputs.block_size
        block = config.offload_block_tokens(engine_block)
        if trace.kind == "access":
            logged = trace.requests[0].access.block_tokens  # type: ignore[union-attr]
            if (block, engine_block) != (logged, logged):
                notes.append(f"the access log's blocks are {logged} tokens: kvtier's blocks and the engine's are "
                             f"replayed at {logged} (--block-size {engine_block} and block_size do not apply)")
            block = engine_block = logged
        guessed = sum(1 for r in trace.requests if r.access is None and r.output is None and r.max_tokens)
        if guessed:
            notes.append(f"{guessed} requests give max_tokens without output_token_ids: their answers' blocks "
                         "take room in every cache but match nothing")
        mean_prompt = max(1, round(sum(r.num_prompt_tokens for r in trace.requests) / len(trace.requests)))
        planned = replace(inputs, block_size=engine_block)
        block_plan = make_plan(source.name, source.config, replace(planned, context=block))
        context_plan = make_plan(source.name, source.config, replace(planned, context=mean_prompt))
        geo = block_plan.geometry
        if geo.sliding_layers or geo.stateful_layers:
            notes.append("the model has sliding-window or Mamba layers: the engine's own cache is modelled as "
                         "one group of full attention (vLLM's hybrid allocator keeps windows and states apart)")
        geometry = ReplayGeometry.from_plans(block_plan, context_plan, engine_block,
                                             **({"remote_bw_gbps": options.remote_bw} if options.remote_bw else {}))
        if geometry.engine_blocks < 2:
            raise click.ClickException(
                f"the engine's KV cache ({fmt_bytes(geometry.engine_kv_bytes)} per device) holds no block of "
                f"{engine_block} tokens: give --kv-cache-gib or --gpu-memory")
        slower = [tier for tier, cost in geometry.load_s_per_token.items() if cost >= geometry.recompute_s_per_token]
        if slower:
            notes.append(f"at these rates loading a token from {', '.join(slower)} ("
                         f"{geometry.load_s_per_token[slower[0]] * 1e6:.2f} us from {slower[0]}) takes no less than "
                         f"prefilling it ({geometry.recompute_s_per_token * 1e6:.2f} us), so the time saved is not "
                         "positive there: give the measured --prefill-tps and --host-bw / --disk-bw (kvtier doctor --measure)")
        settings = ReplaySettings(
            block_tokens=block, engine_block_tokens=engine_block, engine_blocks=geometry.engine_blocks,
            concurrency=options.concurrency, eviction_policy=config.eviction_policy,
            store_threshold=config.store_threshold, max_tracker_size=config.max_tracker_size,
            offload_prompt_only=config.offload_prompt_only, tails=config.offload_partial_blocks,
        )
        runner = CurveRun(trace, settings, geometry, host_sizes=sizes["host"], disk_sizes=sizes["disk"] or [0],
                          remote_sizes=sizes["remote"] or [0], method=options.method,
                          progress=None if as_json and not sys.stderr.isatty() else (lambda m: err.print(f"kvtier plan: {m}")))
        report = runner.result()
    except (TraceError, TokenizerMissing, ModelConfigError, EnginePoolTooSmall, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    report = {"model": source.name, **report, "notes": notes}
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    console = terminal_console(piped_width=150, highlight=False)
    render(report, console)
    from kvtier.replay.plot import write_figure

    assert png is not None
    stack = runner.stack() if runner.method == "stack" else None
    console.print(f"figure: {write_figure(png, report, stack)}")


def figure_path(options: TraceOptions) -> Path:
    """Where the figure goes (``--png``, else ``./kvtier-plan-<trace name>.png``), checked: a usage
    error naming ``--png`` unless its folder is already a directory this user writes in (none is
    created: :func:`kvtier.core.dirs.output_file_problem`)."""
    from kvtier.core.dirs import output_file_problem

    png = Path(options.png).expanduser() if options.png else Path(f"kvtier-plan-{Path(options.trace).stem}.png")
    problem = output_file_problem(png)
    if problem is not None:
        raise click.BadParameter(f"{png} {problem}", param_hint="'--png'")
    return png


def render(report: dict[str, Any], console: Console) -> None:
    """The table of points, then the engine's share, the unlimited host tier and the knee."""
    trace, settings = report["trace"], report["settings"]
    title = (f"kvtier plan --trace: {report['model']}, {trace['requests']:,} requests, "
             f"{trace['prompt_tokens']:,} prompt tokens ({trace['order']}); blocks of {settings['block_tokens']} "
             f"tokens, engine {settings['engine_blocks']} blocks of {settings['engine_block_tokens']}; "
             f"{settings['eviction_policy']}, {settings['method']}")
    table = Table(title=title, title_justify="left")
    for name in ("host", "disk", "remote", "hit rate", "engine", "from host", "from disk", "from remote",
                 "computed", "time saved"):
        table.add_column(name, justify="right")
    for point in report["curve"]:
        tiers = point["tokens_by_tier"]
        table.add_row(
            fmt_bytes(point["host_bytes"]), _size(point["disk_bytes"]), _size(point["remote_bytes"]),
            f"{point['hit_rate']:.1%}", f"{tiers['engine']:,}", f"{tiers['host']:,}", f"{tiers['disk']:,}",
            f"{tiers['remote']:,}", f"{tiers['computed']:,}", fmt_seconds(point["time_saved_s"]),
        )
    console.print(table)
    engine = report["engine"]
    console.print(f"the engine's own prefix cache serves {engine['fraction']:.1%} of prompt tokens "
                  f"({engine['tokens']:,}); kvtier's tiers serve what it has lost")
    unlimited = report["unlimited_host"]
    saved = unlimited["time_saved_s"]
    console.print(f"an unlimited host tier: hit rate {unlimited['hit_rate']:.1%}, "
                  f"{unlimited['prefill_tokens_saved']:,} prefill tokens saved, "
                  + (f"about {fmt_seconds(saved)} of prefill" if saved >= 0 else
                     f"but loading them takes about {fmt_seconds(-saved)} longer than prefilling them would"))
    console.print(f"knee: {report['knee']['text']}")
    if settings["method"] == "exact":
        console.print(f"every point replayed through kvtier's code ({settings.get('exact_because')})")
    for note in report["notes"]:
        console.print(f"note: {note}")


def _size(n: int) -> str:
    return "-" if not n else fmt_bytes(n)
