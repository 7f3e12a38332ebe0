// Injected by the browser tests (tests/browser.py), never shipped: with "#selftest" in the
// URL, walk every control through its values and back, as a user would, so that a headless
// browser sees the errors of every redraw path too, then hover the explorer's first column.
window.rankkitTestHook = function (dashboard) {
  'use strict';
  if (!new URLSearchParams(location.hash.slice(1)).has('selftest')) return Promise.resolve({});
  let steps = 0;
  function explorerHover() {  // the hover label of the explorer's first column at layer 0
    const div = document.getElementById('plot-explorer');
    if (!div || !div.data) return Promise.resolve(null);
    const x = div.data[1].x;
    Plotly.Fx.hover(div, {xval: (x[0] + x[1]) / 2, yval: 0}, 'x2y2');
    return new Promise(resolve => setTimeout(resolve, 100)).then(() => div.querySelector('.hoverlayer').textContent);
  }
  function sortNumbers() {  // the Spearman table's first rho after a click on its header (ascending), then another
    const table = document.querySelector('#panel-spearman table.sortable');
    if (!table) return null;
    const header = Array.from(table.tHead.rows[0].cells).find(cell => cell.textContent === 'spearman');
    return [0, 1].map(function () {
      header.click();
      return Number(table.tBodies[0].rows[0].cells[header.cellIndex].dataset.value);
    });
  }
  return Array.from(dashboard.inputs).reduce(function (previous, input) {
    const initial = input.value;
    const values = input.type === 'range' ? [input.min, input.max] : Array.from(input.options, option => option.value);
    return values.concat([initial]).reduce(
      (chain, value) => chain.then(() => { steps += 1; return dashboard.setControl(input, value); }), previous);
  }, Promise.resolve()).then(explorerHover)
    .then(label => ({selftest_steps: steps, selftest_hover: label, selftest_sorted: sortNumbers()}));
};
