"""`rankkit overhead SCENARIO`: rankkit's own cost over plain transformers, side by side."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from rankkit import defaults
from rankkit.cli.app import app
from rankkit.cli.options import Device, Model

console = Console()


@app.command()
def overhead(
    scenario: str = typer.Argument(..., help="runner, capture or oracle."),
    lengths: str = typer.Option("1024,4096", help="Comma-separated prompt lengths in tokens."),
    model: Model = defaults.MODEL,
    device: Device = defaults.DEVICE,
    repeats: int = typer.Option(5, min=1, help="Interleaved timed repeats per side, after one warm-up."),
    memory: bool = typer.Option(True, help="Measure peak memory (one fresh process per side)."),
    timing: bool = typer.Option(True, help="Measure time (interleaved repeats)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Time and peak memory of a rankkit path against its plain-transformers baseline."""
    from rankkit.errors import RankkitError
    from rankkit.overhead import SCENARIOS, run_overhead

    if scenario not in SCENARIOS:
        raise RankkitError(f"unknown scenario '{scenario}': choose one of {', '.join(SCENARIOS)}")
    try:
        token_counts = [int(part) for part in lengths.split(",")]
    except ValueError:
        raise RankkitError(f"--lengths takes comma-separated integers, not '{lengths}'") from None
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"{scenario} overhead", total=len(token_counts) * repeats)
        rows = run_overhead(
            scenario,
            token_counts,
            model_spec=model,
            device=device,
            repeats=repeats,
            with_memory=memory,
            with_timing=timing,
            progress=lambda: progress.advance(task),
        )
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title=f"{scenario}: {rows[0]['rankkit']} vs {rows[0]['baseline']} ({rows[0]['device']})")
    for column in (
        "tokens",
        "baseline s",
        "rankkit s",
        "time ratio",
        "baseline peak MiB",
        "rankkit peak MiB",
        "memory ratio",
    ):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            str(row["tokens"]),
            f"{row['baseline_s']:.3f}",
            f"{row['rankkit_s']:.3f}",
            f"{row['time_ratio']:.3f}",
            _mib(row.get("baseline_peak_bytes")),
            _mib(row.get("rankkit_peak_bytes")),
            f"{row['memory_ratio']:.3f}" if "memory_ratio" in row else "-",
        )
    console.print(table)


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"
