"""`rankkit sweep EXPERIMENT.toml --out DIR`: an experiment's grid, every stage, into one directory."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from rankkit.cli.app import app, output
from rankkit.cli.options import AsJson, Format, Threads, Workers, output_format
from rankkit.cli.progress import stage_bars
from rankkit.values import comma_list


@app.command("sweep")
def sweep(
    experiment: Path = typer.Argument(
        ..., help="The experiment file (TOML; docs/sweeps.md shows every field)."
    ),
    out: Path = typer.Option(
        None,
        "--out",
        help="The directory to run into: one store per data cell, one parquet per stage, the dashboards. "
        "Rerunning resumes it, redoing the units an edited file changes; a run that would leave results "
        "made from what it redoes, or a folder holding anything but a sweep, is refused. (default: runs/<file name>)",
    ),
    stages: str | None = typer.Option(
        None,
        "--stages",
        help="Run only these of the experiment's stages, comma-separated (e.g. capture,oracle under torchrun, "
        "then compare,variance,dashboard); the stages they read must have run. (default: all of them)",
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Discard what a previous sweep wrote into --out (the paths its manifest.json lists, nothing "
        "else), and start over.",
    ),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Print the plan (new, changed and kept units, the work ahead, seconds from a cached cost "
        "model) and stop; no model loads.",
    ),
    max_units: int = typer.Option(
        None,
        "--max-units",
        min=1,
        help="Refuse a grid of more units of work than this (an example through a model stage, a unit "
        "of another stage). (default: 100,000)",
    ),
    workers: Workers = None,
    threads: Threads = None,
    as_json: AsJson = False,
    table_format: Format = "table",
) -> None:
    """Run an experiment file's grid (data cells x probes x methods x keep rates x layers), stage by stage.

    Everything is checked before any model loads; then the plan is printed: each stage's new,
    changed (other settings than its last run) and kept units. Only new and changed units run,
    so a keep rate added to the file reuses the stores. Under torchrun every rank takes its share
    of each cell's examples in the model stages (capture, oracle, bench, diffusion) and rank 0
    merges them and runs the others. Ctrl-C or SIGTERM keeps every finished unit and example
    and exits 130; the same command resumes.
    """
    from rankkit.progress import ignore
    from rankkit.shards import shard
    from rankkit.sweep import sweep as run_sweep
    from rankkit.tables import rows_text

    shown_as = output_format(table_format, as_json)
    rank, _ = shard()

    def announce(plan) -> None:
        if rank == 0 and not (dry_run and shown_as != "table"):
            typer.echo("\n".join(plan.lines()), err=not dry_run)

    with stage_bars("sweep") as show:
        summary = run_sweep(
            experiment,
            out or Path("runs") / experiment.stem,
            stages=comma_list(stages, "--stages") or None,
            overwrite=overwrite,
            workers=workers,
            progress=show if rank == 0 else ignore,
            dry_run=dry_run,
            max_units=max_units,
            announce=announce,
            threads=threads,
        )
    if rank != 0:
        return
    if dry_run:
        if shown_as != "table":
            plan = summary.plan.as_dict()
            typer.echo(rows_text(plan["stages"], shown_as, whole=plan))
        return
    rows = [
        {
            "stage": report.stage,
            "ran": report.ran,
            "skipped": report.skipped,
            "outputs": [str(path) for path in report.outputs],
        }
        for report in summary.stages
    ]
    if shown_as != "table":
        whole = {"out": str(summary.out), "seconds": round(summary.seconds, 3), "stages": rows}
        typer.echo(rows_text(rows, shown_as, whole=whole))
        return
    table = Table(title=f"sweep {summary.experiment} → {summary.out} ({summary.seconds:.1f} s)")
    for column in ("stage", "ran", "skipped (finished before)", "wrote"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["stage"], str(row["ran"]), str(row["skipped"]), "\n".join(row["outputs"]) or "-")
    output().print(table)
