"""`rankkit compare STORE` and `rankkit variance STORE`: rankings against the oracle, and ASL's rank-variance curves."""

from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from rankkit import defaults

from .app import app, output
from .options import (
    OFFLINE_METHODS,
    Format,
    NeedleKeep,
    Overwrite,
    Workers,
    keep_or_tokens,
    output_format,
)


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
        None,
        "--layer",
        help="Selection layer of every method that has one, and the layer probes and KV-only methods "
        "are reported at. (default: each method's own; CLAA's l_p for probes; on models with "
        "sliding-window layers the nearest full-attention layer, ties to the earlier; a layer given "
        "here is used as is)",
    ),
    methods: str | None = typer.Option(
        None,
        "--methods",
        help=f"Comma-separated probes (store keys, e.g. window:w=32) and methods ({OFFLINE_METHODS}); a "
        "method's own parameters follow it as claa:aggregation_window=8. (default: all the store offers)",
    ),
    span: str = typer.Option(
        "prompt",
        "--span",
        help="Tokens ranked: prompt (all outside the observation window, CLAA Sec. 3.1) or context.",
    ),
    keep: str | None = typer.Option(
        None,
        "--keep",
        help="Comma-separated keep rates the methods rank under (ASL's k, forced-token counts), "
        "e.g. 0.1,0.2: one comparison each, every output row naming its keep. (default: 0.1)",
    ),
    budget: str | None = typer.Option(
        None,
        "--budget",
        help="Comma-separated budgets in tokens the methods rank under, e.g. 512,1024 (instead of --keep).",
    ),
    needle_keep: NeedleKeep = None,
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Write the per-layer frame to this parquet file, the other frames beside it as "
        "<stem>.per_head/.sweep/.curve/.stability/.summary/.pairs.parquet (refused if any exists).",
    ),
    overwrite: Overwrite = False,
    pairs: str | None = typer.Option(
        None,
        "--pairs",
        help="Paired tests METHOD:BASELINE,... (e.g. claa:fastkv): the mean Spearman difference per layer "
        "over the same examples, its 95% interval and Wilcoxon p. (default: claa against each "
        "single-layer heuristic compared)",
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print the summary's rows as a JSON list instead (--format json)."
    ),
    table_format: Format = "table",
    workers: Workers = None,
) -> None:
    """Spearman, Kendall, top-k and needle recall of every method against the oracle, layer by layer,
    as means over examples with 95% intervals; paired differences between methods."""
    shown_as = output_format(table_format, as_json)
    from rankkit.eval.parallel import shared_workers
    from rankkit.interrupts import deferred_interrupts, keep_on_interrupt

    # the workers import while this process does; an interrupt from the first import on is one line;
    # so is one while the summaries are made and written, which takes longer than the workers' part
    written: list[Path] = []
    with (
        keep_on_interrupt(lambda: interrupted_note(store, written)),
        shared_workers(store, workers, now=True),
    ):
        with deferred_interrupts():
            from rankkit.eval.compare import compare_keeps, pairs_at_layer, summary_table
            from rankkit.methods import Budget
            from rankkit.tables import frame_table, rows_text

        results = compare_keeps(
            store,
            keep=keep,
            budget=budget,
            layer=layer,
            methods=methods,
            oracle=oracle,
            span=span,
            needle_keep=keep_or_tokens(needle_keep, "--needle-keep"),
            workers=workers,
            pairs=pairs,
            out=out,
            overwrite=overwrite,
            written=written,
        )
        if shown_as != "table":
            rows = [{**row, "span": result.span} for result in results for row in result.summary.to_dicts()]
        else:
            tables = []
            for result in results:
                title = (
                    f"Rankings {'vs oracle' if oracle else 'without an oracle'}, {store}, span {result.span}, "
                    f"probes at l_p = {result.pruning_layer}, "
                    f"ranked at {Budget.parse(result.keep).printed}, needle recall in the top "
                    f"{Budget.parse(result.needle_keep, '--needle-keep').printed}: "
                    "means [95% interval] over n examples"
                )
                tables.append(frame_table(summary_table(result.summary), title))
                if result.stability.height:
                    title = "Stability across layers (sd, min, trough: of the mean curve)"
                    # keep and needle keep: as the rankings' title says
                    tables.append(frame_table(result.stability.drop("keep", "needle_keep"), title))
                paired = pairs_at_layer(result.pairs, result.pruning_layer)
                if paired.height:  # differences of Spearman with the oracle: none without it
                    tables.append(
                        frame_table(
                            paired,
                            f"Paired Spearman differences at l_p = {result.pruning_layer} (Wilcoxon p)",
                        )
                    )
    if written:
        typer.echo(f"wrote {', '.join(map(str, written))}", err=True)
    if shown_as != "table":
        typer.echo(rows_text(rows, shown_as))
        return
    console = output()
    for table in tables:
        console.print(table)


def interrupted_note(store: Path, written: list[Path]) -> str:
    if not written:
        return f"interrupted: nothing written, {store} unchanged"
    return f"interrupted after writing {', '.join(map(str, written))}; {store} unchanged"


def _cell(value: object) -> Text:
    if value is None:  # undefined, e.g. Spearman without an oracle or a layer no tau selects
        return Text("–")
    return Text(f"{value:.3f}" if isinstance(value, float) else str(value))


@app.command("variance")
def variance(
    store: Path = typer.Argument(..., help="Capture store, e.g. runs/capture.zarr."),
    method: str = typer.Option(
        defaults.VARIANCE_METHOD,
        "--method",
        help="The ASL method whose curve is drawn, with its parameters (asl:window_size=32).",
    ),
    keep: str | None = typer.Option(
        None,
        "--keep",
        help="The method's keep rate in (0, 1], window included (k = keep x T - W), e.g. 0.1. (default: 0.1)",
    ),
    budget: str | None = typer.Option(
        None, "--budget", help="The method's budget in tokens, window included, e.g. 2048 (instead of --keep)."
    ),
    min_layer: int | None = typer.Option(
        None, "--min-layer", help="First layer of the curve, L_min. (default: layers // 3)"
    ),
    observed_layers: int | None = typer.Option(
        None,
        "--observed-layers",
        help="Layers whose ranks each point compares, L_obs. (default: 8 of 32, scaled)",
    ),
    thresholds: str = typer.Option(
        ",".join(map(str, defaults.VARIANCE_THRESHOLDS)),
        "--thresholds",
        help="Comma-separated thresholds tau whose selection layer each example reports (ASL Sec. 5.5); "
        "the method's own tau is always among them.",
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Write the curves to this parquet file, the selection layers and the mean curves with "
        "their 95% intervals beside it as <stem>.selections.parquet and <stem>.means.parquet "
        "(refused if any exists).",
    ),
    overwrite: Overwrite = False,
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON object per example instead of a table (--format json)."
    ),
    table_format: Format = "table",
    workers: Workers = None,
) -> None:
    """ASL relative rank-variance curves per example and the layer each threshold tau would select."""
    from rankkit.tables import rows_text

    shown_as = output_format(table_format, as_json)
    from rankkit.eval.parallel import shared_workers
    from rankkit.interrupts import deferred_interrupts

    with shared_workers(store, workers, now=True):  # the workers import while this process does
        with deferred_interrupts():
            from rankkit.eval.variance import output_paths, variance_store

        result = variance_store(
            store,
            method=method,
            **_one_budget(keep, budget),
            min_layer=min_layer,
            observed_layers=observed_layers,
            thresholds=thresholds,
            workers=workers,
            out=out,
            overwrite=overwrite,
        )
    if out is not None:
        typer.echo(f"wrote {', '.join(map(str, output_paths(out)))}", err=True)
    rows = result.by_example()
    if shown_as != "table":
        typer.echo(rows_text(rows, shown_as))
        return
    output().print(_variance_table(rows, store))
    if result.means.height:
        from rankkit.tables import frame_table

        means = result.means.drop("probe")
        title = "Mean curve per task and layer"
        output().print(frame_table(means, title))


def _one_budget(keep: str | None, budget: str | None) -> dict:
    """The one budget ``variance`` draws its curve under, as ``variance_store``'s keywords (none: its default)."""
    from rankkit.errors import RankkitError
    from rankkit.methods import given_budgets

    chosen = given_budgets(keep, budget, required=False)
    if len(chosen) > 1:
        raise RankkitError("variance draws one curve: give one keep rate (e.g. --keep 0.1) or one --budget")
    return chosen[0].keywords if chosen else {}


def _selection_cell(row: dict, threshold: str) -> Text:
    """The layer asl selects at ``threshold``, marked where it is the last layer only because the
    curve never drops below the threshold."""
    layer = row["selection_layer"][threshold]
    return Text(f"{layer} (fallback)" if row["fallback"][threshold] else str(layer))


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
            *(_selection_cell(row, threshold) for threshold in thresholds),
            Text(curve),
        )
    return table
