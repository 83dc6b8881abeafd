"""Which copy method moves a job of dense pages: chosen by measuring this engine's own jobs, not by a constant.

Two candidates (:class:`~kvtier.copy.staging.CopyMethod`): RUNS (one DMA descriptor per merged
run) and STAGED (gathers into device buffers pipelined with large DMAs). What decides is the size
of a job's runs: under block-outermost layouts (BLNHC) a run is a whole block of every layer and
RUNS reach the link; under layer-outermost ones (LBNHC, FlashAttention's default) a run is one
page, and descriptors of 8-64 KiB do not (measured on an H100: RUNS at 0.06-0.33 of one
``cudaMemcpyAsync`` below 32 KiB, 0.65-0.78 at 64 KiB; docs/benchmarks.md). So, per direction
and class of mean run size (powers of two):

- below :data:`~kvtier.copy.staging.STAGE_BELOW_BYTES` per run: STAGED, always (RUNS is never
  worth a trial there);
- else jobs of at least :data:`TIMED_BYTES` of the class go by whichever of the two has fewer
  timings until each has :data:`TRIALS`, each timed on the device (its own events,
  ``CopyDone.seconds``) and on the host (what its issue took on the thread that runs the forward
  pass); then, of the methods whose median device bandwidth is within :data:`DEVICE_TIE` of the
  fastest's, the one with the least host time (its quickest trial: a staged job shape's first
  jobs go op by op and build its CUDA graph, later ones only launch it) moves every later job of
  the class, and the choice is logged. Until then, and for smaller jobs, the class's choice so far (RUNS first).

Why the host time decides between equals: a copy's device time overlaps the forward pass (it is
queued behind compute, on its own stream), its issue does not: the forward's thread waits for it,
and every request of the batch with it. Queued behind compute, one descriptor per 8 KiB page moves
at the link's speed, but issuing 16,384 of them costs the calling thread 13 ms (H100, CUDA 13;
docs/benchmarks.md); under block-outermost layouts both methods reach the link and a job of
512 scattered blocks is 512 descriptors (0.3-0.4 ms to issue) or one staged CUDA graph.

Every candidate copies the same bytes correctly; a trial only costs time. Called by the copy
engine on the thread that starts and polls jobs; no locking.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field

from kvtier.copy.base import Direction
from kvtier.copy.staging import STAGE_BELOW_BYTES, CopyMethod

logger = logging.getLogger(__name__)

TRIALS = 3  # timed jobs per candidate before a class's method is chosen
TIMED_BYTES = 4 * 2**20  # smaller jobs are latency-bound: their time says little about bandwidth
# device bandwidths this close count as equal: the GPU kit's bandwidth goal (0.95 of one
# cudaMemcpyAsync); at 0.03, staged trials of BLNHC 8 KiB stores on an H200 came out 3-4% under
# RUNS' (0.976 against 1.000 of the link measured later) and RUNS was kept: 0.92 ms to issue
# against 0.40 (docs/benchmarks.md, 2026-11-28)
DEVICE_TIE = 0.05


@dataclass(frozen=True, slots=True)
class TrialKey:
    direction: Direction
    size_class: int  # floor(log2(mean run bytes))


@dataclass
class _Class:
    # per method, each trial's (device bytes per second, host seconds to issue)
    timings: dict[CopyMethod, list[tuple[float, float]]] = field(
        default_factory=lambda: {CopyMethod.RUNS: [], CopyMethod.STAGED: []})
    chosen: CopyMethod | None = None


class MethodChooser:
    """Picks RUNS or STAGED per job under ``method`` (AUTO measures; RUNS or STAGED are fixed).
    ``staged``: whether staging is possible at all (else RUNS, always)."""

    def __init__(self, method: CopyMethod = CopyMethod.AUTO, staged: bool = True):
        self.method = method
        self.staged = staged
        self._classes: dict[TrialKey, _Class] = {}

    def pick(self, direction: Direction, num_bytes: int, num_runs: int) -> tuple[CopyMethod, TrialKey | None]:
        """The method of one job, and the key to report its timing under if it is a trial."""
        if not self.staged:
            return CopyMethod.RUNS, None
        if self.method is not CopyMethod.AUTO:
            return self.method, None
        mean = num_bytes / num_runs if num_runs else 0
        if mean < STAGE_BELOW_BYTES:
            return CopyMethod.STAGED, None
        key = TrialKey(direction, int(math.log2(mean)))
        state = self._classes.get(key)
        if state is None:
            state = self._classes[key] = _Class()
        if state.chosen is not None:
            return state.chosen, None
        if num_bytes < TIMED_BYTES:
            return CopyMethod.RUNS, None
        timed = state.timings
        method = CopyMethod.RUNS if len(timed[CopyMethod.RUNS]) <= len(timed[CopyMethod.STAGED]) else CopyMethod.STAGED
        return method, key

    def decided_by(self, num_bytes: int, fewest_runs: int, most_runs: int) -> bool:
        """Whether a job of ``num_bytes`` in ``fewest_runs`` to ``most_runs`` runs falls in one
        class whatever its exact count (or is staged whatever it is): then the count need not be made."""
        if fewest_runs <= 0:
            return False
        largest, smallest = num_bytes / fewest_runs, num_bytes / most_runs
        return largest < STAGE_BELOW_BYTES or (
            smallest >= STAGE_BELOW_BYTES and int(math.log2(largest)) == int(math.log2(smallest)))

    def observe(self, key: TrialKey, method: CopyMethod, num_bytes: int, seconds: float, ok: bool,
                issue_seconds: float = 0.0) -> None:
        """A trial job completed (``seconds`` on the device, ``issue_seconds`` on the host): it
        counts towards its class's choice; a failed one does not (the method with fewer timings
        is tried next, so a lost or failed trial is made up by the next job)."""
        state = self._classes[key]
        if state.chosen is not None or not ok or seconds <= 0:
            return
        state.timings[method].append((num_bytes / seconds, issue_seconds))
        if all(len(t) >= TRIALS for t in state.timings.values()):
            device = {m: statistics.median(rate for rate, _ in t) for m, t in state.timings.items()}
            host = {m: min(issue for _, issue in t) for m, t in state.timings.items()}  # steady state
            fastest = max(device.values())
            near = [m for m in device if device[m] >= (1 - DEVICE_TIE) * fastest]
            state.chosen = min(near, key=lambda m: host[m])
            logger.info("kvtier: %s copies of ~%d KiB runs: %s chosen (device bandwidth staged %.1f GB/s, runs "
                        "%.1f GB/s, medians; host time to issue staged %.3f ms, runs %.3f ms, quickest; of %d jobs each)",
                        key.direction.value, 2**key.size_class // 1024, state.chosen.value,
                        device[CopyMethod.STAGED] / 1e9, device[CopyMethod.RUNS] / 1e9,
                        host[CopyMethod.STAGED] * 1e3, host[CopyMethod.RUNS] * 1e3, TRIALS)

    def choices(self) -> dict[str, str]:
        """The method chosen per class so far, e.g. ``{"engine_to_host ~256 KiB runs": "runs"}``."""
        return {f"{key.direction.value} ~{2**key.size_class // 1024} KiB runs": state.chosen.value
                for key, state in self._classes.items() if state.chosen is not None}
