"""Polars frames as rich tables for the terminal, readable at 80 columns.

Metric columns get short headers, and the table's caption is the legend of the ones it
shows. No cell or header is ever cut with an ellipsis.
"""

from __future__ import annotations

from collections.abc import Mapping

import polars as pl
from rich.table import Table
from rich.text import Text

# column -> (short header, what it holds). Spearman and recall follow rankkit.eval.compare,
# the diffusion columns rankkit.eval.diffusion, the ratios rankkit.bench and rankkit.overhead.
HEADERS: Mapping[str, tuple[str, str]] = {
    "spearman": ("ρ", "Spearman with the oracle at the layer shown"),
    "kendall": ("τ_K", "Kendall's tau with the oracle at the layer shown"),
    "mean_spearman": ("mean ρ", "ρ averaged over layers"),
    "std_spearman": ("sd ρ", "standard deviation of ρ over layers"),
    "min_spearman": ("min ρ", "lowest ρ over layers"),
    "trough_layer": ("trough", "layer of the lowest ρ"),
    "layer_to_layer": ("adj ρ", "mean Spearman between adjacent layers' rankings"),
    "recall_at_10": ("rec10", "share of the oracle's top 10% in the method's top 10%"),
    "recall_at_20": ("rec20", "same at 20%"),
    "recall_at_40": ("rec40", "same at 40%"),
    "needle_recall": ("needle", "share of the evidence tokens the method keeps"),
    "n_examples": ("n", "examples averaged"),
    "accuracy": ("acc", "share of answers with full marks"),
    "answer_logprob": ("log p", "log-probability of the reference answer, teacher-forced"),
    "first_token_kl": ("KL 1st token", "KL(unpruned || pruned) of the first answer token's distribution"),
    "evidence_attention": ("attn ev", "share of the answer's attention on the evidence (unpruned run)"),
    "examples": ("n", "examples averaged"),
    "baseline_s": ("base s", "plain transformers' seconds, median of the repeats"),
    "rankkit_s": ("rk s", "rankkit's seconds, median of the repeats"),
    "time_ratio": ("time×", "rankkit's time over the baseline's"),
    "baseline_peak_mib": ("base MiB", "plain transformers' peak memory"),
    "rankkit_peak_mib": ("rk MiB", "rankkit's peak memory"),
    "memory_ratio": ("mem×", "rankkit's peak memory over the baseline's"),
    "ttft_ratio": ("ttft", "time to first token over full's"),
    "ideal_ratio": ("ideal", "compute-model TTFT over full's"),
    "kv_ratio": ("kv", "KV cache bytes over full's"),
}


def frame_table(frame: pl.DataFrame, title: str, digits: int = 3) -> Table:
    """One row per frame row; floats rounded to ``digits``, missing values as '-'; short headers, legend below."""
    shown = [name for name in frame.columns if name in HEADERS]
    legend = "\n".join(f"{HEADERS[name][0]}: {HEADERS[name][1]}" for name in shown)
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
            header, justify="right" if dtype.is_numeric() else "left", min_width=width, no_wrap=True
        )
    for row in zip(*cells, strict=True):
        table.add_row(*map(Text, row))
    return table


def _cell(value, digits: int) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)
