// The dashboard page: live table with the concurrency slider, KPI cards, live charts (with
// seed 004's scaling events and pool sizes), the static benchmark table and the per-worker GPU
// view (grouped by pool when the workers serve disaggregated). Everything is built once per layout
// (single lane or compare mode) and then updated in place, so elements keep their identity
// between the once-a-second status messages.

import { el, replaceChildren, setText, setClassFrom } from './dom.js';
import * as fmt from './format.js';
import { HistoryStore, TimeSeriesChart, LANE_COLORS } from './charts.js';

const SLO_CLASSES = ['slo-red', 'slo-yellow', 'slo-ok'];
const UTIL_CLASSES = ['util-low', 'util-mid', 'util-high'];
const SLIDER_DEBOUNCE_MS = 300;

const LIVE_ROWS = [
  { key: 'ttft', label: 'TTFT (ms)', metric: 'ttft_ms', format: fmt.ms, slo: 'ttft_p95_ms' },
  { key: 'tpot', label: 'TPOT (ms)', metric: 'tpot_ms', format: fmt.ms, slo: 'tpot_p95_ms' },
  { key: 'itl', label: 'ITL (ms)', metric: 'itl_ms', format: fmt.ms, slo: null },
  { key: 'latency', label: 'Latency (s)', metric: 'e2e_s', format: fmt.seconds, slo: null },
];
// source 0: the live lane (lane 0); source 1: the round-robin baseline, or lane 1 in compare mode.
const LIVE_COLS = [
  { key: 'live-p50', source: 0, q: 'p50' },
  { key: 'rr-p50', source: 1, q: 'p50' },
  { key: 'live-p95', source: 0, q: 'p95' },
  { key: 'rr-p95', source: 1, q: 'p95' },
];

const KPIS = [
  { key: 'rps', label: 'RPS', value: (m) => fmt.rps(m.rps), live: true },
  { key: 'requests', label: 'Requests', value: (m) => fmt.integer(m.requests), live: false },
  { key: 'tops', label: 'TOPS', value: (m) => fmt.tops(m.tops), live: true },
  { key: 'kv-hit', label: 'KV Cache Hit', value: (m) => fmt.kvHit(m.kv_hit_rate), live: true },
  { key: 'queued', label: 'Queued', value: (m) => fmt.integer(m.queued), live: true },
  { key: 'errors', label: 'Errors', value: (m) => fmt.integer(m.errors), live: false },
];
// Shown only when the workers report speculative decoding (seed 003's engine metrics).
const SPEC_KPIS = [
  { key: 'acceptance', label: 'Acceptance Rate', value: (m) => fmt.acceptance(m.acceptance_rate), live: true },
  { key: 'tokens-per-step', label: 'Tokens per Step', value: (m) => fmt.perStep(m.tokens_per_step), live: true },
];

// Shown when the gateway attributes reuse (kvroute's gateway): of the prompt tokens some
// worker held, the share the workers reused, and that share of the prompt (what was there to
// reuse). A low hit rate with a low "available" is the workload; with a high one, routing.
const REUSE_KPIS = [
  { key: 'reuse-achieved', label: 'Reuse / Available', value: (m) => fmt.kvHit(m.reuse_achieved), live: true },
  { key: 'reuse-available', label: 'Reuse Available', value: (m) => fmt.kvHit(m.reuse_available), live: true },
];

// Seed 004's pools, in display order: the gateway's `pool` label and the workers' role.
const POOLS = [
  { key: 'prefill', title: 'Prefill pool' },
  { key: 'decode', title: 'Decode pool' },
  { key: 'aggregated', title: 'Aggregated workers' },
];
const POOL_STATS = [
  { key: 'ttft-p50', label: 'TTFT p50', read: (p) => p?.ttft_ms?.p50 },
  { key: 'ttft-p95', label: 'TTFT p95', read: (p) => p?.ttft_ms?.p95 },
  { key: 'itl-p50', label: 'ITL p50', read: (p) => p?.itl_ms?.p50 },
  { key: 'itl-p95', label: 'ITL p95', read: (p) => p?.itl_ms?.p95 },
];
const POOL_COLORS = { prefill: LANE_COLORS[0], decode: LANE_COLORS[1] };

/** A worker's pool: its role, aggregated when it has none or serves both parts. */
function poolOf(worker) {
  return worker.role === 'prefill' || worker.role === 'decode' ? worker.role : 'aggregated';
}

/** Whether any worker of the lane serves one part only (a disaggregated fleet). */
function isDisaggregated(lane) {
  return (lane.workers?.list || []).some((w) => poolOf(w) !== 'aggregated');
}

/**
 * Seed 004's scaling events as chart markers: "prefill 1→2" at the event's time (the ones
 * carried out: an action the fleet refused is not a change to mark).
 */
function scalingMarkers(status) {
  const events = status?.scenario?.events;
  if (!Array.isArray(events)) return [];
  return events
    .filter((e) => e && typeof e.at_ms === 'number' && e.applied !== false)
    .map((e) => ({ t: e.at_ms, kind: e.source, label: `${e.pool} ${e.from}\u2192${e.to}` }));
}

/** Seed 003's phase switches as chart markers: "→ eagle3" at the switch's time. */
function phaseMarkers(status) {
  const switches = status?.ladder?.switches;
  if (!Array.isArray(switches)) return [];
  return switches
    .filter((s) => s && typeof s.at_ms === 'number' && typeof s.phase === 'string')
    .map((s) => ({ t: s.at_ms, kind: 'phase', label: `\u2192 ${s.phase}` }));
}

/** Whether any lane's workers report speculative decoding. */
function reportsSpec(status) {
  return (status?.lanes || []).some((l) => typeof l.metrics?.acceptance_rate === 'number'
    || typeof l.metrics?.tokens_per_step === 'number');
}

/** Whether any lane's gateway attributes reuse. */
function reportsReuse(status) {
  return (status?.lanes || []).some((l) => typeof l.metrics?.reuse_available === 'number');
}

const $ = (id) => document.getElementById(id);

function isCompare(status) {
  return Array.isArray(status?.lanes) && status.lanes.length === 2;
}

function laneLabel(lane, i) {
  return lane?.name || `lane ${i}`;
}

export class Dashboard {
  /** `onConcurrency(n)` is called (debounced) when the user moves the slider. */
  constructor({ onConcurrency }) {
    this.onConcurrency = onConcurrency;
    this.status = null;
    this.baseline = null;
    this.visible = false;
    this.liveLayout = null;
    this.kpiLayout = null;
    this.showsReuse = false;
    this.workersLayout = null;
    this.history = new HistoryStore();
    this.slider = $('concurrency-slider');
    this.sliderValue = $('concurrency-value');
    this.dragging = false;
    this.debounceTimer = null;
    this.postsInFlight = 0; // user changes sent, not yet answered
    this.setupSlider();
    const slo = (key) => () => this.status?.slo?.[key] ?? null;
    const markers = () => [...scalingMarkers(this.status), ...phaseMarkers(this.status)];
    this.charts = {
      ttft: new TimeSeriesChart($('chart-ttft'), { unit: 'ms', slo: slo('ttft_p95_ms'), markers }),
      tpot: new TimeSeriesChart($('chart-tpot'), { unit: 'ms', slo: slo('tpot_p95_ms'), markers }),
      tops: new TimeSeriesChart($('chart-tops'), { unit: 'tok/s', markers }),
      kv: new TimeSeriesChart($('chart-kv-hit'), { unit: '%', fixedMax: 100, markers }),
      ttft50: new TimeSeriesChart($('chart-ttft-p50'), { unit: 'ms', slo: slo('ttft_p95_ms'), markers }),
      inflight: new TimeSeriesChart($('chart-inflight'), { unit: 'requests', markers }),
      // Reference lines: what each recorded phase of seed 003's ladder measured at this
      // concurrency (ITL p50; TTFT p50 of turns 2+, the figure KV routing changes).
      itl: new TimeSeriesChart($('chart-itl'), { unit: 'ms', references: () => this.references('itl_p50_ms'), markers }),
      ttftTurns: new TimeSeriesChart($('chart-ttft-turns'), { unit: 'ms', references: () => this.references('ttft_later_p50_ms'), markers }),
      pools: new TimeSeriesChart($('chart-pools'), { unit: 'replicas', markers }),
    };
    this.renderKpis(null);
  }

  /** The recorded phases' values of `field` at the current level, as reference lines. */
  references(field) {
    const refs = this.status?.references;
    if (!refs) return [];
    return (refs.phases || []).map((p) => ({ label: p.phase, value: p[field] }));
  }

  setVisible(visible) {
    this.visible = visible;
    if (visible) this.renderCharts();
  }

  // ---- concurrency slider ----

  setupSlider() {
    const s = this.slider;
    s.addEventListener('pointerdown', () => { this.dragging = true; });
    const release = () => { this.dragging = false; };
    window.addEventListener('pointerup', release);
    window.addEventListener('pointercancel', release);
    s.addEventListener('input', () => {
      const n = Number(s.value);
      setText(this.sliderValue, String(n));
      clearTimeout(this.debounceTimer);
      this.debounceTimer = setTimeout(() => {
        this.debounceTimer = null;
        this.postsInFlight++;
        Promise.resolve(this.onConcurrency(n)).finally(() => { this.postsInFlight--; });
      }, SLIDER_DEBOUNCE_MS);
    });
  }

  /**
   * The concurrency shown beside the slider (what Start sends): the user's choice, else the
   * server's value, which may lie outside the slider's range when set through the API.
   */
  concurrency() {
    const n = Number(this.sliderValue.textContent);
    return Number.isFinite(n) && n > 0 ? n : undefined;
  }

  updateSlider(status) {
    const range = status.slider || {};
    for (const attr of ['min', 'max', 'step']) {
      if (typeof range[attr] === 'number' && this.slider.getAttribute(attr) !== String(range[attr])) {
        this.slider.setAttribute(attr, String(range[attr]));
      }
    }
    // Follow changes made elsewhere, but never fight the user's hand: not while dragging, not
    // while a debounced change waits, not while its POST is in flight.
    const userBusy = this.dragging || this.debounceTimer !== null || this.postsInFlight > 0;
    if (!userBusy && typeof status.concurrency === 'number') {
      if (this.slider.value !== String(status.concurrency)) this.slider.value = String(status.concurrency);
      setText(this.sliderValue, String(status.concurrency));
    }
    // Seed 004's workload mix and arrivals, read-only (set through the API or the flags).
    if (typeof status.mix === 'string') {
      const loop = typeof status.rate === 'number'
        ? `open loop, ${status.rate} sessions/s`
        : 'closed loop';
      setText($('workload-shape'), `Mix ${status.mix.replaceAll(',', ' ')} · ${loop}`);
    }
  }

  // ---- status ----

  update(status) {
    this.status = status;
    const slo = status.slo || {};
    setText($('slo-line'), `SLO: TTFT p95 < ${fmt.ms(slo.ttft_p95_ms)} ms, TPOT p95 < ${fmt.ms(slo.tpot_p95_ms)} ms`);
    this.updateSlider(status);
    this.renderLive(status);
    this.renderKpis(status);
    this.renderWorkers(status);
    this.highlightStaticRow();
    this.history.setOrder((status.lanes || []).map((l) => l.name));
    // Redraw on a new point, and when the SLO lines move (the first status brings them).
    const refs = status.references;
    // Scaling events and pool sizes change the charts too (markers, the replica chart).
    const scenario = status.scenario;
    const poolHistory = Array.isArray(scenario?.pool_history) ? scenario.pool_history : null;
    // Without a fleet to resize (an external target) the pools' sizes are not known here.
    $('chart-pools-card').hidden = !poolHistory || (!poolHistory.length && scenario.fleet === 'none');
    const events = Array.isArray(scenario?.events) ? scenario.events : [];
    const lastPool = poolHistory?.[poolHistory.length - 1];
    const switches = Array.isArray(status.ladder?.switches) ? status.ladder.switches : [];
    const scenarioKey = `${events.length}|${events[events.length - 1]?.at_ms}|${poolHistory?.length}|${lastPool?.at_ms}`
      + `|${switches.length}|${switches[switches.length - 1]?.at_ms}`;
    const sloKey = `${slo.ttft_p95_ms}|${slo.tpot_p95_ms}|${refs ? `${refs.setup}@${refs.concurrency}` : ''}|${scenarioKey}`;
    const appended = this.history.append(status);
    if (appended || sloKey !== this.chartSloKey) {
      this.chartSloKey = sloKey;
      this.renderCharts();
    }
    const note = $('reference-note');
    note.hidden = !refs;
    if (refs) {
      setText(note, `Dotted lines: seed 003's phases (${(refs.phases || []).map((p) => p.phase).join(', ')}) `
        + `as recorded at concurrency ${refs.concurrency} on ${refs.setup} — ${refs.source}.`);
    }
  }

  seedHistory(history) {
    this.history.seed(history);
    this.renderCharts();
  }

  /**
   * The pool sizes over time as step lines (a size holds until the next change), drawn over
   * `range` (a size set before it starts at its left edge), and the range they need when the
   * other charts have none (the workload stopped).
   */
  poolSeries(range) {
    const history = this.status?.scenario?.pool_history;
    if (!Array.isArray(history)) return { series: [], range: null };
    const points = history.filter((p) => p && typeof p.at_ms === 'number').sort((a, b) => a.at_ms - b.at_ms);
    const now = typeof this.status?.time_ms === 'number' ? this.status.time_ms : Date.now();
    const own = points.length ? [Math.min(points[0].at_ms, now - 2 * 60 * 1000), now] : null;
    const start = (range || own)?.[0] ?? -Infinity;
    const series = ['prefill', 'decode'].map((pool) => {
      const line = [];
      for (const p of points) {
        const t = Math.max(p.at_ms, start);
        const v = typeof p[pool] === 'number' ? p[pool] : null;
        if (line.length) line.push([t, line[line.length - 1][1]]);
        line.push([t, v]);
      }
      if (line.length) line.push([Math.max(now, line[line.length - 1][0]), line[line.length - 1][1]]);
      return { name: pool, color: POOL_COLORS[pool], points: line };
    });
    return { series, range: own };
  }

  renderCharts() {
    if (!this.visible) return;
    const range = this.history.timeRange();
    const pools = this.poolSeries(range);
    if (!$('chart-pools-card').hidden) this.charts.pools.render(pools.series, range || pools.range);
    this.charts.ttft.render(this.history.series('ttft'), range);
    this.charts.tpot.render(this.history.series('tpot'), range);
    this.charts.tops.render(this.history.series('tops'), range);
    this.charts.kv.render(this.history.series('kv'), range);
    this.charts.ttft50.render(this.history.series('ttft50'), range);
    this.charts.inflight.render(this.history.series('inflight'), range);
    this.charts.itl.render(this.history.seriesPair(['itl50', 'itl95'], ['p50', 'p95']), range);
    this.charts.ttftTurns.render(this.history.seriesPair(['ttft1', 'ttft2'], ['turn 1', 'turns 2+']), range);
  }

  // ---- section 1: live table ----

  renderLive(status) {
    const lanes = status.lanes || [];
    const compare = isCompare(status);
    const hasData = lanes.some((l) => {
      const m = l.metrics || {};
      return (m.requests || 0) > 0 || (m.errors || 0) > 0 || LIVE_ROWS.some((r) => m[r.metric]);
    });
    $('live-placeholder').hidden = hasData;
    $('live-table-box').hidden = !hasData;
    const names = compare ? [laneLabel(lanes[0], 0), laneLabel(lanes[1], 1)] : ['Live', 'RR'];
    setText($('live-heading'), compare ? `${names[0]} vs ${names[1]} (both live)` : 'Live vs Round-Robin');
    const layoutKey = `${compare}|${names.join('|')}`;
    if (this.liveLayout !== layoutKey) {
      this.liveLayout = layoutKey;
      this.buildLiveTable(names);
    }

    const slo = status.slo || {};
    const sources = [lanes[0]?.metrics || null, compare ? lanes[1]?.metrics || null : status.baseline];
    for (const row of LIVE_ROWS) {
      for (const col of LIVE_COLS) {
        const cell = this.liveCells[`${row.key}-${col.key}`];
        const value = sources[col.source]?.[row.metric]?.[col.q] ?? null;
        setText(cell, row.format(value));
        // SLO colours on live values only (lane 1 is live too in compare mode); the p50 cells
        // use the p95 SLO as well, since the SLO is defined on p95.
        const live = col.source === 0 || compare;
        setClassFrom(cell, SLO_CLASSES, live && row.slo ? fmt.sloClass(value, slo[row.slo]) : '');
      }
    }

    let caption;
    const windowText = typeof status.window_s === 'number' ? `last ${Math.round(status.window_s)} s` : 'recent window';
    if (compare) {
      caption = `Both columns are live, fed the same conversations: ${names[0]} (router ${lanes[0]?.router ?? 'unknown'}) vs ${names[1]} (router ${lanes[1]?.router ?? 'unknown'}), ${windowText}.`;
    } else {
      const lane = lanes[0];
      const live = lane ? `Live: ${lane.name}${lane.router ? ` (router ${lane.router})` : ''}, ${windowText}, ${fmt.integer(lane.metrics?.window_samples)} turns.` : '';
      const b = status.baseline;
      const rr = b ? ` RR: ${b.router} measured by kvroute bench at concurrency ${b.concurrency}.` : ' RR: no baseline loaded.';
      caption = live + rr;
    }
    setText($('live-caption'), caption);
  }

  buildLiveTable(names) {
    const head = $('live-head');
    const headers = [`${names[0]} p50`, `${names[1]} p50`, `${names[0]} p95`, `${names[1]} p95`];
    replaceChildren(head, el('th', { scope: 'col', text: 'Metric' }),
      headers.map((h, i) => el('th', { scope: 'col', class: LIVE_COLS[i].source === 1 ? 'muted' : '', text: h })));
    this.liveCells = {};
    const rows = LIVE_ROWS.map((row) => el('tr', {},
      el('th', { scope: 'row', text: row.label }),
      LIVE_COLS.map((col) => {
        const cell = el('td', {
          class: `num${col.source === 1 ? ' muted' : ''}`,
          testid: `cell-${row.key}-${col.key}`,
          text: fmt.DASH,
        });
        this.liveCells[`${row.key}-${col.key}`] = cell;
        return cell;
      })));
    replaceChildren($('live-body'), rows);
  }

  // ---- section 2: KPI cards ----

  renderKpis(status) {
    const lanes = status?.lanes?.length ? status.lanes : [null];
    const compare = isCompare(status);
    // The acceptance and tokens-per-step cards appear once the workers report them.
    // Once the gateway has shown it attributes reuse, its cards stay (a dash while stopped)
    // rather than come and go with every start and stop.
    this.showsReuse = this.showsReuse || reportsReuse(status);
    const kpis = KPIS.concat(reportsSpec(status) ? SPEC_KPIS : [], this.showsReuse ? REUSE_KPIS : []);
    const layoutKey = `${compare ? lanes.map((l, i) => laneLabel(l, i)).join('|') : 'single'}|${kpis.length}`;
    if (this.kpiLayout !== layoutKey) {
      this.kpiLayout = layoutKey;
      this.kpiCells = [];
      const rows = lanes.map((lane, i) => {
        const cells = {};
        this.kpiCells.push(cells);
        return el('div', { class: 'kpi-row' },
          compare ? el('div', { class: 'kpi-lane', text: laneLabel(lane, i) }) : null,
          el('div', { class: 'kpi-cards' }, kpis.map((k) => {
            const value = el('div', { class: 'kpi-value', testid: `kpi-${k.key}${i === 0 ? '' : `-${i}`}`, text: fmt.DASH });
            cells[k.key] = value;
            return el('div', { class: `kpi-card kpi-${k.key}` }, el('div', { class: 'kpi-label', text: k.label }), value);
          })));
      });
      replaceChildren($('kpi-rows'), rows);
    }
    lanes.forEach((lane, i) => {
      const m = lane?.metrics || {};
      const running = !!status?.running;
      // Totals since start stay meaningful after Stop; window rates do not.
      const started = running || (m.requests || 0) > 0 || (m.errors || 0) > 0;
      for (const k of kpis) {
        const cell = this.kpiCells[i][k.key];
        const show = lane && (k.live ? running : started);
        setText(cell, show ? k.value(m) : fmt.DASH);
        if (k.key === 'errors') cell.classList.toggle('error', !!show && (m.errors || 0) > 0);
      }
    });
  }

  // ---- section 3: static benchmark table ----

  setBaseline(baseline, errorText) {
    this.baseline = baseline;
    const table = $('static-table');
    const placeholder = $('static-placeholder');
    const note = $('static-note');
    if (!baseline) {
      table.hidden = true;
      note.hidden = true;
      placeholder.hidden = false;
      setText(placeholder, errorText || 'No benchmark results loaded.');
      return;
    }
    placeholder.hidden = true;
    table.hidden = false;
    const rr = baseline.baseline_router || 'baseline';
    const kv = baseline.kv_router || 'kv';
    const slo = baseline.slo || this.status?.slo || {};
    setText($('static-sub'), `p95 latency of ${rr} vs ${kv} at every tested concurrency level (static data, `
      + `SLO: TTFT p95 < ${fmt.ms(slo.ttft_p95_ms)} ms, TPOT p95 < ${fmt.ms(slo.tpot_p95_ms)} ms).`);
    replaceChildren($('static-head'),
      el('tr', {},
        el('th', { rowspan: 2, scope: 'col', text: 'Concurrency' }),
        el('th', { colspan: 3, scope: 'colgroup', class: 'group', text: 'TTFT p95 (ms)' }),
        el('th', { colspan: 3, scope: 'colgroup', class: 'group', text: 'TPOT p95 (ms)' })),
      el('tr', {}, [0, 1].map(() => [
        el('th', { scope: 'col', text: rr }),
        el('th', { scope: 'col', text: kv }),
        el('th', { scope: 'col', text: 'Improvement' }),
      ])));
    const metrics = [{ key: 'ttft', field: 'ttft_ms', slo: slo.ttft_p95_ms }, { key: 'tpot', field: 'tpot_ms', slo: slo.tpot_p95_ms }];
    const levels = (baseline.levels || []).slice().sort((a, b) => a.concurrency - b.concurrency);
    replaceChildren($('static-body'), levels.map((level) => {
      const c = level.concurrency;
      return el('tr', { testid: `static-row-${c}`, 'data-concurrency': c },
        el('th', { scope: 'row', text: fmt.integer(c) }),
        metrics.map((m) => {
          const rrValue = level.baseline?.[m.field]?.p95 ?? null;
          const kvValue = level.kv?.[m.field]?.p95 ?? null;
          const pct = fmt.improvementPct(rrValue, kvValue);
          return [
            el('td', { class: `num ${fmt.sloClass(rrValue, m.slo)}`, testid: `static-${c}-${m.key}-rr`, text: fmt.ms(rrValue) }),
            el('td', { class: `num ${fmt.sloClass(kvValue, m.slo)}`, testid: `static-${c}-${m.key}-kv`, text: fmt.ms(kvValue) }),
            el('td', {
              class: `num imp ${pct === null ? '' : pct > 0.05 ? 'imp-pos' : pct < -0.05 ? 'imp-neg' : ''}`,
              testid: `static-${c}-${m.key}-imp`,
              text: fmt.improvement(rrValue, kvValue),
            }),
          ];
        }));
    }));
    note.hidden = false;
    replaceChildren(note, 'Recorded by ', el('code', { text: 'kvroute bench' }),
      baseline.source ? [' — ', el('code', { text: baseline.source })] : '',
      '. Use your own with ', el('code', { text: '--baseline results.json' }), '.');
    this.highlightStaticRow();
  }

  /** Highlights the row of the current concurrency (the nearest level when none is equal). */
  highlightStaticRow() {
    const levels = this.baseline?.levels || [];
    const target = this.status?.concurrency;
    let current = null;
    if (typeof target === 'number' && levels.length) {
      current = levels.reduce((best, l) =>
        (Math.abs(l.concurrency - target) < Math.abs(best.concurrency - target) ? l : best)).concurrency;
    }
    for (const row of $('static-body').querySelectorAll('tr')) {
      row.classList.toggle('current', Number(row.dataset.concurrency) === current);
    }
  }

  // ---- section 4: infrastructure ----

  renderWorkers(status) {
    const lanes = status.lanes || [];
    const compare = isCompare(status);
    const box = $('workers');
    // Rebuild only when what is shown changes shape; values update in place.
    const shape = JSON.stringify(lanes.map((l) => {
      const w = l.workers || {};
      return [l.name, w.available, w.error, w.gpu, w.model,
        (w.list || []).map((k) => [k.name, k.role, (k.gpus || []).map((g) => g.index)])];
    }));
    if (this.workersLayout !== shape) {
      this.workersLayout = shape;
      this.gpuCells = new Map();
      this.poolCells = [];
      if (!lanes.length) {
        replaceChildren(box, el('p', { class: 'placeholder', text: 'No lanes reported.' }));
        return;
      }
      replaceChildren(box, lanes.map((lane, i) => this.buildWorkerGroup(lane, i, compare)));
    }
    lanes.forEach((lane, i) => {
      (lane.workers?.list || []).forEach((worker, w) => {
        for (const gpu of worker.gpus || []) {
          const cells = this.gpuCells.get(`${i}|${w}|${gpu.index}`);
          if (!cells) continue;
          setText(cells.util, fmt.percent(gpu.util_pct));
          setClassFrom(cells.util, UTIL_CLASSES, fmt.utilClass(gpu.util_pct));
          setClassFrom(cells.box, UTIL_CLASSES, fmt.utilClass(gpu.util_pct));
          setText(cells.mem, fmt.percent(gpu.memory_pct));
          cells.bar.style.width = `${Math.min(100, Math.max(0, gpu.memory_pct || 0))}%`;
        }
      });
      // Each pool's TTFT and ITL as the gateway measured them over the window.
      const latency = lane.workers?.pools || [];
      for (const [pool, cells] of Object.entries(this.poolCells[i] || {})) {
        const figures = latency.find((p) => p.pool === pool);
        for (const stat of POOL_STATS) setText(cells[stat.key], fmt.ms(stat.read(figures) ?? null));
      }
    });
  }

  buildWorkerGroup(lane, i, compare) {
    const w = lane.workers || { available: false, error: 'no worker data reported' };
    const meta = [];
    if (w.gpu) meta.push(el('span', { class: 'meta-item' }, el('span', { class: 'meta-label', text: 'GPU' }), w.gpu));
    if (w.model) meta.push(el('span', { class: 'meta-item' }, el('span', { class: 'meta-label', text: 'Model' }), w.model));
    const warning = w.available === false
      ? el('div', { class: 'warning', testid: 'prometheus-unavailable' },
        el('strong', { text: 'Prometheus unavailable' }), w.error ? `: ${w.error}` : '')
      : null;
    const workers = (w.list || []).map((worker, index) => ({ worker, index }));
    const card = ({ worker, index }) => el('div', { class: 'worker-card', testid: 'worker-card', 'data-role': worker.role || '' },
      el('div', { class: 'worker-name', text: worker.name }),
      el('div', { class: 'gpu-boxes' }, (worker.gpus || []).map((gpu) => {
        const util = el('div', { class: 'gpu-util', testid: 'gpu-util', text: fmt.DASH });
        const mem = el('span', { class: 'gpu-mem', testid: 'gpu-mem', text: fmt.DASH });
        const bar = el('div', { class: 'mem-bar-fill' });
        const box = el('div', { class: 'gpu-box' },
          el('div', { class: 'gpu-index', text: `GPU ${gpu.index}` }),
          util,
          el('div', { class: 'gpu-caption', text: 'utilisation' }),
          el('div', { class: 'mem-bar' }, bar),
          el('div', { class: 'gpu-caption' }, 'memory ', mem));
        this.gpuCells.set(`${i}|${index}|${gpu.index}`, { util, mem, bar, box });
        return box;
      })));
    let body;
    this.poolCells[i] = {};
    if (isDisaggregated(lane)) {
      // Seed 004: one group per pool, with its size and its latency.
      const suffix = i === 0 ? '' : `-${i}`;
      body = POOLS.map((pool) => {
        const members = workers.filter(({ worker }) => poolOf(worker) === pool.key);
        if (!members.length && pool.key === 'aggregated') return null;
        const cells = {};
        this.poolCells[i][pool.key] = cells;
        const stats = POOL_STATS.map((stat) => {
          const value = el('span', { class: 'pool-stat-value', testid: `pool-${pool.key}-${stat.key}${suffix}`, text: fmt.DASH });
          cells[stat.key] = value;
          return el('span', { class: 'pool-stat' }, el('span', { class: 'pool-stat-label', text: stat.label }), value, el('span', { class: 'pool-stat-label', text: 'ms' }));
        });
        const count = `${members.length} ${members.length === 1 ? 'worker' : 'workers'}`;
        return el('div', { class: 'pool-group', testid: `pool-${pool.key}${suffix}`, 'data-pool': pool.key },
          el('div', { class: 'pool-head' },
            el('h3', { class: 'pool-title', text: pool.title }),
            el('span', { class: 'pool-count', testid: `pool-${pool.key}-count${suffix}`, text: count }),
            el('div', { class: 'pool-stats' }, stats)),
          members.length ? el('div', { class: 'worker-cards' }, members.map(card))
            : el('p', { class: 'placeholder', text: 'No workers in this pool.' }));
      });
    } else {
      body = workers.length ? el('div', { class: 'worker-cards' }, workers.map(card))
        : (w.available !== false ? el('p', { class: 'placeholder', text: 'No workers reported.' }) : null);
    }
    return el('div', { class: 'worker-group' },
      compare ? el('h3', { class: 'lane-title', text: laneLabel(lane, i) }) : null,
      meta.length ? el('div', { class: 'worker-meta' }, meta) : null,
      warning,
      body);
  }
}
