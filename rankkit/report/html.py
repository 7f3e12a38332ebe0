"""One self-contained HTML page: plotly.js inlined once, the panels' figures as JSON, the
explorer's per-example arrays as compact base64, and a small runtime wiring the controls.

How the controls act, by kind (``Control.kind``):

- ``filter``: a trace whose ``meta`` has the control's id is visible only while its value matches;
- ``explorer``: the token-score explorer redraws from the picked example's arrays (it also
  redraws for the example, layer and keep-rate controls);
- ``shape``: nothing beyond what every control does: move the shapes named
  ``"<control id>:<axis>:<half width>"`` to its value.

Each example's explorer arrays sit in their own ``<script type="application/json">`` and are
parsed and decoded only when the example is first picked. Initial control values can be set
in the URL fragment (``report.html#example=niah-3&colour=score``).

The CSS and JavaScript live in ``rankkit/report/assets`` (package data, inlined here at write
time): ``error_capture.js`` runs first, ``dashboard.js`` is the runtime.

The page reports on itself in ``<pre id="rankkit-status">`` once every panel has drawn:
JavaScript errors (caught from the first script on), per panel the traces, visible points and
SVG trace groups drawn, the explorer's current view, and the render time. The browser tests
read it from ``chromium --dump-dom``; they inject a ``window.rankkitTestHook`` (called with
the controls and ``setControl`` after the first draw, its result merged into the status) to
step every control, which no written page carries.
"""

from __future__ import annotations

import base64
import html
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib.resources import files
from typing import Any, Literal

import numpy as np
import plotly.graph_objects as go
import plotly.offline
import polars as pl

from rankkit.outputs import GENERATOR_TAG

ControlKind = Literal["filter", "explorer", "shape"]


@dataclass(frozen=True)
class Control:
    id: str
    label: str
    kind: ControlKind
    options: Sequence[tuple[Any, str]] = ()  # (value, label); empty for a slider
    default: Any = None
    slider_range: tuple[int, int] | None = None  # inclusive, for a slider


@dataclass(frozen=True)
class Panel:
    id: str
    title: str
    caption: str  # what the panel shows and where it comes from
    figure: go.Figure | None = None
    missing: str | None = None  # HTML naming the command that produces the data, when figure is None
    # every number the figure draws, as a sortable table below it; without a figure, the panel's table, open
    numbers: pl.DataFrame | None = None


@dataclass
class Page:
    title: str
    facts: list[tuple[str, str]]  # header key/value pairs
    controls: list[Control]
    panels: list[Panel]
    examples: dict[str, dict] = field(default_factory=dict)  # explorer payload per example id
    explorer: dict[str, Any] = field(default_factory=dict)  # explorer settings for the runtime


def encode_array(values: np.ndarray, dtype: str) -> dict[str, str]:
    """A little-endian array as base64 with its dtype code ("f2", "f4", "u1", "u2", "u4", "i4")."""
    array = np.ascontiguousarray(values, dtype=np.dtype(dtype).newbyteorder("<"))
    return {"dtype": dtype, "b64": base64.b64encode(array.tobytes()).decode("ascii")}


def _json_for_script(value: Any) -> str:
    """JSON safe inside a <script> element: no "</script>" or "<!--" can appear in it."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.replace("<", "\\u003c")


def _figure_json(figure: go.Figure) -> dict:
    return json.loads(figure.to_json())  # plotly's encoder: numpy as typed-array specs, NaN as null


def _control_html(control: Control) -> str:
    label = html.escape(control.label)
    if control.slider_range is not None:
        low, high = control.slider_range
        return (
            f'<label class="control">{label} <input type="range" data-control="{control.id}" '
            f'min="{low}" max="{high}" step="1" value="{control.default}">'
            f'<output data-output="{control.id}">{control.default}</output></label>'
        )
    options = "".join(
        f'<option value="{html.escape(str(value))}"{" selected" if value == control.default else ""}>'
        f"{html.escape(text)}</option>"
        for value, text in control.options
    )
    return f'<label class="control">{label} <select data-control="{control.id}">{options}</select></label>'


def _panel_html(panel: Panel) -> str:
    if panel.figure is not None:
        body = f'<div class="plot" id="plot-{panel.id}"></div>'
    elif panel.missing is not None or panel.numbers is None:
        body = f'<div class="missing" id="plot-{panel.id}">{panel.missing}</div>'
    else:  # a table-only panel
        body = f'<div class="table" id="plot-{panel.id}"></div>'
    numbers = "" if panel.numbers is None else _numbers_html(panel.numbers, shown=panel.figure is None)
    return (
        f'<section class="panel" id="panel-{panel.id}"><h2>{html.escape(panel.title)}</h2>'
        f'<p class="caption">{panel.caption}</p>{body}{numbers}</section>'
    )


def _numbers_html(frame: pl.DataFrame, *, shown: bool = False) -> str:
    """The frame as a table the runtime sorts by any column (a click on its header); numbers are shown
    to three decimals and sorted by their full value (``data-value``), missing ones as "–", sorted last."""
    head = "".join(f"<th>{html.escape(name)}</th>" for name in frame.columns)

    def cell(value) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return '<td data-value="NaN">–</td>'
        if isinstance(value, float):
            return f'<td data-value="{value!r}">{value:.3f}</td>'
        if isinstance(value, int):
            return f'<td data-value="{value}">{value}</td>'
        return f"<td>{html.escape(str(value))}</td>"

    rows = "".join("<tr>" + "".join(map(cell, row)) + "</tr>" for row in frame.iter_rows())
    return (
        f'<details class="numbers"{" open" if shown else ""}><summary>The numbers: {frame.height} rows (click a column to sort)</summary>'
        f'<table class="numbers sortable"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></details>'
    )


@cache
def asset(name: str) -> str:
    """A file of ``rankkit/report/assets`` (the page's CSS and JavaScript, shipped as package data)."""
    return files(__package__).joinpath("assets", name).read_text(encoding="utf-8")


def render(page: Page) -> str:
    figures = {panel.id: _figure_json(panel.figure) for panel in page.panels if panel.figure is not None}
    config = {
        "controls": {control.id: control.kind for control in page.controls},
        "panels": [panel.id for panel in page.panels],
        "explorer": page.explorer,
    }
    facts = "".join(
        f"<div><dt>{html.escape(key)}</dt><dd>{html.escape(value)}</dd></div>" for key, value in page.facts
    )
    example_scripts = "\n".join(
        f'<script type="application/json" class="rankkit-example" data-example="{html.escape(example_id)}">'
        f"{_json_for_script(payload)}</script>"
        for example_id, payload in page.examples.items()
    )
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
{GENERATOR_TAG}
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(page.title)}</title>
<script>{asset("error_capture.js")}</script>
<style>{asset("dashboard.css")}</style>
<script>{plotly.offline.get_plotlyjs()}</script>
<script>window.rankkitPlotlyReady = performance.now();</script>
</head>
<body>
<header><h1>{html.escape(page.title)}</h1><dl class="facts">{facts}</dl></header>
<nav class="controls">{"".join(_control_html(control) for control in page.controls)}</nav>
<main>{"".join(_panel_html(panel) for panel in page.panels)}</main>
<pre id="rankkit-status" hidden></pre>
<script type="application/json" id="rankkit-config">{_json_for_script(config)}</script>
<script type="application/json" id="rankkit-figures">{_json_for_script(figures)}</script>
{example_scripts}
<script>{asset("dashboard.js")}</script>
</body>
</html>
"""


def render_index(
    title: str, facts: Sequence[tuple[str, str]], rows: Sequence[dict[str, str]], link: str
) -> str:
    """A page of links to other pages, with the dashboards' style: one table row per entry of ``rows``
    (its keys are the columns), the ``link`` column's value being the linked page's relative path."""
    columns = list(rows[0]) if rows else [link]
    head = "".join(f"<th>{html.escape(column)}</th>" for column in columns)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td><a href="{html.escape(row[column])}">{html.escape(row[column])}</a></td>'
            if column == link
            else f"<td>{html.escape(row[column])}</td>"
            for column in columns
        )
        + "</tr>"
        for row in rows
    )
    fact_items = "".join(
        f"<div><dt>{html.escape(key)}</dt><dd>{html.escape(value)}</dd></div>" for key, value in facts
    )
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
{GENERATOR_TAG}
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title>
<style>{asset("dashboard.css")}
table.index {{ border-collapse: collapse; }} table.index th, table.index td {{ text-align: left; padding: 4px 14px 4px 0; }}</style>
</head>
<body>
<header><h1>{html.escape(title)}</h1><dl class="facts">{fact_items}</dl></header>
<main><section class="panel"><table class="index"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></section></main>
</body>
</html>
"""
