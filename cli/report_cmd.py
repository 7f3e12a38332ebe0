"""`rankkit report STORE --bench B.parquet`: each method's offline and end-to-end numbers in one table."""

from pathlib import Path

import typer

from .app import app, output
from .options import Format, Overwrite, output_format


@app.command("report")
def report(
    store: Path = typer.Argument(..., help="Capture store with an oracle, e.g. runs/capture.zarr."),
    bench: Path = typer.Option(..., "--bench", help="`rankkit bench --out` parquet of the store's examples."),
    out: Path | None = typer.Option(
        None, "--out", help="Write the per-example join (key example_id) to this parquet (refused if it exists)."
    ),
    overwrite: Overwrite = False,
    as_json: bool = typer.Option(
        False, "--json", help="Print the summary's rows as a JSON list instead (--format json)."
    ),
    table_format: Format = "table",
) -> None:
    """Per method and keep rate: Spearman and needle recall at the method's layer, evidence kept offline
    and online, and accuracy, each with its 95% interval and n."""
    from rankkit.report.joined import join_store_and_bench
    from rankkit.tables import frame_table, rows_text

    shown_as = output_format(table_format, as_json)
    joined = join_store_and_bench(store, bench, out=out, overwrite=overwrite)
    if out is not None:
        typer.echo(f"wrote {out}", err=True)
    if shown_as != "table":
        typer.echo(rows_text(joined.summary.to_dicts(), shown_as))
        return
    title = (
        f"Offline ({store}, ρ and needle recall at each method's own layer) and end to end ({bench}): "
        "means [95% interval] over n examples"
    )
    output().print(frame_table(joined.summary, title))
