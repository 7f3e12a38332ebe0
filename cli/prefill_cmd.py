"""`rankkit prefill` (one method on one prompt, optionally beside another) and `rankkit bench` (the grid)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from rankkit import defaults
from rankkit.cli.app import app, output, say_if_timing_only
from rankkit.cli.options import (
    AllowOverlength,
    AsJson,
    CompileDecode,
    CudaGraphs,
    Device,
    DeviceMap,
    Draft,
    Format,
    Layer,
    MaxNewTokens,
    Mirror,
    Model,
    Overwrite,
    Repeats,
    Threads,
    Warmup,
    output_format,
)
from rankkit.cli.progress import progress_bar
from rankkit.errors import RankkitError
from rankkit.values import comma_list


def _library_options(given: dict) -> dict:
    """The library's option objects from the options ``prefill`` and ``bench`` share (their ``locals()``)."""
    from rankkit.bench import BenchSettings, MethodOptions, Setup

    return dict(
        options=MethodOptions(given["layer"], given["draft"], given["mirror"]),
        settings=BenchSettings(given["max_new_tokens"], given["warmup"], given["repeats"]),
        setup=Setup(
            given["model"],
            given["device"],
            given["threads"],
            given["allow_overlength"],
            given["device_map"],
            given["cuda_graphs"],
            given["compile_decode"],
        ),
    )


def _megabytes(value) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f}"


def _number(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


@app.command()
def prefill(
    method: str = typer.Option(
        ...,
        help="A method, optionally with its parameters: full, gemfilter, fastkv, claa, asl, ... or e.g. "
        "claa:aggregation_window=8 (see docs/methods.md).",
    ),
    keep: str = typer.Option(None, help="Keep rate in (0, 1], e.g. 0.1 (full needs none)."),
    budget: str = typer.Option(None, help="Tokens to keep, e.g. 2048 (instead of --keep)."),
    layer: Layer = None,
    model: Model = defaults.MODEL,
    data: str = typer.Option(
        None, help="A data spec (niah:length=4096, ruler:..., FILE.jsonl); uses --example."
    ),
    example: int = typer.Option(0, "--example", min=0, help="Which example of --data to run."),
    context_file: Path = typer.Option(
        None, exists=True, dir_okay=False, help="Context text (with --question)."
    ),
    question: str = typer.Option(None, help="The question after the context (with --context-file)."),
    max_new_tokens: MaxNewTokens = defaults.MAX_NEW_TOKENS,
    compare: str = typer.Option(None, help="Run this method too (e.g. full) and print both and the ratios."),
    draft: Draft = None,
    mirror: Mirror = None,
    warmup: Warmup = defaults.WARMUP,
    repeats: Repeats = defaults.REPEATS,
    threads: Threads = None,
    device: Device = defaults.DEVICE,
    device_map: DeviceMap = None,
    cuda_graphs: CudaGraphs = False,
    compile_decode: CompileDecode = False,
    allow_overlength: AllowOverlength = False,
    as_json: AsJson = False,
    table_format: Format = "table",
    kept_layers: str = typer.Option(
        None,
        help="With --json: comma-separated layers (e.g. 0,15,29) whose kept positions per KV head it lists.",
    ),
) -> None:
    """Run one method's selection end to end on one prompt and print the answer and its measurements.

    Every option is checked before the model loads. --format csv prints one line per method run.
    """
    from rankkit.bench import prefill as run_prefill
    from rankkit.bench import prefill_json
    from rankkit.tables import rows_text

    shown_as = output_format(table_format, as_json)

    rows = run_prefill(
        method,
        keep=keep,
        budget=budget,
        data=data,
        example=example,
        context_file=context_file,
        question=question,
        compare=compare,
        kept_layers=_layer_list(kept_layers, shown_as == "json"),
        **_library_options(locals()),
    )
    if shown_as != "table":
        typer.echo(rows_text(rows, shown_as, whole=prefill_json(rows)))
        return
    _print_runs(rows, compare is not None)


def _layer_list(text: str | None, as_json: bool) -> str | tuple:
    """``--kept-layers`` as given (the library reads the list); it lists positions only in JSON."""
    if text is not None and not as_json:
        raise RankkitError("--kept-layers lists positions in the JSON output: add --json")
    return () if text is None else text  # an empty one is the library's to refuse, not to drop


def _print_runs(rows: list[dict], compared: bool) -> None:
    table = Table(title=f"{rows[0]['length']} prompt tokens, {rows[0]['budget']}")
    table.add_column("")
    for row in rows:
        table.add_column(row["method"], justify="right")
    lines = [
        ("TTFT (s)", lambda r: _number(r["ttft_s"])),
        ("TPOT (s)", lambda r: _number(r["tpot_s"], 4)),
        ("end to end (s)", lambda r: _number(r["e2e_s"])),
        ("KV cache (MiB)", lambda r: _megabytes(r["kv_bytes"])),
        ("peak memory (MiB)", lambda r: _megabytes(r["peak_mem_bytes"])),
        ("ideal TTFT ratio", lambda r: _number(r["ideal_ratio"])),
        ("tokens kept", _kept),
        ("score", lambda r: _number(r["score"], 2)),
    ]
    if compared:
        lines += [
            ("TTFT ratio", lambda r: _number(r["ttft_ratio"])),
            ("TPOT ratio", lambda r: _number(r["tpot_ratio"])),
            ("KV ratio", lambda r: _number(r["kv_ratio"])),
        ]
    for label, cell in lines:
        table.add_row(label, *(cell(row) for row in rows))
    output().print(table)
    for row in rows:
        output().print(f"[bold]{row['method']}[/bold]: {row['answer']!r}")
    _say_if_first_runs_timed([row["warmup"] for row in rows])
    say_if_timing_only(rows[0].get("timing_only", False))


def _kept(row: dict) -> str:
    """How many prompt tokens a prompt-pruning method kept, and where (a KV method's share is its KV ratio)."""
    if row.get("selected_positions") is None:
        return "-"
    kept = len(row["selected_positions"])
    # a draft's choice (SpecPrefill) is made before the model's first layer
    return f"{kept} before layer 0" if row["selection_layer"] is None else f"{kept} at layer {row['selection_layer']}"


def _say_if_first_runs_timed(warmups: list[int]) -> None:
    from rankkit.bench import FIRST_RUNS_TIMED, first_runs_timed

    if first_runs_timed(warmups):
        output().print(FIRST_RUNS_TIMED)


@app.command()
def bench(
    methods: str = typer.Option(..., help="Comma-separated methods, e.g. full,gemfilter,fastkv,claa,oracle."),
    keep: str = typer.Option(None, help="Comma-separated keep rates, e.g. 0.1,0.2,0.4."),
    budget: str = typer.Option(None, help="Comma-separated token budgets (instead of --keep)."),
    data: str = typer.Option(..., help="A data spec, e.g. niah:n=4,length=4096."),
    limit: int = typer.Option(None, min=1, help="Only the first N examples."),
    out: Path = typer.Option(
        None,
        help="Write one row per (example, method, budget) to this parquet file. Finished examples are kept "
        "beside it as they finish: after Ctrl-C (or SIGTERM) the same command resumes; an existing --out "
        "is refused unless --overwrite.",
    ),
    overwrite: Overwrite = False,
    layer: Layer = None,
    model: Model = defaults.MODEL,
    max_new_tokens: MaxNewTokens = defaults.MAX_NEW_TOKENS,
    draft: Draft = None,
    mirror: Mirror = None,
    warmup: Warmup = defaults.WARMUP,
    repeats: Repeats = defaults.REPEATS,
    threads: Threads = None,
    device: Device = defaults.DEVICE,
    device_map: DeviceMap = None,
    cuda_graphs: CudaGraphs = False,
    compile_decode: CompileDecode = False,
    allow_overlength: AllowOverlength = False,
    as_json: AsJson = False,
    table_format: Format = "table",
) -> None:
    """Run the methods x budgets grid over a dataset; print accuracy and TTFT ratio per method and budget.

    Every option is checked before the model loads. Ctrl-C or SIGTERM keeps every finished
    example (with --out), says so and exits 130; rerunning the same command resumes.
    """
    from rankkit.bench import bench as run_bench
    from rankkit.bench import is_timing_only, summary
    from rankkit.tables import rows_text

    shown_as = output_format(table_format, as_json)
    with progress_bar("bench") as show:
        frame = run_bench(
            comma_list(methods, "--methods"),
            data,
            keep=keep,
            budget=budget,
            limit=limit,
            out=out,
            overwrite=overwrite,
            progress=show,
            **_library_options(locals()),
        )
    table = summary(frame)
    if shown_as != "table":
        rows = table.to_dicts()
        whole = {"out": str(out) if out else None, "warmup": warmup, "timing_only": is_timing_only(table)}
        whole["summary"] = rows
        typer.echo(rows_text(rows, shown_as, whole=whole))
        return
    _print_summary(table, out, warmup, is_timing_only(table))


def _print_summary(table, out: Path | None, warmup: int, timing_only: bool = False) -> None:
    from rankkit.eval.stats import row_with_interval
    from rankkit.tables import HEADERS

    def interval(metric: str, unit: float = 1.0, digits: int = 2):
        return lambda row: row_with_interval(row, metric, unit=unit, digits=digits)

    def plain(key: str):
        return lambda row: str(row[key])

    title = "methods vs full: means [95% interval] over n examples"
    if "n_clusters" in table.columns:
        title += f" ({HEADERS['n_clusters'][0]}: independent samples)"
    view = Table(title=f"{title}, timing only" if timing_only else title)
    columns = [
        ("method", plain("method")),
        ("budget", plain("budget")),
        ("n", plain("n_examples")),
        # examples sharing a haystack or needle are one sample: the intervals' n, as compare shows it
        *([(HEADERS["n_clusters"][0], plain("n_clusters"))] if "n_clusters" in table.columns else []),
        ("accuracy", interval("accuracy")),
        ("TTFT ratio", interval("ttft_ratio")),
        ("ideal", interval("ideal_ratio")),
        ("measured/ideal", interval("measured_over_ideal", digits=3)),
        ("TPOT ratio", interval("tpot_ratio")),
        ("TPOT/bound", interval("tpot_over_bound")),
        ("KV ratio", interval("kv_ratio")),
        ("KV MiB", interval("kv_bytes", unit=2**20, digits=1)),
        ("peak MiB", interval("peak_mem_bytes", unit=2**20, digits=1)),
    ]
    for label, _ in columns:
        view.add_column(label, justify="left" if label in ("method", "budget") else "right")
    for row in table.to_dicts():
        view.add_row(*(render(row) for _, render in columns))
    output().print(view)
    _say_if_first_runs_timed([warmup])
    say_if_timing_only(timing_only)
    if out is not None:
        output().print(f"rows: {out}")
