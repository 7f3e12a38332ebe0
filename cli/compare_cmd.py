"""`rankkit compare STORE` and `rankkit variance STORE`: rankings against the oracle, and ASL's rank-variance curves."""

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .app import app


@app.command("compare")
def compare(
    store: Path = typer.Argument(..., help="Capture store, e.g. runs/capture.zarr."),
    oracle: bool = typer.Option(
        True,
        "--oracle/--no-oracle",
        help="Compare with the stored Answer-Informed Oracle; --no-oracle keeps only needle recall "
        "and layer-to-layer Spearman.",
    ),
    layer: int | None = typer.Option(
        None, "--layer", help="Pruning layer l_p the table reports at. (default: half the model's depth)"
    ),
    methods: list[str] | None = typer.Option(
        None,
        "--methods",
        help="Methods to compare, repeated or comma-separated: probe names, gemfilter, fastkv, claa, "
        "specprefill. (default: all the store offers)",
    ),
    out: Path | None = typer.Option(
        None, "--out", help="Write the per-layer frame to this parquet file, the other frames beside it."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the table's rows as a JSON list instead."),
) -> None:
    """Spearman, Kendall, top-k and needle recall of every method against the oracle, layer by layer."""
    from rankkit.eval.compare import compare_store
    from rankkit.report.tables import frame_table

    chosen = [name for entry in methods or [] for name in entry.split(",") if name]
    result = compare_store(store, layer=layer, methods=chosen or None, use_oracle=oracle)
    if out is not None:
        written = result.write(out)
        typer.echo(f"wrote {', '.join(map(str, written))}", err=True)
    if as_json:
        typer.echo(json.dumps(result.summary.to_dicts(), indent=2))
        return
    title = f"Rankings vs oracle, {store}, l_p = {result.pruning_layer}"
    Console().print(frame_table(result.summary.select(_COMPARE_COLUMNS), title))


# The summary columns the table shows, in order (--json and --out carry them all).
_COMPARE_COLUMNS = (
    "method",
    "spearman",
    "mean_spearman",
    "std_spearman",
    "min_spearman",
    "trough_layer",
    "recall_at_10",
    "needle_recall",
    "layer_to_layer",
    "n_examples",
)


def _cell(value: object) -> Text:
    if value is None:  # undefined, e.g. Spearman without an oracle or a layer no tau selects
        return Text("–")
    return Text(f"{value:.3f}" if isinstance(value, float) else str(value))


@app.command("variance")
def variance(
    store: Path = typer.Argument(..., help="Capture store, e.g. runs/capture.zarr."),
    probe: str = typer.Option(
        "window", "--probe", help="Probe whose layer scores are ranked (ASL Algorithm 1)."
    ),
    budget: str = typer.Option(
        "0.1",
        "--budget",
        help="Top-k per layer: a keep rate in (0, 1] (e.g. 0.1) or a token count (e.g. 2016).",
    ),
    l_min: int | None = typer.Option(
        None, "--l-min", help="First layer of the curve, L_min. (default: layers // 3)"
    ),
    l_obs: int = typer.Option(8, "--l-obs", help="Layers whose ranks each point compares, L_obs."),
    out: Path | None = typer.Option(
        None, "--out", help="Write the curves to this parquet file, the selection layers beside it."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON object per example instead of a table."
    ),
) -> None:
    """ASL relative rank-variance curves per example and the layer each threshold tau would select."""
    from rankkit.eval.variance import variance_store

    result = variance_store(
        store, probe=probe, budget=_budget(budget), min_layer=l_min, observed_layers=l_obs
    )
    if out is not None:
        written = result.write(out)
        typer.echo(f"wrote {', '.join(map(str, written))}", err=True)
    rows = result.by_example()
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    Console().print(_variance_table(rows, store))


def _budget(text: str) -> int | float:
    try:
        return int(text) if text.isdigit() else float(text)
    except ValueError:
        raise typer.BadParameter(
            f"{text!r} is neither a keep rate nor a token count", param_hint="--budget"
        ) from None


def _variance_table(rows: list[dict], store: Path) -> Table:
    table = Table(title=Text(f"ASL relative rank variance, {store}"))
    table.add_column("example")
    table.add_column("task")
    thresholds = list(rows[0]["selection_layer"]) if rows else []
    for threshold in thresholds:
        table.add_column(f"τ={threshold}", justify="right")
    table.add_column("relative variance from L_min", overflow="fold")
    for row in rows:
        curve = " ".join(
            "–" if value is None else f"{value:.2f}" for value in row["relative_variance"][row["min_layer"] :]
        )
        table.add_row(
            Text(row["example"]),
            Text(str(row["task"])),
            *(_cell(row["selection_layer"][threshold]) for threshold in thresholds),
            Text(curve),
        )
    return table
