"""vLLM's own prefix cache, as vLLM 0.32's block pool runs it: which prompt tokens the engine serves
itself before it asks kvtier (``v1/core/block_pool.py``, ``v1/core/kv_cache_manager.py``,
``v1/core/single_type_kv_cache_manager.py``).

What is modelled, one KV cache group of full attention:

- a pool of ``num_blocks`` blocks (vLLM's ``num_gpu_blocks``; block 0 is vLLM's null block, so
  ``num_blocks - 1`` hold KV), all free at start;
- a lookup hits the longest run of the request's full blocks that are cached, at most
  ``(prompt tokens - 1) // block`` blocks (vLLM computes at least the last prompt token); a hit block
  that is free leaves the free queue (``BlockPool.touch``), one in use by another request is shared
  (its reference count rises);
- the request then takes ``ceil((prompt + answer - 1) / block)`` blocks in all (the last token it
  generates is never fed back); new blocks come from the front of the free queue (``popleft_n``),
  which holds blocks without a hash first (freed partial blocks, never-used blocks) and then cached
  blocks in least-recently-freed order: taking a cached block evicts its hash;
- every full block of its computed tokens is cached (hashed) as it fills; vLLM does not deduplicate,
  so a block whose hash is cached but beyond the hit run is a second block with that hash;
- when the request finishes its blocks are freed in reverse order (``free`` passes
  ``reversed(blocks)``): cached ones are appended to the free queue's end, last block first, so a
  request's tail blocks are evicted before its head; a partial (unhashed) block goes to the front.

Not modelled: preemption, the admission watermark (it only delays a request when others run),
chunked prefill (allocation in pieces takes the same blocks in the same order), several KV cache
groups (sliding windows, Mamba), speculative tokens. Requests run ``concurrency`` at a time: one
starts when the one ``concurrency`` places before it finishes (:mod:`kvtier.replay.exact` orders the
events).

Single thread; no I/O.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import repeat, takewhile


class EnginePoolTooSmall(ValueError):
    """A request needs more blocks than the engine's KV cache holds (vLLM could not run it)."""


class EnginePrefixCache:
    """The block pool of one engine. ``start`` a request (its hit), later ``finish`` it.

    State: ``_free`` holds the cached blocks nobody uses, in eviction order (a block is its hash,
    or ``(hash, n)`` for a second block of a hash: vLLM does not deduplicate); ``_cached`` the
    hashes of every cached block (in use or free), ``_copies`` how many blocks beyond the first a
    hash has; ``_held`` how many running requests hold each hash, counted only while two or more run
(one request alone holds each of its hashes once). Bulk operations run in C
    (``map`` over dict methods); the per-block Python work is where the rare cases are.
    """

    def __init__(self, num_blocks: int, block_tokens: int):
        if num_blocks < 2:
            raise ValueError(f"the engine's KV cache needs at least 2 blocks (one is vLLM's null block), got {num_blocks}")
        self.block_tokens = block_tokens
        self.usable = num_blocks - 1
        self._free: OrderedDict = OrderedDict()
        self._unhashed_free = self.usable  # free blocks without a hash: taken first
        self._cached: dict[bytes, None] = {}
        self._copies: dict[bytes, int] = {}
        self._held: dict[bytes, int] = {}
        self._running: dict[int, tuple[list[bytes], int]] = {}  # request -> (its cached blocks, unhashed ones)
        self._serial = 0

    def start(self, request: int, keys: Sequence[bytes], prompt_tokens: int, computed_tokens: int) -> int:
        """Schedule request ``request`` whose full blocks are named ``keys`` (of its
        ``computed_tokens``: prompt and answer but the last token); returns the prompt tokens the
        engine's own cache serves."""
        block = self.block_tokens
        max_hit = min((prompt_tokens - 1) // block, len(keys)) if prompt_tokens > 0 else 0
        cached, free, held = self._cached, self._free, self._held
        if self._running and not held:  # from now on two requests run at once: count references
            for others, _ in self._running.values():
                for key in others:
                    held[key] = held.get(key, 0) + 1
        hit_keys = list(takewhile(cached.__contains__, keys[:max_hit]))
        hit = len(hit_keys)
        # touch: a free hit block leaves the free queue; one a running request holds is shared
        missing = [key for key, found in zip(hit_keys, map(free.pop, hit_keys, repeat(False))) if found is False]
        for key in missing:
            if not held.get(key):  # only a second block of this hash is free
                del free[next(k for k in free if isinstance(k, tuple) and k[0] == key)]
        total = -(-max(computed_tokens, prompt_tokens) // block)
        full = min(len(keys), computed_tokens // block)
        new = total - hit
        available = self._unhashed_free + len(free)
        if new > available:
            raise EnginePoolTooSmall(
                f"a request needs {total} blocks of {block} tokens ({max(computed_tokens, prompt_tokens)} tokens) "
                f"but only {available} of the engine's {self.usable} are free")
        from_unhashed = min(new, self._unhashed_free)
        self._unhashed_free -= from_unhashed
        if new > from_unhashed:  # popleft: evict the least recently freed cached blocks
            popitem = free.popitem
            victims = [popitem(False)[0] for _ in range(new - from_unhashed)]
            if self._copies or not all(map(bytes.__instancecheck__, victims)):
                for victim in victims:
                    self._uncache(victim)
            else:
                deque(map(cached.pop, victims), maxlen=0)
        mine = list(keys[:full])
        fresh = mine[hit:]
        again = list(filter(cached.__contains__, fresh))  # a second block of a cached hash
        for key in again:
            self._copies[key] = self._copies.get(key, 0) + 1
        cached.update(zip(fresh, repeat(None)))
        if held:
            for key in mine:
                held[key] = held.get(key, 0) + 1
        self._running[request] = (mine, total - full)
        return hit * block

    def _uncache(self, victim) -> None:
        """A free cached block was taken: its hash goes unless another block holds it too."""
        name = victim if isinstance(victim, bytes) else victim[0]
        left = self._copies.get(name, 0)
        if left:
            if left == 1:
                del self._copies[name]
            else:
                self._copies[name] = left - 1
        else:
            del self._cached[name]

    def finish(self, request: int) -> None:
        """The request finished: its blocks are freed in reverse order."""
        mine, unhashed = self._running.pop(request)
        held, free = self._held, self._free
        if not held or not self._running:  # it held every reference: all its blocks are freed
            held.clear()
            freed = mine[::-1]
        else:
            freed = []
            for key in reversed(mine):
                left = held[key] - 1
                if left:
                    held[key] = left
                else:
                    del held[key]
                    freed.append(key)
        if any(map(free.__contains__, freed)):
            for key in freed:
                if key in free:  # a second block with this hash (vLLM does not deduplicate)
                    self._serial += 1
                    free[(key, self._serial)] = None
                else:
                    free[key] = None
        else:
            free.update(zip(freed, repeat(None)))
        self._unhashed_free += unhashed

    @property
    def running(self) -> list[int]:
        return list(self._running)

    def cached_blocks(self) -> int:
        """Blocks holding a hash (running or free)."""
        return len(self._cached) + sum(self._copies.values())
