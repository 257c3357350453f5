// Entry point: hash routing between the pages, the header (Start/Stop, connection state), the
// status WebSocket, and the wiring of the dashboard and conversation pages.

import * as api from './api.js';
import { setText } from './dom.js';
import { Dashboard } from './dashboard.js';
import { Booth, DEFAULT_MIX, DEFAULT_RATE_RPS } from './booth.js';
import { Conversations } from './conversations.js';
import { Ladder } from './ladder.js';
import { TracePanel } from './trace.js';

const STATUS_POLL_MS = 3000; // REST polling of /api/status while the WebSocket is down
const TOAST_MS = 6000;

const $ = (id) => document.getElementById(id);

const state = {
  status: null,
  connected: false,
  busy: false, // a Start/Stop request is in flight
  baselineLoaded: false,
  page: null,
};

let toastTimer = null;
function toast(message) {
  const box = $('toast');
  setText(box, message);
  box.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => { box.hidden = true; }, TOAST_MS);
}

const dashboard = new Dashboard({
  onConcurrency: async (n) => {
    try {
      applyStatus(await api.setConcurrency(n));
    } catch (err) {
      toast(`Could not set concurrency to ${n}: ${err.message}`);
    }
  },
});

/** A Status (the answer of most POSTs); other answers are followed by a fresh GET. */
function isStatus(value) {
  return !!value && typeof value === 'object' && Array.isArray(value.lanes);
}

async function applyAnswer(answer) {
  applyStatus(isStatus(answer) ? answer : await api.getStatus());
}

const booth = new Booth({
  onConfig: async (change, label) => {
    try {
      applyStatus(await api.configureWorkload(change));
      booth.clearError();
    } catch (err) {
      booth.showError(`${label} failed: ${err.message}`);
      api.getStatus().then(applyStatus, () => {});
    }
  },
  onAuto: async (enabled) => {
    const label = enabled ? 'Auto mode' : 'Manual mode';
    try {
      await applyAnswer(await (enabled ? api.scenarioAuto() : api.scenarioManual()));
      booth.clearError();
    } catch (err) {
      booth.showError(`${label} failed: ${err.message}`);
    }
  },
});

const ladder = new Ladder({
  // A failure rejects: the panel shows the API's message.
  onSwitch: async (phase) => applyAnswer(await api.switchPhase(phase)),
});

const tracePanel = new TracePanel();

const conversations = new Conversations({
  isCompare: () => (state.status?.lanes?.length ?? 0) === 2,
});

// ---- access ----

/**
 * A 401 from the API: the load generator wants its token (--api-token) and this page has
 * none, or a wrong one. Say so and how to open the page, instead of staying "disconnected".
 */
function onApiError(err) {
  if (err?.status !== 401) return;
  const banner = $('auth-banner');
  const why = api.hasApiToken()
    ? 'The load generator refused the token in this page\'s address.'
    : 'This load generator needs its API token.';
  setText(banner, `${why} Open the dashboard as ${location.origin}${location.pathname}?token=TOKEN `
    + `with the token it was started with (--api-token or KVROUTE_API_TOKEN). Server: ${err.message}`);
  banner.hidden = false;
}

function clearApiError() {
  $('auth-banner').hidden = true;
}

// ---- header ----

function renderHeader() {
  const running = !!state.status?.running;
  const known = state.status !== null;
  $('btn-start').disabled = !state.connected || state.busy || !known || running;
  $('btn-stop').disabled = !state.connected || state.busy || !known || !running;
  $('btn-reset').disabled = !state.connected || state.busy || !known;
  setText($('ws-state'), state.connected ? 'connected' : 'disconnected');
  $('ws-indicator').classList.toggle('up', state.connected);
  const runState = $('run-state');
  setText(runState, !known ? '' : running ? 'running' : 'stopped');
  runState.classList.toggle('running', running);
}

async function runAction(action, label) {
  state.busy = true;
  renderHeader();
  try {
    await applyAnswer(await action());
    booth.clearError();
  } catch (err) {
    toast(`${label} failed: ${err.message}`);
    booth.showError(`${label} failed: ${err.message}`);
    // 409 means our view was stale; fetch the truth.
    api.getStatus().then(applyStatus, () => {});
  } finally {
    state.busy = false;
    renderHeader();
  }
}

$('btn-start').addEventListener('click', () =>
  runAction(() => api.startWorkload(dashboard.concurrency()), 'Start'));
$('btn-stop').addEventListener('click', () => runAction(() => api.stopWorkload(), 'Stop'));

/** Reset: auto mode off, the workload stopped, back to Balanced at the default rate. */
async function reset() {
  if (state.status?.scenario?.mode === 'auto') await api.scenarioStop();
  const fresh = await api.getStatus();
  if (fresh.running) await api.stopWorkload();
  return api.configureWorkload({ mix: { ...DEFAULT_MIX }, rate: DEFAULT_RATE_RPS });
}

$('btn-reset').addEventListener('click', () => runAction(reset, 'Reset'));

// ---- status ----

function applyStatus(status) {
  if (!isStatus(status)) return;
  clearApiError();
  // Ignore answers older than what is shown (a REST answer racing the WebSocket).
  if (state.status && typeof status.time_ms === 'number' && typeof state.status.time_ms === 'number'
    && status.time_ms < state.status.time_ms) return;
  state.status = status;
  renderHeader();
  dashboard.update(status);
  booth.update(status);
  ladder.update(status);
  tracePanel.update(status);
}

function loadBaseline() {
  api.getBaseline().then(
    (baseline) => { state.baselineLoaded = true; dashboard.setBaseline(baseline); },
    (err) => {
      const text = err.status === 404
        ? 'No benchmark results loaded. Run kvroute bench --out DIR and point the load generator at its results.json.'
        : `Could not load benchmark results: ${err.message}`;
      dashboard.setBaseline(null, text);
    });
}

function loadHistory() {
  api.getHistory().then((history) => dashboard.seedHistory(history), () => {});
}

const socket = new api.StatusSocket({
  onStatus: applyStatus,
  onConnection: (connected) => {
    state.connected = connected;
    renderHeader();
    if (connected) {
      // Fill what was missed while disconnected.
      loadHistory();
      if (!state.baselineLoaded) loadBaseline();
    }
  },
});

setInterval(() => {
  if (!state.connected) api.getStatus().then(applyStatus, onApiError);
}, STATUS_POLL_MS);

// ---- routing ----

const PAGES = ['dashboard', 'conversations', 'conversation', 'architecture', 'kv-routing', 'features'];

function parseHash() {
  const parts = location.hash.replace(/^#\/?/, '').split('/');
  if (parts[0] === 'conversations' && parts[1]) {
    return { page: 'conversation', id: decodeURIComponent(parts.slice(1).join('/')) };
  }
  return { page: PAGES.includes(parts[0]) && parts[0] !== 'conversation' ? parts[0] : 'dashboard' };
}

function route() {
  const { page, id } = parseHash();
  for (const section of document.querySelectorAll('main > .page')) {
    section.hidden = section.dataset.page !== page;
  }
  const tab = page === 'conversation' ? 'conversations' : page;
  for (const link of document.querySelectorAll('nav.tabs a')) {
    const active = link.dataset.page === tab;
    link.classList.toggle('active', active);
    if (active) link.setAttribute('aria-current', 'page');
    else link.removeAttribute('aria-current');
  }
  conversations.stop();
  if (page === 'conversations') conversations.showList();
  if (page === 'conversation') conversations.showDetail(id);
  dashboard.setVisible(page === 'dashboard');
  if (state.page !== page) window.scrollTo(0, 0);
  state.page = page;
}

window.addEventListener('hashchange', route);

// ---- start ----

renderHeader();
route();
api.getStatus().then(applyStatus, onApiError);
loadBaseline();
loadHistory();
socket.open();
