"""A process that writes (and reads back) blocks through its own DiskTier, for the tests of engines
sharing a disk root (tests/test_disk_sharing.py) and of a full disk (tests/test_disk_full.py).

Run by ``multiprocessing`` with the spawn start method (a fresh interpreter, as a second engine
would be): :func:`run_writer` gets a :class:`WriterPlan` and puts a :class:`WriterReport` on a queue.
Keys and payloads are functions of (writer, index) and (key, rank), so any process can check the
bytes of a block any other wrote.
"""

from __future__ import annotations

import hashlib
import random
import resource
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.tiers.base import IoKind, IoResult
from kvtier.tiers.blockfile import HEADER_LEN
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk.layout import DiskLayout
from kvtier.tiers.disk.ledger import Sharing

ENGINE = bytes(range(32))
PARENT = b"\x00" * 32
MODEL = "HuggingFaceTB/SmolLM2-135M"
NS_JSON = '{"model_name":"test","tp_size":2}'


def rank_digests(world: int) -> list[bytes]:
    return [bytes([0xA0 + rank]) * 32 for rank in range(world)]


def key_for(writer: int, i: int) -> bytes:
    return hashlib.sha256(f"{writer}/{i}".encode()).digest()


def payload_of(key: bytes, rank: int, size: int) -> bytes:
    return random.Random(key + bytes([rank])).randbytes(size)


def layout_at(root: str | Path, world: int) -> DiskLayout:
    """The layout (paths only) of the tiers :func:`open_tier` opens."""
    return DiskLayout(root, MODEL, ENGINE, world, 0)


def open_tier(root: str | Path, *, world: int, payload: int, capacity_blocks: int, **overrides: Any) -> DiskTier:
    args: dict[str, Any] = dict(
        root_dir=root, model_name=MODEL, engine_digest=ENGINE, rank_digests=rank_digests(world),
        namespace_json=NS_JSON, payload_bytes=payload,
        capacity_bytes=capacity_blocks * world * (HEADER_LEN + payload),
        # A queue of 4 per process: the writes in flight of every process stay well within the
        # tiny test capacity (20 blocks), as an engine's do within a real one.
        n_read_threads=2, n_write_threads=2, max_pending_writes=4,
    )
    args.update(overrides)
    return DiskTier(**args)


@dataclass
class WriterPlan:
    root: str
    writer: int  # keys are key_for(writer, i)
    keys: int  # how many distinct keys to write
    world: int = 2
    payload: int = 4096
    capacity_blocks: int = 20
    ledger: bool = True  # False: the negative control (the tier behaves as on a root that cannot lock)
    rescan_every: int = 50  # writes between rescans (the orchestrator refreshes every 30 s)
    read_every: int = 3  # writes between reads of a block some writer wrote earlier
    peers: int = 2  # writers whose keys are read back
    file_size_limit: int | None = None  # RLIMIT_FSIZE for the first half of the keys (EFBIG), then lifted


@dataclass
class WriterReport:
    writer: int
    sharing: str = ""
    results: dict[str, int] = field(default_factory=dict)  # write/read outcome -> count
    stats: dict[str, Any] = field(default_factory=dict)  # DiskTierStats
    wrong_bytes: int = 0  # reads that returned ok with other bytes than written: must stay 0
    error: str = ""


def run_writer(plan: WriterPlan, start: Any, reports: Any) -> None:
    """The process body: open the tier, wait at ``start`` (a Barrier of every writer and the test:
    no start-up scan runs while another writes), write, report on ``reports`` (a Queue)."""
    report = WriterReport(plan.writer)
    try:
        if plan.file_size_limit is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG instead of a kill
            _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (plan.file_size_limit, hard))
        tier = open_tier(plan.root, world=plan.world, payload=plan.payload, capacity_blocks=plan.capacity_blocks)
        if not plan.ledger:
            tier._ledger.sharing = Sharing.PER_PROCESS  # noqa: SLF001 - the negative control only
        report.sharing = tier.sharing.value
        start.wait(120)
        _Driver(tier, plan, report).run()
        tier.close()
        for name, count in _count(tier.poll()).items():
            report.results[name] = report.results.get(name, 0) + count
        report.stats = asdict(tier.stats)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        report.error = f"{type(exc).__name__}: {exc}"
    reports.put(report)


def _count(results: list[IoResult]) -> dict[str, int]:
    """Results by ``<kind>_<ok or error>``, e.g. ``write_ok``, ``write_dropped``, ``read_not_found``."""
    counts: dict[str, int] = {}
    for result in results:
        name = f"{result.kind.value}_{'ok' if result.ok else result.error.value}"
        counts[name] = counts.get(name, 0) + 1
    return counts


class _Driver:
    """Submits the plan's writes and reads, polling as an orchestrator does."""

    def __init__(self, tier: DiskTier, plan: WriterPlan, report: WriterReport) -> None:
        self.tier, self.plan, self.report = tier, plan, report
        self.rng = random.Random(plan.writer)
        self.job = 0
        self.reads: dict[int, tuple[bytes, list[bytearray]]] = {}  # job -> (key, buffers)

    def run(self) -> None:
        plan = self.plan
        for i in range(plan.keys):
            if plan.file_size_limit is not None and i == plan.keys // 2:
                self.drain()
                _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
                resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # space returns
            key = key_for(plan.writer, i)
            sources = [memoryview(payload_of(key, rank, plan.payload)) for rank in range(plan.world)]
            self.job += 1
            while not self.tier.submit_write(self.job, key, PARENT, 16, sources):
                self.poll()
                time.sleep(0.0005)
            if i % plan.read_every == 0 and i:
                self.read(key_for(self.rng.randrange(plan.peers), self.rng.randrange(i)))
            if i % plan.rescan_every == 0 and i:
                self.tier.rescan()
            self.poll()
        self.drain()

    def read(self, key: bytes) -> None:
        self.job += 1
        buffers = [bytearray(self.plan.payload) for _ in range(self.plan.world)]
        self.reads[self.job] = (key, buffers)
        self.tier.submit_read(self.job, key, [memoryview(b) for b in buffers])

    def poll(self) -> None:
        results = self.tier.poll()
        for result in results:
            if result.kind is IoKind.READ:
                key, buffers = self.reads.pop(result.job_id)
                if result.ok and [bytes(b) for b in buffers] != [
                    payload_of(key, rank, self.plan.payload) for rank in range(self.plan.world)
                ]:
                    self.report.wrong_bytes += 1
        for name, count in _count(results).items():
            self.report.results[name] = self.report.results.get(name, 0) + count

    def drain(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.tier._state.writing or self.reads:  # noqa: SLF001
            if time.monotonic() > deadline:
                raise TimeoutError("jobs did not complete")
            self.poll()
            time.sleep(0.001)
        self.poll()
