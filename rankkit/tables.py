"""Polars frames as rich tables for the terminal, readable at 80 columns, and a command's rows as
CSV or JSON (``--format``) for scripts.

Metric columns get short headers, and the table's caption is the legend of the ones it
shows. No cell or header is ever cut with an ellipsis.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import polars as pl
from rich.table import Table
from rich.text import Text

# column -> (short header, what it holds). Spearman and recall follow rankkit.eval.compare,
# the diffusion columns rankkit.eval.diffusion, the ratios rankkit.bench and rankkit.overhead.
HEADERS: Mapping[str, tuple[str, str]] = {
    "spearman": ("ρ", "Spearman with the oracle at the layer shown"),
    "kendall": ("τ_K", "Kendall's tau with the oracle at the layer shown"),
    "mean_spearman": ("mean ρ", "ρ averaged over layers per example, then over examples"),
    "std_spearman": ("sd ρ", "standard deviation of ρ over layers"),
    "min_spearman": ("min ρ", "lowest ρ over layers"),
    "trough_layer": ("trough", "layer of the lowest ρ"),
    "layer_to_layer": ("adj ρ", "ρ of adjacent layers' rankings, averaged as mean ρ"),
    "recall_at_10": ("rec10", "share of the oracle's top 10% in the method's top 10%"),
    "recall_at_20": ("rec20", "same at 20%"),
    "recall_at_40": ("rec40", "same at 40%"),
    "needle_recall": ("needle", "share of the evidence in the top keep of its ranking"),
    "n_examples": ("n", "examples averaged"),
    "n_clusters": ("ind.", "independent samples: examples sharing a haystack or needle count once"),
    "difference": ("Δρ", "mean paired difference method - baseline"),
    "p_value": ("p", "Wilcoxon signed-rank p-value of the difference"),
    "higher_layers": (
        "sig.↑",
        "layers where the method is higher with p < 0.05 (of the layers both methods have)",
    ),
    "lower_layers": ("sig.↓", "layers where the method is lower with p < 0.05"),
    "evidence_kept_offline": ("ev off", "share of the evidence its selection keeps offline (top keep + window, sinks)"),
    "evidence_kept": ("ev on", "share of the evidence tokens the end-to-end run keeps"),
    "accuracy": ("acc", "mean answer score in [0, 1] (the share right where each is right or wrong)"),
    "correct": ("correct", "share of answers with full marks"),
    "answer_logprob": ("log p", "log-probability of the reference answer, teacher-forced"),
    "first_token_kl": ("KL 1st token", "KL(unpruned || pruned) of the first answer token's distribution"),
    "evidence_attention": ("attn ev", "share of the answer's attention on the evidence (unpruned run)"),
    "examples": ("n", "examples averaged"),
    "baseline_s": ("base s", "plain transformers' seconds, median of the repeats"),
    "rankkit_s": ("rk s", "rankkit's seconds, median of the repeats"),
    "time_ratio": ("time×", "rankkit's time over the baseline's, median of each repeat's ratio"),
    "baseline_peak_mib": ("base MiB", "plain transformers' peak memory"),
    "rankkit_peak_mib": ("rk MiB", "rankkit's peak memory"),
    "memory_ratio": ("mem×", "rankkit's peak memory over the baseline's"),
    "bound_s": ("bound s", "a step's weight and KV bytes read at the memory bandwidth in the title"),
    "bound_ratio": ("bound×", "rankkit's time over the bound"),
    "read_bound_s": ("read s", "the same bytes at the bandwidth a streaming read reaches here"),
    "relative_variance": ("rel. var.", "the layer's rank variance over L_min's (ASL Alg. 2)"),
    "ttft_ratio": ("ttft", "time to first token over full's"),
    "ideal_ratio": ("ideal", "compute-model TTFT over full's"),
    "kv_ratio": ("kv", "KV cache bytes over full's"),
}


def frame_table(
    frame: pl.DataFrame, title: str, digits: int = 3, *, intervals_over: str = "examples", interval_digits: int = 2
) -> Table:
    """One row per frame row; floats rounded to ``digits``, missing values as '-'; short headers, legend below.

    A column with interval columns beside it (``rankkit.eval.stats.interval_columns``) shows
    "0.62 [0.55, 0.69]" in ``interval_digits`` ("0.62 [–]" without an interval), and the interval columns are not shown on their
    own; the legend says what the interval resamples (``intervals_over``).
    """
    frame, merged = _merge_intervals(frame, interval_digits)
    shown = [name for name in frame.columns if name in HEADERS]
    legend = "\n".join(f"{HEADERS[name][0]}: {HEADERS[name][1]}" for name in shown)
    if merged:
        legend += f"\n[low, high]: 95% interval over {intervals_over}"
    # No rules and one space between columns: ten metric columns and a method name fit 80 columns.
    table = Table(
        title=Text(title),
        caption=Text(legend) if legend else None,
        caption_justify="left",
        box=None,
        padding=(0, 1, 0, 0),
        header_style="bold underline",
    )
    cells = [[_cell(value, digits) for value in column] for column in frame.iter_columns()]
    for (name, dtype), column in zip(frame.schema.items(), cells, strict=True):
        header = HEADERS[name][0] if name in HEADERS else name
        # A cell is never cut: the column is as wide as its widest cell and header.
        width = max([len(header), *map(len, column)])
        table.add_column(
            header,
            justify="right" if dtype.is_numeric() or name in merged else "left",
            min_width=width,
            no_wrap=True,
        )
    for row in zip(*cells, strict=True):
        table.add_row(*map(Text, row))
    return table


def _merge_intervals(frame: pl.DataFrame, digits: int) -> tuple[pl.DataFrame, list[str]]:
    """``frame`` with each metric that has interval columns as one text column "mean [low, high]",
    its own count beside it where it is not the row's (``rankkit.eval.stats.row_with_interval``)."""
    from rankkit.eval.stats import count_column, interval_columns, row_with_interval

    merged = [name for name in frame.columns if set(interval_columns(name)) <= set(frame.columns)]
    if not merged:
        return frame, merged
    rows = frame.to_dicts()
    texts = [
        pl.Series(name, [row_with_interval(row, name, digits=digits) for row in rows], dtype=pl.String)
        for name in merged
    ]
    hidden = {column for name in merged for column in (*interval_columns(name), count_column(name))}
    return frame.with_columns(texts).drop(hidden, strict=False), merged


def _cell(value, digits: int) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


FORMATS = ("table", "csv", "json")


def rows_text(rows: Sequence[Mapping[str, Any]], table_format: str, whole: Any = None) -> str:
    """A command's rows as ``table_format`` (csv or json), every value whole.

    csv: a header of every key in the order the rows first name it, then one line per row;
    a missing, null or NaN value is an empty field, a list or mapping its compact JSON. json: ``whole``
    (what the command's ``--json`` prints, when that is more than its rows), else the rows.
    """
    if table_format == "json":
        return json_text(rows if whole is None else whole, indent=2)
    if table_format != "csv":
        raise ValueError(f"rows are written as csv or json, not {table_format!r}")
    header = list(dict.fromkeys(key for row in rows for key in row))
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    for row in rows:
        writer.writerow(_field(row.get(key)) for key in header)
    return buffer.getvalue().rstrip("\n")


def json_text(value: Any, indent: int | None = None) -> str:
    """``value`` as the JSON a command prints for scripts. A NaN or infinite float (a figure not
    measured, or undefined) is written null: Python's default writes NaN, which no JSON parser
    outside Python reads."""
    return json.dumps(_finite(value), indent=indent, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def flat_rows(mapping: Mapping[str, Any], prefix: str = "") -> list[dict[str, Any]]:
    """A nested mapping as key/value rows, nested keys joined by dots (``examples.complete``)."""
    rows = []
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            rows += flat_rows(value, f"{name}.")
        else:
            rows.append({"key": name, "value": value})
    return rows


def _field(value: Any) -> Any:
    value = _finite(value)
    if isinstance(value, Mapping | list | tuple):
        return json.dumps(value, separators=(",", ":"))
    return "" if value is None else value
