"""`rankkit report STORE --bench B.parquet`: each method's offline and end-to-end numbers in one table."""

from pathlib import Path

import typer

from .app import app


@app.command("report")
def report(
    store: Path = typer.Argument(..., help="Capture store with an oracle, e.g. runs/capture.zarr."),
    bench: Path = typer.Option(..., "--bench", help="`rankkit bench --out` parquet of the store's examples."),
    out: Path | None = typer.Option(
        None, "--out", help="Write the per-example join (key example_id) to this parquet."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON (one object per row)."),
) -> None:
    """Per method and keep rate: Spearman and needle recall at the method's layer, evidence kept offline
    and online, and accuracy, each with its 95% interval and n."""
    from rankkit import outputs
    from rankkit.report.joined import join_store_and_bench
    from rankkit.report.tables import json_text

    joined = join_store_and_bench(store, bench)
    if out is not None:
        outputs.write_parquet(joined.per_example, out)
    if as_json:
        typer.echo(json_text(joined.summary.to_dicts()))
        return
    import polars as pl

    with pl.Config(tbl_cols=-1, tbl_rows=-1):
        typer.echo(str(joined.summary))
