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
in the URL fragment (``report.html#example=niah-3&colour=score``); ``#selftest`` then steps
every control through all its values.

The page reports on itself in ``<pre id="rankkit-status">`` once every panel has drawn:
JavaScript errors (caught from the first script on), per panel the traces, visible points and
SVG trace groups drawn, the explorer's current view, and the render time. The browser test
reads it from ``chromium --dump-dom``.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import plotly.graph_objects as go
import plotly.offline

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
    body = (
        f'<div class="plot" id="plot-{panel.id}"></div>'
        if panel.figure is not None
        else f'<div class="missing" id="plot-{panel.id}">{panel.missing}</div>'
    )
    return (
        f'<section class="panel" id="panel-{panel.id}"><h2>{html.escape(panel.title)}</h2>'
        f'<p class="caption">{panel.caption}</p>{body}</section>'
    )


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
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(page.title)}</title>
<script>{_ERROR_CAPTURE_JS}</script>
<style>{_CSS}</style>
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
<script>{_RUNTIME_JS}</script>
</body>
</html>
"""


# Registered before plotly.js loads, so errors anywhere on the page are reported.
_ERROR_CAPTURE_JS = """
window.rankkitErrors = [];
function rankkitError(text) {
  window.rankkitErrors.push(text);
  // Until the runtime reports, the status shows the errors: a runtime that failed to start still tells.
  const status = document.getElementById('rankkit-status');
  if (status && !status.textContent) status.textContent = JSON.stringify({errors: window.rankkitErrors, done: false});
}
window.onerror = function (message, source, line, column) {
  rankkitError(String(message) + ' at ' + source + ':' + line + ':' + column);
};
window.addEventListener('unhandledrejection', function (event) {
  rankkitError('unhandled rejection: ' + String(event.reason && (event.reason.stack || event.reason)));
});
"""

_CSS = """
:root { --ink: #1d2430; --muted: #5b6575; --line: #e3e7ee; --accent: #2d6cdf; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 Inter, "Segoe UI", Helvetica, Arial, sans-serif; color: var(--ink); background: #f6f8fb; }
header { padding: 18px 28px 8px; background: #fff; border-bottom: 1px solid var(--line); }
h1 { margin: 0 0 8px; font-size: 20px; }
.facts { display: flex; flex-wrap: wrap; gap: 4px 28px; margin: 0; }
.facts div { display: flex; gap: 6px; } .facts dt { color: var(--muted); } .facts dd { margin: 0; font-weight: 600; }
nav.controls { position: sticky; top: 0; z-index: 10; display: flex; flex-wrap: wrap; gap: 10px 22px; align-items: center;
  padding: 10px 28px; background: rgba(255,255,255,0.96); border-bottom: 1px solid var(--line); box-shadow: 0 1px 4px rgba(0,0,0,0.04); }
.control { display: flex; align-items: center; gap: 6px; color: var(--muted); font-size: 13px; }
.control select, .control input { font: inherit; color: var(--ink); }
.control select { padding: 3px 6px; border: 1px solid #cfd6e0; border-radius: 4px; background: #fff; max-width: 260px; }
.control output { min-width: 2ch; font-weight: 600; color: var(--ink); }
main { padding: 16px 28px 40px; display: grid; gap: 18px; }
.panel { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 14px 18px 8px; }
.panel h2 { margin: 0 0 2px; font-size: 16px; }
.caption { margin: 0 0 6px; color: var(--muted); max-width: 110ch; }
.missing { padding: 22px; border: 1px dashed #c9d1dc; border-radius: 6px; color: var(--muted); background: #fafbfd; }
code { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12.5px; background: #eef2f7; padding: 1px 4px; border-radius: 3px; }
"""

_RUNTIME_JS = r"""
(function () {
  'use strict';
  const started = performance.now();
  const config = JSON.parse(document.getElementById('rankkit-config').textContent);
  const figures = JSON.parse(document.getElementById('rankkit-figures').textContent);
  const state = {};
  const inputs = document.querySelectorAll('[data-control]');
  const fromUrl = new URLSearchParams(location.hash.slice(1));
  inputs.forEach(function (input) {
    const wanted = fromUrl.get(input.dataset.control);
    if (wanted !== null && (input.type === 'range' || Array.from(input.options).some(o => o.value === wanted))) {
      input.value = wanted;
    }
    state[input.dataset.control] = input.value;
  });

  function matches(tag, value) {
    return typeof tag === 'number' ? Math.abs(tag - Number(value)) < 1e-9 : String(tag) === value;
  }
  const filters = Object.keys(config.controls).filter(id => config.controls[id] === 'filter');

  // What the controls make of a figure: trace visibility (filters) and the positions of the
  // shapes named after a control.
  function controlled(data, shapes) {
    const visible = data.map(function (trace) {
      const meta = trace.meta || {};
      if (!filters.some(id => id in meta)) return trace.visible === undefined ? true : trace.visible;
      return filters.every(id => !(id in meta) || matches(meta[id], state[id]));
    });
    const shapeUpdate = {};
    (shapes || []).forEach(function (shape, index) {
      const parts = (shape.name || '').split(':');
      if (parts.length !== 3 || !(parts[0] in state)) return;
      const value = Number(state[parts[0]]), half = Number(parts[2]);
      shapeUpdate['shapes[' + index + '].' + parts[1] + '0'] = value - half;
      shapeUpdate['shapes[' + index + '].' + parts[1] + '1'] = value + half;
    });
    return {visible: visible, shapes: shapeUpdate};
  }
  function applyToFigure(figure) {  // before the first draw: one render per panel
    const update = controlled(figure.data, figure.layout.shapes);
    figure.data.forEach((trace, index) => { trace.visible = update.visible[index]; });
    Object.keys(update.shapes).forEach(function (key) {
      const found = key.match(/^shapes\[(\d+)\]\.(\w+)$/);
      figure.layout.shapes[Number(found[1])][found[2]] = update.shapes[key];
    });
    return figure;
  }
  function applyToPlot(div) {  // after a control changed: one render per panel
    const update = controlled(div.data, div.layout.shapes);
    return Plotly.update(div, {visible: update.visible}, update.shapes);
  }

  // -- token-score explorer: an example's arrays are parsed and decoded when it is first picked --
  function halfToFloat(bits) {
    const sign = bits & 0x8000 ? -1 : 1, exponent = (bits >> 10) & 0x1f, fraction = bits & 0x3ff;
    if (exponent === 0) return sign * Math.pow(2, -14) * (fraction / 1024);
    if (exponent === 31) return fraction ? NaN : sign * Infinity;
    return sign * Math.pow(2, exponent - 15) * (1 + fraction / 1024);
  }
  function decode(array) {
    const binary = atob(array.b64), bytes = new Uint8Array(binary.length);
    for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
    switch (array.dtype) {
      case 'u1': return bytes;
      case 'u2': return new Uint16Array(bytes.buffer);
      case 'u4': return new Uint32Array(bytes.buffer);
      case 'f4': return new Float32Array(bytes.buffer);
      case 'f2': return Float32Array.from(new Uint16Array(bytes.buffer), halfToFloat);
    }
    throw new Error('unknown array dtype ' + array.dtype);
  }
  const examples = {};
  function example(id) {
    if (!(id in examples)) {
      const element = Array.from(document.querySelectorAll('script.rankkit-example')).find(e => e.dataset.example === id);
      examples[id] = JSON.parse(element.textContent);
      examples[id].decoded = {};
    }
    return examples[id];
  }
  function bins(payload, name) {  // {score, offset, rank} of the oracle or a probe
    if (!(name in payload.decoded)) {
      const arrays = name === 'oracle' ? payload.oracle : payload.probes[name];
      payload.decoded[name] = arrays && {score: decode(arrays.score), offset: decode(arrays.offset), rank: decode(arrays.rank)};
    }
    return payload.decoded[name];
  }
  function heatmapData(payload, found, rows) {
    const numBins = payload.edges.length - 1, byRank = state.colour === 'rank';
    const z = [], customdata = [], text = [];
    for (let row = 0; row < rows; row++) {
      const zRow = [], dataRow = [], textRow = [];
      for (let b = 0; b < numBins; b++) {
        const cell = row * numBins + b, top = payload.edges[b] + found.offset[cell];
        const rank = found.rank[cell], score = found.score[cell];
        zRow.push(byRank ? 1 - rank / Math.max(1, payload.ranked - 1) : score);
        dataRow.push([payload.edges[b], payload.edges[b + 1] - 1, top, rank + 1, score]);
        textRow.push(payload.tokens[top - payload.edges[0]]);
      }
      z.push(zRow); customdata.push(dataRow); text.push(textRow);
    }
    return {z: z, customdata: customdata, text: text};
  }
  function keptStrip(payload) {  // the columns Python marked as holding the layer's kept tokens
    const numBins = payload.edges.length - 1, layer = Math.min(Number(state.layer), payload.layers - 1);
    const key = String(Number(state.keep));
    payload.decodedKept = payload.decodedKept || {};
    const name = state.probe + ' ' + key;
    if (!(name in payload.decodedKept)) payload.decodedKept[name] = decode(payload.kept[state.probe][key]);
    const grid = payload.decodedKept[name];
    const z = [], customdata = [], text = [];
    for (let b = 0; b < numBins; b++) {
      const inTop = grid[layer * numBins + b] === 1;
      z.push(inTop ? 1 : 0); customdata.push([payload.edges[b], payload.edges[b + 1] - 1]);
      text.push(inTop ? 'kept' : 'dropped');
    }
    return {z: [z], customdata: [customdata], text: [text],
            meta: {probe: state.probe, kept_rate: Math.round(Number(state.keep) * 100) + '%', kept_layer: layer}};
  }
  function explorerFigure(template) {
    const payload = example(state.example);
    const [stripTemplate, heatTemplate, keptTemplate] = template.data;
    const x = payload.edges.map(edge => edge - 0.5);
    const meta = {probe: state.probe, ranked: payload.ranked};
    const colorbar = Object.assign({}, heatTemplate.colorbar,
      {title: {text: config.explorer.colour_titles[state.colour], side: 'right'}});
    const heat = Object.assign({}, heatTemplate, heatmapData(payload, bins(payload, state.probe), payload.layers),
      {x: x, y: Array.from({length: payload.layers}, (_, i) => i), meta: meta, name: state.probe, colorbar: colorbar});
    const oracle = payload.oracle && bins(payload, 'oracle');
    const strip = Object.assign({}, stripTemplate, oracle ? heatmapData(payload, oracle, 1) : {z: [], customdata: [], text: []},
      {x: x, y: stripTemplate.y, meta: meta});
    const kept = Object.assign({}, keptTemplate, keptStrip(payload), {x: x, y: keptTemplate.y});
    const layout = Object.assign({}, template.layout);
    const evidence = [];
    payload.evidence.forEach(function (span) {
      ['y domain', 'y2 domain'].forEach(function (yref) {
        evidence.push(Object.assign({}, layout.meta.evidence_shape,
          {name: 'evidence', x0: span[0] - 0.5, x1: span[1] - 0.5, y0: 0, y1: 1, xref: 'x', yref: yref}));
      });
    });
    layout.shapes = (layout.shapes || []).filter(shape => shape.name !== 'evidence').concat(evidence);
    layout.title = Object.assign({}, layout.title, {text: payload.title + ' · probe <b>' + state.probe + '</b>'});
    const columns = payload.width === 1 ? 'one token per column' : payload.width + ' tokens per column, max shown';
    layout.xaxis2 = Object.assign({}, layout.xaxis2, {title: {text: 'token position (context, ' + columns + ')'}});
    return applyToFigure({data: [strip, heat, kept], layout: layout});
  }

  const EXPLORER_ALSO = ['example', 'layer', 'keep'];  // other controls the explorer redraws for
  const timings = {};
  let selfTestSteps = null, selfTestHover = null;
  function draw(id) {
    const begun = performance.now();
    const figure = id === 'explorer' ? explorerFigure(figures[id]) : applyToFigure(figures[id]);
    return Plotly.newPlot('plot-' + id, figure.data, figure.layout, {responsive: true, displaylogo: false})
      .then(() => { timings[id] = Math.round(performance.now() - begun); });
  }
  function redraw(changed) {
    return Promise.all(config.panels.filter(id => id in figures).map(function (id) {
      const div = document.getElementById('plot-' + id);
      if (id === 'explorer' && (config.controls[changed] === 'explorer' || EXPLORER_ALSO.includes(changed))) {
        const figure = explorerFigure(figures[id]);
        return Plotly.react(div, figure.data, figure.layout);
      }
      return applyToPlot(div);
    }));
  }

  function countPoints(trace) {
    if (trace.visible !== true) return 0;
    if (trace.z) return trace.z.length ? trace.z.length * (trace.z[0].length || 1) : 0;
    return trace.x ? trace.x.length : trace.y ? trace.y.length : 0;
  }
  function report() {
    const status = {errors: window.rankkitErrors, panels: {}, since_navigation_ms: Math.round(performance.now()),
                    plotly_ready_ms: Math.round(window.rankkitPlotlyReady), runtime_start_ms: Math.round(started),
                    panel_ms: timings, selftest_steps: selfTestSteps,
                    selftest_hover: selfTestHover, state: state};
    config.panels.forEach(function (id) {
      const div = document.getElementById('plot-' + id);
      if (!(id in figures)) { status.panels[id] = {missing: true, text: div.textContent}; return; }
      if (!div.data) { status.panels[id] = {failed: true}; return; }
      const full = div._fullData || [];
      status.panels[id] = {
        traces: div.data.length,
        visible_traces: full.filter(trace => trace.visible === true).length,
        points: full.reduce((sum, trace) => sum + countPoints(trace), 0),
        svg_traces: div.querySelectorAll('.cartesianlayer .trace, .cartesianlayer .hm').length,
        shapes: (div.layout.shapes || []).length,
      };
    });
    if ('explorer' in figures) {
      const explorerDiv = document.getElementById('plot-explorer'), heat = explorerDiv.data[1];
      status.explorer = {example: state.example, probe: state.probe, colour: state.colour, layers: heat.z.length,
                         bins: heat.z[0].length, row_max: heat.z.map(row => Math.max.apply(null, row)),
                         kept_columns: explorerDiv.data[2].z[0].reduce((sum, value) => sum + value, 0)};
    }
    status.done = true;
    document.getElementById('rankkit-status').textContent = JSON.stringify(status);
  }

  function setControl(input, value) {
    input.value = value;
    state[input.dataset.control] = value;
    const output = document.querySelector('[data-output="' + input.dataset.control + '"]');
    if (output) output.textContent = value;
    return redraw(input.dataset.control);
  }
  // "#selftest" walks every control through its values and back, as a user would, so that a
  // headless browser sees the errors of every redraw path too.
  function selfTest() {
    let steps = 0;
    return Array.from(inputs).reduce(function (previous, input) {
      const initial = input.value;
      const values = input.type === 'range' ? [input.min, input.max] : Array.from(input.options, option => option.value);
      return values.concat([initial]).reduce(
        (chain, value) => chain.then(() => { steps += 1; return setControl(input, value); }), previous);
    }, Promise.resolve()).then(explorerHover).then(function (label) {
      selfTestHover = label;
      return steps;
    });
  }
  function explorerHover() {  // the hover label of the explorer's first column at layer 0
    const div = document.getElementById('plot-explorer');
    if (!div || !div.data) return Promise.resolve(null);
    const x = div.data[1].x;
    Plotly.Fx.hover(div, {xval: (x[0] + x[1]) / 2, yval: 0}, 'x2y2');
    return new Promise(resolve => setTimeout(resolve, 100)).then(() => div.querySelector('.hoverlayer').textContent);
  }
  function caught(error) { window.rankkitErrors.push(String(error && (error.stack || error))); }

  // One panel after another, so the first ones show while the rest are drawn.
  config.panels.filter(id => id in figures)
    .reduce((previous, id) => previous.then(() => draw(id)), Promise.resolve())
    .then(() => fromUrl.has('selftest') ? selfTest().then(steps => { selfTestSteps = steps; }) : null)
    .catch(caught)
    .then(report);

  inputs.forEach(function (input) {
    input.addEventListener(input.type === 'range' ? 'input' : 'change', function () {
      setControl(input, input.value).catch(caught).then(report);
    });
  });
})();
"""
