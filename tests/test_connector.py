"""The connector's scheduler and worker sides under vLLM's real scheduler (tests/support/engine_sim.py).

Every case compares the generated tokens with vLLM alone's (the fake model's tokens hash every KV
byte it reads) and checks the KV pages directly, so a wrong, stale or partial load fails here.
Cases where the timing of vLLM's steps and of the workers' reports matters also run as vLLM runs
on GPUs by default (``cpu_and_gpu_defaults``: the V2 runner under async scheduling, where the next
step is scheduled before the last one's tokens and reports are delivered; tests/test_async_scheduling.py).
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
from support.engine_sim import (
    SimEngine,
    by_prompt,
    cpu_and_gpu_defaults,
    counting,
    external,
    prompts_of,
    reference_outputs,
    renamed,
    settle,
    tokens_of,
    write_model,
)

from vllm.v1.request import RequestStatus

from kvtier.copy import Direction, SlotRun, page_list
from kvtier.tiers.blockfile import HEADER_LEN

HOST = {"cpu_bytes_to_use": 2 * 2**20}  # 64 slots of 2 layers x 16 tokens x 8 floats x 4 B


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "model", seed=7)


def disk_config(root: Path, host_bytes: int = 2 * 2**20, **extra) -> dict:
    """Host + disk tier config; ``extra`` are more top-level keys."""
    return {"cpu_bytes_to_use": host_bytes, **extra,
            "secondary_tiers": [{"type": "fs", "root_dir": str(root), "capacity_bytes": 2**30}]}


def store_copies(sim: SimEngine):
    """The worker's copy engine of ``sim`` (to gate or break copies in a test)."""
    return sim.worker._worker.copies  # noqa: SLF001


@cpu_and_gpu_defaults
def test_round_two_is_served_from_the_host_tier_bit_exact(model, mode):
    prompts = prompts_of(1, 4, 100, shared_prefix=40)
    ref = reference_outputs(model, prompts, 4)
    with SimEngine(model, kvtier=HOST, **mode) as sim:
        assert tokens_of(sim.generate(prompts, 4)) == ref
        assert sim.reset_prefix_cache()
        second = sim.generate(renamed(prompts, "-2"), 4)
        assert by_prompt(second, "-2") == ref
        assert sum(external(second)) >= 4 * 64  # full blocks of every prompt came from kvtier
        assert sim.model.kv_mismatches == []


def test_a_hit_is_loaded_asynchronously_its_request_in_no_batch_until_the_copy_is_reported(model):
    """One KV cache group too: vLLM holds the request in WAITING_FOR_REMOTE_KVS while the workers
    copy (no compute-stream wait on CUDA), then computes the rest of its prompt from the hit."""
    prompt = prompts_of(32, 1, 100)["r32-0"]
    ref = reference_outputs(model, {"x": prompt}, 2)["x"]
    with SimEngine(model, kvtier=HOST) as sim:
        sim.generate({"warm": prompt}, 2)
        assert sim.reset_prefix_cache()
        copies = store_copies(sim)
        real, seen = copies.start_load, []
        copies.start_load = lambda job_id, pages, **kwargs: seen.append(kwargs) or real(job_id, pages, **kwargs)
        request = sim.add("again", prompt, 2)
        first = sim.step()
        assert "again" not in first.num_scheduled_tokens and seen == [{"synchronous": False}]
        assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        second = sim.step()
        sim.run()
        local, loaded = sim.prefill["again"]
        assert local == 0 and loaded >= 96 and second.num_scheduled_tokens["again"] == 100 - loaded
        assert sim.outputs["again"] == ref


def test_jobs_of_one_host_run_reach_the_workers_as_slot_runs_and_stay_bit_exact(model):
    """kvtier's scheduler sends a job of consecutive slots (most stores, and loads of blocks
    stored together) as a SlotRun; the workers copy it as the table it stands for."""
    prompts = prompts_of(40, 3, 100)
    ref = reference_outputs(model, prompts, 3)
    with SimEngine(model, kvtier=HOST) as sim:
        copies = store_copies(sim)
        sent = []
        real_store, real_load = copies.start_store, copies.start_load
        copies.start_store = lambda job_id, pages: sent.append(("store", type(pages))) or real_store(job_id, pages)
        copies.start_load = lambda job_id, pages, **kwargs: sent.append(("load", type(pages))) or \
            real_load(job_id, pages, **kwargs)
        sim.generate(prompts, 3)
        assert sim.reset_prefix_cache()
        second = sim.generate(renamed(prompts, "-2"), 3)
        assert by_prompt(second, "-2") == ref and sum(external(second)) >= 3 * 96
    assert ("store", SlotRun) in sent and ("load", SlotRun) in sent, sent
    assert sim.model.kv_mismatches == []


def test_negative_control_a_load_that_copies_nothing_is_caught(model):
    """Claiming a hit without copying its bytes changes the outputs: the harness can fail."""
    prompts = prompts_of(2, 3, 100)
    ref = reference_outputs(model, prompts, 4)
    with SimEngine(model, kvtier=HOST) as sim:
        sim.generate(prompts, 4)
        assert sim.reset_prefix_cache()
        copies = store_copies(sim)
        copies.copier.copy = lambda direction, pages: 0 if direction is Direction.LOAD else real(direction, pages)
        real = type(copies.copier).copy.__get__(copies.copier)
        second = sim.generate(renamed(prompts, "-2"), 4)
        assert by_prompt(second, "-2") != ref
        assert sim.model.kv_mismatches


@cpu_and_gpu_defaults
def test_a_fresh_engine_is_served_from_disk_bit_exact(model, tmp_path, mode):
    prompts = prompts_of(3, 3, 90)
    ref = reference_outputs(model, prompts, 3)
    with SimEngine(model, kvtier=disk_config(tmp_path / "kv"), **mode) as first:
        assert tokens_of(first.generate(prompts, 3)) == ref
    with SimEngine(model, kvtier=disk_config(tmp_path / "kv"), **mode) as second:  # a restart on the same root
        results = second.generate(renamed(prompts, "-r"), 3)
        assert by_prompt(results, "-r") == ref
        assert all(n >= 80 for n in external(results))
        assert second.model.kv_mismatches == []


def test_a_fine_tune_with_the_same_config_and_folder_name_never_hits(model, tmp_path):
    """Same config.json, same folder name, other weights: a miss on a shared root, bit-exact."""
    prompts = prompts_of(4, 3, 90)
    with SimEngine(model, kvtier=disk_config(tmp_path / "kv")) as base:
        base.generate(prompts, 3)
    tuned = write_model(tmp_path / "runs" / "model", seed=8)  # same basename, same config, new weights
    assert (tuned / "config.json").read_text() == (model / "config.json").read_text()
    ref = reference_outputs(tuned, prompts, 3)
    with SimEngine(tuned, kvtier=disk_config(tmp_path / "kv")) as sim:
        results = sim.generate(renamed(prompts, "-t"), 3)
        assert by_prompt(results, "-t") == ref
        assert external(results) == [0, 0, 0]


def test_another_engine_block_size_on_the_same_root_never_hits(model, tmp_path):
    """Offload blocks of 64 tokens over 16- vs 32-token engine pages: same slot size, other byte order."""
    prompts = prompts_of(5, 3, 140)
    with SimEngine(model, kvtier=disk_config(tmp_path / "kv", block_size=64), block_size=16) as small:
        small.generate(prompts, 3)
    ref = reference_outputs(model, prompts, 3, block_size=32)
    with SimEngine(model, kvtier=disk_config(tmp_path / "kv", block_size=64), block_size=32) as big:
        results = big.generate(renamed(prompts, "-b"), 3)
        assert by_prompt(results, "-b") == ref
        assert external(results) == [0, 0, 0]


def test_a_block_file_of_another_namespace_copied_into_place_is_a_counted_miss(model, tmp_path):
    prompts = prompts_of(6, 1, 90)
    other = write_model(tmp_path / "other" / "model", seed=9)
    with SimEngine(other, kvtier=disk_config(tmp_path / "kv-other")) as sim:
        sim.generate(prompts, 3)
    with SimEngine(model, kvtier=disk_config(tmp_path / "kv")) as sim:
        sim.generate(prompts, 3)
    mine = sorted((tmp_path / "kv").glob("model_*_r0/*/*/*.bin"))
    theirs = {p.name: p for p in (tmp_path / "kv-other").glob("model_*_r0/*/*/*.bin")}
    assert mine and theirs
    # Same token ids, another model: other keys. Copy a foreign file over ours under our name.
    foreign = next(iter(theirs.values()))
    for path in mine:
        shutil.copyfile(foreign, path)
    ref = reference_outputs(model, prompts, 3)
    with SimEngine(model, kvtier=disk_config(tmp_path / "kv")) as sim:
        results = sim.generate(renamed(prompts, "-f"), 3)
        assert by_prompt(results, "-f") == ref and external(results) == [0]
        disk = sim.kvtier_scheduler.orchestrator.disk
        assert disk.stats.corrupt_quarantined >= 1
    assert list((tmp_path / "kv" / "quarantine").iterdir())


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_preemptions_in_the_middle_of_loads_and_stores_stay_bit_exact(model, runner, async_scheduling):
    """8 concurrent requests growing by 48 decode tokens each in 20 engine blocks of 16 tokens:
    vLLM preempts running requests (their stores flushed first) and resumes them (loads from kvtier).
    Under the V2 runner (GPUs) a resumed request comes as a new one, its whole table: kvtier once
    appended it to the stale table of before the preemption, and stored other engine blocks' KV
    (a wrong output and 94 wrong KV pages in the second round)."""
    prompts = prompts_of(7, 8, 64, shared_prefix=16)
    engine = {"num_blocks": 20, "max_num_seqs": 16, "max_num_batched_tokens": 128}
    with SimEngine(model, kvtier=None, **engine) as alone:
        ref = tokens_of(alone.generate(prompts, 48))
    config = {**HOST, "offload_prompt_only": False}
    with SimEngine(model, kvtier=config, runner=runner, async_scheduling=async_scheduling, **engine) as sim:
        preempted = []
        results = sim.generate(prompts, 48, before_forward=lambda so: preempted.extend(so.preempted_req_ids))
        assert tokens_of(results) == ref
        assert preempted, "the workload should force preemptions"
        # resumed requests reloaded what kvtier held instead of recomputing it
        assert sim.model.forward_tokens < alone.model.forward_tokens
        second = sim.generate(renamed(prompts, "-2"), 48, before_forward=lambda so: preempted.extend(so.preempted_req_ids))
        assert by_prompt(second, "-2") == ref
        assert sum(external(second)) > 0
        assert sim.model.kv_mismatches == []
        host = sim.kvtier_scheduler.orchestrator.host
        assert host.pinned_slots() == 0  # nothing leaked


class StoreGate:
    """Holds the worker's store copies until released (a slow store, for real)."""

    def __init__(self, sim: SimEngine):
        self.open = threading.Event()
        copier = store_copies(sim).copier
        real = copier.copy

        def gated(direction, pages):
            if direction is Direction.STORE:
                self.open.wait(30)
            return real(direction, pages)

        copier.copy = gated

    def release(self) -> None:
        self.open.set()


@cpu_and_gpu_defaults
def test_a_finished_request_is_freed_at_once_and_its_blocks_reused_only_after_its_stores(model, mode):
    """A request finishes while its stores are still copying (held): kvtier delays no free, so vLLM
    frees its blocks at once and hands them to the next requests, and the step that does first
    waits for those stores (the reuse fence); the stored blocks then serve bit-exact."""
    prompts = prompts_of(8, 1, 96)
    others = prompts_of(9, 6, 90)
    engine = {"num_blocks": 16, "max_num_seqs": 8}
    ref = reference_outputs(model, prompts, 2, **engine)
    with SimEngine(model, kvtier=HOST, **engine, **mode) as sim:
        gate = StoreGate(sim)
        for req_id, tokens in prompts.items():
            sim.add(req_id, tokens, 2)
        for _ in range(6):
            sim.step()
        assert prompts.keys() <= sim.finished.keys()
        assert not prompts.keys() & sim.scheduler.requests.keys()  # freed, its stores still held
        assert sim.kvtier_scheduler.has_pending_jobs()
        threading.Timer(0.5, gate.release).start()  # the steps that reuse its blocks wait for this
        for req_id, tokens in others.items():
            sim.add(req_id, tokens, 2)
        sim.run()
        assert sim.reset_prefix_cache()
        results = sim.generate(renamed(prompts, "-2"), 2)
        assert by_prompt(results, "-2") == ref and external(results)[0] >= 80
        assert sim.model.kv_mismatches == []


@cpu_and_gpu_defaults
def test_abort_while_stores_are_in_flight(model, mode):
    prompts = prompts_of(10, 2, 96)
    ref = reference_outputs(model, prompts, 3)
    with SimEngine(model, kvtier=HOST, **mode) as sim:
        gate = StoreGate(sim)
        for req_id, tokens in prompts.items():
            sim.add(req_id, tokens, 50)
        sim.step()  # prefill: stores of every full block start (and are held)
        for req_id in prompts:
            sim.abort(req_id)
        sim.step()
        gate.release()
        sim.run()
        settle(sim)
        assert sim.kvtier_scheduler.orchestrator.host.pinned_slots() == 0
        assert not sim.kvtier_scheduler.has_pending_jobs()
        assert sim.reset_prefix_cache()
        results = sim.generate(renamed(prompts, "-2"), 3)
        assert by_prompt(results, "-2") == ref and all(n >= 80 for n in external(results))


@cpu_and_gpu_defaults
def test_a_load_failing_part_way_is_recomputed_bit_exact(model, mode):
    """The copy fails after some of the load's pages: vLLM recomputes the request (its request is
    reported in ``failed_recving``) and kvtier offers it no load again."""
    prompts = prompts_of(11, 1, 130)
    ref = reference_outputs(model, prompts, 3)
    with SimEngine(model, kvtier=HOST, **mode) as sim:
        sim.generate(prompts, 3)
        assert sim.reset_prefix_cache()
        copies = store_copies(sim)
        real = copies.copier.copy
        failed: list[int] = []

        def broken(direction, pages):
            pages = page_list(pages)
            if direction is Direction.LOAD and not failed:
                failed.append(pages[3].block_id)
                raise OSError("injected: host memory read failed")
            return real(direction, pages)

        copies.copier.copy = broken
        counted = counting(sim.kvtier_scheduler.orchestrator)
        results = sim.generate(renamed(prompts, "-2"), 3)
        assert by_prompt(results, "-2") == ref
        assert failed and counted.add(sim.kvtier_scheduler.orchestrator.stats).load_errors == 1


@cpu_and_gpu_defaults
def test_reset_prefix_cache_while_a_promotion_is_in_flight(model, tmp_path, monkeypatch, mode):
    """reset_prefix_cache(reset_connector) clears kvtier while disk reads are running (held until
    after the reset): the reads' completions must not resurrect or pin cleared blocks."""
    from kvtier.tiers.disk import files

    prompts = prompts_of(12, 2, 100)
    ref = reference_outputs(model, prompts, 2)
    with SimEngine(model, kvtier=disk_config(tmp_path / "kv")) as sim:
        sim.generate(prompts, 2)
    reads_may_finish = threading.Event()
    real_read = files.read_block

    def held_read(*args):
        reads_may_finish.wait(30)
        return real_read(*args)

    monkeypatch.setattr(files, "read_block", held_read)
    with SimEngine(model, kvtier=disk_config(tmp_path / "kv"), **mode) as sim:  # blocks only on disk now
        orchestrator = sim.kvtier_scheduler.orchestrator
        for req_id, tokens in renamed(prompts, "-2").items():
            sim.add(req_id, tokens, 2)
        sim.step()  # lookups start promotions and answer "ask again"
        assert orchestrator.has_pending_io()
        assert sim.reset_prefix_cache(reset_connector=True)
        reads_may_finish.set()
        sim.run()
        assert {k.removesuffix("-2"): v.tokens for k, v in sim.finished.items()} == ref
        settle(sim)
        assert orchestrator.host.pinned_slots() == 0


def test_every_host_slot_pinned_drops_stores_without_stalling(model):
    """A host tier of 3 slots under 8 concurrent requests: stores are dropped (counted), never waited for."""
    prompts = prompts_of(13, 8, 100, shared_prefix=64)
    host = {"cpu_bytes_to_use": 3 * 2 * 16 * 8 * 4}
    ref = reference_outputs(model, prompts, 3)
    with SimEngine(model, kvtier=host) as sim:
        assert tokens_of(sim.generate(prompts, 3)) == ref
        results = sim.generate(renamed(prompts, "-2"), 3)
        assert by_prompt(results, "-2") == ref
        assert sim.kvtier_scheduler.orchestrator.host.pinned_slots() == 0


def test_prompt_embeds_requests_are_never_loaded_or_stored(model):
    import torch

    with SimEngine(model, kvtier=HOST) as sim:
        embeds = torch.zeros(64, 16)
        for i in range(2):
            sim.scheduler.add_request(sim.add.__self__ and _embeds_request(sim, f"e{i}", embeds))
        sim.run()
        scheduler = sim.kvtier_scheduler
        assert scheduler.orchestrator.host.used_slots == 0  # nothing stored
        assert [sim.prefill[f"e{i}"][1] for i in range(2)] == [0, 0]  # nothing loaded


def test_requests_that_read_no_prefix_cache_are_not_looked_up_but_stored(model):
    """A request with prompt logprobs (vLLM sets ``skip_reading_prefix_cache``: its prompt's logprobs
    need every token computed) is never looked up: vLLM's scheduler drops any hit of it, and vLLM's
    own offloading does not look it up. No lookup counted, nothing held or promoted; its blocks are
    still stored, and a later plain request is served them, bit-exact."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    prompts = prompts_of(2, 2, 100)
    ref = reference_outputs(model, prompts, 4)
    first = dict(list(prompts.items())[:1])
    with SimEngine(model, kvtier=HOST) as sim:
        assert tokens_of(sim.generate(first, 4)) == {k: ref[k] for k in first}
        assert sim.reset_prefix_cache()
        stats = sim.kvtier_scheduler.orchestrator.stats
        lookups, used = stats.lookups, sim.kvtier_scheduler.orchestrator.host.used_slots
        params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0, prompt_logprobs=1)
        for i, prompt in enumerate(prompts.values()):  # the first stored, the second not yet
            sim.scheduler.add_request(Request(request_id=f"lp{i}", prompt_token_ids=list(prompt),
                                              sampling_params=params, pooling_params=None,
                                              block_hasher=sim._hasher))  # noqa: SLF001
        sim.run()
        assert [sim.prefill[f"lp{i}"][1] for i in range(2)] == [0, 0]  # nothing loaded
        assert stats.lookups == lookups  # never looked up
        settle(sim)
        assert sim.kvtier_scheduler.orchestrator.host.used_slots > used  # the second prompt's blocks stored
        assert sim.reset_prefix_cache()
        second = sim.generate(renamed(prompts, "-2"), 4)
        assert by_prompt(second, "-2") == ref and all(n >= 64 for n in external(second))
        assert sim.model.kv_mismatches == []


def _embeds_request(sim: SimEngine, req_id: str, embeds):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id=req_id, prompt_token_ids=None, prompt_embeds=embeds,
                   sampling_params=SamplingParams(max_tokens=2, ignore_eos=True), pooling_params=None,
                   block_hasher=sim._hasher)  # noqa: SLF001


def test_failed_loads_are_recomputed_not_failed(model):
    """vLLM 0.32's default kv_load_failure_policy is "fail"; kvtier switches it to "recompute"."""
    with SimEngine(model, kvtier=HOST) as sim:
        assert sim.vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"
        assert sim.scheduler.recompute_kv_load_failures


def test_namespace_names_the_workers_page_format(model, tmp_path):
    with SimEngine(model, kvtier=disk_config(tmp_path / "kv")) as sim:
        namespace = sim.kvtier_scheduler.namespace
        page = namespace.page
        assert page.engine_block_tokens == 16 and page.kv_dtype == "float32" and page.num_layers == 2
        assert namespace.model.weights.startswith("blake3:")
        config = json.loads(next((tmp_path / "kv").glob("model_*/config.json")).read_text())
        assert config["model_name"] == "model" and config["spec_version"] == "kvtier/2"
        files = list((tmp_path / "kv").glob("model_*_r0/*/*/*.bin"))
        assert not files or files[0].stat().st_size == HEADER_LEN + sim.kvtier_scheduler.geometry.layout.slot_bytes


def test_lora_adapters_are_identified_by_their_weights_not_their_name(model, tmp_path):
    """A re-registered adapter name with new weights gets other keys; until an adapter's weights
    are fingerprinted (in the background) its requests are neither loaded nor stored."""
    import time

    import torch
    from safetensors.torch import save_file
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import RequestStatus

    def adapter(folder: Path, value: float) -> Path:
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text('{"r": 8}')
        save_file({"lora_A": torch.full((8, 4), value)}, str(folder / "adapter_model.safetensors"))
        return folder

    first = adapter(tmp_path / "v1" / "support-bot", 1.0)
    second = adapter(tmp_path / "v2" / "support-bot", 2.0)  # same name, other weights
    with SimEngine(model, kvtier=HOST) as sim:
        scheduler = sim.kvtier_scheduler

        def identity(req_id: str, path: Path, int_id: int):
            request = sim.add(req_id, list(range(40)), 1, lora_request=LoRARequest("support-bot", int_id, str(path)))
            sim.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
            return scheduler._request_identity(request)  # noqa: SLF001

        lora, why = identity("a", first, 1)
        assert lora is None and why is not None  # not fingerprinted yet: a miss, never a guess
        deadline = time.monotonic() + 30
        while (result := identity("b", first, 1))[0] is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        first_id, why = result
        assert why is None and first_id.startswith("blake3:")
        while (result := identity("c", second, 2))[0] is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert result[0] != first_id
        for attempt in range(20):  # an adapter that cannot be fingerprinted stays a miss for good
            assert identity(f"d{attempt}", tmp_path / "missing", 3)[0] is None
            time.sleep(0.01)


def test_an_engine_without_prefix_caching_gets_an_inactive_connector(model, tmp_path, caplog):
    """Prefix caching off: vLLM does not resume from cached KV, so kvtier neither loads nor stores
    (no host region, no files) and says so once; outputs stay vLLM's own."""
    prompts = prompts_of(3, 3, 80)
    ref = reference_outputs(model, prompts, 4, enable_prefix_caching=False)
    root = tmp_path / "kv"
    with caplog.at_level("WARNING", logger="kvtier"), \
            SimEngine(model, kvtier=disk_config(root), enable_prefix_caching=False) as sim:
        assert tokens_of(sim.generate(prompts, 4)) == ref
        second = sim.generate(renamed(prompts, "-2"), 4)
        assert by_prompt(second, "-2") == ref
        assert external(second) == [0, 0, 0]
        assert sim.worker._worker is None and sim.connector._scheduler is None  # noqa: SLF001
    assert not list(root.rglob("*.bin"))
    assert sum("kvtier is INACTIVE" in r.getMessage() for r in caplog.records) == 1
    assert "prefix caching is off" in caplog.text


@cpu_and_gpu_defaults
def test_a_request_aborted_after_its_load_failed_leaves_no_unwritten_blocks_to_hit(model, mode):
    """A load fails; the request is aborted before it recomputes its blocks; a request with the
    same prompt must not get a prefix-cache hit on those never-written blocks. With synchronous
    loads it did (vLLM 0.32 caches their blocks at allocation and keeps them after a failed load
    under "recompute"): the second output was wrong. Loads are asynchronous, whose blocks vLLM
    caches only once the load succeeded."""
    prompt = prompts_of(31, 1, 100)["r31-0"]
    ref = reference_outputs(model, {"x": prompt}, 4)["x"]
    with SimEngine(model, kvtier=HOST, **mode) as sim:
        sim.generate({"warm": prompt}, 4)  # kvtier holds the prompt's full blocks
        assert sim.reset_prefix_cache()
        copier = sim.worker._worker.copies.copier  # noqa: SLF001
        real, failed = type(copier).copy.__get__(copier), []

        def fail_once(direction, pages):
            if direction is Direction.LOAD and not failed:
                failed.append(len(pages))
                raise OSError("injected: the load's copy failed")
            return real(direction, pages)

        copier.copy = fail_once
        sim.add("first", prompt, 4)
        sim.step()  # the load fails: vLLM sets the request back to recompute its blocks
        sim.abort("first")  # the client went away before that recompute
        sim.run()
        second = sim.generate({"second": prompt}, 4)
    assert failed and second["second"].tokens == ref
