"""Namespaces for unit tests: a real :class:`~kvtier.core.keys.Namespace` with made-up identities."""

from __future__ import annotations

from kvtier.core.keys import ModelIdentity, Namespace, PageFormat


def toy_namespace(
    *,
    layers: int = 2,
    kv_heads: int = 1,
    head_size: int = 8,
    block_tokens: int = 4,
    engine_block_tokens: int | None = None,
    tp_size: int = 1,
    weights: str = "blake3:" + "0" * 64,
    kv_dtype: str = "float32",
) -> Namespace:
    engine_block = engine_block_tokens or block_tokens
    page = PageFormat(
        engine_block_tokens=engine_block,
        kv_dtype=kv_dtype,
        layout="LBHNC",
        attention="full_attention",
        backends=("CPU_ATTN",),
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_size=head_size,
        page_bytes=2 * kv_heads * engine_block * head_size * 4,
        pages="0" * 32,
    )
    model = ModelIdentity(weights=weights, config="c" * 32, dtype=kv_dtype)
    return Namespace(model=model, ranks=(page,) * tp_size, block_tokens=block_tokens, tp_size=tp_size)
