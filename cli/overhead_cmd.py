"""`rankkit overhead SCENARIO`: rankkit's own cost over plain transformers, side by side."""

from __future__ import annotations

import json

import polars as pl
import typer
from rich.console import Console
from rich.progress import Progress

from rankkit.cli.app import app

console = Console()


@app.command()
def overhead(
    scenario: str = typer.Argument(..., help="runner, capture or oracle."),
    lengths: str = typer.Option("1024,4096", help="Comma-separated prompt lengths in tokens."),
    model: str = typer.Option("default"),
    device: str = typer.Option("auto"),
    repeats: int = typer.Option(5, min=1, help="Interleaved timed repeats per side, after one warm-up."),
    memory: bool = typer.Option(True, help="Measure peak memory (one fresh process per side)."),
    timing: bool = typer.Option(True, help="Measure time (interleaved repeats)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Time and peak memory of a rankkit path against its plain-transformers baseline."""
    from rankkit.errors import RankkitError
    from rankkit.overhead import SCENARIOS, run_overhead
    from rankkit.report.tables import frame_table

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
    frame = pl.DataFrame(
        [
            {
                "tokens": row["tokens"],
                "baseline_s": row["baseline_s"],
                "rankkit_s": row["rankkit_s"],
                "time_ratio": row["time_ratio"],
                "baseline_peak_mib": _mib(row.get("baseline_peak_bytes")),
                "rankkit_peak_mib": _mib(row.get("rankkit_peak_bytes")),
                "memory_ratio": row.get("memory_ratio"),
            }
            for row in rows
        ]
    )
    title = f"{scenario}: {rows[0]['rankkit']} vs {rows[0]['baseline']} ({rows[0]['device']})"
    console.print(frame_table(frame, title))


def _mib(value: int | None) -> float | None:
    return None if value is None else value / 2**20
