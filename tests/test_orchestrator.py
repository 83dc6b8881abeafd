"""Orchestrator over a real host index, plain byte buffers and a real disk tier (no engine)."""

import threading
import time
from pathlib import Path

import pytest
from support.namespaces import toy_namespace

from kvtier.core.keys import chain_block_keys
from kvtier.core.stats import KVTierStats
from kvtier.policy.admission import StoreAdmission
from kvtier.replay.sim_tiers import SimDiskTier
from kvtier.runtime.orchestrator import AcquireStatus, BlockInfo, HostBytes, Orchestrator
from kvtier.tiers.base import Medium, TierUsage
from kvtier.tiers.blockfile import HEADER_LEN
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostIndex

SLOT = 4096
NS = toy_namespace(block_tokens=4)


def keys(n: int, seed: int = 0) -> list[bytes]:
    return chain_block_keys(NS.digest, [seed * 1000 + i for i in range(4 * n)], 4)


def make(tmp_path: Path | None, num_slots=4, threshold=0, ranks=1,
         max_pending_writes=64, disk_blocks=10**8 // SLOT) -> tuple[Orchestrator, list[bytearray]]:
    buffers = [bytearray(SLOT * num_slots) for _ in range(ranks)]
    disk = None
    if tmp_path is not None:
        ns = toy_namespace(block_tokens=4, tp_size=ranks)
        disk = DiskTier(
            root_dir=tmp_path, model_name="toy", engine_digest=ns.digest,
            rank_digests=ns.rank_digests(), namespace_json=ns.config_json("toy"),
            payload_bytes=SLOT, capacity_bytes=disk_blocks * ranks * (HEADER_LEN + SLOT),
            n_read_threads=2, n_write_threads=2, max_pending_writes=max_pending_writes,
        )
    orch = Orchestrator(
        HostIndex(num_slots), HostBytes([memoryview(b) for b in buffers], SLOT), [disk] if disk else [],
        StoreAdmission(threshold, 100),
    )
    return orch, buffers


def store(orch: Orchestrator, buffers, ks, fill=None) -> list[int | None]:
    slots = []
    for i, key in enumerate(ks):
        slot = orch.begin_store(key, BlockInfo(ks[i - 1] if i else NS.digest, 4))
        slots.append(slot)
        if slot is not None:
            for rank, buf in enumerate(buffers):
                buf[slot * SLOT : (slot + 1) * SLOT] = bytes([(fill or i + 1 + rank * 7) % 256]) * SLOT
    orch.finish_store([k for k, s in zip(ks, slots) if s is not None], ok=True)
    return slots


def settle(orch: Orchestrator, timeout=30.0) -> None:
    deadline = time.monotonic() + timeout
    while orch.has_pending_io():
        assert time.monotonic() < deadline, "tier I/O did not finish"
        orch.poll()
        time.sleep(0.005)


def acquire_until_ready(orch, owner, ks, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        got = orch.acquire(owner, ks)
        if got.status is AcquireStatus.READY:
            return got
        assert time.monotonic() < deadline, "promotion never finished"
        time.sleep(0.005)


def test_host_hit_pins_and_release_unpins():
    orch, buffers = make(None)
    ks = keys(3)
    store(orch, buffers, ks)
    got = orch.acquire("r1", ks + keys(1, seed=9))
    assert got.status is AcquireStatus.READY and got.num_blocks == 3 and got.from_disk == 0
    assert orch.host.pinned_slots() == 3
    again = orch.acquire("r1", ks[:2])  # a new answer replaces the old hold
    assert again.num_blocks == 2 and orch.host.pinned_slots() == 2
    orch.release("r1")
    assert orch.host.pinned_slots() == 0


def test_pinned_blocks_survive_pressure_and_full_host_drops_stores():
    orch, buffers = make(None, num_slots=2)
    ks = keys(2)
    store(orch, buffers, ks)
    orch.acquire("r1", ks)
    assert store(orch, buffers, keys(1, seed=5)) == [None]
    assert orch.stats.stores_dropped == 1
    assert orch.acquire("r2", ks).num_blocks == 2


def test_cascade_to_disk_then_promotion_restores_exact_bytes(tmp_path):
    orch, buffers = make(tmp_path, ranks=2)
    ks = keys(3)
    store(orch, buffers, ks)
    expected = [bytes(b) for b in buffers]
    settle(orch)
    assert all(orch.disk.contains(k) for k in ks)
    orch.host.clear()  # as after a restart: only the disk has them
    for buf in buffers:
        buf[:] = bytes(len(buf))
    first = orch.acquire("r1", ks)
    assert first.status is AcquireStatus.RETRY
    got = acquire_until_ready(orch, "r1", ks)
    assert got.num_blocks == 3 and got.from_disk == 3
    for key, slot in zip(ks, orch.slots_of(ks)):
        index = ks.index(key)
        for rank, buf in enumerate(buffers):
            assert buf[slot * SLOT : (slot + 1) * SLOT] == bytes([(index + 1 + rank * 7) % 256]) * SLOT
    assert orch.stats.promotions == 3 and orch.stats.disk_to_host.bytes == 3 * 2 * SLOT
    assert expected  # the host copies were the same bytes


class _GatedDisk(DiskTier):
    """A real disk tier whose read of one key waits for a gate: reads land out of order."""

    def __init__(self, gated_key: bytes, **kwargs):
        super().__init__(**kwargs)
        self.gated_key, self.gate = gated_key, threading.Event()

    def _read_job(self, job_id, key, gen, views):
        if key == self.gated_key:
            assert self.gate.wait(60.0), "the test never opened the gate"
        return super()._read_job(job_id, key, gen, views)


def test_promotions_landing_out_of_order_stay_held_and_counted(tmp_path):
    """Blocks 2 and 3 read before block 1: the RETRY answers in between keep them pinned for the
    owner, and the READY answer counts all three as promoted from disk (CI once saw 2 of 3)."""
    orch, buffers = make(tmp_path)
    ks = keys(3)
    store(orch, buffers, ks)
    settle(orch)
    plain = orch.tiers[0]
    plain.close()
    ns = toy_namespace(block_tokens=4)
    gated = _GatedDisk(
        ks[0], root_dir=tmp_path, model_name="toy", engine_digest=ns.digest,
        rank_digests=ns.rank_digests(), namespace_json=ns.config_json("toy"),
        payload_bytes=SLOT, capacity_bytes=10**8, n_read_threads=2, n_write_threads=1, max_pending_writes=8,
    )
    orch = Orchestrator(HostIndex(4), HostBytes([memoryview(b) for b in buffers], SLOT), [gated],
                        StoreAdmission(0, 100))
    deadline = time.monotonic() + 30
    while not all(gated.contains(k) for k in ks):  # the reopened tier adopts the files
        assert time.monotonic() < deadline
        orch.poll()
        time.sleep(0.005)
    assert orch.acquire("r1", ks).status is AcquireStatus.RETRY
    while orch.stats.promotions < 2:
        assert time.monotonic() < deadline, "blocks 2 and 3 were never read"
        orch.poll()
        time.sleep(0.005)
    again = orch.acquire("r1", ks)
    assert again.status is AcquireStatus.RETRY and again.num_blocks == 0
    # blocks 2 and 3 held for r1, block 1's slot being read into
    assert orch.host.pinned_slots() == 3, "finished promotions must stay pinned for their owner"
    gated.gate.set()
    got = acquire_until_ready(orch, "r1", ks)
    assert got.num_blocks == 3 and got.from_disk == 3 and orch.host.pinned_slots() == 3
    orch.release("r1")
    assert orch.host.pinned_slots() == 0


def test_corrupt_disk_block_cuts_the_run_and_is_counted(tmp_path):
    orch, buffers = make(tmp_path)
    ks = keys(3)
    store(orch, buffers, ks)
    settle(orch)
    orch.host.clear()
    victim = next(p for p in tmp_path.rglob("*.bin") if p.stem == ks[1].hex())
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(data)
    got = acquire_until_ready(orch, "r1", ks)
    assert got.num_blocks == 1, "a corrupt block must end the hit run"
    assert orch.stats.checksum_failures == 1 and orch.stats.promotion_failures == 1
    assert not victim.exists() and any((tmp_path / "quarantine").iterdir())


def test_a_block_gone_before_its_read_is_a_counted_miss_logged_by_no_one(tmp_path, caplog):
    """Another engine's eviction or a purge removed a block the index still lists: a miss, counted
    (promotion_failures), without a warning (routine on a shared root; behind vLLM's offloading,
    kvtier_disk logs none either: reason 'vanished'); a corrupt one is warned of once, by the tier."""
    import logging

    orch, buffers = make(tmp_path)
    ks = keys(3)
    store(orch, buffers, ks)
    settle(orch)
    orch.host.clear()
    next(p for p in tmp_path.rglob("*.bin") if p.stem == ks[1].hex()).unlink()
    corrupt = next(p for p in tmp_path.rglob("*.bin") if p.stem == ks[2].hex())
    corrupt.write_bytes(corrupt.read_bytes()[:-1] + b"\x00")
    with caplog.at_level(logging.DEBUG, logger="kvtier"):
        assert acquire_until_ready(orch, "r1", ks).num_blocks == 1
        orch.release("r1")
        assert acquire_until_ready(orch, "r2", ks[2:]).num_blocks == 0
    assert orch.stats.promotion_failures == 2 and orch.stats.checksum_failures == 1
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "quarantined" in warned[0], warned


def test_store_threshold_admits_on_the_nth_offer():
    orch, buffers = make(None, threshold=2)
    ks = keys(1)
    assert store(orch, buffers, ks) == [None]
    assert orch.stats.stores_skipped_threshold == 1
    assert store(orch, buffers, ks)[0] is not None


def test_already_stored_blocks_are_not_stored_again(tmp_path):
    orch, buffers = make(tmp_path)
    ks = keys(2)
    store(orch, buffers, ks)
    assert store(orch, buffers, ks) == [None, None]
    assert orch.stats.stores_submitted == 2


@pytest.mark.parametrize("ok", [True, False])
def test_failed_engine_store_frees_the_slot(ok):
    orch, _ = make(None, num_slots=1)
    key = keys(1)[0]
    assert orch.begin_store(key, BlockInfo(NS.digest, 4)) is not None
    orch.finish_store([key], ok=ok)
    assert orch.host.is_ready(key) is ok
    assert orch.host.used_slots == (1 if ok else 0)


def test_residency_changes_follow_blocks_through_host_and_disk(tmp_path):
    from kvtier.core.residency import ChangeKind
    from kvtier.tiers.base import Medium

    early = keys(1, seed=9)
    orch, buffers = make(tmp_path, num_slots=2)
    store(orch, buffers, early)  # before tracking starts: never reported
    settle(orch)
    orch.track_residency()
    ks = keys(3)
    store(orch, buffers, ks[:2])
    settle(orch)
    store(orch, buffers, ks[2:])  # the host tier holds 2 blocks: evicts the least recent one
    settle(orch)
    assert orch.disk.delete([ks[0]]) == 1
    name = {key: i for i, key in enumerate(ks)} | {early[0]: "early"}
    changes = [(c.kind, c.medium, name[c.key]) for c in orch.take_residency_changes()]
    S, R, H, D = ChangeKind.STORED, ChangeKind.REMOVED, Medium.HOST, Medium.DISK
    host = [(kind, i) for kind, medium, i in changes if medium is H]
    disk = [(kind, i) for kind, medium, i in changes if medium is D]
    # the early block was in the host tier when tracking began: its eviction is still reported
    assert host == [(R, "early"), (S, 0), (S, 1), (R, 0), (S, 2)]
    assert sorted(disk[:3]) == [(S, 0), (S, 1), (S, 2)] and disk[3:] == [(R, 0)]  # writes finish in any order
    assert orch.media_of(ks[1]) == [H, D] and orch.media_of(ks[0]) == [] and orch.media_of(early[0]) == [D]
    assert orch.take_residency_changes() == []
    orch.close()


def test_wait_for_tiers_sleeps_until_a_promotion_lands_and_never_without_a_waiting_owner(tmp_path):
    """An engine step with nothing to compute waits for the tiers instead of spinning: the wait
    ends as soon as a tier posts (here: the disk reads of a promotion), not at the timeout; it
    does not wait at all when no owner was told to ask again, nor after that owner got its hit or
    was released. (Bounds: a wait that returned early takes well under 10 s even on a loaded
    machine; one that waited for its timeout takes 30 s.)"""
    orch, buffers = make(tmp_path)
    ks = keys(2)
    store(orch, buffers, ks)
    settle(orch)
    orch.host.clear()
    started = time.monotonic()
    assert orch.wait_for_tiers(30.0) is False and time.monotonic() - started < 10  # nobody waits

    assert orch.acquire("r1", ks).status is AcquireStatus.RETRY  # reads submitted
    steps = 0
    while orch.acquire("r1", ks).status is AcquireStatus.RETRY:
        started = time.monotonic()
        assert orch.wait_for_tiers(30.0) is True
        assert time.monotonic() - started < 10, "the wait did not end when the reads landed"
        steps += 1
    assert steps <= 4  # about one wait per completion (two reads here), not a spin
    started = time.monotonic()
    assert orch.wait_for_tiers(30.0) is False and time.monotonic() - started < 10  # r1 got its hit
    orch.release("r1")
    assert orch.wait_for_tiers(30.0) is False


def test_a_long_prompt_reaches_a_tier_whose_write_queue_is_shorter(tmp_path):
    """A prefill step of 300 blocks against a tier that takes 4 writes at a time: every block is
    written (they wait, pinned in the host tier, and go as room frees), none is dropped."""
    orch, buffers = make(tmp_path, num_slots=320, max_pending_writes=4)
    ks = keys(300, seed=9)
    assert None not in store(orch, buffers, ks)
    assert orch.has_pending_io()
    settle(orch, timeout=60)
    assert all(orch.disk.contains(k) for k in ks)
    assert orch.stats.disk_writes_dropped == 0
    assert orch.host.pinned_slots() == 0
    orch.close()


def test_a_prefill_step_larger_than_the_disk_tier_turns_it_over_without_drops(tmp_path):
    """40 blocks at once to a disk tier that holds 8 (64 writes allowed in flight): a write can
    evict indexed blocks but not the space of writes in flight, so the tier invites 8 at a time and
    the rest wait in the host tier; every block is written in turn, none dropped, 8 stay."""
    orch, buffers = make(tmp_path, num_slots=48, disk_blocks=8)
    ks = keys(40, seed=4)
    assert None not in store(orch, buffers, ks)
    settle(orch, timeout=60)
    disk = orch.disk
    assert orch.stats.disk_writes_dropped == 0 and disk.stats.writes_dropped == 0
    assert disk.stats.writes_ok == 40 and disk.stats.evictions == 32
    assert len(disk.lru_keys()) == 8 and set(disk.lru_keys()) <= set(ks) and orch.host.pinned_slots() == 0
    orch.close()


def test_stats_count_host_evictions_and_those_that_continued_a_run_since_the_last_take():
    orch, buffers = make(None, num_slots=4)
    store(orch, buffers, keys(4))  # slots 0-3: full
    store(orch, buffers, keys(3, seed=1))  # the LRU victim (slot 0), then slots 1 and 2: cold, continuing the run
    stats = orch.take_stats()
    assert (stats.host_evictions, stats.host_run_evictions) == (3, 2) == (orch.host.evictions, orch.host.run_evictions)
    store(orch, buffers, keys(1, seed=2))  # slot 3 continues the run
    stats = orch.take_stats()
    assert (stats.host_evictions, stats.host_run_evictions) == (1, 1)
    assert (orch.take_stats().host_evictions, orch.take_stats().host_run_evictions) == (0, 0)


def test_a_write_that_fails_with_an_io_error_is_counted_alike_in_every_way_in(tmp_path, monkeypatch):
    """A tier write that fails (disk EIO here; a Redis error reply, an S3 PUT that failed) stored
    nothing, as a dropped one: the core (embedded engine, node service) counts it in
    ``<tier>_writes_dropped`` and the native ChunkStore in a reason of kvtier_offload_stores_dropped,
    both by the one mapping WRITE_FAILURES."""
    import errno

    import kvtier.tiers.disk.writer as writer
    from kvtier.runtime.chunks.rows import Rows
    from kvtier.runtime.chunks.store import ChunkStore

    def eio(*_args, **_kwargs):
        raise OSError(errno.EIO, "Input/output error (injected)")

    monkeypatch.setattr(writer, "_fill", eio)
    orch, buffers = make(tmp_path / "embedded")
    store(orch, buffers, keys(2))
    settle(orch)
    stats = orch.take_stats()
    assert orch.disk.stats.io_errors == 2 and stats.host_to_disk.jobs == 0
    assert stats.disk_writes_dropped == 2 and stats.promotion_failures == 0
    orch.close()

    from kvtier.tiers.base import WRITE_FAILURES, IoError, write_failure

    tier = make(tmp_path / "native")[0].disk
    region = bytearray(SLOT * 2)
    chunks = ChunkStore(tier, Rows(memoryview(region).cast("B", (2, SLOT)), copies=1, payload_bytes=SLOT),
                        namespace_digest=NS.digest, chunk_tokens=16)
    chunks.submit_store(1, [b"k" * 36], [0])
    deadline = time.monotonic() + 30
    while not (outcomes := chunks.poll()):
        assert time.monotonic() < deadline, "the store job never completed"
        time.sleep(0.005)
    assert not outcomes[0].ok and dict(chunks.counts) == {write_failure(IoError.IO).reason: 1}
    chunks.close()
    assert write_failure(None) == WRITE_FAILURES[IoError.IO] and set(WRITE_FAILURES) == {IoError.IO, IoError.DROPPED}
    assert {f.counter for f in WRITE_FAILURES.values()} == {"writes_dropped"}


class _SimS3(SimDiskTier):
    """An in-memory tier (kvtier.replay.sim_tiers) standing for the S3 tier: a capacity it keeps
    by evicting, as S3's capacity sweeps do."""

    medium = Medium.S3

    def usage(self) -> TierUsage:
        return TierUsage(Medium.S3, self.index.used, self.index.capacity, len(self.index.index))


def test_stats_count_s3_evictions_since_the_last_take():
    """Every secondary tier's evictions reach KVTierStats, as disk_evictions do (kvtier_evictions{tier};
    the node service: evicted_<tier>); the connector's Prometheus side: tests/test_prom.py."""
    block_bytes = HEADER_LEN + SLOT
    s3 = _SimS3(capacity_bytes=2 * block_bytes, block_bytes=block_bytes)
    buffers = [bytearray(SLOT * 8)]
    orch = Orchestrator(HostIndex(8), HostBytes([memoryview(b) for b in buffers], SLOT), [s3], StoreAdmission(0, 100))
    store(orch, buffers, keys(5))
    settle(orch)
    stats = orch.take_stats()
    assert s3.evictions == 3 and stats.s3_evictions == 3 and stats.disk_evictions == 0
    assert KVTierStats.from_dict(stats.as_dict()).s3_evictions == 3
    assert orch.take_stats().s3_evictions == 0
    orch.close()
