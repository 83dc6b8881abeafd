"""The model half of the simulated engine (tests/support/engine_sim.py): a fake model built so that
wrong KV cannot go unseen.

- the KV it writes for position ``p`` of every layer is a function of the model's weights (a seed
  stored in a real ``model.safetensors``, so kvtier fingerprints it like real weights) and of the
  whole token prefix up to ``p`` (a hash chain), like real attention KV;
- every token it samples is a hash of *all* KV bytes of the sequence as it reads them from the
  engine's pages through the block table. One wrong byte anywhere, and the outputs change.

It also checks the KV directly: before each forward, every already-computed position of every
scheduled request must hold exactly the bytes the model would have written
(:attr:`FakeModel.kv_mismatches` records any that do not).

Its input tokens are its own, as a model runner's are: a request's tokens as the scheduler output
gives them when the request is (re)installed (a new request's prompt, V2's ``prefill_token_ids``
of a new or resumed request, V1's ``all_token_ids`` of a request not scheduled in the step before),
then the tokens it sampled itself. Under async scheduling a decode step is scheduled before the
previous step's sampled token reaches the scheduler's ``Request`` (which counts a placeholder),
and the GPU runners read that token from their own last sample (vLLM 0.32
``v1/worker/gpu_model_runner.py:1736-1770`` ``prev_sampled_token_ids``, V2
``v1/worker/gpu/model_runner.py:1471-1482`` ``last_sampled_tokens``). What the scheduler has
delivered must always be a prefix of what the model holds (else the harness is wrong: it raises).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.request import Request

VOCAB = 1000
LAYER_NAMES = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def write_model(folder: Path, seed: int, *, num_layers: int = 2, kv_heads: int = 1, head_size: int = 4) -> Path:
    """A model folder: a small Llama config.json and a model.safetensors holding the model's seed
    (its "weights"). Two folders with the same config and another seed are two fine-tunes."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": kv_heads * head_size * 4,
        "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": kv_heads,
        "head_dim": head_size, "num_hidden_layers": num_layers, "vocab_size": VOCAB,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True,
    }
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"seed": torch.tensor([seed], dtype=torch.int64)}, str(folder / "model.safetensors"))
    return folder


def read_seed(folder: Path) -> int:
    from safetensors.torch import load_file

    return int(load_file(str(folder / "model.safetensors"))["seed"][0])


def _installed_tokens(req: NewRequestData) -> list[int]:
    """A new (or, under V2, resumed) request's tokens as the runner takes them."""
    if req.prefill_token_ids is not None:  # V2: every token of the request (a live list: copied)
        return list(req.prefill_token_ids)
    if req.prompt_token_ids is None:  # prompt embeddings: placeholder ids, as vLLM's Request holds
        return [0] * len(req.prompt_embeds)
    return list(req.prompt_token_ids)


class FakeModel:
    """The model half of the simulated engine; see the module docstring."""

    def __init__(self, seed: int, kv: dict[str, torch.Tensor], block_size: int, kv_heads: int, head_size: int,
                 replicas: list[dict[str, torch.Tensor]] | None = None, sliding_window: int | None = None):
        self.seed = seed
        self.kv = kv
        self.replicas = replicas or []  # other ranks' KV, the same bytes (replicated MLA latent)
        self.block_size = block_size
        self.width = kv_heads * 2 * head_size  # floats per position per layer
        self.kv_heads = kv_heads
        self.head_size = head_size
        self.sliding_window = sliding_window
        self.layer_group = (0, 1) if sliding_window else (0, 0)  # KV cache group of each layer
        self.block_tables: dict[str, list[list[int]]] = {}  # one table per group
        self._prefix: dict[str, list[bytes]] = {}
        self._tokens: dict[str, list[int]] = {}  # each request's input tokens, as the runner holds them
        self.kv_mismatches: list[tuple[str, int]] = []
        self.forward_tokens = 0  # positions computed (the prefill work kvtier saves)

    # --- the KV a position must hold ------------------------------------------------------
    def _prefix_hashes(self, req_id: str, tokens: list[int], upto: int) -> list[bytes]:
        chain = self._prefix.setdefault(req_id, [])
        if len(chain) > upto:
            return chain
        prev = chain[-1] if chain else self.seed.to_bytes(8, "little")
        for p in range(len(chain), upto):
            prev = hashlib.blake2b(prev + tokens[p].to_bytes(4, "little"), digest_size=16).digest()
            chain.append(prev)
        return chain

    def expected(self, prefix_hash: bytes, layer: int) -> torch.Tensor:
        raw = hashlib.blake2b(prefix_hash + bytes([layer]), digest_size=4 * self.width).digest()
        return torch.frombuffer(bytearray(raw), dtype=torch.int32).to(torch.float32).view(self.kv_heads, 2 * self.head_size)

    def _page_slot(self, table: list[int], p: int) -> tuple[int, int]:
        return table[p // self.block_size], p % self.block_size

    def _first_read(self, layer: int, end: int) -> int:
        """The first position layer ``layer`` reads when its last computed position is ``end - 1``."""
        return max(0, end - self.sliding_window) if self.layer_group[layer] else 0

    # --- one forward ----------------------------------------------------------------------
    def update_tables(self, so: SchedulerOutput) -> None:
        """Keep block tables as vLLM's worker does (new requests, appended or resumed blocks)."""
        groups = max(self.layer_group) + 1
        for req in so.scheduled_new_reqs:
            self.block_tables[req.req_id] = [list(ids) for ids in req.block_ids]
            self._tokens[req.req_id] = _installed_tokens(req)
        cached = so.scheduled_cached_reqs
        for req_id, tokens in cached.all_token_ids.items():  # V1: requests not scheduled in the step before
            self._tokens[req_id] = list(tokens)
        for i, req_id in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.block_tables[req_id] = [list(ids) for ids in new] if new else [[] for _ in range(groups)]
            elif new:
                tables = self.block_tables.setdefault(req_id, [[] for _ in range(groups)])
                for table, ids in zip(tables, new, strict=True):
                    table.extend(ids)
        for req_id in so.finished_req_ids:
            self.block_tables.pop(req_id, None)
            self._prefix.pop(req_id, None)
            self._tokens.pop(req_id, None)

    def forward(self, so: SchedulerOutput, requests: dict[str, Request]) -> dict[str, list[int]]:
        """Check the KV of computed positions, write the new positions' KV, sample from all KV."""
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        sampled: dict[str, list[int]] = {}
        for req_id, n in so.num_scheduled_tokens.items():
            tokens = self._tokens[req_id]
            delivered = requests[req_id].all_token_ids
            assert tokens[: len(delivered)] == list(delivered), f"{req_id}: the runner's tokens are not the scheduler's"
            start, end = computed[req_id], computed[req_id] + n
            tables = self.block_tables[req_id]
            chain = self._prefix_hashes(req_id, tokens, end)
            for kv in [self.kv, *self.replicas]:  # every rank must hold the right KV
                for layer, name in enumerate(LAYER_NAMES):
                    table = tables[self.layer_group[layer]]
                    for p in range(self._first_read(layer, start + 1), start):
                        block, offset = self._page_slot(table, p)
                        if not torch.equal(kv[name][block, :, offset, :], self.expected(chain[p], layer)):
                            self.kv_mismatches.append((req_id, p))
                            break
                    for p in range(start, end):
                        block, offset = self._page_slot(table, p)
                        kv[name][block, :, offset, :] = self.expected(chain[p], layer)
            self.forward_tokens += n
            if end < len(tokens):
                sampled[req_id] = []  # a prefill chunk: nothing sampled yet
                continue
            digest = hashlib.blake2b(self.seed.to_bytes(8, "little"), digest_size=8)
            for layer, name in enumerate(LAYER_NAMES):
                table = tables[self.layer_group[layer]]
                for p in range(self._first_read(layer, end), end):
                    block, offset = self._page_slot(table, p)
                    digest.update(self.kv[name][block, :, offset, :].numpy().tobytes())
            sampled[req_id] = [3 + int.from_bytes(digest.digest(), "little") % (VOCAB - 3)]
            tokens.extend(sampled[req_id])  # the next step's input (the runner's own copy)
        return sampled
