"""`rankkit store info PATH`: what a capture store holds."""

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.table import Table
from rich.text import Text

from rankkit import stores

from .app import app, output
from .options import Format, output_format

store_app = typer.Typer(name="store", help="Inspect capture stores.", no_args_is_help=True)
app.add_typer(store_app, name="store")

_VALUE_WIDTH = 80


@store_app.command("info")
def info(
    path: Path = typer.Argument(..., help="Store directory, e.g. runs/capture.zarr."),
    as_json: bool = typer.Option(
        False, "--json", help="Print the summary as JSON instead of tables (--format json)."
    ),
    table_format: Format = "table",
) -> None:
    """Run metadata, example counts, tasks, probes with their shapes, oracles and added groups.

    --format csv prints one key,value line per entry, nested keys joined by dots (examples.complete)."""
    from rankkit.tables import flat_rows, rows_text

    shown_as = output_format(table_format, as_json)
    summary = stores.describe(path)
    if shown_as != "table":
        typer.echo(rows_text(flat_rows(summary), shown_as, whole=summary))
        return
    console = output()
    console.print(_run_table(summary))
    console.print(_examples_table(summary))
    if summary["probes"]:
        console.print(_probes_table(summary["probes"]))
    if summary["groups"]:
        console.print(_groups_table(summary["groups"]))


def _run_table(summary: dict[str, Any]) -> Table:
    table = Table(title=Text(f"Store {summary['path']}"), show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value", overflow="fold")
    for key in ("schema_version", "rankkit_version", "created"):
        table.add_row(key, str(summary[key]))
    for key, value in summary["run_meta"].items():
        table.add_row(Text(key), Text(_compact(value, whole=not sys.stdout.isatty())))
    return table


def _examples_table(summary: dict[str, Any]) -> Table:
    counts = summary["examples"]
    table = Table(title="Examples")
    table.add_column("examples")
    table.add_column("count", justify="right")
    table.add_row("complete", str(counts["complete"]))
    table.add_row("incomplete (redone on resume)", str(counts["incomplete"]))
    table.add_row("with oracle", str(counts["with_oracle"]))
    table.add_section()
    for task, count in summary["tasks"].items():
        table.add_row(Text(f"task {task}"), str(count))
    return table


def _probes_table(probes: dict[str, dict[str, Any]]) -> Table:
    table = Table(title=Text("Probes: scores [layers, kv_heads, tokens]"))
    for column in ("probe", "examples", "layers", "kv_heads", "tokens"):
        table.add_column(column, justify="left" if column == "probe" else "right")
    for probe, shape in probes.items():
        tokens = f"{shape['tokens_min']}–{shape['tokens_max']}"
        table.add_row(
            Text(probe),
            str(shape["examples"]),
            ", ".join(map(str, shape["layers"])),
            ", ".join(map(str, shape["kv_heads"])),
            tokens if shape["tokens_min"] != shape["tokens_max"] else str(shape["tokens_min"]),
        )
    return table


def _groups_table(groups: dict[str, int]) -> Table:
    table = Table(title="Groups added after capture")
    table.add_column("group")
    table.add_column("examples", justify="right")
    for group, count in groups.items():
        table.add_row(Text(group), str(count))
    return table


def _compact(value: Any, whole: bool = False) -> str:
    """One line per metadata value; on a terminal long ones (model configs) are cut, saying that --json
    has them whole; ``whole`` (a log or a pipe, where no cell is cut) keeps them whole."""
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return text if whole or len(text) <= _VALUE_WIDTH else text[:_VALUE_WIDTH] + " … (whole with --json)"


@store_app.command("verify")
def verify(
    path: Path = typer.Argument(..., help="Store directory, e.g. runs/capture.zarr."),
    reset: bool = typer.Option(
        False,
        "--reset",
        help="Unflag every damaged part, so rerunning the capture (or `rankkit oracle`) redoes it.",
    ),
) -> None:
    """Check every file of every example against what its write recorded; exit 2 if any is damaged
    (and not reset), unreadable or mismatched."""
    report = stores.verify(path, reset=reset)
    for problem in report.problems:
        typer.echo(f"{problem.example}\t{problem.state}\t{problem.part}\t{problem.detail}")
    typer.echo(report.summary())
    note = report.reset_note()
    if note is not None:
        typer.echo(note)
    report.raise_if_damaged()
