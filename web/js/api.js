// The load generator's REST API and status WebSocket (docs/LOADGEN-API.md).

/** An API error carrying the OpenAI error JSON's message and code when the server sent one. */
export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

// The API token of a load generator started with --api-token: the page is opened as
// /?token=TOKEN and sends it with every API request and the WebSocket (docs/LOADGEN-API.md).
const API_TOKEN = new URLSearchParams(location.search).get('token');

/** Whether this page was opened with `?token=`. */
export const hasApiToken = () => !!API_TOKEN;

async function request(method, path, body) {
  const init = { method, headers: { Accept: 'application/json' } };
  if (API_TOKEN) init.headers.Authorization = `Bearer ${API_TOKEN}`;
  // The server takes POST bodies only as JSON.
  if (method === 'POST') init.headers['Content-Type'] = 'application/json';
  if (body !== undefined) init.body = JSON.stringify(body);
  let response;
  try {
    response = await fetch(path, init);
  } catch (err) {
    throw new ApiError(0, `network error: ${err.message}`, 'network');
  }
  const text = await response.text();
  let json = null;
  try {
    json = text ? JSON.parse(text) : null;
  } catch {
    json = null;
  }
  if (!response.ok) {
    const message = json?.error?.message || `${response.status} ${response.statusText}`;
    throw new ApiError(response.status, message, json?.error?.code);
  }
  if (json === null) throw new ApiError(response.status, 'the answer was not JSON', 'bad_json');
  return json;
}

export const getStatus = () => request('GET', '/api/status');
export const getBaseline = () => request('GET', '/api/baseline');
export const getHistory = () => request('GET', '/api/history');
export const getConversations = (limit = 200) =>
  request('GET', `/api/conversations?limit=${encodeURIComponent(limit)}`);
export const getConversation = (id) =>
  request('GET', `/api/conversations/${encodeURIComponent(id)}`);
export const startWorkload = (concurrency) =>
  request('POST', '/api/workload/start', Number.isFinite(concurrency) ? { concurrency } : {});
export const stopWorkload = () => request('POST', '/api/workload/stop');
export const setConcurrency = (concurrency) =>
  request('POST', '/api/workload/config', { concurrency });
/** Seed 004's shape: any of `{mix, rate}` (docs/LOADGEN-API.md). */
export const configureWorkload = (change) => request('POST', '/api/workload/config', change);
// The scenario controller (seed 004's auto mode).
export const scenarioAuto = () => request('POST', '/api/scenario/auto');
export const scenarioManual = () => request('POST', '/api/scenario/manual');
export const scenarioStop = () => request('POST', '/api/scenario/stop');
// Seed 003's phase ladder (kvroute demo): restarts the simulated cluster at `phase`.
export const switchPhase = (phase) => request('POST', '/api/phase', { phase });

const BACKOFF_FIRST_MS = 500;
const BACKOFF_MAX_MS = 10000;
// The server pushes a status every second; silence this long means the link is dead even if
// the socket has not noticed (e.g. a laptop that slept).
const SILENCE_LIMIT_MS = 5000;

/**
 * Keeps a WebSocket to /ws open, reconnecting with exponential backoff (0.5 s doubling to 10 s,
 * reset after a successful open). Calls `onStatus(status)` for every status message and
 * `onConnection(bool)` on every change of connection state.
 */
export class StatusSocket {
  constructor({ onStatus, onConnection, url }) {
    this.onStatus = onStatus;
    this.onConnection = onConnection;
    this.url = url || StatusSocket.defaultUrl();
    this.backoffMs = BACKOFF_FIRST_MS;
    this.socket = null;
    this.connected = false;
    this.retryTimer = null;
    this.lastMessageAt = 0;
    this.watchdog = setInterval(() => this.checkSilence(), 1000);
  }

  static defaultUrl() {
    const scheme = location.protocol === 'https:' ? 'wss' : 'ws';
    // A browser's WebSocket cannot send an Authorization header: the token goes in the query.
    const query = API_TOKEN ? `?token=${encodeURIComponent(API_TOKEN)}` : '';
    return `${scheme}://${location.host}/ws${query}`;
  }

  open() {
    clearTimeout(this.retryTimer);
    this.retryTimer = null;
    let socket;
    try {
      socket = new WebSocket(this.url);
    } catch {
      this.scheduleRetry();
      return;
    }
    this.socket = socket;
    socket.addEventListener('open', () => {
      if (this.socket !== socket) return;
      this.backoffMs = BACKOFF_FIRST_MS;
      this.lastMessageAt = Date.now();
      this.setConnected(true);
    });
    socket.addEventListener('message', (event) => {
      if (this.socket !== socket) return;
      this.lastMessageAt = Date.now();
      let msg;
      try {
        msg = JSON.parse(event.data);
      } catch {
        return; // not ours; ignore rather than break the stream
      }
      if (msg && msg.type === 'status' && msg.data) this.onStatus(msg.data);
    });
    socket.addEventListener('close', () => {
      if (this.socket !== socket) return;
      this.socket = null;
      this.setConnected(false);
      this.scheduleRetry();
    });
    // 'error' is always followed by 'close'; nothing to do here.
  }

  checkSilence() {
    if (this.connected && Date.now() - this.lastMessageAt > SILENCE_LIMIT_MS) {
      const socket = this.socket;
      this.socket = null;
      if (socket) socket.close();
      this.setConnected(false);
      this.scheduleRetry();
    }
  }

  scheduleRetry() {
    if (this.retryTimer !== null) return;
    const wait = this.backoffMs;
    this.backoffMs = Math.min(this.backoffMs * 2, BACKOFF_MAX_MS);
    this.retryTimer = setTimeout(() => {
      this.retryTimer = null;
      this.open();
    }, wait);
  }

  setConnected(connected) {
    if (this.connected === connected) return;
    this.connected = connected;
    this.onConnection(connected);
  }
}
