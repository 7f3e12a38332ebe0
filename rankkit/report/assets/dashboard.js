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
  let hookStatus = {};  // what a test hook (window.rankkitTestHook) adds to the status
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
                    panel_ms: timings, state: state};
    config.panels.forEach(function (id) {
      const div = document.getElementById('plot-' + id);
      if (!(id in figures)) {  // a missing panel, or one that is a table only
        status.panels[id] = div.classList.contains('missing') ? {missing: true, text: div.textContent}
          : {table_rows: document.querySelectorAll('#panel-' + id + ' table.numbers tbody tr').length};
        return;
      }
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
    Object.assign(status, hookStatus);
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
  function caught(error) { window.rankkitErrors.push(String(error && (error.stack || error))); }

  // One panel after another, so the first ones show while the rest are drawn.
  config.panels.filter(id => id in figures)
    .reduce((previous, id) => previous.then(() => draw(id)), Promise.resolve())
    .then(() => window.rankkitTestHook
      ? window.rankkitTestHook({inputs: inputs, setControl: setControl}).then(found => { hookStatus = found; })
      : null)
    .catch(caught)
    .then(report);

  inputs.forEach(function (input) {
    input.addEventListener(input.type === 'range' ? 'input' : 'change', function () {
      setControl(input, input.value).catch(caught).then(report);
    });
  });

  // -- the numbers under a figure: a click on a column's header sorts by it, a second click reverses --
  function sortBy(table, column) {
    const body = table.tBodies[0], header = table.tHead.rows[0].cells[column];
    const descending = header.dataset.sorted === 'ascending';
    Array.from(table.tHead.rows[0].cells).forEach(cell => { delete cell.dataset.sorted; });
    header.dataset.sorted = descending ? 'descending' : 'ascending';
    function key(row) {
      const cell = row.cells[column];
      return 'value' in cell.dataset ? Number(cell.dataset.value) : cell.textContent;
    }
    function order(x, y) {  // a missing number (NaN) after every other
      if (typeof x !== 'number' || typeof y !== 'number') return String(x).localeCompare(String(y));
      return isNaN(x) || isNaN(y) ? Number(isNaN(x)) - Number(isNaN(y)) : x - y;
    }
    const rows = Array.from(body.rows).sort((a, b) => (descending ? -1 : 1) * order(key(a), key(b)));
    rows.forEach(row => body.appendChild(row));
  }
  document.querySelectorAll('table.sortable').forEach(function (table) {
    Array.from(table.tHead.rows[0].cells).forEach(function (header, column) {
      header.addEventListener('click', () => sortBy(table, column));
    });
  });
})();
