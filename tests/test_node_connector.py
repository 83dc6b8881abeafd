"""kvtier's connector attached to a node service (``"node": SOCKET``) under vLLM's real scheduler
(tests/support/engine_sim.py) and a real service (tests/support/node_service.py): outputs are
compared with vLLM alone's and every loaded KV page is checked by the fake model, so a block read
from the wrong slot or pool fails here."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from support.engine_sim import SimEngine, by_prompt, counting, external, prompts_of, reference_outputs, renamed, \
    tokens_of, write_model
from support.node_service import NodeThread

from kvtier.core.config import ConfigError
from kvtier.node import NodeClient, Role

SLOT = 4096  # 2 layers x one 32-token page of 1 head x 2 x 8 floats (a multiple of 4 KiB, as the pool needs)
GEOMETRY = {"kv_heads": 1, "head_size": 8, "block_size": 32}
PROMPTS = prompts_of(3, 4, 200, shared_prefix=96)  # 6 full blocks each, the first 3 shared


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "model", seed=11)


@pytest.fixture
def ref(model) -> dict[str, list[int]]:
    return reference_outputs(model, PROMPTS, 4, **GEOMETRY)


def engine(name: str) -> str:
    """The engine id of the sim engine ``name``: unique per process, since an engine's host region
    is named by it (/dev/shm/kvtier-<engine_id>-r0) and another run of these tests on the machine
    would otherwise hold the same name."""
    return f"{name}-{os.getpid()}"


def attached(model: Path, sock: Path, name: str) -> SimEngine:
    return SimEngine(model, kvtier={"cpu_bytes_to_use": 2 * 2**20, "node": str(sock)}, engine_id=engine(name),
                     **GEOMETRY)


def test_a_second_engine_is_served_from_the_pool_the_first_filled_and_blocks_are_held_once(model, ref, tmp_path):
    node = NodeThread(tmp_path / "node.sock", pool_bytes=256 * SLOT)
    try:
        with attached(model, node.sock, "a") as a:
            assert tokens_of(a.generate(PROMPTS, 4)) == ref
            blocks = node.stats()["blocks"]
            assert blocks == 3 + 4 * 3, "the shared prefix is not held once"
            with attached(model, node.sock, "b") as b:
                second = b.generate(renamed(PROMPTS, "-b"), 4)
                assert by_prompt(second, "-b") == ref
                assert sum(external(second)) >= 6 * 32 + 3 * 3 * 32  # every full block not in vLLM's cache
                assert b.model.kv_mismatches == []
        deadline = time.monotonic() + 30
        while node.stats()["attached_engines"]:  # the service sees the closed connections on its loop
            assert time.monotonic() < deadline, "the engines' connections stayed attached after shutdown"
            time.sleep(0.02)
        stats = node.stats()
        assert stats["blocks"] == blocks and stats["engines"][engine("b")]["stored_blocks"] == 0
        assert stats["pinned_blocks"] == 0
    finally:
        node.stop()


def test_the_service_gone_costs_misses_and_its_successor_is_attached_by_itself(model, ref, tmp_path):
    sock = tmp_path / "node.sock"
    node = NodeThread(sock, pool_bytes=256 * SLOT)
    with attached(model, sock, "a") as sim:
        sim.kvtier_scheduler.orchestrator.client.retry_interval_s = 0.0
        sim.worker._worker._node.retry_interval_s = 0.0  # noqa: SLF001
        host = sim.kvtier_scheduler.orchestrator
        counted = counting(host)
        assert tokens_of(sim.generate(PROMPTS, 4)) == ref
        first_pool = node.stats()["pool_id"]
        node.stop()
        assert sim.reset_prefix_cache()
        down = sim.generate(renamed(PROMPTS, "-down"), 4)
        assert by_prompt(down, "-down") == ref and sum(external(down)) == 0
        assert counted.add(host.stats).node_unavailable > 0 and counted.stores_dropped > 0
        node = NodeThread(sock, pool_bytes=256 * SLOT)
        try:
            assert sim.reset_prefix_cache()
            refill = sim.generate(renamed(PROMPTS, "-refill"), 4)  # stores into the new pool
            assert by_prompt(refill, "-refill") == ref
            assert sim.worker._worker._pool_id == node.stats()["pool_id"] != first_pool  # noqa: SLF001
            assert sim.reset_prefix_cache()
            again = sim.generate(renamed(PROMPTS, "-again"), 4)
            assert by_prompt(again, "-again") == ref and sum(external(again)) >= 6 * 32
            assert sim.model.kv_mismatches == []
            # Another engine reads what this one stored after the restart: the bytes are in the new
            # pool (an engine copying into its stale mapping would serve itself right, others zeros).
            with attached(model, sock, "b") as other:
                fresh = other.generate(renamed(PROMPTS, "-b"), 4)
                assert by_prompt(fresh, "-b") == ref and sum(external(fresh)) >= 6 * 32
                assert other.model.kv_mismatches == []
        finally:
            sim.close()
            node.stop()


def test_an_engine_whose_service_is_not_running_yet_starts_misses_and_attaches_by_itself(model, ref, tmp_path):
    """A node that boots its engines and its service independently: the engine starts without the
    service, serves (misses, counted), and attaches within ``retry_interval_s`` once it answers."""
    sock = tmp_path / "node.sock"
    with attached(model, sock, "a") as sim:
        host = sim.kvtier_scheduler.orchestrator
        counted = counting(host)
        first = sim.generate(PROMPTS, 4)
        assert tokens_of(first) == ref and sum(external(first)) == 0
        assert counted.add(host.stats).node_unavailable > 0 and counted.stores_dropped > 0
        node = NodeThread(sock, pool_bytes=256 * SLOT)
        time.sleep(host.client.retry_interval_s)  # the next call attaches
        try:
            for suffix, loaded in (("-stored", 0), ("-again", 6 * 32)):  # into the pool, then from it
                assert sim.reset_prefix_cache()
                out = sim.generate(renamed(PROMPTS, suffix), 4)
                assert by_prompt(out, suffix) == ref and sum(external(out)) >= loaded
            assert node.stats()["engines"][engine("a")]["stored_blocks"] > 0 and sim.model.kv_mismatches == []
        finally:
            sim.close()
            node.stop()


def test_a_service_that_refuses_the_engine_at_start_up_stops_it_naming_the_key_and_both_sizes(model, tmp_path):
    node = NodeThread(tmp_path / "node.sock", pool_bytes=256 * SLOT, slot_bytes=2 * SLOT)
    other = NodeClient(node.sock, engine="other", role=Role.WORKER, slot_bytes=2 * SLOT)
    try:
        other.connect()  # an engine of another block size uses the pool
        with pytest.raises(ConfigError, match=rf"'node' = .*refused this engine.*{2 * SLOT} bytes.*{SLOT} bytes"):
            attached(model, node.sock, "a")
    finally:
        other.close()
        node.stop()


def test_a_load_whose_pin_went_with_a_lost_connection_fails_and_is_recomputed(model, ref, tmp_path):
    """Engine A pins a run, then loses its connection (a call timed out) and reattaches to the same
    service before the run's load is planned: the service released the pin when the connection
    closed, and engine B's blocks now fill those slots. A's load fails (vLLM recomputes) and never
    copies B's bytes (the fake model samples from every KV byte: B's would change the outputs)."""
    node = NodeThread(tmp_path / "node.sock", pool_bytes=16 * SLOT)  # A's 15 blocks fill it
    try:
        with attached(model, node.sock, "lost-pin") as a:
            assert tokens_of(a.generate(PROMPTS, 4)) == ref
            host = a.kvtier_scheduler.orchestrator
            counted = counting(host)
            acquire, lost = host.acquire, []

            def acquire_then_lose_the_pin(owner, keys, *args, **kwargs):
                got = acquire(owner, keys, *args, **kwargs)
                if got.num_blocks and not lost:
                    slots = [s[0] for s in host.held_slots(owner)]
                    host.client.connect()  # a new attachment to the same pool: the old one's pin is released
                    assert host.client.generation == 2 and host.pool_id == node.stats()["pool_id"]
                    deadline = time.monotonic() + 30
                    while node.stats()["pinned_blocks"]:  # the service sees the old connection close on its loop
                        assert time.monotonic() < deadline, "the lost connection's pin was never released"
                        time.sleep(0.01)
                    with NodeClient(node.sock, engine="b", slot_bytes=SLOT) as b:
                        taken = b.reserve([bytes([0xB0, i]) * 16 for i in range(16)])  # evicts all of A's
                        for _status, (slot,) in taken:
                            b.pool.slot(slot)[:] = b"\x55" * SLOT
                        b.commit([bytes([0xB0, i]) * 16 for i in range(16)])
                    assert {slot for _status, (slot,) in taken} >= set(slots)
                    lost.append(owner)
                return got

            host.acquire = acquire_then_lose_the_pin
            assert a.reset_prefix_cache()
            again = a.generate(renamed(PROMPTS, "-again"), 4)
            assert lost and by_prompt(again, "-again") == ref
            assert counted.add(host.stats).load_errors == 1
    finally:
        node.stop()


def test_a_reset_of_an_engines_cache_deletes_nothing_from_the_pool_and_offers_it_nothing_of_before(
        model, ref, tmp_path):
    """``pause_generation`` before an in-place weight update resets the connector's cache: the pool
    is every engine's, so nothing is deleted, and the engine moves to a new key epoch: the pool's
    blocks are not offered to it again (the fake model's weights change in place: loading one would
    be a KV mismatch and a wrong output); another engine still reads them."""
    updated = reference_outputs(write_model(tmp_path / "updated", seed=12), PROMPTS, 4, **GEOMETRY)
    assert updated != ref
    node = NodeThread(tmp_path / "node.sock", pool_bytes=256 * SLOT)
    try:
        with attached(model, node.sock, "reset-a") as a, attached(model, node.sock, "reset-b") as b:
            assert tokens_of(a.generate(PROMPTS, 4)) == ref
            blocks = node.stats()["blocks"]
            assert a.reset_prefix_cache(reset_connector=True)
            assert node.stats()["blocks"] == blocks
            a.model.seed = 12  # the weights, updated in place
            results = a.generate(renamed(PROMPTS, "-u"), 4)
            assert by_prompt(results, "-u") == updated and sum(external(results)) == 0
            assert a.model.kv_mismatches == []
            assert node.stats()["blocks"] == 2 * blocks  # stored again, under the new epoch's keys
            results = b.generate(renamed(PROMPTS, "-b"), 4)
            assert by_prompt(results, "-b") == ref and sum(external(results)) >= 6 * 32 + 3 * 3 * 32
            assert b.model.kv_mismatches == []
    finally:
        node.stop()
