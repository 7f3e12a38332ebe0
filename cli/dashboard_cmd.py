"""`rankkit dashboard STORE [--bench bench.parquet] [--diffusion diffusion.parquet] [--out report.html]`."""

from pathlib import Path

import typer

from rankkit.values import comma_list

from .app import app
from .options import NeedleKeep, Overwrite, Workers, keep_or_tokens


@app.command("dashboard")
def dashboard(
    store: Path = typer.Argument(..., help="Capture store, e.g. runs/capture.zarr."),
    bench: list[Path] | None = typer.Option(
        None,
        "--bench",
        help="Rows written by `rankkit bench --out`, for the needle, accuracy-vs-TTFT and report panels; give "
        "it once per run (of any model) to draw several side by side, each method named after its file, model "
        "and weights; only a bench of the store's model is joined with the store's figures (the report panel).",
    ),
    diffusion: Path | None = typer.Option(
        None, "--diffusion", help="Curves written by `rankkit diffusion --out`, for the diffusion panel."
    ),
    out: Path = typer.Option(
        Path("report.html"),
        "--out",
        help="The HTML file to write (self-contained, works offline); refused if it exists, "
        "is a directory, or lies inside the store.",
    ),
    overwrite: Overwrite = False,
    explore: str | None = typer.Option(
        None,
        "--explore",
        help="Comma-separated example ids for the token explorer. (default: all, or an evenly spaced "
        "sample of at most 100 in larger stores, fewer when their score arrays would pass the page's budget)",
    ),
    keep: str | None = typer.Option(
        None,
        "--keep",
        help="Comma-separated keep rates the store is compared at, as compare --keep: the Spearman panel "
        "shows the first, the needle recall panel one heatmap each. (default: 0.1)",
    ),
    budget: str | None = typer.Option(
        None,
        "--budget",
        help="Comma-separated budgets in tokens the store is compared under, e.g. 512,1024 (instead of --keep).",
    ),
    needle_keep: NeedleKeep = None,
    workers: Workers = None,
) -> None:
    """One self-contained HTML report: rankings per layer, ASL curves, token explorer, needles, accuracy vs TTFT,
    offline and end-to-end figures joined, diffusion."""
    from rankkit.eval.parallel import shared_workers
    from rankkit.interrupts import deferred_interrupts

    with shared_workers(store, workers, now=True):  # the workers import while this process does
        with deferred_interrupts():
            from rankkit.report import write_dashboard

        written = write_dashboard(
            store,
            out,
            bench=bench,
            diffusion=diffusion,
            overwrite=overwrite,
            workers=workers,
            explore=comma_list(explore, "--explore") or None,
            keep=keep,
            budget=budget,
            needle_keep=keep_or_tokens(needle_keep, "--needle-keep"),
        )
    typer.echo(written)
