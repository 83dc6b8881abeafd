"""An engine run as its offloading stack states it, and the kvtier namespace of its chunks.

:class:`EngineRun` restates, without vLLM types, what vLLM's ``OffloadingConfig`` says about the
bytes of one offloaded chunk: the KV cache groups (tokens per block, layers), how many engine
blocks make a chunk, the bytes every worker contributes, the parallel layout (every rank's pages
side by side in one row, or one copy when the KV is replicated) and the page layout. Together with
the model (:class:`~kvtier.core.keys.ModelIdentity`) and the hash seed
(:class:`~kvtier.runtime.chunks.identity.HashSeed`) it makes a kvtier
:class:`~kvtier.core.keys.Namespace` (:func:`namespace`), so a root or a Redis server written
through vLLM's offloading holds ordinary kvtier namespaces: ``config.json``, per-rank digests in
every record header, readable by ``kvtier inspect / verify / purge``.

Facts kvtier's own connector takes from its workers (the attention backend each layer got, per-layer
page shapes and memory orders) are not visible to a scheduler-side tier: vLLM picks the backend in
its workers and hands a tier only its offloading config. The namespace names what is visible and
changes the bytes: device type, KV cache layout (as configured), dtype, bytes per block, and
ROCm's shuffled KV layout (``VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT``: same page size, other bytes).
Engines sharing a root or a Redis server must therefore run the same attention backend (the same
vLLM build, GPU generation and ``--attention-backend``); kvtier's own connector checks it.

Compatibility: the page format's ``backends`` pair was (device, ``VLLM_ATTENTION_BACKEND`` or
"auto"); vLLM 0.32 never reads that variable, so it is no longer read and the pair's second slot
is the constant "auto" every namespace so far was written with (their digests are unchanged). The
shuffled layout enters the namespace only when on, so other namespaces keep theirs too. Pure data,
no I/O.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from kvtier.core.keys import ModelIdentity, Namespace, PageFormat
from kvtier.runtime.chunks.identity import HashSeed

NATIVE_FORMAT = "vllm-offloading/1"
"""Names this mapping of vLLM's offloaded chunks onto kvtier records (in every namespace's pages)."""

BACKEND_SLOT = "auto"
"""The second slot of every native page format's ``backends``: a constant (see the module
docstring: a scheduler-side tier cannot see the backend; "auto" keeps old namespaces' digests)."""


@dataclass(frozen=True)
class GroupFacts:
    """One KV cache group vLLM offloads: its original group id, tokens per engine block, layers,
    and (vLLM 0.33) how many chunks a sliding window keeps (None: full attention or unknown)."""

    group_id: int
    tokens_per_block: int
    layer_names: tuple[str, ...]
    sliding_window_chunks: int | None = None


@dataclass(frozen=True)
class EngineRun:
    """The bytes of one offloaded chunk, as the engine's offloading config states them."""

    model_name: str
    kv_dtype: str
    groups: tuple[GroupFacts, ...]
    tokens_per_hash: int
    blocks_per_chunk: int
    worker_kv_bytes_per_block: int
    world_size: int
    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    replicated: bool = False
    canonical_layout: bool = False
    kv_cache_layout: str | None = None
    device: str = "cpu"
    rocm_shuffled_kv: bool = False  # vLLM's ROCm AITER shuffled page layout (same size, other bytes)
    num_kv_heads: int = 0  # per rank, from the model's config.json (0: not known)
    head_size: int = 0

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("an offloaded run has at least one KV cache group")
        for name in ("blocks_per_chunk", "worker_kv_bytes_per_block", "world_size", "tokens_per_hash"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def copies(self) -> int:
        """Payloads in one row: one per rank, or one when every rank holds the same bytes."""
        return 1 if self.replicated else self.world_size

    @property
    def payload_bytes(self) -> int:
        """Bytes of one rank's part of a chunk (one record per rank)."""
        return self.worker_kv_bytes_per_block * self.blocks_per_chunk

    @property
    def chunk_tokens(self) -> int:
        return self.groups[0].tokens_per_block * self.blocks_per_chunk


def namespace(run: EngineRun, model: ModelIdentity, seed: HashSeed) -> Namespace:
    """The kvtier namespace of ``run``'s chunks: blocks of two runs match only when everything here
    is equal (see the module docstring). The per-rank page formats are equal; each rank's records
    still carry their own digest (:meth:`~kvtier.core.keys.Namespace.for_rank`)."""
    facts = {
        "format": NATIVE_FORMAT,
        "hash": seed.to_dict(),
        "tokens_per_hash": run.tokens_per_hash,
        "blocks_per_chunk": run.blocks_per_chunk,
        "groups": [asdict(group) for group in run.groups],
        "parallel": {"world": run.world_size, "tp": run.tp_size, "pp": run.pp_size, "pcp": run.pcp_size,
                     "dcp": run.dcp_size, "replicated": run.replicated},
        "canonical_layout": run.canonical_layout,
    }
    if run.rocm_shuffled_kv:  # only when on: every other namespace keeps its digest
        facts["rocm_shuffled_kv_cache"] = True
    page = PageFormat(
        engine_block_tokens=run.groups[0].tokens_per_block,
        kv_dtype=run.kv_dtype,
        layout=run.kv_cache_layout or "default",
        attention=",".join("full" if g.sliding_window_chunks is None else f"sliding:{g.sliding_window_chunks}"
                           for g in run.groups),
        backends=(run.device, BACKEND_SLOT),
        num_layers=sum(len(group.layer_names) for group in run.groups),
        num_kv_heads=run.num_kv_heads,
        head_size=run.head_size,
        page_bytes=run.worker_kv_bytes_per_block,
        pages=json.dumps(facts, sort_keys=True, separators=(",", ":")),
    )
    if run.replicated:
        tp, pp = run.tp_size, run.pp_size
    elif run.tp_size * run.pp_size == run.world_size:
        tp, pp = run.tp_size, run.pp_size
    else:  # context parallelism: every rank of the row is a copy of its own (pcp/dcp are in `pages`)
        tp, pp = run.world_size, 1
    return Namespace(model=model, ranks=(page,) * run.copies, block_tokens=run.chunk_tokens,
                     tp_size=tp, pp_size=pp, replicated=run.replicated)


def config_json(ns: Namespace, run: EngineRun, seed: HashSeed) -> str:
    """A namespace's ``config.json`` for operators: kvtier's usual fields, plus what vLLM's
    offloading wrote it with (readable copies of facts the digest already covers)."""
    data = json.loads(ns.config_json(run.model_name))
    data["vllm_offloading"] = {"format": NATIVE_FORMAT, **seed.to_dict(),
                               "blocks_per_chunk": run.blocks_per_chunk, "device": run.device}
    return json.dumps(data, sort_keys=True, indent=1)
