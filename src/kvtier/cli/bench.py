"""The ``kvtier bench`` command (click). Importing this module is cheap (click only); the
benchmark's modules are imported when the command runs."""

from __future__ import annotations

import click

DEFAULT_MODES = "vllm,example,kvtier"
DEFAULT_BLOCK_SIZE = 64
"""Half of vLLM-CPU's 128: a returning chat turn then recomputes ~32 tokens of the previous prompt
instead of ~64, about 110 ms of a ~600 ms TTFT on 2 cores (docs/benchmarks.md)."""
EMBEDDED_KV_BYTES_PER_TOKEN = 46_080  # SmolLM2-135M float32: 2 x 30 layers x 3 KV heads x 64 x 4 bytes
GPU_LIKE = {"workload": "prefix-repetition", "block_size": 32, "prefix_tokens": 4096, "max_model_len": 8192,
            "prefixes": 4, "prompts": 8, "kv_cache_memory_bytes": 512 * 2**20, "kv_offloading_size": 2.0,
            "disk_size": 4.0}
"""``--shape gpu-like``: the nearest vLLM-CPU runs to a GPU server's shape (16-token blocks there, one
offloaded chunk per block, 8k-100k-token prompts): 32-token blocks (vLLM-CPU's smallest), chunks
of one block (the native modes set no offload block size), 4,096-token documents."""


@click.command(short_help="Benchmark vLLM alone, vLLM's ExampleConnector and kvtier on the same prompts.")
@click.option("--modes", default=DEFAULT_MODES, show_default=True,
              help="Comma-separated modes, each run on its own fresh server, in this order: "
                   "vllm (no connector), example (vLLM's ExampleConnector), kvtier (host + disk), "
                   "kvtier-redis (a fresh engine with host + Redis after a first engine filled a loopback "
                   "redis-server: a new node joining a fleet; needs redis-server installed), kvtier-node (a second "
                   "replica on the same node: server A and then a fresh server B on one kvtier node service, A's "
                   "rounds 1 and 2 and B's round 1, then an embedded kvtier server's rounds 1 and 2 for reference; "
                   "each round is a column 'kvtier-node:<round>'), floor (vLLM "
                   "alone with a KV space holding the whole workload and 32-token blocks: the TTFT of a "
                   "returning turn that computes only its new tokens; a timing reference, outputs not compared); "
                   "vLLM's own OffloadingConnector with kvtier's KVTierOffloadingSpec: native-cpu (its CPU tier "
                   "alone), native-fs (+ vLLM's fs tier), native-kvtier-disk (+ kvtier_disk), native-kvtier-redis "
                   "(+ kvtier_redis on a loopback redis-server); native-fs-restart, native-kvtier-disk-restart, "
                   "native-kvtier-redis-restart: a fresh engine on the root (server) a first engine warmed.")
@click.option("--base-url", default=None, metavar="URL",
              help="Benchmark this already-running OpenAI-compatible server instead (mode 'external').")
@click.option("--node", default=None, type=click.Path(dir_okay=False), metavar="PATH",
              help="kvtier-node mode: attach its servers to this running kvtier node service instead of starting "
                   "one (its pool should not hold the workload yet, or round 1 measures hits).")
@click.option("--model", default=None, help="Model to serve [default: the embedded SmolLM2-135M-Instruct].")
@click.option("--workload", type=click.Choice(["multi-turn", "prefix-repetition", "unique"]),
              default="multi-turn", show_default=True,
              help="multi-turn: chat sessions resending the transcript (each opens with a long document); "
                   "prefix-repetition: shared documents + unique questions, in rounds; unique: no reuse at all.")
@click.option("--prefixes", default=6, show_default=True, help="prefix-repetition: shared documents.")
@click.option("--prefix-tokens", default=1024, show_default=True,
              help="prefix-repetition: tokens per document; unique: prompt tokens (plus --suffix-tokens).")
@click.option("--suffix-tokens", default=32, show_default=True, help="prefix-repetition: tokens of each unique question.")
@click.option("--prompts", default=24, show_default=True, help="prefix-repetition / unique: number of requests.")
@click.option("--sessions", default=4, show_default=True, help="multi-turn: conversations.")
@click.option("--turns", default=4, show_default=True, help="multi-turn: turns per conversation.")
@click.option("--context-tokens", default=1536, show_default=True, help="multi-turn: document opening each session.")
@click.option("--message-tokens", default=48, show_default=True, help="multi-turn: tokens per user message.")
@click.option("--output-tokens", default=16, show_default=True, help="Tokens generated per request (ignore_eos).")
@click.option("--concurrency", default=None, type=click.IntRange(min=1),
              help="Requests in flight at once [default: 1 for multi-turn (one conversation at a time, so "
                   "TTFT measures the cache rather than waiting behind another prompt's prefill), 2 otherwise].")
@click.option("--seed", default=0, show_default=True, help="Workload seed (and vLLM's --seed).")
@click.option("--kv-cache-memory-bytes", default=128 * 2**20, show_default=True,
              help="vLLM's own KV space (small, so returning prefixes have left it).")
@click.option("--max-model-len", default=2048, show_default=True)
@click.option("--block-size", default=DEFAULT_BLOCK_SIZE, show_default=True, type=click.IntRange(min=0),
              help="vLLM's KV block size in tokens, the same for every mode (vLLM-CPU takes multiples of 32; "
                   "0: vLLM's default, 128 on CPU). Prefix caches reuse only whole blocks, so a returning "
                   "prompt recomputes the previous prompt's last, partial block: half a block on average.")
@click.option("--kv-offloading-size", default=1.0, show_default=True, metavar="GiB",
              help="kvtier modes: host tier; native modes: vLLM's CPU tier (cpu_bytes_to_use).")
@click.option("--disk-size", default=2.0, show_default=True, metavar="GiB",
              help="kvtier mode and native-kvtier-disk: disk tier (temp dir).")
@click.option("--redis-size", default=2.0, show_default=True, metavar="GiB",
              help="kvtier-redis mode: maxmemory of its loopback redis-server (allkeys-lru).")
@click.option("--kv-config", default=None, metavar="JSON",
              help="kvtier modes: more kvtier keys, as `kvtier serve --kv-config` takes them "
                   "(e.g. '{\"offload_prompt_only\": true}').")
@click.option("--kv-bytes-per-token", default=EMBEDDED_KV_BYTES_PER_TOKEN, show_default=True,
              help="KV bytes per token of the model (for the footprint check; default: embedded model).")
@click.option("--shape", type=click.Choice(["default", "gpu-like"]), default="default", show_default=True,
              help="gpu-like: the nearest this machine runs to a GPU server's shape (one offloaded chunk per "
                   "32-token block, 4,096-token documents): --workload prefix-repetition --block-size 32 "
                   "--prefix-tokens 4096 --max-model-len 8192 --prefixes 4 --prompts 8 --kv-cache-memory-bytes "
                   "512 MiB --kv-offloading-size 2 --disk-size 4, each unless given.")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="Output folder, created with its missing parents if need be; checked before any server "
                   "starts [default: ./bench-results/<timestamp>/].")
@click.option("--save-trace", default=None, type=click.Path(dir_okay=False), metavar="FILE",
              help="Also write the workload as a trace for kvtier plan --trace: one request per line, its prompt "
                   "and output token ids as the server saw them, in the order sent (the kvtier mode's requests, "
                   "else the first mode that finished). Its folder must exist (checked before any server starts).")
@click.option("--startup-timeout", default=600.0, show_default=True, help="Seconds to wait for /health.")
@click.option("--request-timeout", default=600.0, show_default=True, help="Seconds per request.")
@click.pass_context
def bench(ctx: click.Context, **opts) -> None:
    """Run one workload against each mode's fresh server (same prompts, greedy, streamed) and compare
    TTFT, latency, throughput, prompt tokens by cache source and kvtier's transfers; check that
    every mode generated the same tokens.

    \b
    Writes results.json, bench.png and the server logs to --out, prints a table, and prints a
    one-line JSON summary as the last line of stdout. Exit code 1 if a mode failed or outputs differ.
    """
    from kvtier.bench.command import run_command

    check_outputs(opts["out_dir"], opts["save_trace"])
    given = {name for name in opts if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE}
    raise SystemExit(run_command(shaped(opts, given)))


def check_outputs(out_dir: str | None, save_trace: str | None) -> None:
    """Usage errors, before any server starts, for outputs the run could not write at its end:
    ``--out`` must be a directory this user writes in or one it can create (with its missing
    parents, as --help says); ``--save-trace`` a file in a folder that already exists (none is created
    for it). :mod:`kvtier.core.dirs` says why, naming the path."""
    from kvtier.core.dirs import dir_problem, output_file_problem

    if out_dir is not None:
        problem = dir_problem(out_dir)
        if problem is not None:
            raise click.BadParameter(f"{out_dir} {problem}", param_hint="'--out'")
    if save_trace is not None:
        problem = output_file_problem(save_trace)
        if problem is not None:
            raise click.BadParameter(f"{save_trace} {problem}", param_hint="'--save-trace'")


def shaped(opts: dict, given: set[str]) -> dict:
    """``opts`` with ``--shape``'s settings applied to the options not in ``given`` (set by the user)."""
    opts = dict(opts)
    if opts.pop("shape") == "gpu-like":
        opts.update({name: value for name, value in GPU_LIKE.items() if name not in given})
    return opts
