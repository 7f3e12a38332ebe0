"""`rankkit dashboard STORE [--bench bench.parquet] [--diffusion diffusion.parquet] [--out report.html]`."""

from pathlib import Path

import typer

from .app import app


@app.command("dashboard")
def dashboard(
    store: Path = typer.Argument(..., help="Capture store, e.g. runs/capture.zarr."),
    bench: Path | None = typer.Option(
        None,
        "--bench",
        help="Rows written by `rankkit bench --out`, for the needle and accuracy-vs-TTFT panels.",
    ),
    diffusion: Path | None = typer.Option(
        None, "--diffusion", help="Curves written by `rankkit diffusion --out`, for the diffusion panel."
    ),
    out: Path = typer.Option(
        Path("report.html"), "--out", help="The HTML file to write (self-contained, works offline)."
    ),
    explore: str | None = typer.Option(
        None,
        "--explore",
        help="Comma-separated example ids for the token explorer. (default: all, or an evenly spaced "
        "sample of 100 in larger stores)",
    ),
    workers: int | None = typer.Option(
        None,
        "--workers",
        help="Processes sharing the examples; the page does not depend on it. (default: CPU count)",
    ),
) -> None:
    """One self-contained HTML report: rankings per layer, ASL curves, token explorer, needles, accuracy vs TTFT, diffusion."""
    from rankkit.report import write_dashboard

    typer.echo(
        write_dashboard(
            store,
            out,
            bench=bench,
            diffusion=diffusion,
            workers=workers,
            explore=[name for name in (explore or "").split(",") if name] or None,
        )
    )
