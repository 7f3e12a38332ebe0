"""`rankkit capture` and `rankkit oracle`: scores and ground truth into a store."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from rankkit import defaults
from rankkit.cli.app import app, output, say_if_timing_only
from rankkit.cli.options import (
    DRAFT_SPEC,
    AllowOverlength,
    AsJson,
    Device,
    DeviceMap,
    Format,
    MaxNewTokens,
    Model,
    Threads,
    output_format,
)
from rankkit.cli.progress import progress_bar


def _oracle_options(answer: str, softmax: bool, kernel: int, max_new_tokens: int):
    from rankkit.capture import OracleOptions

    return OracleOptions(answer=answer, softmax=softmax, kernel=kernel, max_new_tokens=max_new_tokens)


def _print_summary(summary, shown_as: str, title: str) -> None:
    from rankkit.eval.stats import interval_columns, row_with_interval
    from rankkit.tables import rows_text

    accuracy = summary.accuracy or {}
    low, high = interval_columns("accuracy")
    row = {
        "out": summary.out,
        "examples": summary.examples,
        "written": summary.written,
        "skipped": summary.skipped,
        "tokens": summary.tokens,
        "seconds": round(summary.seconds, 3),
        "tokens_per_second": None if summary.tokens_per_second is None else round(summary.tokens_per_second, 1),
        # the oracle's answers, over every example of the run (an earlier run's scored ones included)
        "accuracy": accuracy.get("accuracy"),
        low: accuracy.get(low),
        high: accuracy.get(high),
        "scored": accuracy.get("n_examples", 0),
        "without_answer": len(summary.without_answer),
    }
    if shown_as != "table":
        whole = {**row, "timing_only": summary.timing_only}
        typer.echo(rows_text([whole], shown_as, whole=whole))
        return
    shown = {key: value for key, value in row.items() if key not in (low, high)}
    if accuracy:
        shown["accuracy"] = row_with_interval(accuracy, "accuracy")
    table = Table(title=title, show_header=False)
    for key, value in shown.items():
        table.add_row(key, "-" if value is None else str(value))
    output().print(table)
    say_if_timing_only(summary.timing_only)


@app.command()
def capture(
    model: Model = defaults.MODEL,
    data: str = typer.Option(
        defaults.CAPTURE_DATA, help="Data spec: niah:..., ruler:task=...,..., or a .jsonl path."
    ),
    probes: str = typer.Option(
        "all",
        help="Probes with their settings, e.g. window:w=32,kernel=7,last_token_raw (w = window_size, "
        "kernel = kernel_size); each setting is stored under that key. 'all': every probe at its "
        "defaults plus every setting a registered method ranks by (window at W=8 and window:w=32).",
    ),
    out: Path = typer.Option(
        Path(defaults.CAPTURE_OUT),
        help="The zarr store to write; rerunning the same command resumes it (after Ctrl-C, SIGTERM "
        "or a crash), other settings are refused.",
    ),
    limit: int = typer.Option(None, min=1, help="Capture at most this many examples."),
    device: Device = defaults.DEVICE,
    device_map: DeviceMap = None,
    threads: Threads = None,
    overwrite: bool = typer.Option(False, help="Delete an existing store at --out first."),
    oracle: bool = typer.Option(False, help="Also add the Answer-Informed Oracle in the same run."),
    answer: str = typer.Option(
        defaults.ORACLE_ANSWER, help="Oracle answer: generated or reference (teacher-forced gold)."
    ),
    softmax: bool = typer.Option(False, help="Oracle on post-softmax attention instead of raw logits."),
    kernel: int = typer.Option(
        defaults.ORACLE_KERNEL, min=1, help="Oracle 1-D average-pooling kernel: an odd width (the pooling keeps the length)."
    ),
    max_new_tokens: MaxNewTokens = defaults.MAX_NEW_TOKENS,
    draft: str = typer.Option(
        None,
        "--draft",
        help=f"Also record a draft's lookahead scores, so SpecPrefill ranks from this store: {DRAFT_SPEC}. "
        "Without it no draft is recorded.",
    ),
    allow_overlength: AllowOverlength = False,
    as_json: AsJson = False,
    table_format: Format = "table",
    score_dtype: str = typer.Option(
        defaults.SCORE_DTYPE,
        "--score-dtype",
        help="float32, or float16 for half-size stores (docs/benchmarks.md).",
    ),
) -> None:
    """Record every probe's per-layer token scores in one forward pass per example.

    Ctrl-C or SIGTERM keeps every example written whole and exits 130; the same command resumes.
    A store's oracles are all made with the same --answer/--softmax/--kernel/--max-new-tokens.
    """
    from rankkit.capture import capture as run_capture
    from rankkit.capture import requested_oracle
    from rankkit.progress import ignore
    from rankkit.shards import shard

    shown_as = output_format(table_format, as_json)
    rank, _ = shard()
    options = requested_oracle(oracle, _oracle_options(answer, softmax, kernel, max_new_tokens))
    with progress_bar("capture") as show:
        summary = run_capture(
            model=model,
            data=data,
            probes=probes,
            out=out,
            limit=limit,
            device=device,
            overwrite=overwrite,
            oracle=options,
            draft=draft,
            progress=show if rank == 0 else ignore,
            allow_overlength=allow_overlength,
            score_dtype=score_dtype,
            device_map=device_map,
            threads=threads,
        )
    if rank == 0:
        _print_summary(summary, shown_as, f"capture → {summary.out}")


@app.command()
def oracle(
    store: Path = typer.Argument(..., help="A store written by rankkit capture."),
    model: str = typer.Option(None, help="The model the store was captured with, if not the default."),
    answer: str = typer.Option(
        defaults.ORACLE_ANSWER, help="generated or reference (teacher-forced gold answer)."
    ),
    softmax: bool = typer.Option(False, help="Post-softmax attention instead of raw logits."),
    kernel: int = typer.Option(
        defaults.ORACLE_KERNEL, min=1, help="1-D average-pooling kernel: an odd width (the pooling keeps the length)."
    ),
    max_new_tokens: MaxNewTokens = defaults.MAX_NEW_TOKENS,
    redo: bool = typer.Option(
        False,
        help="Recompute every oracle made with other settings (needed to change them); one made with these "
        "is kept, so an interrupted --redo resumes.",
    ),
    device: Device = defaults.DEVICE,
    device_map: DeviceMap = None,
    threads: Threads = None,
    as_json: AsJson = False,
    table_format: Format = "table",
) -> None:
    """Add the Answer-Informed Oracle (CLAA Algorithm 1) to a store captured earlier.

    Settings other than those of the store's oracles are refused unless --redo. Ctrl-C or
    SIGTERM keeps every oracle written and exits 130; the same command resumes. Under
    torchrun each rank adds the oracles of its share of the examples.
    """
    from rankkit.capture import add_oracle
    from rankkit.progress import ignore
    from rankkit.shards import shard

    shown_as = output_format(table_format, as_json)
    rank, _ = shard()
    with progress_bar("oracle") as show:
        summary = add_oracle(
            store,
            options=_oracle_options(answer, softmax, kernel, max_new_tokens),
            model=model,
            device=device,
            redo=redo,
            progress=show if rank == 0 else ignore,
            device_map=device_map,
            threads=threads,
        )
    if rank == 0:
        _print_summary(summary, shown_as, f"oracle → {summary.out}")
