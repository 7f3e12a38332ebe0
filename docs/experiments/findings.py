"""What the scripts of docs/experiments share: run an experiment file with ``rankkit sweep``, read
its stage parquets one cell at a time, and rewrite a marked section of docs/findings.md.

A section is the text between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``; everything in
it is written by code, so the numbers in the docs come from the sweep's outputs.
"""

from __future__ import annotations

import re
from pathlib import Path

import polars as pl

from rankkit import outputs
from rankkit.cli.progress import stage_bars
from rankkit.experiment import DataCell, Experiment, read_experiment
from rankkit.sweep import sweep, tag_columns

EXPERIMENTS = Path(__file__).resolve().parent
FINDINGS = EXPERIMENTS.parent / "findings.md"


def run_experiment(name: str, out: Path) -> Experiment:
    """Run (or resume) ``docs/experiments/NAME.toml`` into ``out``; returns the experiment."""
    path = EXPERIMENTS / f"{name}.toml"
    with stage_bars(name) as show:
        sweep(path, out, progress=show)
    return read_experiment(path)[0]


def cell_frame(out: Path, output: str, cell: DataCell) -> pl.DataFrame:
    """The rows of one cell in the sweep's ``OUTPUT.parquet`` (e.g. ``compare.summary``), without the
    columns naming the unit: the frame the library call on that cell returned."""
    frame = pl.read_parquet(out / f"{output}.parquet").filter(pl.col("cell") == cell.name)
    return frame.drop(tag_columns(output.partition(".")[0]))


def rewrite_section(name: str, body: str) -> None:
    """Replace the text between the section's markers in docs/findings.md with ``body``."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = FINDINGS.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(f"{FINDINGS} has no {begin} ... {end} section to fill")
    outputs.write_text(pattern.sub(lambda _: f"{begin}\n{body}\n{end}", text), FINDINGS)
