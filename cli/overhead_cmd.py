"""`rankkit overhead SCENARIO`: rankkit's own cost over plain transformers, side by side; and
`rankkit overhead analysis`: what compare, variance and dashboard cost on a synthetic store."""

from __future__ import annotations

import polars as pl
import typer
from rich.table import Table

from rankkit import defaults
from rankkit.cli.app import app, output
from rankkit.cli.options import (
    AllowOverlength,
    AsJson,
    CompileDecode,
    CudaGraphs,
    Device,
    Format,
    Model,
    Threads,
    output_format,
)
from rankkit.cli.progress import progress_bar

# what only `overhead analysis` uses, and what only the model scenarios do
ANALYSIS_OPTIONS = ("examples", "workers")
MODEL_OPTIONS = (
    "model", "device", "repeats", "memory", "timing", "cuda_graphs", "compile_decode", "allow_overlength", "threads",
)  # fmt: skip


def _refuse_unused_options(ctx: typer.Context, scenario: str) -> None:
    """An option given on the command line that ``scenario`` does not use is refused: it was ignored."""
    from rankkit.errors import RankkitError

    unused = ANALYSIS_OPTIONS if scenario != "analysis" else MODEL_OPTIONS
    given = [
        "/".join([*param.opts, *param.secondary_opts])
        for param in ctx.command.params
        if param.name in unused and ctx.get_parameter_source(param.name).name == "COMMANDLINE"
    ]
    if given:
        raise RankkitError(f"overhead {scenario} does not use {', '.join(given)}; leave it out")


@app.command()
def overhead(
    ctx: typer.Context,
    scenario: str = typer.Argument(..., help="runner, capture, oracle, decode or analysis."),
    lengths: str = typer.Option("1024,4096", help="Comma-separated prompt lengths in tokens."),
    model: Model = defaults.MODEL,
    device: Device = defaults.DEVICE,
    repeats: int = typer.Option(
        defaults.OVERHEAD_REPEATS, min=1, help="Interleaved timed repeats per side, after one warm-up (six or more give the ratio a 95% interval)."
    ),
    memory: bool = typer.Option(True, help="Measure peak memory (one fresh process per side)."),
    timing: bool = typer.Option(True, help="Measure time (interleaved repeats)."),
    cuda_graphs: CudaGraphs = False,
    compile_decode: CompileDecode = False,
    allow_overlength: AllowOverlength = False,
    threads: Threads = None,
    as_json: AsJson = False,
    table_format: Format = "table",
    examples: int = typer.Option(1000, min=1, help="analysis: examples in the synthetic store."),
    workers: int | None = typer.Option(None, help="analysis: --workers of each step. (default: CPU count)"),
) -> None:
    """Time and peak memory of a rankkit path against its plain-transformers baseline (`decode`: time
    per token against model.generate, and the memory-bandwidth bound: a GPU's data sheet, else
    measured); `analysis` times
    compare --oracle, variance and dashboard on a synthetic store of --examples x --lengths."""
    from rankkit.errors import RankkitError
    from rankkit.overhead import SCENARIOS, run_overhead
    from rankkit.tables import frame_table, rows_text

    shown_as = output_format(table_format, as_json)
    if scenario not in (*SCENARIOS, "analysis"):
        raise RankkitError(f"unknown scenario '{scenario}': choose one of {', '.join(SCENARIOS)}, analysis")
    _refuse_unused_options(ctx, scenario)
    try:
        token_counts = [int(part) for part in lengths.split(",")]
    except ValueError:
        raise RankkitError(f"--lengths takes comma-separated integers, not '{lengths}'") from None
    if scenario == "analysis":
        _analysis(examples, token_counts, workers, shown_as)
        return
    with progress_bar(f"{scenario} overhead") as show:
        rows = run_overhead(
            scenario,
            token_counts,
            model_spec=model,
            device=device,
            repeats=repeats,
            with_memory=memory,
            with_timing=timing,
            cuda_graphs=cuda_graphs,
            compile_decode=compile_decode,
            allow_overlength=allow_overlength,
            progress=show,
            threads=threads,
        )
    if shown_as != "table":
        typer.echo(rows_text(rows, shown_as))
        return
    frame = pl.DataFrame(
        [
            {
                "tokens": row["tokens"],
                "baseline_s": row["baseline_s"],
                "rankkit_s": row["rankkit_s"],
                "time_ratio": row["time_ratio"],
                "time_ratio_ci_low": row["time_ratio_ci_low"],
                "time_ratio_ci_high": row["time_ratio_ci_high"],
                "baseline_peak_mib": _mib(row.get("baseline_peak_bytes")),
                "rankkit_peak_mib": _mib(row.get("rankkit_peak_bytes")),
                "memory_ratio": row.get("memory_ratio"),
            }
            | ({key: row[key] for key in ("bound_s", "bound_ratio", "read_bound_s")} if "bound_s" in row else {})
            for row in rows
        ]
    )
    title = f"{scenario}: {rows[0]['rankkit']} vs {rows[0]['baseline']} ({rows[0]['device']}, {repeats} repeats)"
    if "bandwidth_source" in rows[0]:
        title += f", bound at the {rows[0]['bandwidth_source']} memory bandwidth"
    output().print(frame_table(frame, title, intervals_over="repeats", interval_digits=3))


def _mib(value: int | None) -> float | None:
    return None if value is None else value / 2**20


def _analysis(examples: int, token_counts: list[int], workers: int | None, shown_as: str) -> None:
    from rankkit.eval.cost import run_analysis_cost
    from rankkit.tables import rows_text

    with progress_bar("analysis cost") as show:
        rows = run_analysis_cost(examples, token_counts, workers=workers, progress=show)
    if shown_as != "table":
        typer.echo(rows_text(rows, shown_as))
        return
    table = Table(title=f"analysis of {examples} synthetic examples ({rows[0]['workers']} workers)")
    for column in ("step", "tokens", "seconds", "s per example", "peak MiB", "files per example", "page MiB"):
        table.add_column(column, justify="left" if column == "step" else "right")
    for row in rows:
        table.add_row(
            row["step"],
            str(row["tokens"]),
            f"{row['seconds']:.1f}",
            f"{row['seconds_per_example']:.3f}",
            f"{row['peak_mib']:.0f}",
            str(row["files_per_example"]),
            "-" if row["output_mib"] is None else f"{row['output_mib']:.1f}",
        )
    output().print(table)
