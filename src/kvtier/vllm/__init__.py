"""kvtier's vLLM integration. The only package of kvtier that imports vllm.

Use it with ``--kv-transfer-config '{"kv_connector": "KVTierConnector",
"kv_connector_module_path": "kvtier.vllm", "kv_role": "kv_both",
"kv_connector_extra_config": {"cpu_bytes_to_use": 8000000000}}'``.

``KVTierConnector`` is imported on first access (vLLM looks it up with ``getattr`` after importing
this package), so submodules such as :mod:`kvtier.vllm.cli_shim` load without importing vLLM first.

vLLM imports this package in every process it starts (API server, engine core, workers).
"""

from typing import Any

__all__ = ["KVTierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVTierConnector":
        from kvtier.vllm.connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
