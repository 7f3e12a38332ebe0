"""`rankkit capture` and `rankkit oracle`: scores and ground truth into a store."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rankkit.cli.app import THREADS_HELP, app, use_threads

console = Console(stderr=True)


def _oracle_options(answer: str, softmax: bool, kernel: int, max_new_tokens: int):
    from rankkit.capture import OracleOptions

    return OracleOptions(answer=answer, softmax=softmax, kernel=kernel, max_new_tokens=max_new_tokens)


def _progress_bar(total: int | None, what: str):
    progress = Progress(
        TextColumn(f"[bold]{what}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        console=console,
    )
    task = progress.add_task(what, total=total, rate="")
    state = {"tokens": 0, "seconds": 0.0}

    import time

    started = time.perf_counter()

    def advance(kind: str, done: int, tokens: int) -> None:
        state["tokens"] += tokens
        elapsed = time.perf_counter() - started
        rate = f"{state['tokens'] / elapsed:,.0f} tok/s" if state["tokens"] else kind
        progress.update(task, completed=done, rate=rate)

    return progress, advance


def _print_summary(summary, as_json: bool, title: str) -> None:
    row = {
        "out": summary.out,
        "examples": summary.examples,
        "written": summary.written,
        "skipped": summary.skipped,
        "tokens": summary.tokens,
        "seconds": round(summary.seconds, 3),
        "tokens_per_second": round(summary.tokens_per_second, 1),
        "accuracy": summary.accuracy,
    }
    if as_json:
        print(json.dumps(row))
        return
    table = Table(title=title, show_header=False)
    for key, value in row.items():
        table.add_row(key, "-" if value is None else str(value))
    Console().print(table)


@app.command()
def capture(
    model: str = typer.Option("default", help="'default', an HF folder, or a hub id."),
    data: str = typer.Option(
        "niah:n=8,length=2048", help="Data spec: niah:..., ruler:task=...,..., or a .jsonl path."
    ),
    probes: str = typer.Option("all", help="Comma-separated probe names, or 'all'."),
    out: Path = typer.Option(
        Path("runs/capture.zarr"), help="The zarr store to write (resumed if it exists)."
    ),
    limit: int = typer.Option(None, min=1, help="Capture at most this many examples."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
    threads: int = typer.Option(None, min=1, help=THREADS_HELP),
    overwrite: bool = typer.Option(False, help="Delete an existing store at --out first."),
    oracle: bool = typer.Option(False, help="Also add the Answer-Informed Oracle in the same run."),
    answer: str = typer.Option(
        "generated", help="Oracle answer: generated or reference (teacher-forced gold)."
    ),
    softmax: bool = typer.Option(False, help="Oracle on post-softmax attention instead of raw logits."),
    kernel: int = typer.Option(7, min=1, help="Oracle 1-D average-pooling kernel."),
    max_new_tokens: int = typer.Option(32, min=1, help="Oracle answer length limit."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Record every probe's per-layer token scores in one forward pass per example."""
    from rankkit.capture import capture as run_capture
    from rankkit.capture import shard

    use_threads(threads)
    rank, _ = shard()
    options = _oracle_options(answer, softmax, kernel, max_new_tokens) if oracle else None
    progress, advance = _progress_bar(limit, "capture")
    with progress if rank == 0 else nullcontext():
        summary = run_capture(
            model=model,
            data=data,
            probes=probes,
            out=out,
            limit=limit,
            device=device,
            overwrite=overwrite,
            oracle=options,
            progress=advance if rank == 0 else None,
        )
    if rank == 0:
        _print_summary(summary, as_json, f"capture → {summary.out}")


@app.command()
def oracle(
    store: Path = typer.Argument(..., help="A store written by rankkit capture."),
    model: str = typer.Option(None, help="The model the store was captured with, if not the default."),
    answer: str = typer.Option("generated", help="generated or reference (teacher-forced gold answer)."),
    softmax: bool = typer.Option(False, help="Post-softmax attention instead of raw logits."),
    kernel: int = typer.Option(7, min=1, help="1-D average-pooling kernel."),
    max_new_tokens: int = typer.Option(32, min=1),
    redo: bool = typer.Option(False, help="Recompute oracles that are already there."),
    device: str = typer.Option("auto"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Add the Answer-Informed Oracle (CLAA Algorithm 1) to a store captured earlier."""
    from rankkit.capture import add_oracle

    progress, advance = _progress_bar(None, "oracle")
    with progress:
        summary = add_oracle(
            store,
            options=_oracle_options(answer, softmax, kernel, max_new_tokens),
            model=model,
            device=device,
            redo=redo,
            progress=advance,
        )
    _print_summary(summary, as_json, f"oracle → {summary.out}")
