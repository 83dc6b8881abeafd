"""kvtier's native tier under vLLM 0.33's tier-poll thread, on 0.33's real TieringOffloadingManager
(tests only). Runs in a subprocess whose ``vllm`` is 0.33's released files
(``python -c 'from support.poll033 import main; main(["kvtier", ...])'``, from tests/test_native_vllm033.py); prints one JSON object.

What 0.33 does (v1/kv_offload/tiering/manager.py): when a secondary tier sets
``tolerates_off_thread_polling`` (a P2P tier does), the manager starts a ``vllm_offload_tier_poll``
thread that every ~1 ms takes the manager lock and runs ``poll_tiers``: that tier's
``get_finished_jobs`` and ``serve_external_requests``. A P2P server looks keys up there through the
manager (``ParentManager.lookup``); on a primary miss that asks every other secondary tier, kvtier's
included, from the poll thread, and a HIT queues a promotion the scheduler thread submits at its next
``on_schedule_end``. The scheduler thread meanwhile stores, looks up and promotes under the same lock,
one lock region per step, as 0.33's connector does (offloading/scheduler.py ``_acquire_step``).

The harness: 0.33's manager (:class:`~support.native_rig.NativeRig`) with kvtier's disk tier, then
:class:`PeerTier` (a P2P server in miniature: inbound asks for stored keys, served from the poll
thread; each HIT is pinned with ``create_store_job`` and its bytes read from the primary row). Each
round the scheduler thread stores prompts, resets the primary tier (kvtier keeps them: its entry
says ``keep_on_reset``), and fetches the previous round's prompts while the peer is asked for this
round's: both threads reach kvtier's tier for stored keys. A mode fails (``problems`` not empty) when:

- kvtier's tier was never called from the poll thread (the harness would not test what it claims);
- kvtier's tier answers anything but HIT for a stored key, on either thread (every key the
  harness looks up was stored; a RETRY that only the scheduler thread could end would still let the
  peer be served, through the scheduler's own per-step serve, so each answer is checked);
- a peer's ask or a scheduler fetch of a stored key is not a HIT with the stored bytes;
- two threads are inside kvtier's tier at once (each call sleeps 50 us inside, so without exclusion
  an overlap is all but certain);
- a poll round logged a failure, the scheduler waited more than ``STALL_S`` for the lock, or
  anything raised.

Modes: ``kvtier`` (kvtier's disk tier as shipped), ``kvtier_redis`` (kvtier's Redis tier as
shipped, on a throwaway redis-server: lookups answer RETRY while an EXISTS probe runs), ``kvtier_polled`` (the same with
``tolerates_off_thread_polling`` set, so the poll thread also takes its finished jobs), and two
broken on purpose to show the checks fire: ``thread_confined`` (a tier whose answers depend on the
calling thread, as per-thread state would make them) and ``unlocked`` (the manager's lock a no-op).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager

from kvtier.vllm.native.tiers import KVTierDiskTier

STALL_S = 10.0
"""The longest a scheduler step may wait for the manager lock before the run counts a stall."""
ROUND_S = 60.0
"""The longest one round may take (peer asks and fetches settled)."""
MODEL_S = 0.005
"""How long the model runs after each scheduler step (the manager's lock is free meanwhile)."""
INSIDE_S = 50e-6
"""How long each instrumented call into kvtier's tier sleeps inside it (widens any overlap)."""
TRACED = ("lookup", "submit_store", "submit_load", "get_finished_jobs", "has_pending_work", "touch",
          "on_new_request", "on_request_finished", "take_events", "drain_jobs", "on_schedule_end",
          "serve_external_requests", "get_stats")
"""kvtier tier methods the harness counts per thread and checks for overlapping entries."""


class PolledDiskTier(KVTierDiskTier):
    """kvtier's disk tier, also serviced from 0.33's poll thread (its finished jobs taken there)."""

    tolerates_off_thread_polling: ClassVar[bool] = True


class ThreadConfinedDiskTier(KVTierDiskTier):
    """Broken on purpose: answers MISS to any thread but the one that built it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._owner = threading.get_ident()

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        if threading.get_ident() != self._owner:
            return LookupResult.MISS
        return super().lookup(key, req_context)


class PeerTier(SecondaryTierManager):
    """A P2P server in miniature: stores nothing, answers MISS, and serves inbound asks (lists of
    keys) from ``serve_external_requests`` as 0.33's P2P server does (session/server.py): lookup
    each key through the parent until HIT or MISS, pin the HITs with ``create_store_job``, read
    their rows, report the job done, then ``on_request_finished``. Fed by the scheduler thread
    (``ask``) under the manager's lock; served by the poll thread."""

    tolerates_off_thread_polling: ClassVar[bool] = True

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, **_: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self._rows = np.frombuffer(primary_kv_view, dtype=np.uint8).reshape(primary_kv_view.shape[0], -1)
        self._inbox: queue.SimpleQueue[list[bytes]] = queue.SimpleQueue()  # the network, in effect
        self._asks: list[dict[str, Any]] = []
        self._done_jobs: list[JobResult] = []
        self.answers: list[tuple[bytes, bool, bytes | None]] = []  # (key, hit, row bytes)
        self.serving_threads: collections.Counter[str] = collections.Counter()
        self._n = 0
        self._opening = threading.Event()  # never set: open at once (NativeRig waits on kvtier's)

    def ask(self, keys: list[bytes]) -> None:
        """A remote peer asks for ``keys`` (any thread, any time: it arrives over the network)."""
        self._inbox.put(keys)

    @property
    def taken(self) -> bool:
        """Whether every ask so far has been taken in (and first looked up) by a serve."""
        return self._inbox.empty()

    @property
    def idle(self) -> bool:
        return not self._asks and self._inbox.empty()

    def serve_external_requests(self, parent: Any) -> None:
        self.serving_threads[threading.current_thread().name] += 1
        while not self._inbox.empty():
            self._n += 1
            self._asks.append({"ctx": ReqContext(req_id=f"peer{self._n}"), "keys": self._inbox.get(),
                               "resolved": {}, "new": True})
        for ask in list(self._asks):
            if ask["new"]:
                parent.on_new_request(ask["ctx"])
                ask["new"] = False
            hits = []
            for key in ask["keys"]:
                if key in ask["resolved"]:
                    continue
                result = parent.lookup(key, ask["ctx"])
                if result is LookupResult.HIT:
                    ask["resolved"][key] = True
                    hits.append(key)
                elif result is LookupResult.MISS:
                    ask["resolved"][key] = False
                    self.answers.append((key, False, None))
            if hits:
                job = parent.create_store_job(hits, ask["ctx"])
                for key, row in zip(hits, job.chunk_ids):
                    self.answers.append((key, True, self._rows[int(row)].tobytes()))
                self._done_jobs.append(JobResult(job_id=job.job_id, success=True))
            if len(ask["resolved"]) == len(ask["keys"]):
                parent.on_request_finished(ask["ctx"])
                self._asks.remove(ask)

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        return LookupResult.MISS

    def submit_store(self, job_metadata: Any) -> None:  # cascades: taken and dropped
        self._done_jobs.append(JobResult(job_id=job_metadata.job_id, success=True))

    def submit_load(self, job_metadata: Any) -> None:  # never asked: lookup() never says HIT
        self._done_jobs.append(JobResult(job_id=job_metadata.job_id, success=False))

    def get_finished_jobs(self) -> list[JobResult]:
        done, self._done_jobs = self._done_jobs, []
        return done

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        pass

    def shutdown(self) -> None:
        self.__dict__.pop("_rows", None)  # our view of vLLM's region: vLLM unmaps it at shutdown


class _NoLock:
    """Broken on purpose: the manager's lock replaced by one that excludes nobody."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return True

    def release(self) -> None:
        pass

    def locked(self) -> bool:
        return False

    def __enter__(self) -> bool:
        return True

    def __exit__(self, *exc: Any) -> None:
        pass


class _Trace:
    """Wraps a tier instance's methods: counts calls per thread, records overlapping entries and
    lookups of (stored) keys that are not a HIT."""

    def __init__(self, tier: Any, problems: list[str]) -> None:
        self.calls: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self._inside = 0
        self._guard = threading.Lock()
        self._problems = problems
        for name in TRACED:
            if callable(getattr(tier, name, None)):
                setattr(tier, name, self._wrap(name, getattr(tier, name)))

    def _wrap(self, name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            with self._guard:
                self._inside += 1
                overlap = self._inside > 1
                self.calls[threading.current_thread().name][name] += 1
            if overlap:
                self._problems.append(f"two threads inside kvtier's tier at once (one in {name})")
            try:
                time.sleep(INSIDE_S)
                result = fn(*args, **kwargs)
                if name == "lookup" and result is not LookupResult.HIT:  # every key asked was stored
                    self._problems.append(f"kvtier's tier answered {result.name} for a stored key on "
                                          f"{threading.current_thread().name}")
                return result
            finally:
                with self._guard:
                    self._inside -= 1
        return call


class _PollFailures(logging.Handler):
    """Collects what 0.33's poll thread logs when a round raises (``logger.exception``)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "tier-poll" in record.getMessage():
            self.messages.append(record.getMessage() + (f": {record.exc_info[1]!r}" if record.exc_info else ""))


MODULE = "support.poll033"
"""This module, as vLLM's tier factory imports it (``module_path``)."""
TIER_TYPES = {"kvtier": "kvtier_disk", "kvtier_redis": "kvtier_redis", "kvtier_polled": "PolledDiskTier",
              "thread_confined": "ThreadConfinedDiskTier", "unlocked": "kvtier_disk"}
"""The tier entry's ``type`` per mode (kvtier_disk: kvtier's entry point; the others: this module)."""


def run_mode(mode: str, folder: Path, *, rounds: int = 3, prompts_per_round: int = 2, chunks: int = 3) -> dict:
    """One harness run (see the module docstring); returns its problems and what it saw."""
    from support import native_rig

    problems: list[str] = []
    server = None
    if mode == "kvtier_redis":
        from support.redis_server import RedisServer

        server = RedisServer(folder / "redis")
        entry = {"type": "kvtier_redis", "url": server.url(), "keep_on_reset": True}
    else:
        entry = {"type": TIER_TYPES[mode], "root_dir": str(folder / mode), "capacity_bytes": 10**8,
                 "keep_on_reset": True}
    if TIER_TYPES[mode] not in ("kvtier_disk", "kvtier_redis"):
        entry["module_path"] = MODULE
    peer = {"type": "PeerTier", "module_path": MODULE}
    rig = native_rig.NativeRig(native_rig.make_model(folder / "model"), [entry, peer], num_chunks=64)
    tier, peer_tier = rig.tiers
    manager = rig.manager
    if mode == "unlocked":
        manager._lock = _NoLock()
    trace = _Trace(tier, problems)
    failures = _PollFailures()
    logging.getLogger("vllm").addHandler(failures)
    expected: dict[bytes, bytes] = {}
    fetched = 0
    requests = iter(range(10**9))
    config_info: list[dict[str, Any]] = []

    def step(body: Any = None) -> Any:
        """One scheduler step: the manager lock for the step's manager calls, then the model runs."""
        t0 = time.monotonic()
        if not manager.lock.acquire(timeout=STALL_S):
            raise TimeoutError(f"the scheduler waited {STALL_S:.0f} s for the manager lock")
        try:
            out = body() if body is not None else None
            manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        finally:
            manager.lock.release()
        if time.monotonic() - t0 > STALL_S:
            problems.append(f"a scheduler step took {time.monotonic() - t0:.1f} s")
        time.sleep(MODEL_S)
        return out

    def settle() -> None:
        deadline = time.monotonic() + ROUND_S
        while step(manager.has_pending_work) or not peer_tier.idle:
            if time.monotonic() > deadline:
                raise TimeoutError("jobs or peer asks did not settle")

    def store(keys: list[bytes]) -> None:
        def body() -> None:
            context = ReqContext(req_id=f"store{next(requests)}")
            manager.on_new_request(context)
            out = manager.prepare_store(keys, context)
            assert out is not None, "the CPU tier has no room"
            for key, row in zip(out.keys_to_store, out.store_spec.block_ids):
                payload = np.random.default_rng().bytes(rig.rows.shape[1])
                rig.rows[int(row)] = np.frombuffer(payload, dtype=np.uint8)
                expected[key] = payload[: rig.payload_bytes]
            manager.complete_store(out.keys_to_store, context)
            manager.on_request_finished(context)
        step(body)

    def fetch(keys: list[bytes]) -> None:
        """The scheduler's lookups of one request, step after step, then its load of the HITs."""
        nonlocal fetched
        context = ReqContext(req_id=f"fetch{next(requests)}")
        step(lambda: manager.on_new_request(context))
        deadline = time.monotonic() + ROUND_S
        while True:
            results = step(lambda: [manager.lookup(key, context) for key in keys])
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in results):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"lookups never settled: {results}")
        missed = [k for k, r in zip(keys, results) if r is not LookupResult.HIT]
        if missed:
            problems.append(f"the scheduler's lookup of {len(missed)} stored key(s) missed")

        def load() -> None:
            nonlocal fetched
            hits = [k for k in keys if k not in missed]
            if hits:
                spec = manager.prepare_load(hits, context)
                for key, row in zip(hits, spec.block_ids):
                    if rig.rows[int(row)].tobytes()[: rig.payload_bytes] != expected[key]:
                        problems.append("the scheduler loaded other bytes than were stored")
                    fetched += 1
                manager.complete_load(hits, context)
            manager.on_request_finished(context)
        step(load)

    try:
        previous: list[list[bytes]] = []
        for r in range(rounds):
            current = [rig.keys(native_rig.prompt(1000 * r + p, chunks)) for p in range(prompts_per_round)]
            for keys in current:
                store(keys)
            settle()
            step(lambda: (manager.reset_cache(), manager.on_reset_flushed()))  # kvtier keeps them
            for keys in current:  # they arrive while the model runs: the poll thread takes them
                peer_tier.ask(keys)
            deadline = time.monotonic() + STALL_S
            while not peer_tier.taken and time.monotonic() < deadline:  # however loaded the machine
                time.sleep(0.0005)
            for keys in previous:
                fetch(keys)
            settle()
            previous = current
        config_info = [dict(info) for info in manager.config_info()]  # 0.33's config-info gauge
    except Exception:  # noqa: BLE001  (anything raised is a finding)
        problems.append("raised: " + traceback.format_exc(limit=4).strip().splitlines()[-1])
    finally:
        logging.getLogger("vllm").removeHandler(failures)
        try:
            rig.close()
        except Exception as exc:  # noqa: BLE001
            problems.append(f"shutdown raised {exc!r}")
        if server is not None:
            server.stop()
    peer_hits = 0
    for key, hit, row in peer_tier.answers:
        if not hit:
            problems.append("a peer's ask of a stored key answered MISS")
        elif row is None or row[: rig.payload_bytes] != expected[key]:
            problems.append("a peer read other bytes than were stored")
        else:
            peer_hits += 1
    problems.extend(failures.messages)
    poll_calls = trace.calls.get("vllm_offload_tier_poll", {})
    if not poll_calls.get("lookup"):
        problems.append("kvtier's tier was never looked up from the poll thread")
    return {"problems": sorted(set(problems)), "peer_hits": peer_hits, "fetched": fetched,
            "calls": {thread: dict(counts) for thread, counts in trace.calls.items()},
            "peer_served_on": dict(peer_tier.serving_threads), "config_info": config_info}


def main(modes: list[str]) -> None:
    from importlib.metadata import version

    import vllm

    os.environ.pop("PYTHONHASHSEED", None)
    report: dict[str, Any] = {"vllm": version("vllm"), "vllm_file": vllm.__file__}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["KVTIER_CACHE_DIR"] = str(Path(tmp) / "kvtier-cache")
        for mode in modes:
            report[mode] = run_mode(mode, Path(tmp))
    print(json.dumps(report))

