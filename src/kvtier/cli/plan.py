"""``kvtier plan``: size the KV tiers of a deployment from the model's config.json.

:func:`run` resolves the model (:mod:`kvtier.planning.model_source`), computes the plan
(:func:`kvtier.planning.sizing.make_plan`) and prints it as a table (:func:`render`) or JSON
(:func:`plan_json`). Standard library, rich and kvtier's pure core only: never torch or vLLM.
"""

from __future__ import annotations

import json
import shlex

from rich.console import Console
from rich.table import Table

from kvtier.cli.terminal import console as terminal_console
from kvtier.planning.sizing import GIB, Plan, PlanInputs, make_plan


def fmt_bytes(n: float) -> str:
    """``1.50 GiB``, ``45.0 KiB``, ``512 B``: binary units."""
    for unit, size in (("TiB", 2**40), ("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_seconds(s: float) -> str:
    """``12.3 ms`` below a second (either sign), ``1.50 s`` from one; a time that rounds to zero is
    ``0.0 ms``, never ``-0.0 ms`` (a tiny negative time saved is none)."""
    text = f"{s * 1000:.1f} ms" if abs(s) < 1 else f"{s:.2f} s"
    return "0.0 ms" if text == "-0.0 ms" else text


def _per_token_formula(plan: Plan) -> str:
    geo, width = plan.geometry, plan.kv_dtype_bytes
    if geo.is_mla:
        return (f"{geo.attention_layers} layers x {geo.mla_latent_dim} latent (kv_lora_rank + "
                f"qk_rope_head_dim; one vector, not K and V) x {width} B = {plan.kv_bytes_per_token:,} B")
    return (f"2 (K,V) x {geo.attention_layers} attention layers x {geo.num_kv_heads} KV heads x "
            f"{geo.head_dim} x {width} B = {plan.kv_bytes_per_token:,} B")


def _model_line(plan: Plan) -> str:
    geo = plan.geometry
    layers = [f"{geo.full_layers} full"]
    if geo.sliding_layers:
        layers.append(f"{geo.sliding_layers} sliding (window {geo.sliding_window})")
    if geo.stateful_layers:
        layers.append(f"{geo.stateful_layers} Mamba/linear (no KV)")
    heads = (f"MLA latent {geo.mla_latent_dim}" if geo.is_mla
             else f"{geo.num_attention_heads} q / {geo.num_kv_heads} KV heads x {geo.head_dim}")
    kind = geo.attention_kind.upper()
    return f"{geo.model_type}, {kind} ({heads}), {geo.num_layers} layers: {', '.join(layers)}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _ratio(load: float, recompute: float) -> str:
    if load <= 0:
        return ""
    factor = recompute / load
    if 0.9 <= factor <= 1.1:
        return "about as fast as recompute"
    if factor > 1:
        return f"{factor:.1f}x faster than recompute"
    return f"{1 / factor:.1f}x SLOWER than recompute"


def _host_split(plan: Plan) -> str:
    if plan.stored_copies < plan.tp:
        return "one copy of the replicated MLA latent, in rank 0's region, read by every rank"
    return f"{fmt_bytes(plan.host_bytes_rank)} per rank"


def rows(plan: Plan) -> list[tuple[str, str, str]]:
    """(item, value, how it was obtained) rows of the human table."""
    tp, a = plan.tp, plan.assumptions
    ranks = f"{tp} ranks" if tp > 1 else "1 rank"
    if a["kv_cache_gib_per_device"] is not None:
        budget_how = f"fixed engine KV cache of {a['kv_cache_gib_per_device']:g} GiB per device"
    else:
        budget_how = (f"{a['gpu_memory_gib']:g} GiB x {a['gpu_memory_utilization']:g} - "
                      f"{fmt_bytes(plan.weight_bytes_rank)} weights - {a['reserve_gib_per_device']:g} GiB "
                      "reserve (activations, graphs)")
    seq_how = f"{plan.context} tokens in blocks of {plan.block_size}"
    if plan.offload_sequence_bytes_rank != plan.sequence_bytes_rank:
        seq_how += f"; sliding layers hold their window (kvtier stores {fmt_bytes(plan.offload_sequence_bytes_rank)})"
    contexts_on_disk = plan.disk_bytes // max(1, plan.offload_sequence_bytes_total)
    return [
        ("model", plan.model, _model_line(plan)),
        ("parameters", _count(plan.params_total), f"active per token {_count(plan.params_active)}"),
        ("weights", f"{fmt_bytes(plan.weight_bytes_total)} total",
         f"{fmt_bytes(plan.weight_bytes_rank)} per device ({plan.dtype}, tp={tp}); {a['weights']}"),
        ("KV per token", f"{plan.kv_bytes_per_token:,} B",
         _per_token_formula(plan) + f" ({plan.kv_dtype} KV)"),
        ("KV per token per rank", f"{plan.kv_bytes_per_token_rank:,} B",
         f"{plan.geometry.kv_heads_per_rank(tp)} KV head(s) per rank; all {ranks}: "
         f"{plan.kv_bytes_per_token_total:,} B"),
        ("one context", f"{fmt_bytes(plan.offload_sequence_bytes_total)} total",
         f"{fmt_bytes(plan.sequence_bytes_rank)} per rank on the accelerator; {seq_how}"),
        ("accelerator KV budget", f"{fmt_bytes(plan.kv_budget_rank)} per device",
         f"{budget_how}; all {ranks}: {fmt_bytes(plan.kv_budget_total)}"),
        ("fits on the accelerator", f"{plan.sequences_fit} x {plan.context} tokens",
         f"{plan.tokens_fit:,} tokens in the KV pool"),
        ("working set", fmt_bytes(plan.working_set_total),
         f"{plan.concurrency} x {plan.context} tokens; {fmt_bytes(plan.overflow_total)} of it does not "
         "fit on the accelerators"),
        ("host tier (TOTAL)", f"{plan.host_gib} GiB total",
         f"--kv-offloading-size {plan.host_gib} = cpu_bytes_to_use {plan.host_bytes_total}: TOTAL across "
         f"{ranks} ({_host_split(plan)}). Basis: {plan.host_basis}"),
        ("disk tier", f"{plan.disk_gib} GiB total",
         f"{a['disk_factor']} x the host tier: about {contexts_on_disk:,} contexts of {plan.context} tokens"),
        ("load from host", fmt_seconds(plan.host_load_s),
         f"{fmt_bytes(plan.offload_sequence_bytes_rank)} per rank at {a['host_bw_gbps']:g} GB/s per device; "
         + _ratio(plan.host_load_s, plan.recompute_s)),
        ("load from disk", fmt_seconds(plan.disk_load_s),
         f"{fmt_bytes(plan.offload_sequence_bytes_total)} at {a['disk_bw_gbps']:g} GB/s, then host -> "
         "device; " + _ratio(plan.disk_load_s, plan.recompute_s)),
        ("recompute (prefill)", fmt_seconds(plan.recompute_s), plan.recompute_basis),
    ]


def commands(plan: Plan, model_arg: str) -> list[str]:
    """The flags that configure this plan, for kvtier serve and plain vllm serve."""
    from kvtier.planning.model_source import is_default_name

    tp = f" -tp {plan.tp}" if plan.tp > 1 else ""
    if is_default_name(model_arg):
        model, vllm_model = "", "$(kvtier model)"  # kvtier serve's default; the converted folder for vllm
    else:
        path = model_arg[: -len("/config.json")] if model_arg.endswith("/config.json") else model_arg
        model = vllm_model = "MODEL" if path.endswith(".json") else shlex.quote(path)
    transfer = json.dumps({"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"cpu_bytes_to_use": plan.host_bytes_total}})
    served = f" {model}" if model else ""
    return [
        f"kvtier serve{served}{tp} --kv-offloading-size {plan.host_gib} --disk-size {plan.disk_gib}",
        f"vllm serve {vllm_model}{tp} --kv-transfer-config '{transfer}'",
    ]


def render(plan: Plan, model_arg: str, console: Console | None = None) -> None:
    """Print the plan as a table, its notes and the flags to use."""
    if console is None:  # piped or captured: 150 columns keep the "how" column readable
        console = terminal_console(piped_width=150)
    table = Table(title=f"kvtier plan: {plan.model}, tp={plan.tp}, context {plan.context}, "
                        f"concurrency {plan.concurrency}", show_lines=False, title_justify="left")
    table.add_column("", style="bold", no_wrap=True)
    table.add_column("value", no_wrap=True)
    table.add_column("how", overflow="fold")
    for item, value, how in rows(plan):
        table.add_row(item, value, how)
    console.print(table)
    for note in plan.notes:
        console.print(f"note: {note}", highlight=False)
    console.print("configure:", highlight=False)
    for line in commands(plan, model_arg):
        console.print(f"  {line}", highlight=False, markup=False, soft_wrap=True)


def plan_json(plan: Plan, model_arg: str) -> str:
    data = plan.to_dict()
    data["commands"] = commands(plan, model_arg)
    return json.dumps(data, indent=2)


def run(model: str, inputs: PlanInputs, as_json: bool) -> None:
    """The ``kvtier plan`` command body; errors become click errors."""
    import click

    from kvtier.planning.geometry import ModelConfigError
    from kvtier.planning.model_source import load_model_config
    from kvtier.planning.sizing import PlanInputError, check_inputs

    try:
        check_inputs(inputs)
    except PlanInputError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        source = load_model_config(model)
        plan = make_plan(source.name, source.config, inputs)
    except (ModelConfigError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(plan_json(plan, model))
    else:
        render(plan, model)
