"""Unit tests of ``kvtier bench``: workloads, the streaming client's parsing, the request driver
(against an in-process fake server), /metrics parsing on a real capture, stats, the output
comparison, the report and the server commands. No vLLM server is started here."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import click
import httpx
import pytest

from kvtier.bench import workloads as wl
from kvtier.bench.client import Completion, apply_chunk, completion_body
from kvtier.bench.driver import RequestResult, WorkloadRun, run_workload
from kvtier.bench.metrics import CacheSummary, by_label, diff, parse_counters, summarize, total
from kvtier.bench.stats import compare_outputs, goals, mode_stats, percentile

FIXTURES = Path(__file__).parent / "fixtures"
KV_BYTES_PER_TOKEN = 46_080
VLLM_KV = 128 * 2**20


# ---------------------------------------------------------------- workloads

def test_workloads_are_deterministic():
    for make in (wl.prefix_repetition, wl.multi_turn, wl.unique):
        assert make() == make()
        assert make(seed=1) != make(seed=0)
    assert wl.prefix_repetition(seed=1).requests[0].prompt != wl.prefix_repetition(seed=0).requests[0].prompt


def test_prefix_repetition_structure():
    w = wl.prefix_repetition(num_prefixes=6, num_prompts=24, seed=3)
    assert len(w.requests) == 24 and w.concurrency == 2
    assert len({r.id for r in w.requests}) == 24
    assert len({r.prompt for r in w.requests}) == 24  # unique suffixes
    order = [r.group for r in w.requests[:6]]
    assert sorted(order) == list(range(6))  # round 0 is a permutation of the prefixes
    for i, r in enumerate(w.requests):
        assert r.group == order[i % 6] and r.round == i // 6
        assert r.returning == (i >= 6)  # every prefix's first use comes before its reuses
        assert r.prompt.startswith(f"Document {r.group}:\n")
        assert r.after is None and r.max_tokens == 16
    # every use of a prefix carries the same document text
    documents = {}
    for r in w.requests:
        documents.setdefault(r.group, r.prompt.split("\n\nQuestion ")[0])
        assert r.prompt.startswith(documents[r.group])
    assert len(set(documents.values())) == 6
    # reuse distance: all other prefixes pass between two uses of one prefix
    last_seen = {}
    for i, r in enumerate(w.requests):
        if r.group in last_seen:
            assert i - last_seen[r.group] == 6
        last_seen[r.group] = i


def test_prefix_repetition_partial_last_round_and_validation():
    w = wl.prefix_repetition(num_prefixes=4, num_prompts=6)
    assert [r.round for r in w.requests] == [0, 0, 0, 0, 1, 1]
    assert wl.prefix_repetition(num_prefixes=8, num_prompts=3).reusable_tokens == 3 * 1024
    with pytest.raises(ValueError, match="num_prefixes"):
        wl.prefix_repetition(num_prefixes=0)
    with pytest.raises(ValueError, match="concurrency"):
        wl.multi_turn(concurrency=0)


def test_default_footprint_is_at_least_twice_vllm_kv_and_fits_the_tiers():
    w = wl.prefix_repetition()
    assert w.reusable_tokens == 6 * 1024
    footprint = w.footprint_bytes(KV_BYTES_PER_TOKEN)
    assert footprint == 6 * 1024 * 46_080 == 283_115_520
    assert footprint >= 2 * VLLM_KV
    assert footprint <= 1 * 2**30  # the default kvtier host tier (1 GiB) holds it all
    m = wl.multi_turn()
    assert 2 * VLLM_KV <= m.footprint_bytes(KV_BYTES_PER_TOKEN) <= 1 * 2**30
    longest = 1536 + 4 * (48 + 16) + 64  # the last turn's prompt, with headers, plus its answer
    assert longest <= 2048  # the bench's default --max-model-len


def test_default_concurrency_depends_on_the_workload():
    from kvtier.bench.command import make_workload

    opts = dict(output_tokens=16, concurrency=None, seed=0, sessions=2, turns=2, context_tokens=8, message_tokens=4,
                prefixes=2, prefix_tokens=8, suffix_tokens=4, prompts=2)
    assert make_workload({**opts, "workload": "multi-turn"}).concurrency == 1
    assert make_workload({**opts, "workload": "prefix-repetition"}).concurrency == 2
    assert make_workload({**opts, "workload": "unique"}).concurrency == 2
    assert make_workload({**opts, "workload": "multi-turn", "concurrency": 3}).concurrency == 3
    assert wl.unique().reusable_tokens == 0


def test_words_for_tokens():
    assert wl.words_for(1) == 1
    assert wl.words_for(1060) == 1000
    assert wl.words_for(0) == 1


def test_prompt_lengths_match_the_tokenizer():
    """The word-to-token ratio holds on SmolLM2's real tokenizer (skipped if the model is not built)."""
    tokenizers = pytest.importorskip("tokenizers")
    from kvtier.models.default import DEFAULT_MODEL_NAME, default_cache_dir

    path = default_cache_dir() / "models" / f"{DEFAULT_MODEL_NAME}-float32" / "tokenizer.json"
    if not path.is_file():
        pytest.skip("embedded model not converted")
    tok = tokenizers.Tokenizer.from_file(str(path))
    w = wl.prefix_repetition(num_prefixes=2, num_prompts=2, prefix_tokens=1024, suffix_tokens=32)
    for r in w.requests:
        n = len(tok.encode(r.prompt).ids)
        assert 1024 * 0.95 <= n - 32 <= 1024 * 1.1, n


def test_multi_turn_structure():
    w = wl.multi_turn(sessions=3, turns=4, seed=5)
    ids = [r.id for r in w.requests]
    assert ids[:3] == ["s000t000", "s001t000", "s002t000"]  # turn-major: sessions interleave
    position = {r.id: i for i, r in enumerate(w.requests)}
    for r in w.requests:
        if r.round == 0:
            assert r.after is None and not r.returning
            assert r.prompt.startswith(f"Document {r.group}:\n") and r.prompt.endswith("\nAssistant:")
        else:
            assert r.after == f"s{r.group:03d}t{r.round - 1:03d}" and r.returning
            assert position[r.after] < position[r.id]  # a dependency always comes earlier
            assert r.prompt.startswith("\nUser: ") and r.prompt.endswith("\nAssistant:")
    first, second = w.requests[0], w.requests[3]
    assert second.after == first.id
    transcript = wl.full_prompt(second, first.prompt, " an answer.")
    assert transcript == first.prompt + " an answer." + second.prompt
    assert wl.full_prompt(first, None, None) == first.prompt
    with pytest.raises(ValueError, match="needs the prompt and answer"):
        wl.full_prompt(second, None, None)


def test_unique_prompts_share_no_block():
    w = wl.unique(num_prompts=10)
    prompts = [r.prompt for r in w.requests]
    assert len(set(prompts)) == 10
    assert all(not r.returning for r in w.requests)
    # they differ within the first few characters (the document number), so no KV block is shared
    assert len({p[:12] for p in prompts}) == 10


def test_workload_json_leaves_prompts_out():
    data = wl.multi_turn(sessions=2, turns=2).to_json()
    assert data["num_requests"] == 4 and "prompt" not in data["requests"][0]
    json.dumps(data)


# ---------------------------------------------------------------- client and driver

def test_completion_body_is_greedy_streamed_and_fixed_length():
    body = completion_body("m", "p", 7)
    assert body["temperature"] == 0 and body["stream"] and body["ignore_eos"] and body["max_tokens"] == 7
    assert body["stream_options"] == {"include_usage": True} and body["return_token_ids"]


def test_apply_chunk_real_stream():
    # chunks as vLLM 0.32 streams them (captured), with the prompt ids chunk first
    result = Completion(start=10.0)
    apply_chunk(result, {"choices": [{"index": 0, "text": "", "token_ids": [], "prompt_token_ids": [1, 2]}]}, 10.5)
    assert result.first_token is None
    apply_chunk(result, {"choices": [{"index": 0, "text": " about", "token_ids": [563], "finish_reason": None}]}, 11.0)
    apply_chunk(result, {"choices": [{"index": 0, "text": " a", "token_ids": [253], "finish_reason": "length"}]}, 11.2)
    apply_chunk(result, {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6,
                                                   "prompt_tokens_details": {"cached_tokens": 0}}}, 11.3)
    result.end = 11.4
    assert result.ttft_s == pytest.approx(1.0) and result.latency_s == pytest.approx(1.4)
    assert result.text == " about a" and result.token_ids == [563, 253] and result.finish_reason == "length"
    assert (result.prompt_tokens, result.output_tokens, result.cached_tokens) == (4, 2, 0)
    assert result.prompt_token_ids == [1, 2]  # what --save-trace writes


def test_save_trace_writes_what_plan_trace_replays(tmp_path):
    """--save-trace: the kvtier mode's requests in the order sent, prompt and answer token ids as
    the server saw them; failed requests left out; read back by kvtier plan --trace."""
    from kvtier.bench.measure import ModeRun
    from kvtier.bench.trace import trace_mode, write_trace
    from kvtier.replay.trace import read_trace

    def result(id_: str, start: float, prompt: list[int] | None, error: str | None = None) -> RequestResult:
        return RequestResult(id=id_, group=0, round=0, returning=False, prompt_chars=5, prompt_tokens=3,
                             cached_tokens=0, output_tokens=2, output_text="x", output_token_ids=[9, 8],
                             start_s=start, ttft_s=0.1, latency_s=0.2, error=error, prompt_token_ids=prompt)

    vllm = ModeRun("vllm", "vllm", run=WorkloadRun([result("a", 0.0, [1, 2, 3])], 1.0))
    kvtier = ModeRun("kvtier", "kvtier", run=WorkloadRun(
        [result("b", 2.0, [4, 5]), result("a", 1.0, [1, 2, 3]), result("c", 3.0, None, error="HTTP 500")], 1.0))
    assert trace_mode([vllm, kvtier]) is kvtier
    assert trace_mode([vllm, ModeRun("x", "x", error="boom")]) is vllm
    assert write_trace(tmp_path / "t.jsonl", kvtier) == 2
    trace = read_trace(tmp_path / "t.jsonl")
    assert [list(r.prompt) for r in trace.requests] == [[1, 2, 3], [4, 5]]  # in the order sent
    assert [list(r.output) for r in trace.requests] == [[9, 8], [9, 8]] and trace.ordered_by_time
    assert "prompt_token_ids" not in json.dumps(kvtier.run.results[0].to_json())  # results.json stays lean


def _fake_server(log: list[str]) -> httpx.MockTransport:
    """An OpenAI-like streaming server: the answer is ' <' + the prompt's last word + '>'."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        log.append(body["prompt"])
        if "FAIL" in body["prompt"]:
            return httpx.Response(500, text="boom")
        word = body["prompt"].split()[-1]
        chunks = [
            {"choices": [{"index": 0, "text": f" <{word}>", "token_ids": [len(word)], "finish_reason": "length"}]},
            {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1,
                                      "prompt_tokens_details": {"cached_tokens": 3}}},
        ]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def test_driver_multi_turn_sends_transcripts_in_dependency_order():
    w = wl.multi_turn(sessions=3, turns=3, context_tokens=8, message_tokens=4, output_tokens=1, concurrency=2)
    sent: list[str] = []
    done: list[str] = []
    run = asyncio.run(run_workload(w, "http://fake", "m", on_done=lambda r: done.append(r.id),
                                   transport=_fake_server(sent)))
    assert [r.id for r in run.results] == [r.id for r in w.requests]  # results in workload order
    assert sorted(done) == sorted(r.id for r in w.requests) and len(sent) == 9
    by_id = {r.id: r for r in run.results}
    # the full prompt each request was sent with (each ends with its own, unique, new message)
    full = {spec.id: next(p for p in sent if p.endswith(spec.prompt)) for spec in w.requests}
    for spec in w.requests:
        result = by_id[spec.id]
        assert result.error is None and result.cached_tokens == 3 and result.output_token_ids
        assert result.prompt_chars == len(full[spec.id])
        if spec.after:
            prev = by_id[spec.after]
            assert done.index(spec.after) < done.index(spec.id)  # sent only after that answer arrived
            assert full[spec.id] == full[spec.after] + prev.output_text + spec.prompt
        else:
            assert full[spec.id] == spec.prompt
    assert run.wall_s > 0


def test_driver_failed_turn_skips_later_turns():
    w = wl.multi_turn(sessions=1, turns=3, context_tokens=4, message_tokens=2, output_tokens=1)
    w = wl.Workload(w.name, (w.requests[0].__class__(**{**w.requests[0].__dict__, "prompt": "FAIL"}), *w.requests[1:]),
                    w.concurrency, w.reusable_tokens)
    run = asyncio.run(run_workload(w, "http://fake", "m", transport=_fake_server([])))
    errors = [r.error for r in run.results]
    assert errors[0].startswith("HTTP 500") and errors[1] == "skipped: s000t000 failed" and errors[2].startswith("skipped")


# ---------------------------------------------------------------- metrics

def test_parse_real_metrics_capture():
    """Counters of a real vLLM 0.32 + kvtier server (/metrics before and after 12 requests served
    from kvtier's host and disk tiers after a restart)."""
    before = parse_counters((FIXTURES / "bench_metrics_kvtier_before.txt").read_text())
    after = parse_counters((FIXTURES / "bench_metrics_kvtier_after.txt").read_text())
    assert all(name.endswith("_total") for name, _ in after)  # no _created samples
    delta = diff(before, after)
    s = summarize(delta)
    assert s.prompt_tokens == 12_865 and s.computed_tokens == 577
    assert s.cached_by_source["host"] == 7_296 and s.cached_by_source["disk"] == 4_992
    assert s.cached_by_source["device"] == 0 and s.cached_tokens == 12_288
    assert list(s.cached_by_source)[:3] == ["device", "host", "disk"]
    assert s.transfer_bytes["disk_to_host"] == 283_115_520  # 6 prefixes x 8 blocks x 5.9 MB
    assert s.transfer_bytes["host_to_engine"] == 566_231_040
    assert s.bandwidth()["disk_to_host"] == pytest.approx(283_115_520 / s.transfer_seconds["disk_to_host"])
    assert "engine_to_host" not in s.bandwidth()  # nothing moved that way
    assert total(after, "vllm:prompt_tokens_total") == total(before, "vllm:prompt_tokens_total") + 12_865
    json.dumps(s.to_json())


def test_metrics_helpers():
    text = """# HELP c_total x
# TYPE c_total counter
c_total{engine="0",source="a"} 2.0
c_total{engine="1",source="a"} 3.0
c_total{engine="0",source="b"} 1.0
c_created{engine="0",source="a"} 123.0
# HELP g x
# TYPE g gauge
g 5.0
"""
    counters = parse_counters(text)
    assert len(counters) == 3
    assert total(counters, "c_total") == 6 and total(counters, "c_total", source="a") == 5
    assert by_label(counters, "c_total", "source") == {"a": 5, "b": 1}
    assert diff({}, counters) == counters  # a counter absent before counts from zero
    assert summarize({}).cached_by_source["host"] == 0 and CacheSummary().bandwidth() == {}


# ---------------------------------------------------------------- stats, comparison, goals

def test_percentile():
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert percentile(range(1, 101), 99) == pytest.approx(99.01)
    assert percentile([1, 2], 0) == 1 and percentile([1, 2], 100) == 2
    with pytest.raises(ValueError):
        percentile([1], 101)


def _result(id_: str, ttft: float | None, returning: bool, tokens=(1, 2, 3), error=None, text=None, latency=2.0):
    return RequestResult(id=id_, group=0, round=int(returning), returning=returning, prompt_chars=10,
                         prompt_tokens=100, cached_tokens=64 if returning else 0, output_tokens=len(tokens),
                         output_text=text if text is not None else " ".join(map(str, tokens)),
                         output_token_ids=list(tokens), start_s=0.0, ttft_s=ttft, latency_s=latency, error=error)


def test_mode_stats():
    results = [_result("a", 1.0, False), _result("b", 3.0, False), _result("c", 0.1, True),
               _result("d", 0.3, True), _result("e", None, True, error="HTTP 500")]
    s = mode_stats(results, wall_s=8.0)
    assert s["requests"] == 5 and s["errors"] == 1
    assert s["ttft_p50_s"] == pytest.approx(0.65) and s["ttft_returning_p50_s"] == pytest.approx(0.2)
    assert s["ttft_first_use_p50_s"] == pytest.approx(2.0)
    assert s["requests_per_s"] == pytest.approx(0.5) and s["output_tokens_per_s"] == pytest.approx(12 / 8)
    assert s["usage_cached_tokens"] == 128 and s["usage_prompt_tokens"] == 400
    assert s["latency_p50_s"] == 2.0 and s["output_tokens_per_s_p50"] == pytest.approx(1.5)


def test_compare_outputs():
    same = [_result("a", 1, False), _result("b", 1, True, tokens=(4, 5))]
    check = compare_outputs({"vllm": same, "example": list(same), "kvtier": list(same)})
    assert check.identical and check.compared == 4 and check.reference == "vllm"
    differs = [_result("a", 1, False), _result("b", 1, True, tokens=(4, 6))]
    check = compare_outputs({"vllm": same, "kvtier": differs})
    assert not check.identical and len(check.mismatches) == 1
    m = check.mismatches[0]
    assert (m.id, m.mode, m.reference, m.first_difference) == ("b", "kvtier", "vllm", 1)
    # requests in the reference's order: the first mismatch listed is the first differing request
    many = [_result("a", 1, False, tokens=(9,)), _result("b", 1, True, tokens=(9,))]
    assert [m.id for m in compare_outputs({"vllm": same, "kvtier": many}).mismatches] == ["a", "b"]
    # an errored request is reported missing, not compared
    check = compare_outputs({"vllm": same, "kvtier": [same[0], _result("b", None, True, error="x")]})
    assert not check.identical and check.missing == ["kvtier:b"] and check.compared == 1
    # text fallback when one server returns no token ids
    no_ids = [_result("a", 1, False, tokens=(), text="1 2 3"), _result("b", 1, True, tokens=(), text="4 5")]
    assert compare_outputs({"vllm": same, "external": no_ids}).identical
    # nothing compared is not "identical": a one-mode run proves nothing about outputs
    assert compare_outputs({}).identical is None
    assert compare_outputs({"vllm": same}).compared == 0 and compare_outputs({"vllm": same}).identical is None


def test_goals():
    per_mode = {"vllm": {"ttft_returning_p50_s": 4.0, "requests_per_s": 1.0},
                "example": {"ttft_returning_p50_s": 4.4, "requests_per_s": 0.9},
                "kvtier": {"ttft_returning_p50_s": 0.3, "requests_per_s": 0.97}}
    g = goals("prefix-repetition", per_mode, True)
    assert g["ttft_returning_p50_vs_vllm"] == pytest.approx(0.075) and g["ttft_returning_p50_vs_vllm_ok"]
    assert g["ttft_returning_p50_vs_example_ok"] and g["outputs_identical"]
    per_mode["kvtier"]["ttft_returning_p50_s"] = 0.5
    assert not goals("multi-turn", per_mode, True)["ttft_returning_p50_vs_vllm_ok"]
    u = goals("unique", per_mode, False)
    assert u["throughput_vs_vllm"] == pytest.approx(0.97) and u["throughput_vs_vllm_ok"] and not u["outputs_identical"]
    assert goals("unique", {"vllm": per_mode["vllm"]}, True) == {"outputs_identical": True}
    per_mode["kvtier-redis"] = {"ttft_returning_p50_s": 0.7}
    fleet = goals("multi-turn", per_mode, True)
    assert fleet["ttft_redis_vs_host_p50"] == pytest.approx(1.4) and fleet["ttft_redis_vs_host_p50_ok"]
    per_mode["kvtier-redis"] = {"ttft_returning_p50_s": 0.8}
    assert not goals("multi-turn", per_mode, True)["ttft_redis_vs_host_p50_ok"]
    per_mode["floor"] = {"ttft_returning_p50_s": 0.4}
    floor = goals("multi-turn", per_mode, True)
    assert floor["ttft_returning_p50_vs_floor"] == pytest.approx(1.25) and floor["ttft_returning_p50_vs_floor_ok"]


def test_fleet_workload_is_the_first_use_of_every_prefix_all_returning():
    from kvtier.bench.workloads import fleet_workload

    for workload in (wl.multi_turn(sessions=3, turns=3, context_tokens=64, message_tokens=8, output_tokens=2),
                     wl.prefix_repetition(num_prefixes=2, prefix_tokens=64, suffix_tokens=8, num_prompts=6,
                                          output_tokens=2)):
        fleet = fleet_workload(workload)
        assert [r.id for r in fleet.requests] == [r.id for r in workload.requests if r.round == 0]
        assert len({r.group for r in fleet.requests}) == len(fleet.requests) and all(r.returning for r in fleet.requests)
        assert all(r.after is None for r in fleet.requests)


def test_bench_redis_server_starts_on_loopback_with_lru_and_stops(tmp_path):
    import redis

    from kvtier.bench.redis_server import LocalRedis

    server = LocalRedis.start(tmp_path / "redis", 64 * 2**20)
    try:
        client = redis.Redis.from_url(server.url)
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
        assert client.config_get("bind")["bind"] == "127.0.0.1" and client.config_get("save")["save"] == ""
        assert int(client.config_get("maxmemory")["maxmemory"]) == 64 * 2**20
    finally:
        server.stop()
    assert server.process.poll() is not None


# ---------------------------------------------------------------- report and figure

def test_report_json_table_summary_and_figure(tmp_path):
    from rich.console import Console

    from kvtier.bench.driver import WorkloadRun
    from kvtier.bench.plot import write_figure
    from kvtier.bench.report import build_results, comparison_table, summary, verdict_lines, write_json
    from kvtier.bench.runner import ModeRun

    w = wl.prefix_repetition(num_prefixes=2, num_prompts=4)
    results = [_result(r.id, 3.0 if not r.returning else 2.5, r.returning) for r in w.requests]
    fast = [_result(r.id, 3.0 if not r.returning else 0.2, r.returning) for r in w.requests]
    runs = [
        ModeRun("vllm", "vLLM alone", run=WorkloadRun(results, 10.0),
                cache=CacheSummary(400, 400, {"device": 0.0, "host": 0.0})),
        ModeRun("example", "ExampleConnector", error="example server exited with code 1 during start-up; log: x"),
        ModeRun("kvtier", "kvtier", run=WorkloadRun(fast, 5.0),
                cache=CacheSummary(400, 272, {"device": 0.0, "host": 128.0}, {"engine_to_host": 5.9e6},
                                   {"engine_to_host": 0.01})),
    ]
    data = build_results(w, runs, 60.0, {"kv_cache_memory_bytes": VLLM_KV}, KV_BYTES_PER_TOKEN)
    assert data["workload"]["footprint"]["reusable_bytes"] == 2 * 1024 * KV_BYTES_PER_TOKEN
    assert data["outputs"]["identical"] and data["modes"]["example"]["stats"] is None
    assert data["goals"]["ttft_returning_p50_vs_vllm"] == pytest.approx(0.08)
    assert data["modes"]["kvtier"]["cache"]["bandwidth_bytes_per_s"]["engine_to_host"] == pytest.approx(5.9e8)
    write_json(tmp_path / "results.json", data)
    assert json.loads((tmp_path / "results.json").read_text())["modes"]["vllm"]["requests"][0]["id"] == "r0000"

    console = Console(width=150, record=True)
    console.print(comparison_table(data))
    text = console.export_text()
    assert "TTFT p50, returning" in text and "200 ms" in text and "failed" in text and "cached: host" in text
    assert "engine to host" in text and "6 MB @ 0.59 GB/s" in text
    lines = verdict_lines(data)
    assert lines[0].startswith("outputs: identical") and any("NOT met" in line or "met" in line for line in lines)

    figure = write_figure(tmp_path / "bench.png", data)
    assert figure is not None and figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    line = json.dumps(summary(data, tmp_path / "results.json", figure))
    parsed = json.loads(line)
    assert "\n" not in line and parsed["modes"]["kvtier"]["ttft_returning_p50_ms"] == 200.0
    assert parsed["modes"]["example"] is None and parsed["errors"]["example"].startswith("example server exited")
    assert parsed["modes"]["kvtier"]["cached_by_source"] == {"host": 128.0}


# ---------------------------------------------------------------- server commands and CLI

def test_launch_specs(tmp_path, monkeypatch):
    from kvtier.bench.servers import ServerSettings, launch_spec

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    settings = ServerSettings(model=str(tmp_path / "model"))
    specs = {m: launch_spec(m, settings, tmp_path / m, port=18000 + i) for i, m in enumerate(("vllm", "example", "kvtier"))}
    for mode, spec in specs.items():
        argv = spec.argv
        assert argv[0] == sys.executable and "serve" in argv and settings.model in argv
        for flag in ("--enforce-eager", "--enable-prefix-caching", "--enable-prompt-tokens-details"):
            assert flag in argv
        assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(128 * 2**20)
        assert argv[argv.index("--port") + 1] == str(spec.port) and spec.base_url.startswith("http://127.0.0.1:")
        # VLLM_CPU_KVCACHE_SPACE would override --kv-cache-memory-bytes on vLLM-CPU
        assert "VLLM_CPU_KVCACHE_SPACE" not in spec.env
        assert spec.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
        assert spec.env["TMPDIR"] == str(tmp_path / mode) and spec.env["VLLM_CACHE_ROOT"].startswith(str(tmp_path / mode))
    shared = launch_spec("kvtier", replace(settings, vllm_cache_dir=str(tmp_path / "cache")), tmp_path / "k2", port=18009)
    assert shared.env["VLLM_CACHE_ROOT"] == str(tmp_path / "cache")  # a bench run's servers share one
    assert "--kv-transfer-config" not in specs["vllm"].argv
    example = json.loads(specs["example"].argv[specs["example"].argv.index("--kv-transfer-config") + 1])
    assert example["kv_connector"] == "ExampleConnector" and example["kv_role"] == "kv_both"
    assert example["kv_connector_extra_config"]["shared_storage_path"].startswith(str(tmp_path / "example"))
    kvtier = json.loads(specs["kvtier"].argv[specs["kvtier"].argv.index("--kv-transfer-config") + 1])
    assert kvtier["kv_connector"] == "KVTierConnector"
    assert json.dumps(kvtier).count(str(tmp_path / "kvtier" / "kvtier-disk")) == 1
    with pytest.raises(ValueError, match="unknown mode"):
        launch_spec("nope", settings, tmp_path, port=1)
    assert "--block-size" not in specs["vllm"].argv  # None: vLLM's own default
    fleet = launch_spec("kvtier-redis", settings, tmp_path / "fleet", port=18050, redis_url="redis://127.0.0.1:7/0")
    fleet_config = json.loads(fleet.argv[fleet.argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert fleet_config["secondary_tiers"] == [{"type": "redis", "url": "redis://127.0.0.1:7/0"}]
    with pytest.raises(ValueError, match="URL of its redis-server"):
        launch_spec("kvtier-redis", settings, tmp_path / "fleet2", port=18051)
    sized = ServerSettings(model=str(tmp_path / "model"), block_size=64)
    for i, mode in enumerate(("vllm", "example", "kvtier")):  # the same engine block size in every mode
        argv = launch_spec(mode, sized, tmp_path / f"b{mode}", port=18100 + i).argv
        assert argv[argv.index("--block-size") + 1] == "64"
    floor = launch_spec("floor", sized, tmp_path / "floor", port=18200).argv
    assert floor[floor.index("--block-size") + 1] == "32" and "--kv-transfer-config" not in floor
    assert floor[floor.index("--kv-cache-memory-bytes") + 1] == str(2 * 2**30)
    configured = ServerSettings(model=str(tmp_path / "model"), kv_config={"offload_prompt_only": True})
    argv = launch_spec("kvtier", configured, tmp_path / "configured", port=18300).argv
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["offload_prompt_only"] is True


def test_kv_config_flag_is_a_json_object():
    from kvtier.bench.command import parse_kv_config

    assert parse_kv_config(None) is None
    assert parse_kv_config('{"offload_partial_blocks": false}') == {"offload_partial_blocks": False}
    for bad in ("[1]", "{nope"):
        with pytest.raises(click.BadParameter, match="--kv-config|JSON"):
            parse_kv_config(bad)


def test_scratch_folder_stays_short(tmp_path):
    from kvtier.bench.servers import MAX_SOCKET_PATH_CHARS, make_scratch, socket_path_chars

    short_base = Path("/tmp") / "kvb"  # short enough: the folder stays where it was asked for
    short_base.mkdir(exist_ok=True)
    # a 40-character base once passed a fixed 40-character limit, yet the longest mode's name
    # ("kvtier-redis-seed") then made the socket path 117 bytes and vLLM failed to start
    middle_base = Path("/tmp") / ("m" * 35)
    middle_base.mkdir(exist_ok=True)
    long_base = tmp_path / ("x" * 60)
    long_base.mkdir()
    made = []
    try:
        short = make_scratch("kvtier", base=str(short_base))
        made.append(short)
        assert short.parent == short_base
        for mode in ("kvtier", "kvtier-redis-seed"):
            for base in (middle_base, long_base):
                folder = make_scratch(mode, base=str(base))
                made.append(folder)
                assert folder.name.startswith(f"kvtier-bench-{mode}-")
                assert socket_path_chars(str(folder)) <= MAX_SOCKET_PATH_CHARS, folder
        assert made[-1].parent == Path("/tmp")  # the long base was given up for /tmp
    finally:
        for folder in made:
            folder.rmdir()
        middle_base.rmdir()
        short_base.rmdir()


def test_cli_modes_and_help():
    import click
    from click.testing import CliRunner

    from kvtier.bench.command import parse_modes
    from kvtier.cli.main import main

    assert parse_modes("vllm, kvtier") == ["vllm", "kvtier"]
    for bad in ("vllm,foo", "", "kvtier,kvtier"):
        with pytest.raises(click.BadParameter):
            parse_modes(bad)
    result = CliRunner().invoke(main, ["bench", "--help"])
    assert result.exit_code == 0 and "--base-url" in result.output and "--workload" in result.output


def test_bench_modules_do_not_import_vllm():
    code = ("import sys, kvtier.cli.main, kvtier.bench.command, kvtier.bench.runner, kvtier.bench.report; "
            "print(any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_native_modes_launch_vllms_offloading_connector_with_kvtiers_spec(tmp_path):
    from kvtier.bench.native import NATIVE_MODES, RESTART_MODES
    from kvtier.bench.runner import is_seeded
    from kvtier.bench.servers import ServerSettings, launch_spec

    settings = ServerSettings(model=str(tmp_path / "model"), kv_offloading_size_gib=1.0, disk_size_gib=2.0)
    url = "redis://127.0.0.1:7/0"
    tiers = {}
    for i, mode in enumerate(NATIVE_MODES + RESTART_MODES):
        spec = launch_spec(mode, settings, tmp_path / mode, port=18400 + i, redis_url=url)
        config = json.loads(spec.argv[spec.argv.index("--kv-transfer-config") + 1])
        assert config["kv_connector"] == "OffloadingConnector" and config["kv_role"] == "kv_both"
        extra = config["kv_connector_extra_config"]
        assert extra["spec_name"] == "KVTierOffloadingSpec" and extra["spec_module_path"] == "kvtier.vllm.native"
        assert extra["cpu_bytes_to_use"] == 2**30
        tiers[mode] = extra["secondary_tiers"]
        assert is_seeded(mode) == mode.endswith("-restart")
        assert ("restart" in spec.summary) == mode.endswith("-restart")
    root = str(tmp_path / "native-fs" / "native-root")
    assert tiers["native-cpu"] == [] and tiers["native-fs"] == [{"type": "fs", "root_dir": root}]
    assert tiers["native-kvtier-disk"][0]["type"] == "kvtier_disk"
    assert tiers["native-kvtier-disk"][0]["capacity_bytes"] == 2 * 2**30
    assert tiers["native-kvtier-redis-restart"] == [{"type": "kvtier_redis", "url": url}]
    with pytest.raises(ValueError, match="URL of its redis-server"):
        launch_spec("native-kvtier-redis", settings, tmp_path / "r", port=18500)


def test_native_restart_goal_is_kvtier_disk_within_5_percent_of_the_fs_tier():
    per_mode = {"native-fs-restart": {"ttft_returning_p50_s": 0.40},
                "native-kvtier-disk-restart": {"ttft_returning_p50_s": 0.41}}
    g = goals("multi-turn", per_mode, True)
    assert g["ttft_restart_kvtier_disk_vs_native_fs_p50"] == pytest.approx(1.025)
    assert g["ttft_restart_kvtier_disk_vs_native_fs_p50_ok"]
    per_mode["native-kvtier-disk-restart"]["ttft_returning_p50_s"] = 0.43
    assert not goals("multi-turn", per_mode, True)["ttft_restart_kvtier_disk_vs_native_fs_p50_ok"]


def test_the_gpu_like_shape_sets_what_the_user_did_not():
    from kvtier.cli.bench import GPU_LIKE, shaped

    opts = {"shape": "gpu-like", "block_size": 64, "prefix_tokens": 1024, "prompts": 3, "modes": "native-cpu"}
    out = shaped(opts, given={"prompts", "modes", "shape"})
    assert out["block_size"] == 32 and out["prefix_tokens"] == 4096 and out["max_model_len"] == 8192
    assert out["prompts"] == 3 and out["modes"] == "native-cpu" and "shape" not in out
    assert shaped({**opts, "shape": "default"}, given=set()) == {k: v for k, v in opts.items() if k != "shape"}
    assert GPU_LIKE["block_size"] % 32 == 0  # vLLM-CPU takes multiples of 32


# ---------------------------------------------------------------- kvtier-node mode (two servers on one node)
def test_node_mode_plan_attaches_a_and_b_to_one_service_and_keeps_an_embedded_reference(tmp_path):
    from kvtier.bench.node_pair import Phase, Replica, plan
    from kvtier.bench.servers import MODES, NODE_MODE, ServerSettings, launch_spec

    assert NODE_MODE in MODES
    settings = ServerSettings(model=str(tmp_path / "model"), kv_offloading_size_gib=0.5, block_size=64)
    node_plan = plan(settings, tmp_path)
    assert node_plan.socket == tmp_path / "node.sock" and not node_plan.external
    assert node_plan.pool_bytes == 2**30  # room for both engines' caps

    def extra(replica):
        argv = node_plan.specs[replica].argv
        return json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]

    for replica in (Replica.A, Replica.B):
        config = extra(replica)
        assert config["node"] == str(tmp_path / "node.sock") and config["cpu_bytes_to_use"] == 2**29
        assert "secondary_tiers" not in config  # the node's pool is the host tier, nothing of its own
    assert "node" not in extra(Replica.EMBEDDED) and extra(Replica.EMBEDDED)["secondary_tiers"][0]["type"] == "fs"
    ports = {spec.port for spec in node_plan.specs.values()}
    assert len(ports) == 3
    for replica, spec in node_plan.specs.items():
        assert spec.env["VLLM_SERVER_DEV_MODE"] == "1"  # the reset between rounds 1 and 2
        assert spec.env["TMPDIR"] == str(tmp_path / replica.value) and (tmp_path / replica.value).is_dir()
        assert spec.argv[spec.argv.index("--block-size") + 1] == "64"  # the same engine block size everywhere
    argv = node_plan.node_argv()
    assert argv[argv.index("--socket") + 1] == str(tmp_path / "node.sock")
    assert argv[argv.index("--pool-bytes") + 1] == str(2**30)

    assert [p.value for p in Phase] == ["A-compute", "A-pool-hit", "B-from-A", "embedded-compute", "embedded-host-hit"]
    assert [p.server for p in Phase] == [Replica.A, Replica.A, Replica.B, Replica.EMBEDDED, Replica.EMBEDDED]
    assert [p for p in Phase if p.after_reset] == [Phase.A_POOL_HIT, Phase.EMBEDDED_HOST_HIT]
    assert Phase.B_FROM_A.mode == "kvtier-node:B-from-A"

    (tmp_path / "other").mkdir()
    given = plan(settings, tmp_path / "other", node=str(tmp_path / "run" / "n.sock"))
    assert given.external and given.socket == tmp_path / "run" / "n.sock"
    with pytest.raises(ValueError, match="socket of its kvtier node"):
        launch_spec(NODE_MODE, settings, tmp_path / "x")


def test_node_goals_b_over_a_pool_hit_and_embedded_host_hit():
    from kvtier.bench.node_pair import Phase

    def ttft(p50, p90):
        return {"ttft_p50_s": p50, "ttft_p90_s": p90}

    per_mode = {Phase.A_COMPUTE.mode: ttft(1.0, 1.2), Phase.A_POOL_HIT.mode: ttft(0.20, 0.25),
                Phase.B_FROM_A.mode: ttft(0.21, 0.30), Phase.EMBEDDED_HOST_HIT.mode: ttft(0.2, 0.3)}
    out = goals("unique", per_mode, True)
    assert out["ttft_node_b_vs_a_pool_hit_p50"] == pytest.approx(1.05) and out["ttft_node_b_vs_a_pool_hit_p50_ok"]
    assert out["ttft_node_b_vs_a_pool_hit_p90"] == pytest.approx(1.2) and not out["ttft_node_b_vs_a_pool_hit_p90_ok"]
    assert out["ttft_node_b_vs_embedded_host_hit_p50"] == pytest.approx(1.05)
    assert out["ttft_node_b_vs_embedded_host_hit_p90_ok"]
    del per_mode[Phase.B_FROM_A.mode]  # B failed: nothing to judge
    assert not any(k.startswith("ttft_node") for k in goals("unique", per_mode, True))


def test_node_flag_needs_the_node_mode():
    from click.testing import CliRunner

    from kvtier.cli.main import main

    result = CliRunner().invoke(main, ["bench", "--modes", "vllm", "--node", "/tmp/none.sock"])
    assert result.exit_code == 2 and "--node" in result.output and "kvtier-node" in result.output
    help_text = CliRunner().invoke(main, ["bench", "--help"]).output
    assert "kvtier-node" in help_text and "--node PATH" in help_text


def test_node_mode_starts_a_real_service_and_reads_its_counters(tmp_path):
    from kvtier.bench.node_pair import _start_node, node_stats, plan
    from kvtier.bench.servers import ServerSettings

    node_plan = plan(ServerSettings(model="m", kv_offloading_size_gib=1 / 64), tmp_path)
    service = asyncio.run(_start_node(node_plan, tmp_path / "node.log"))
    try:
        stats = node_stats(node_plan.socket)
        assert stats["pool_bytes"] == 2 * 2**30 // 64 and stats["blocks"] == 0 and stats["engines"] == {}
    finally:
        service.terminate()
        service.wait(timeout=30)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("flag, value, why", [
    ("--out", "{file}/results", "{file}/results cannot be created: {file} is not a directory"),
    ("--save-trace", "{tmp}/no/such/folder/t.jsonl", "cannot be written: {tmp}/no/such/folder does not exist"),
    ("--save-trace", "{file}/t.jsonl", "cannot be written: {file} is not a directory"),
])
def test_an_output_that_cannot_be_written_is_refused_before_any_server(tmp_path, flag, value, why):
    """Checked first (rc 2, the path and why), not a traceback at the start or an error after a run of
    minutes; --save-trace's folder is never created. (A closed port as --base-url: nothing is started
    even where the check is missing.)"""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    fill = {"{file}": str(blocker), "{tmp}": str(tmp_path)}
    for key, text in fill.items():
        value, why = value.replace(key, text), why.replace(key, text)
    args = {"--out": str(tmp_path / "out"), flag: value}
    done = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "--base-url",
                           f"http://127.0.0.1:{_free_port()}", "--workload", "unique", "--prompts", "1",
                           "--request-timeout", "5", *[a for pair in args.items() for a in pair]],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and f"Invalid value for '{flag}'" in done.stderr and why in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "no").exists()
