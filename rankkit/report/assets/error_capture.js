// Registered before plotly.js loads, so errors anywhere on the page are reported.
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
