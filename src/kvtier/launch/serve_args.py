"""The vLLM arguments ``kvtier serve`` passes through: where the model is, which vLLM flags it must
refuse, and the values of the few vLLM flags it reads (``--dtype``, ``--tensor-parallel-size``...).

Flag names are read with :func:`kvtier.launch.cmdline.option_name` / :func:`kvtier.launch.cmdline.short_option`
(vLLM's spelling rules: ``_`` or ``-``, ``--flag=value``, dotted ``--flag.key``, ``-tp``); vLLM's
abbreviations are matched against the minimum unambiguous prefixes below. Standard library only
(plus ``yaml`` for a ``--config`` file, when one is given).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvtier.launch.cmdline import option_name, short_option


class ServeConfigError(ValueError):
    """A bad ``serve`` option. ``flag`` names the option at fault (``--disk-dir``, ``--kv-config``,
    or a vLLM flag that conflicts); ``str(exc)`` is a complete message that starts with it."""

    def __init__(self, flag: str, message: str):
        super().__init__(message if message.startswith(flag) else f"{flag}: {message}")
        self.flag = flag


# vLLM flags kvtier serve sets itself or that would replace its connector. vLLM's parser accepts
# unambiguous abbreviations, so a prefix at least as long as the second string also counts.
_RESERVED = {
    "--kv-transfer-config": ("--kv-t", "kvtier serve sets it itself; use --kv-config '{...}' for kvtier keys "
                             "(merged into kv_connector_extra_config), or run vllm serve directly."),
    "--kv-offloading-size": ("--kv-offloading-s", "vLLM's own flag would replace kvtier with vLLM's "
                             "OffloadingConnector; give kvtier's --kv-offloading-size before any '--'."),
    "--kv-offloading-backend": ("--kv-offloading-b", "it selects vLLM's own offloading, which would replace "
                                "kvtier; kvtier is the offloading backend here."),
}
# Unambiguous prefixes of the vLLM flags whose value serve reads (from vLLM 0.32's option list).
_MIN_PREFIX = {
    "--enable-prefix-caching": "--enable-pre",
    "--no-enable-prefix-caching": "--no-enable-pre",
    "--kv-cache-memory-bytes": "--kv-cache-mem",
    "--tensor-parallel-size": "--tensor",
    "--config": "--config",
    "--model": "--model",
}


def split_model(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """``[MODEL] [vllm args...]`` -> (MODEL or None, vllm args). A first argument starting with
    ``-`` is a vLLM argument, not a model. ``--model X`` / ``--model=X`` (vLLM's deprecated form)
    counts as MODEL and is removed; giving a model both ways is an error."""
    args = list(args)
    model = None
    if args and not args[0].startswith("-"):
        model, args = args[0], args[1:]
    for index, arg in enumerate(args):
        if arg == "--":
            break
        name = option_name(arg)
        if name != "--model":
            continue
        if "=" in arg:
            value, used = arg.split("=", 1)[1], 1
        elif index + 1 < len(args):
            value, used = args[index + 1], 2
        else:
            raise ServeConfigError("--model", "--model needs a value (or give MODEL as the first argument).")
        if model is not None:
            raise ServeConfigError(
                "--model", f"the model is given twice ({model!r} and --model {value!r}); give it once."
            )
        return value, args[:index] + args[index + used :]
    return model, args


def check_model(model: str) -> None:
    """Raise :class:`ServeConfigError` (flag ``MODEL``) when ``model`` is written as a local path
    (absolute, ``./``, ``../``, ``~``, or two ``/`` or more: never a Hugging Face repo id) and
    nothing is there: vLLM would take it for a repo id and stop with Hugging Face's validation
    traceback. Anything else passes untouched: a path that exists, and ``org/name`` or ``name``,
    which vLLM finds in its cache or downloads (a repo id, or a relative folder: only vLLM can tell,
    and nothing here touches the network)."""
    looks_like_path = (model.startswith(("/", "./", "../", "~")) or model in (".", "..")
                       or model.rstrip("/").count("/") >= 2)
    if looks_like_path and not Path(model).expanduser().exists():
        raise ServeConfigError("MODEL", f"MODEL {model}: no such file or directory (give a model folder that "
                                        "exists, or a Hugging Face repo id such as Qwen/Qwen3-0.6B).")


def config_file_model(vllm_args: Sequence[str]) -> str | None:
    """The ``model`` key of a ``--config FILE`` among ``vllm_args`` (vLLM reads it too), else None."""
    path = flag_value(vllm_args, "--config")
    if not path:
        return None
    try:
        import yaml

        data = yaml.safe_load(Path(path).read_text())
    except Exception:  # vLLM reports a bad config file itself
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return str(model) if model else None


def check_passthrough(vllm_args: Sequence[str]) -> None:
    """Raise :class:`ServeConfigError` if ``vllm_args`` (before any ``--``) contain a vLLM flag of
    ``_RESERVED``, in any spelling or abbreviation vLLM accepts."""
    for arg in vllm_args:
        if arg == "--":
            break
        name = option_name(arg)
        if name is None:
            continue
        for full, (minimum, why) in _RESERVED.items():
            if _abbreviates(name, full, minimum):
                shown = full if name == full else f"{full} (as {arg.split('=', 1)[0]})"
                raise ServeConfigError(full, f"{shown} is not allowed with kvtier serve: {why}")


def last_flag(vllm_args: Sequence[str], fulls: Sequence[str]) -> str | None:
    """Which of the switches ``fulls`` is given last (as a switch, not ``--flag=value``) in
    ``vllm_args`` before any ``--``, else None."""
    found = None
    for arg in vllm_args:
        if arg == "--":
            break
        for full in fulls:
            if _names(arg, full) and "=" not in arg:
                found = full
    return found


def flag_value(vllm_args: Sequence[str], full: str) -> str | None:
    """The value of the last ``full VALUE`` / ``full=VALUE`` in ``vllm_args``, else None."""
    value = None
    for index, arg in enumerate(vllm_args):
        if arg == "--":
            break
        if not _names(arg, full):
            continue
        if "=" in arg:
            value = arg.split("=", 1)[1]
        elif index + 1 < len(vllm_args):
            value = vllm_args[index + 1]
    return value


def _names(arg: str, full: str) -> bool:
    """Does ``arg`` name vLLM's option ``full`` (exactly, as an unambiguous abbreviation or by its
    short form such as ``-tp``)?"""
    name = option_name(arg)
    if name is None:
        return short_option(arg) == full
    if full == "--model" or full == "--config":
        return name == full  # --model-impl, --config-format... exist: no abbreviation
    return _abbreviates(name, full, _MIN_PREFIX.get(full, full))


def _abbreviates(name: str, full: str, minimum: str) -> bool:
    """Is ``name`` the option ``full`` or a prefix of it at least as long as ``minimum`` (the
    shortest prefix vLLM's parser does not find ambiguous)?"""
    return full.startswith(name) and name.startswith(minimum)
