"""vLLM's block-hash seed, as a native tier needs it to name its namespace.

vLLM builds the scheduler (and so its offloading manager and every secondary tier) before it
initializes the block-hash seed (``init_none_hash`` in ``EngineCore.__init__``, 0.32 and 0.33), and
a secondary tier is not given vLLM's configuration, so neither the hash function nor the seed is
known when a tier is constructed. :class:`SeedWatcher` waits for it on a daemon thread (a few
milliseconds after the tier's constructor returns) and hands a
:class:`~kvtier.runtime.chunks.identity.HashSeed` to the tier, which then opens its storage.

What is read: ``kv_cache_utils.NONE_HASH`` (the parent hash of every first block; a new object
each time vLLM initializes it) and ``get_none_hash_seed()`` (vLLM's resolved seed text, read once
here to find which of vLLM's hash functions made ``NONE_HASH``). Only a digest leaves this module.
"""

from __future__ import annotations

import logging
import threading
import time
import typing
from collections.abc import Callable

from vllm.config.cache import PrefixCachingHashAlgo
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils

from kvtier.runtime.chunks.identity import HashSeed, SeedKind, pythonhashseed

logger = logging.getLogger(__name__)

POLL_S = 0.002
WAIT_S = 300.0
"""How long a tier waits for vLLM's seed before it gives up (it then serves misses and stores nothing)."""
GRACE_S = 5.0
"""A seed already initialized when the tier was created (by this engine, in a vLLM that initializes
it earlier) is taken once it has not been replaced for this long."""


def current_seed() -> HashSeed | None:
    """The engine's hash function and seed as vLLM initialized them in this process, or None before."""
    first_parent = getattr(kv_cache_utils, "NONE_HASH", None)
    if first_parent is None:
        return None
    seed_text = kv_cache_utils.get_none_hash_seed()
    for algorithm in typing.get_args(PrefixCachingHashAlgo):
        if get_hash_fn_by_name(algorithm)(seed_text) == first_parent:
            return HashSeed.of(algorithm, SeedKind.of(algorithm, pythonhashseed()), first_parent)
    raise RuntimeError("vLLM's first-block hash matches none of its hash functions "
                       f"{typing.get_args(PrefixCachingHashAlgo)}: this vLLM is not one kvtier knows")


class SeedWatcher:
    """Calls ``on_seed(seed)`` (or ``on_error(exc)``) once, from its own thread, when vLLM has
    initialized its block-hash seed after this watcher was created."""

    def __init__(self, on_seed: Callable[[HashSeed], None], on_error: Callable[[BaseException], None],
                 *, name: str, wait_s: float = WAIT_S):
        self._before = getattr(kv_cache_utils, "NONE_HASH", None)  # an earlier engine's, in this process
        self._on_seed, self._on_error, self._wait_s = on_seed, on_error, wait_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=60)

    def _seeded(self, waited_s: float) -> bool:
        """vLLM initialized the seed since this watcher was created (a new object: identity, not
        equality, since an engine with the same seed computes an equal value), or one initialized
        before has stood for :data:`GRACE_S`."""
        current = getattr(kv_cache_utils, "NONE_HASH", None)
        return current is not None and (current is not self._before or waited_s > GRACE_S)

    def _run(self) -> None:
        start = time.monotonic()
        deadline = start + self._wait_s
        try:
            while not self._seeded(time.monotonic() - start):
                if self._stop.wait(POLL_S):
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vLLM did not initialize its block-hash seed within {self._wait_s:.0f} s")
            seed = current_seed()
            assert seed is not None
            self._on_seed(seed)
        except BaseException as exc:  # the tier must learn that it will never open
            self._on_error(exc)
