"""Polars frames as rich tables for the terminal."""

from __future__ import annotations

import polars as pl
from rich.table import Table


def frame_table(frame: pl.DataFrame, title: str, digits: int = 3) -> Table:
    """One row per frame row; floats rounded to ``digits``, missing values as '-'."""
    table = Table(title=title)
    for name, dtype in frame.schema.items():
        table.add_column(name, justify="right" if dtype.is_numeric() else "left")
    for row in frame.iter_rows():
        table.add_row(*(_cell(value, digits) for value in row))
    return table


def _cell(value, digits: int) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)
