"""Partial-block reuse ("tails") and decode-block offload under vLLM's real scheduler
(tests/support/engine_sim.py: the fake model's tokens hash every KV byte it reads, and every
computed position's KV is checked before each forward).

A returning chat turn resends the transcript: the previous prompt, the answer, a new message.
With tails, kvtier serves everything the engine computed before (all but the answer's last token,
whose KV was never computed), and vLLM computes from the middle of a block.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
from support.engine_sim import SimEngine, counting, cpu_and_gpu_defaults, reference_outputs, settle, write_model
from vllm.v1.request import RequestStatus

from kvtier.core.keys import BlockExtras, block_key, tail_key, tail_keys
from kvtier.tiers.blockfile import HEADER_LEN, decode_header
from kvtier.tiers.disk.index import DiskIndex
from kvtier.tiers.host import HostIndex

BLOCK = 16
KVTIER = str(Path(sys.executable).with_name("kvtier"))
HOST = {"cpu_bytes_to_use": 2 * 2**20, "offload_partial_blocks": True}


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "model", seed=11)


def sessions(seed: int, count: int, length: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"s{i}": [rng.randrange(3, 500) for _ in range(length)] for i in range(count)}


def next_turn(first: dict[str, list[int]], answers: dict[str, list[int]], seed: int, message: int = 7):
    """Each session's transcript (prompt + answer) plus a new message, under a new request id."""
    rng = random.Random(seed)
    return {f"{sid}-t2": first[sid] + answers[sid] + [rng.randrange(3, 500) for _ in range(message)] for sid in first}


def run_two_turns(model: Path, config: dict | None, first: dict[str, list[int]], max_tokens: int, **engine):
    with SimEngine(model, kvtier=config, **engine) as sim:
        turn1 = sim.generate(first, max_tokens)
        answers = {sid: f.tokens for sid, f in turn1.items()}
        if config is not None and config.get("secondary_tiers"):
            settle(sim)
        sim.reset_prefix_cache()  # vLLM's own cache forgets: what comes back comes from kvtier
        second = next_turn(first, answers, seed=5)
        turn2 = sim.generate(second, max_tokens)
        assert sim.model.kv_mismatches == []
    return answers, second, turn2


@cpu_and_gpu_defaults
@pytest.mark.parametrize("prompt_only", [False, True])
def test_a_returning_turn_loads_everything_computed_before(model, prompt_only, mode):
    first = sessions(1, 3, 100)  # 6 full blocks + a tail of 4
    config = {**HOST, "offload_prompt_only": prompt_only}
    answers, second, turn2 = run_two_turns(model, config, first, max_tokens=12, **mode)
    assert {rid: f.tokens for rid, f in turn2.items()} == reference_outputs(model, second, 12)
    for sid, prompt in first.items():
        served = turn2[f"{sid}-t2"].external_cached
        # the engine computed the prompt and all answer tokens but the last one
        expected = len(prompt) if prompt_only else len(prompt) + len(answers[sid]) - 1
        assert served == expected, (sid, served, expected)


def test_without_partial_blocks_a_returning_turn_loads_whole_blocks_only(model):
    """Negative control: ``offload_partial_blocks: false`` is what every prefix cache does."""
    first = sessions(2, 2, 100)
    config = {**HOST, "offload_prompt_only": False, "offload_partial_blocks": False}
    answers, second, turn2 = run_two_turns(model, config, first, max_tokens=12)
    assert {rid: f.tokens for rid, f in turn2.items()} == reference_outputs(model, second, 12)
    for sid, prompt in first.items():
        computed = len(prompt) + len(answers[sid]) - 1
        assert turn2[f"{sid}-t2"].external_cached == computed // BLOCK * BLOCK


def test_the_longest_stored_tail_that_continues_the_prompt_is_loaded(model):
    rng = random.Random(3)
    base = [rng.randrange(3, 500) for _ in range(6 * BLOCK)]
    more = [rng.randrange(3, 500) for _ in range(14)]
    other = [rng.randrange(3, 500) for _ in range(10)]
    stored = {"a": base + more[:3], "b": base + more[:9]}  # tails of 3 and 9 tokens under one block
    asked = {
        "longer": base + more[:12],  # continues both: the 9-token tail
        "diverges": base + more[:5] + other,  # continues only the 3-token one
        # b again (a "regenerate"): its 9-token tail would leave nothing to compute; b also stored
        # its prompt's tail but the last token (8) for this
        "equal": base + more[:9],
        "none": base + other,
    }
    expected = {"longer": 96 + 9, "diverges": 96 + 3, "equal": 96 + 8, "none": 96}
    with SimEngine(model, kvtier=HOST) as sim:
        sim.generate(stored, 1)
        sim.reset_prefix_cache()
        results = sim.generate(asked, 3)
        assert sim.model.kv_mismatches == []
    # (the first request's blocks land in vLLM's own prefix cache: count both caches' tokens)
    assert {rid: f.local_cached + f.external_cached for rid, f in results.items()} == expected
    assert {rid: f.tokens for rid, f in results.items()} == reference_outputs(model, asked, 3)


@pytest.mark.parametrize("window", [None, 48])
def test_a_tail_shorter_than_what_vllm_holds_of_its_block_is_a_miss(model, window):
    """kvtier blocks of 32 tokens over engine blocks of 16: vLLM's own cache holds the first half of
    a kvtier block (16 tokens) and kvtier a tail of 11 tokens of it. The tail adds nothing: a miss.
    It was a hit of -5 tokens, counted so, and with a sliding-window group (asynchronous loads)
    vLLM's scheduler asserted (the engine core died)."""
    rng = random.Random(9)
    base, more = [rng.randrange(3, 500) for _ in range(64)], [rng.randrange(3, 500) for _ in range(16)]
    engine = {} if window is None else {"sliding_window": window}
    config = {**HOST, "block_size": 32}
    asked = {"asked": base + more + [rng.randrange(3, 500) for _ in range(4)]}
    with SimEngine(model, kvtier=config, **engine) as sim:
        sim.generate({"tail": base + more[:11]}, 2)  # kvtier: 2 blocks + an 11-token tail of the third
        sim.generate({"local": base + more + [7, 8, 9]}, 2)  # vLLM: the third block's first 16 tokens
        answers = []
        ask = sim.kvtier_scheduler.get_num_new_matched_tokens
        sim.kvtier_scheduler.get_num_new_matched_tokens = lambda r, n: answers.append(ask(r, n)) or answers[-1]
        results = sim.generate(asked, 3)
        assert sim.model.kv_mismatches == []
    assert {rid: f.tokens for rid, f in results.items()} == reference_outputs(model, asked, 3, **engine)
    assert all(answer is None or answer[0] >= 0 for answer in answers), answers


def test_tails_come_back_from_disk_in_a_fresh_engine(model, tmp_path):
    root = tmp_path / "kv"
    config = {**HOST, "offload_prompt_only": False,
              "secondary_tiers": [{"type": "fs", "root_dir": str(root), "capacity_bytes": 2**30}]}
    first = sessions(4, 2, 100)
    with SimEngine(model, kvtier=config) as sim:
        answers = {sid: f.tokens for sid, f in sim.generate(first, 12).items()}
        settle(sim)
    headers = [decode_header(p.read_bytes()[:HEADER_LEN]) for p in root.rglob("*.bin")]
    tails = sorted(h.num_tokens for h in headers if h.num_tokens < BLOCK)
    # two tails per session: all it computed (for the next turn), its prompt but the last token (a regenerate)
    assert tails == sorted([(100 + 12 - 1) % BLOCK, (100 - 1) % BLOCK] * 2), "tails per session, token counts"
    report = subprocess.run([KVTIER, "inspect", str(root), "--tails", "--json"], capture_output=True, text=True)
    assert report.returncode == 0, report.stderr
    (namespace,) = json.loads(report.stdout)["namespaces"]
    assert namespace["tail_blocks"] == 4 and namespace["complete_blocks"] == len(headers)
    second = next_turn(first, answers, seed=6)
    with SimEngine(model, kvtier=config) as sim:  # a restart: the host tier is empty
        turn2 = sim.generate(second, 12)
        assert sim.model.kv_mismatches == []
    assert {rid: f.tokens for rid, f in turn2.items()} == reference_outputs(model, second, 12)
    assert [f.external_cached for f in turn2.values()] == [100 + 12 - 1] * 2


def test_a_tail_of_another_tenant_never_matches(model):
    first = sessions(5, 1, 100)
    with SimEngine(model, kvtier=HOST) as sim:
        for rid, prompt in first.items():
            sim.add(rid, prompt, 1, cache_salt="tenant-a")
        sim.run()
        sim.reset_prefix_cache()
        for rid, prompt in first.items():
            sim.add(rid + "-b", prompt + [7, 8, 9], 1, cache_salt="tenant-b")
            sim.add(rid + "-a", prompt + [7, 8, 9], 1, cache_salt="tenant-a")
        sim.run()
        got = {rid: f.external_cached for rid, f in sim.finished.items() if rid.endswith(("-a", "-b"))}
    assert got == {"s0-b": 0, "s0-a": 100}


# --- keys and eviction (no engine) ---------------------------------------------------------
def test_tail_keys_are_pinned_and_never_equal_a_block_key():
    assert tail_key(b"", [1, 2, 3]).hex() == "81aedfc9387c86d1c4a9ba821d10a1891606ea470a353716706c0cd7e863736d"
    parent = bytes(32)
    tokens = list(range(BLOCK))
    assert tail_key(parent, tokens) != block_key(parent, tokens)
    candidates = tail_keys(parent, tokens[:5], BlockExtras(cache_salt="t"))
    assert candidates == [tail_key(parent, tokens[:n], BlockExtras(cache_salt="t")) for n in range(1, 6)]
    assert len(set(candidates)) == 5
    assert tail_key(parent, [5]) != tail_key(parent, [5], BlockExtras(cache_salt="t"))
    with pytest.raises(ValueError):
        tail_key(parent, [])


def test_host_tier_evicts_tails_before_blocks_even_recent_ones():
    host = HostIndex(4, run_coldness=None)  # (a store continuing a run may take a cold block's slot first)
    keys = [bytes([i]) * 32 for i in range(6)]
    for key, tail in zip(keys[:4], [False, True, False, True]):
        host.allocate(key, tail=tail)
        host.commit(key)
    host.touch([keys[1], keys[3]])  # the tails are the most recently used
    assert host.allocate(keys[4])[1] == [keys[1]]
    host.commit(keys[4])
    assert host.allocate(keys[5])[1] == [keys[3]]
    host.commit(keys[5])
    host.pin(keys[0])
    assert host.allocate(bytes([99]) * 32)[1] == [keys[2]], "then blocks, least recently used first"


def test_disk_index_evicts_tails_before_blocks():
    removed: list = []

    def remove_files(keys, earlier):
        removed.append(keys)
        return None

    index = DiskIndex(block_bytes=10, capacity_bytes=40, remove_files=remove_files)
    keys = [bytes([i]) * 32 for i in range(5)]
    for key, tail in zip(keys[:4], [True, False, True, False]):
        index.insert(key, tail=tail)
    index.touch_one(keys[0])
    assert isinstance(index.tails, OrderedDict)
    index.insert(keys[4])
    index.evict()
    assert removed == [[keys[2]]], "the least recently used tail goes first"
    assert index.give_way() is None and removed[-1] == [keys[0]]
    index.evict(20)  # room for two more blocks: one must go
    assert removed[-1] == [keys[1]], "no tails left: the least recently used block"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("runner, tail_kept", [("v1", True), ("v2", False)])
def test_a_tail_sent_in_the_step_that_reuses_its_block_is_copied_before_that_step_writes(model, runner, tail_kept,
                                                                                          async_scheduling):
    """The finished request's tail is stored in the next step, from a block vLLM freed at finish
    (kvtier delays no free); when that same step hands the block to a new request (here every free
    block), the workers start the tail's store before the forward writes it. A resend of the prompt
    then loads the tail (its prompt but the last token) and gets vLLM alone's output. Under the V2
    runner, which zeroes new blocks before any connector hook (as for Mamba or mixed-precision
    caches), that store would copy the zeros: it is voided, and the resend loads full blocks only."""
    prompt, other = sessions(33, 2, 100).values()
    engine = {"num_blocks": 8, "max_num_seqs": 2, "runner": runner, "zeroing": True,  # 7 blocks: 102 tokens take all
              "async_scheduling": async_scheduling}
    ref = reference_outputs(model, {"x": prompt}, 2, num_blocks=8)["x"]
    with SimEngine(model, kvtier=HOST, **engine) as sim:
        counted = counting(sim.kvtier_scheduler.orchestrator)
        sim.add("first", prompt, 2)
        while "first" not in sim.finished:
            sim.step()
            sim.wait_for_copies()  # its full blocks' stores land before it finishes (else V2 voids them too)
        sim.add("other", other, 2)
        reused = sim.step()
        assert reused.kv_connector_metadata.flush_job_ids, "the tail's store is flushed in the step reusing its block"
        sim.run()
        voided = counted.add(sim.kvtier_scheduler.orchestrator.stats).stores_voided
        assert sim.reset_prefix_cache()
        sim.add("again", prompt, 2)
        sim.run()
    assert sim.outputs["again"] == ref and sim.prefill["again"] == (0, 99 if tail_kept else 96)
    assert sim.model.kv_mismatches == [] and (voided == 0) == tail_kept


def test_a_pause_that_clears_the_cache_succeeds_right_after_requests_finish_or_are_aborted(model):
    """vLLM's pause_generation(clear_cache=True) (RL weight updates, sleep) aborts what runs and at
    once resets the prefix cache with every running request preempted, which fails while any
    block is held. kvtier holds none: its stores in flight are fenced, and tails not sent yet are
    dropped by the reset (their blocks' bytes are not promised after it). The engine then serves
    bit-exact again."""
    prompts = sessions(35, 3, 100)
    ref = reference_outputs(model, prompts, 6)
    with SimEngine(model, kvtier=HOST) as sim:
        for req_id, tokens in prompts.items():
            sim.add(req_id, tokens, 6 if req_id == "s0" else 2)
        while not {"s1", "s2"} <= sim.finished.keys():  # s1, s2 finished; their tails not sent yet
            sim.step()
        assert "s0" not in sim.finished and sim.kvtier_scheduler._stores.unsent_tails  # noqa: SLF001
        sim.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)  # pause(mode="abort")
        assert sim.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
        assert not sim.kvtier_scheduler._stores.unsent_tails  # noqa: SLF001
        sim.run()
        assert not sim.kvtier_scheduler.has_pending_jobs()
        again = {f"{req_id}-again": tokens for req_id, tokens in prompts.items()}
        for req_id, tokens in again.items():
            sim.add(req_id, tokens, 6)
        sim.run()
    assert {req_id: sim.outputs[f"{req_id}-again"] for req_id in prompts} == ref
    assert sim.model.kv_mismatches == []


@cpu_and_gpu_defaults
def test_a_resend_right_after_a_finish_waits_for_the_tail_being_stored(model, mode):
    """The step after a request finished, its tail's store is only being sent; a resend of the
    prompt looked up then would miss the tail and compute it. kvtier asks vLLM to ask again while
    the run would continue into one of its own stores in flight (vLLM's OffloadingConnector does the
    same for blocks being stored): the resend loads the tail."""
    prompt = sessions(36, 1, 100)["s0"]
    ref = reference_outputs(model, {"x": prompt}, 2)["x"]
    with SimEngine(model, kvtier=HOST, **mode) as sim:
        sim.add("first", prompt, 2)
        while "first" not in sim.finished:
            sim.step()
        assert sim.reset_prefix_cache()  # vLLM's own blocks gone: only kvtier serves the resend
        sim.add("again", prompt, 2)
        sim.run()
    assert sim.outputs["again"] == ref and sim.prefill["again"] == (0, 99)
    assert sim.model.kv_mismatches == []


@cpu_and_gpu_defaults
def test_at_user_shapes_turns_tails_resends_and_a_reset_for_new_weights_stay_bit_exact(model, mode):
    """The tail and wait logic at the shapes users run here: 32-token blocks, two ~4,000-token chat
    sessions, each prompt's prefill one step (a store job of ~125 blocks per request). A returning
    turn loads everything computed before; a resend right after a finish waits for its tail; after
    a reset of the connector's cache and weights changed in place, nothing of before is loaded and
    the outputs are the new weights'. (~15 s: the fake model checks every KV position it reads.)"""
    engine = {"block_size": 32, "num_blocks": 1024, "max_num_batched_tokens": 8192, "max_num_seqs": 4}
    config = {"cpu_bytes_to_use": 64 * 2**20, "offload_partial_blocks": True, "offload_prompt_only": False}
    first = sessions(40, 2, 4003)
    with SimEngine(model, kvtier=config, **engine, **mode) as sim:
        turn1 = sim.generate(first, 12)
        answers = {sid: f.tokens for sid, f in turn1.items()}
        assert sim.reset_prefix_cache()
        second = next_turn(first, answers, seed=41)
        turn2 = sim.generate(second, 12)
        assert {rid: f.tokens for rid, f in turn2.items()} == reference_outputs(model, second, 12, **engine)
        for sid, prompt in first.items():
            assert turn2[f"{sid}-t2"].external_cached == len(prompt) + len(answers[sid]) - 1
        sim.add("resend", second["s0-t2"], 2)  # right after s0-t2 finished: its tails are being stored
        sim.run()
        assert sum(sim.prefill["resend"]) == len(second["s0-t2"]) - 1 and sim.prefill["resend"][1] > 0
        assert sim.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
        sim.model.seed = 12  # the weights, updated in place
        third = {f"{rid}-u": tokens for rid, tokens in second.items()}
        turn3 = sim.generate(third, 12)
        updated = write_model(model.parent / "updated", seed=12)
        assert {rid: f.tokens for rid, f in turn3.items()} == reference_outputs(updated, third, 12, **engine)
        assert all(f.external_cached == 0 for f in turn3.values())
        assert sim.model.kv_mismatches == []
