"""Read a ``vllm serve`` / ``kvtier serve`` command line without running it (for ``kvtier doctor``).

:func:`parse_serve_line` accepts the argv as a list (``["vllm", "serve", "MODEL", "-tp", "4", ...]``),
optionally preceded by ``NAME=value`` environment assignments, and also the module forms
(``python -m vllm.entrypoints.openai.api_server --model M``, ``python -m kvtier.cli.main serve``).
Flags are normalized as vLLM's parser does (``_`` -> ``-``, ``--flag=value``, unique prefixes of the
flags doctor reads, ``-tp``); the last occurrence wins. ``--kv-transfer-config`` is parsed as JSON,
with vLLM's dotted form (``--kv-transfer-config.kv_connector X``) merged in.

:func:`option_name` and :func:`short_option` (one flag's name, vLLM's spelling rules) are also how
``kvtier serve`` reads the vLLM flags passed through it (:mod:`kvtier.launch.serve_args`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_SHORT = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size", "-dp": "--data-parallel-size",
          "-q": "--quantization"}
READ_FLAGS = (
    "--kv-transfer-config", "--kv-offloading-size", "--kv-offloading-backend", "--cpu-offload-gb",
    "--enable-prefix-caching", "--no-enable-prefix-caching", "--tensor-parallel-size",
    "--pipeline-parallel-size", "--kv-cache-dtype", "--max-model-len", "--gpu-memory-utilization",
    "--block-size", "--dtype", "--kv-cache-memory-bytes", "--quantization", "--calculate-kv-scales",
    "--prefix-caching-hash-algo",
)
"""The vLLM flags doctor reads; unique prefixes of these are expanded like vLLM's parser does."""
KVTIER_FLAGS = ("--kv-offloading-size", "--disk-dir", "--disk-size", "--no-disk", "--eviction-policy",
                "--kv-config", "--redis-url", "--redis-password-env", "--s3-url", "--s3-endpoint", "--s3-region",
                "--s3-size", "--s3-ca-bundle", "--fleet-key-env", "--encrypt", "--node", "--node-pool-size",
                "--node-uid")
"""``kvtier serve``'s own flags (before any ``--``; after it everything is vLLM's)."""
_VLLM_CLI_MODULES = (
    "vllm.entrypoints.cli.main",
    "kvtier.vllm.cli_shim",
    "kvtier.launch.vllm_entry",
    "kvtier.cli.serve",
)
"""vLLM's CLI and kvtier's shim of it (``kvtier.cli.serve`` was the shim's module before)."""
_BOOL_LIKE = re.compile(r"^--(no-|enable-|disable-)|^--(enforce-eager|trust-remote-code|calculate-kv-scales|"
                        r"headless|skip-tokenizer-init|async-scheduling|encrypt)$")


class CommandLineError(ValueError):
    """Not a command line doctor understands; the message says what it expected."""


@dataclass
class ServeLine:
    """A parsed serve command line. ``flags`` maps normalized long names to their last value
    (``None`` for switches); ``kvtier_flags`` holds ``kvtier serve``'s own flags."""

    program: str  # "vllm" or "kvtier"
    model: str | None
    flags: dict[str, str | None] = field(default_factory=dict)
    kvtier_flags: dict[str, str | None] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    transfer_config: dict[str, Any] | None = None
    transfer_error: str | None = None
    argv: list[str] = field(default_factory=list)

    def has(self, flag: str) -> bool:
        return flag in self.flags

    def value(self, flag: str) -> str | None:
        return self.flags.get(flag)

    def number(self, flag: str, default: float | None = None) -> float | None:
        """A flag's value as a number (None / ``default`` when absent or not a number)."""
        raw = self.flags.get(flag)
        try:
            return float(raw) if raw is not None else default
        except ValueError:
            return default

    @property
    def tp(self) -> int:
        return max(1, int(self.number("--tensor-parallel-size", 1) or 1))

    @property
    def pp(self) -> int:
        return max(1, int(self.number("--pipeline-parallel-size", 1) or 1))

    @property
    def prefix_caching(self) -> bool:
        """vLLM's V1 engine enables prefix caching unless told not to; the last flag wins."""
        last = None
        for arg in self.argv:
            name = _normalize(arg)
            if name in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
                last = name
        return last != "--no-enable-prefix-caching"

    def getenv(self, name: str) -> str | None:
        """An environment variable set on the line, else in this process's environment."""
        return self.env.get(name, os.environ.get(name))


def option_name(arg: str) -> str | None:
    """The option name of a ``--long_name[.key][=value]`` argument with underscores turned into
    dashes, as vLLM's parser does (``--long-name``; case kept, no abbreviation expanded), else None
    (``--`` itself, a short option, a value)."""
    if not arg.startswith("--") or arg == "--":
        return None
    return "--" + arg[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-")


def short_option(arg: str) -> str | None:
    """The long name vLLM's short option ``-tp`` / ``-pp`` / ``-dp`` / ``-q`` (also ``-tp=4``)
    stands for, else None."""
    return _SHORT.get(arg.split("=", 1)[0])


def _normalize(arg: str) -> str | None:
    """``--Flag_Name.key=v`` -> ``--flag-name``; ``-tp`` -> ``--tensor-parallel-size``; else None."""
    short = short_option(arg)
    if short is not None:
        return short
    name = option_name(arg)
    if name is None:
        return None
    name = name.lower()
    if name in READ_FLAGS or name in KVTIER_FLAGS or name in ("--model", "--config"):
        return name
    matches = [full for full in READ_FLAGS if full.startswith(name)]
    return matches[0] if len(matches) == 1 and len(name) >= 6 else name


def _takes_value(name: str, nxt: str | None) -> bool:
    if nxt is None or nxt == "--" or (nxt.startswith("-") and not re.match(r"^-\d", nxt)):
        return False
    return not _BOOL_LIKE.search(name)


def _program(argv: list[str]) -> tuple[str, list[str]]:
    """(program, arguments after ``serve``) of a command line."""
    if not argv:
        raise CommandLineError(
            "no command line: give it after '--', e.g. kvtier doctor -- vllm serve MODEL ...")
    exe = os.path.basename(argv[0])
    if exe in ("vllm", "kvtier") and len(argv) > 1 and argv[1] == "serve":
        return exe, argv[2:]
    if exe.startswith("python") and len(argv) > 2 and argv[1] == "-m":
        module, rest = argv[2], argv[3:]
        if module == "vllm.entrypoints.openai.api_server":
            return "vllm", rest
        if module in _VLLM_CLI_MODULES and rest[:1] == ["serve"]:
            return "vllm", rest[1:]
        if module in ("kvtier", "kvtier.cli.main") and rest[:1] == ["serve"]:
            return "kvtier", rest[1:]
    raise CommandLineError(
        f"not a serve command line: {' '.join(argv[:3])} ... (expected 'vllm serve ...', 'kvtier serve ...' "
        "or 'python -m vllm.entrypoints.openai.api_server ...')"
    )


def _set_dotted(target: dict[str, Any], dotted: str, raw: str) -> None:
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    keys = dotted.split(".")
    for key in keys[:-1]:
        target = target.setdefault(key, {})
    target[keys[-1]] = value


def parse_serve_line(argv: Sequence[str]) -> ServeLine:
    """Parse ``argv`` (see the module docstring); raise :class:`CommandLineError` if it is not one."""
    argv = list(argv)
    env: dict[str, str] = {}
    while argv and (argv[0] == "env" or _ENV.match(argv[0])):
        if argv[0] != "env":
            name, value = argv[0].split("=", 1)
            env[name] = value
        argv = argv[1:]
    program, args = _program(argv)
    line = ServeLine(program=program, model=None, env=env, argv=list(args))
    if args and not args[0].startswith("-"):
        line.model, args = args[0], args[1:]
    dotted: list[tuple[str, str]] = []
    json_text: str | None = None
    after_dashes = False
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            after_dashes = True
            i += 1
            continue
        name = _normalize(arg)
        if name is None:
            if line.model is None and not after_dashes and not arg.startswith("-"):
                line.model = arg  # vLLM's positional model may follow options
            i += 1
            continue
        nxt = args[i + 1] if i + 1 < len(args) else None
        if "=" in arg:
            value: str | None = arg.split("=", 1)[1]
            used = 1
        elif _takes_value(name, nxt):
            value, used = nxt, 2
        else:
            value, used = None, 1
        if line.program == "kvtier" and not after_dashes and name in KVTIER_FLAGS:
            line.kvtier_flags[name] = value
        elif name == "--model" and line.model is None:
            line.model = value
        else:
            line.flags[name] = value
            head = arg.split("=", 1)[0]
            if name == "--kv-transfer-config":
                if "." in head:
                    dotted.append((head.split(".", 1)[1], value or ""))
                else:
                    json_text = value or ""
        i += used
    _transfer_config(line, json_text, dotted)
    return line


def _transfer_config(line: ServeLine, json_text: str | None, dotted: list[tuple[str, str]]) -> None:
    """``line.transfer_config``: the JSON value, then the dotted overrides (as vLLM merges them)."""
    if json_text is None and not dotted:
        return
    config: dict[str, Any] = {}
    if json_text is not None:
        try:
            config = json.loads(json_text)
        except ValueError as exc:
            line.transfer_error = f"--kv-transfer-config is not valid JSON: {exc}"
            return
        if not isinstance(config, dict):
            line.transfer_error = "--kv-transfer-config must be a JSON object"
            return
    for key, value in dotted:
        _set_dotted(config, key, value)
    line.transfer_config = config
