"""`rankkit select STORE --method M`: the tokens a method keeps, computed from a capture store alone."""

from pathlib import Path

import typer

from .app import app
from .options import OFFLINE_METHODS, Format, output_format


@app.command("select")
def select(
    store: Path = typer.Argument(..., help="Capture store, e.g. runs/capture.zarr."),
    method: str = typer.Option(
        ...,
        "--method",
        help=f"A method with its parameters, e.g. claa or claa:aggregation_window=8 ({OFFLINE_METHODS}).",
    ),
    keep: float | None = typer.Option(None, "--keep", help="Keep rate in (0, 1], e.g. 0.1."),
    budget: int | None = typer.Option(
        None, "--budget", help="Tokens to keep, e.g. 2048 (instead of --keep)."
    ),
    layer: int | None = typer.Option(
        None,
        "--layer",
        help="The method's selection layer (default: its own; on models with sliding-window layers the "
        "nearest full-attention layer, ties to the earlier; a layer given here is used as is), or for "
        "per-head KV-only methods the layer whose kept sets are printed (required for them).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (one object per example; --format json)."),
    table_format: Format = "table",
) -> None:
    """Per example: the method's selection layer and the original positions it keeps there."""
    from rankkit.eval.offline import select_store
    from rankkit.tables import rows_text

    shown_as = output_format(table_format, as_json)
    rows = select_store(store, method, keep=keep, budget=budget, layer=layer)
    if shown_as != "table":
        typer.echo(rows_text(rows, shown_as))
        return
    for row in rows:
        typer.echo(
            f"{row['example_id']}  {row['method']}  layer {row['layer']}  "
            f"{row['kept_tokens']} of a budget of {row['budget_tokens']} tokens: {row['selected_positions']}"
        )
