"""kvtier's vLLM integration. The only package of kvtier that imports vllm.

Use it with ``--kv-transfer-config '{"kv_connector": "KVTierConnector",
"kv_connector_module_path": "kvtier.vllm", "kv_role": "kv_both",
"kv_connector_extra_config": {"cpu_bytes_to_use": 8000000000}}'``.
"""

from kvtier.vllm.connector import KVTierConnector

__all__ = ["KVTierConnector"]
