// Live time-series charts drawn as SVG by hand: one chart per metric, one series per lane.
//
// HistoryStore keeps the points (seeded from GET /api/history, then one point per WebSocket
// status message while running), bounded to the last 15 minutes and MAX_POINTS_PER_LANE.
// TimeSeriesChart draws one metric of every lane against a shared time range.

import { svg, replaceChildren } from './dom.js';
import { clock } from './format.js';

/** Series colours by lane index (lane 0, lane 1). */
export const LANE_COLORS = ['#e8590c', '#1c7ed6'];

const WINDOW_MS = 15 * 60 * 1000;
// 15 minutes at two status messages a second, with room to spare; the oldest go first.
const MAX_POINTS_PER_LANE = 2000;
// A fresh run would otherwise stretch a few seconds across the whole width.
const MIN_SPAN_MS = 2 * 60 * 1000;
// History comes every 2 s and status messages every second; a longer silence is a gap.
const GAP_MS = 10 * 1000;

/** The metrics the charts draw, as they are named in a stored point. */
export const METRICS = {
  ttft: (m) => m?.ttft_ms?.p95 ?? null,
  tpot: (m) => m?.tpot_ms?.p95 ?? null,
  tops: (m) => m?.tops ?? null,
  kv: (m) => (typeof m?.kv_hit_rate === 'number' ? m.kv_hit_rate * 100 : null),
  ttft50: (m) => m?.ttft_ms?.p50 ?? null,
  inflight: (m) => m?.in_flight ?? null,
  itl50: (m) => m?.itl_ms?.p50 ?? null,
  itl95: (m) => m?.itl_ms?.p95 ?? null,
  ttft1: (m) => m?.ttft_turn1_ms?.p50 ?? null,
  ttft2: (m) => m?.ttft_later_ms?.p50 ?? null,
};

function finiteOrNull(v) {
  return typeof v === 'number' && Number.isFinite(v) ? v : null;
}

export class HistoryStore {
  constructor() {
    /** lane name -> [{t, ttft, tpot, tops, kv}] in increasing t */
    this.lanes = new Map();
    this.order = [];
  }

  /** Lane names in display order (the status message's order once one arrived). */
  laneNames() {
    const names = this.order.filter((n) => this.lanes.has(n));
    for (const n of this.lanes.keys()) if (!names.includes(n)) names.push(n);
    return names;
  }

  setOrder(names) {
    this.order = names.slice();
  }

  /** Seeds from GET /api/history; points already appended from the WebSocket are kept. */
  seed(history) {
    for (const lane of history?.lanes || []) {
      const seeded = (lane.points || [])
        .filter((p) => finiteOrNull(p.time_ms) !== null)
        .map((p) => ({
          t: p.time_ms,
          ttft: finiteOrNull(p.ttft_p95_ms),
          tpot: finiteOrNull(p.tpot_p95_ms),
          tops: finiteOrNull(p.tops),
          kv: finiteOrNull(p.kv_hit_rate) === null ? null : p.kv_hit_rate * 100,
          ttft50: finiteOrNull(p.ttft_p50_ms),
          inflight: finiteOrNull(p.in_flight),
          itl50: finiteOrNull(p.itl_p50_ms),
          itl95: finiteOrNull(p.itl_p95_ms),
          ttft1: finiteOrNull(p.ttft_turn1_p50_ms),
          ttft2: finiteOrNull(p.ttft_later_p50_ms),
        }))
        .sort((a, b) => a.t - b.t);
      const last = seeded.length ? seeded[seeded.length - 1].t : -Infinity;
      const live = (this.lanes.get(lane.name) || []).filter((p) => p.t > last);
      this.lanes.set(lane.name, seeded.concat(live));
    }
    this.prune();
  }

  /** Appends one point per lane from a status message (only while the workload runs). */
  append(status) {
    if (!status || !status.running || finiteOrNull(status.time_ms) === null) return false;
    let added = false;
    for (const lane of status.lanes || []) {
      const points = this.lanes.get(lane.name) || [];
      const last = points.length ? points[points.length - 1].t : -Infinity;
      if (status.time_ms <= last) continue;
      const m = lane.metrics;
      points.push({
        t: status.time_ms,
        ttft: finiteOrNull(METRICS.ttft(m)),
        tpot: finiteOrNull(METRICS.tpot(m)),
        tops: finiteOrNull(METRICS.tops(m)),
        kv: finiteOrNull(METRICS.kv(m)),
        ttft50: finiteOrNull(METRICS.ttft50(m)),
        inflight: finiteOrNull(METRICS.inflight(m)),
        itl50: finiteOrNull(METRICS.itl50(m)),
        itl95: finiteOrNull(METRICS.itl95(m)),
        ttft1: finiteOrNull(METRICS.ttft1(m)),
        ttft2: finiteOrNull(METRICS.ttft2(m)),
      });
      this.lanes.set(lane.name, points);
      added = true;
    }
    this.prune();
    return added;
  }

  latest() {
    let t = -Infinity;
    for (const points of this.lanes.values()) {
      if (points.length) t = Math.max(t, points[points.length - 1].t);
    }
    return t;
  }

  prune() {
    const cutoff = this.latest() - WINDOW_MS;
    for (const [name, points] of this.lanes) {
      let drop = 0;
      while (drop < points.length && points[drop].t < cutoff) drop++;
      drop = Math.max(drop, points.length - MAX_POINTS_PER_LANE);
      if (drop > 0) this.lanes.set(name, points.slice(drop));
    }
  }

  /** The time range every chart shares: the last 15 minutes, at least MIN_SPAN_MS wide. */
  timeRange() {
    const end = this.latest();
    if (!Number.isFinite(end)) return null;
    let start = end;
    for (const points of this.lanes.values()) if (points.length) start = Math.min(start, points[0].t);
    start = Math.min(start, end - MIN_SPAN_MS);
    return [start, end];
  }

  /**
   * Two metrics per lane (a solid and a dashed line of the lane's colour), e.g. ITL p50 and
   * p95; `labels` name them in the legend.
   */
  seriesPair(keys, labels) {
    const out = [];
    this.laneNames().forEach((name, i) => {
      const color = LANE_COLORS[i % LANE_COLORS.length];
      keys.forEach((key, k) => out.push({
        name: this.laneNames().length > 1 ? `${name} ${labels[k]}` : labels[k],
        color,
        dashed: k === 1,
        points: (this.lanes.get(name) || []).map((p) => [p.t, p[key]]),
      }));
    });
    return out;
  }

  /** One series per lane for a metric key of a stored point. */
  series(key) {
    return this.laneNames().map((name, i) => ({
      name,
      color: LANE_COLORS[i % LANE_COLORS.length],
      points: (this.lanes.get(name) || []).map((p) => [p.t, p[key]]),
    }));
  }
}

function niceStep(span, targetTicks) {
  const raw = span / targetTicks;
  const magnitude = 10 ** Math.floor(Math.log10(raw));
  const norm = raw / magnitude;
  const nice = norm <= 1 ? 1 : norm <= 2 ? 2 : norm <= 5 ? 5 : 10;
  return nice * magnitude;
}

const TIME_STEPS_S = [5, 10, 15, 30, 60, 120, 180, 300, 600, 900];

function timeStep(spanMs, maxTicks) {
  for (const s of TIME_STEPS_S) if (spanMs / (s * 1000) <= maxTicks) return s * 1000;
  return TIME_STEPS_S[TIME_STEPS_S.length - 1] * 1000;
}

const MARGIN = { left: 58, right: 18, top: 26, bottom: 30 };
const HEIGHT = 250;

/**
 * One chart. Options: `unit` (axis title), `slo` (a function returning the SLO in the chart's
 * unit, or null), `fixedMax` (a fixed y maximum, e.g. 100 for a percent), `references` (a
 * function returning horizontal reference lines `[{label, value}]`: what recorded phases of
 * the ladder measured, seed 003's booth lines), `markers` (a function returning vertical
 * markers `[{t, label, kind}]`: seed 004's scaling events, `kind` "scenario" or "autoscaler",
 * and seed 003's phase switches, `kind` "phase").
 */
export class TimeSeriesChart {
  constructor(svgElement, options) {
    this.svg = svgElement;
    this.options = options;
    this.last = null;
    this.resizeObserver = new ResizeObserver(() => {
      if (this.last) this.render(this.last.series, this.last.range);
    });
    this.resizeObserver.observe(this.svg);
  }

  render(series, range) {
    this.last = { series, range };
    const width = Math.floor(this.svg.getBoundingClientRect().width);
    if (width < 100) return; // hidden page: drawn when it becomes visible (ResizeObserver)
    const height = HEIGHT;
    this.svg.setAttribute('viewBox', `0 0 ${width} ${height}`);
    this.svg.setAttribute('height', String(height));
    const plotW = width - MARGIN.left - MARGIN.right;
    const plotH = height - MARGIN.top - MARGIN.bottom;
    const { unit } = this.options;
    const slo = this.options.slo ? this.options.slo() : null;
    const references = (this.options.references ? this.options.references() : [])
      .filter((r) => typeof r.value === 'number' && Number.isFinite(r.value) && r.value > 0);

    const children = [];
    const hasData = range && series.some((s) => s.points.some(([, v]) => v !== null));
    const [t0, t1] = range || [Date.now() - MIN_SPAN_MS, Date.now()];

    // y range: from 0 to a nice maximum above the data, and above the SLO so its line shows.
    let yMax = this.options.fixedMax;
    let yStep;
    if (yMax === undefined) {
      let dataMax = 0;
      for (const s of series) for (const [, v] of s.points) if (v !== null) dataMax = Math.max(dataMax, v);
      if (typeof slo === 'number') dataMax = Math.max(dataMax, slo * 1.25);
      for (const r of references) dataMax = Math.max(dataMax, r.value * 1.1);
      if (dataMax <= 0) dataMax = 10;
      yStep = niceStep(dataMax, 4);
      yMax = Math.ceil(dataMax / yStep) * yStep;
    } else {
      yStep = niceStep(yMax, 4);
    }
    const x = (t) => MARGIN.left + ((t - t0) / Math.max(1, t1 - t0)) * plotW;
    const y = (v) => MARGIN.top + plotH - (Math.min(Math.max(v, 0), yMax) / yMax) * plotH;

    // Grid and y axis; labels get as many decimals as the step needs (0.5 -> one decimal).
    const decimals = Math.max(0, -Math.floor(Math.log10(yStep) + 1e-9));
    const tickFormat = (v) => v.toFixed(decimals);
    for (let i = 0; i * yStep <= yMax * (1 + 1e-9); i++) {
      const v = i * yStep;
      const yy = y(v);
      children.push(svg('line', { class: 'grid', x1: MARGIN.left, x2: MARGIN.left + plotW, y1: yy, y2: yy }));
      children.push(svg('text', { class: 'tick tick-y', x: MARGIN.left - 6, y: yy + 4, 'text-anchor': 'end', text: tickFormat(v) }));
    }
    children.push(svg('text', { class: 'axis-title', x: 4, y: 14, text: unit }));

    // x axis: time of day.
    const step = timeStep(t1 - t0, Math.max(2, Math.floor(plotW / 90)));
    for (let t = Math.ceil(t0 / step) * step; t <= t1; t += step) {
      const xx = x(t);
      children.push(svg('line', { class: 'tick-mark', x1: xx, x2: xx, y1: MARGIN.top + plotH, y2: MARGIN.top + plotH + 5 }));
      children.push(svg('text', { class: 'tick tick-x', x: xx, y: height - 8, 'text-anchor': 'middle', text: clock(t) }));
    }
    children.push(svg('line', { class: 'axis', x1: MARGIN.left, x2: MARGIN.left + plotW, y1: MARGIN.top + plotH, y2: MARGIN.top + plotH }));
    children.push(svg('line', { class: 'axis', x1: MARGIN.left, x2: MARGIN.left, y1: MARGIN.top, y2: MARGIN.top + plotH }));

    // SLO: shaded area above the line, and the line itself.
    if (typeof slo === 'number' && slo < yMax) {
      const ys = y(slo);
      children.push(svg('rect', { class: 'slo-area', x: MARGIN.left, y: MARGIN.top, width: plotW, height: ys - MARGIN.top }));
      children.push(svg('line', { class: 'slo-line', x1: MARGIN.left, x2: MARGIN.left + plotW, y1: ys, y2: ys }));
      children.push(svg('text', { class: 'slo-label', x: MARGIN.left + 6, y: ys - 5, text: `SLO ${Math.round(slo * 1000) / 1000} ${unit}` }));
    }

    // Reference lines: dotted, labelled at the right end (labels of lines close together
    // are pushed apart so both stay readable).
    let lastLabelY = Infinity;
    for (const r of references.slice().sort((a, b) => a.value - b.value)) {
      if (r.value >= yMax) continue;
      const yr = y(r.value);
      children.push(svg('line', { class: 'ref-line', 'data-ref': r.label, x1: MARGIN.left, x2: MARGIN.left + plotW, y1: yr, y2: yr }));
      const ly = Math.min(yr - 3, lastLabelY - 12);
      lastLabelY = ly;
      children.push(svg('text', { class: 'ref-label', x: MARGIN.left + plotW - 4, y: ly, 'text-anchor': 'end', text: `${r.label} ${Math.round(r.value * 10) / 10}` }));
    }

    // Series: a path per lane, broken where a value is missing; a lone point is drawn as a dot
    // (a zero-length segment with a round cap).
    // A silence longer than GAP_MS (the workload was stopped, the link was down) breaks the line
    // too, rather than drawing a straight line across it.
    for (const s of series) {
      let d = '';
      let run = 0;
      let prevT = -Infinity;
      for (const [t, v] of s.points) {
        if (run > 0 && t - prevT > GAP_MS) {
          if (run === 1) d += ' l0.01 0';
          run = 0;
        }
        prevT = t;
        if (v === null || t < t0) {
          if (run === 1) d += ' l0.01 0';
          run = 0;
          continue;
        }
        d += `${run === 0 ? ' M' : ' L'}${x(t).toFixed(1)} ${y(v).toFixed(1)}`;
        run++;
      }
      if (run === 1) d += ' l0.01 0';
      children.push(svg('path', { class: `series${s.dashed ? ' dashed' : ''}`, d: d.trim() || 'M0 0', stroke: s.color, 'data-lane': s.name }));
    }

    // Event markers: a vertical line at the event's time, labelled at the top of the plot
    // (a label that would overlap the previous one goes one line lower).
    const markers = (this.options.markers ? this.options.markers() : [])
      .filter((m) => typeof m.t === 'number' && Number.isFinite(m.t) && m.t >= t0 && m.t <= t1)
      .sort((a, b) => a.t - b.t);
    let lastLabelEnd = -Infinity;
    let row = 0;
    for (const m of markers) {
      const xm = x(m.t);
      const kind = ['autoscaler', 'phase'].includes(m.kind) ? m.kind : 'scenario';
      children.push(svg('line', {
        class: `event-marker event-${kind}`, 'data-event': m.label, x1: xm, x2: xm, y1: MARGIN.top, y2: MARGIN.top + plotH,
      }));
      row = xm < lastLabelEnd ? (row + 1) % 3 : 0;
      const labelW = m.label.length * 6.5;
      const anchorEnd = xm + labelW > MARGIN.left + plotW;
      children.push(svg('text', {
        class: `event-label event-${kind}`,
        x: anchorEnd ? xm - 3 : xm + 3,
        y: MARGIN.top + 11 + row * 12,
        'text-anchor': anchorEnd ? 'end' : 'start',
        text: m.label,
      }));
      lastLabelEnd = anchorEnd ? xm : xm + labelW;
    }

    // Legend, top right.
    let lx = MARGIN.left + plotW;
    for (const s of series.slice().reverse()) {
      const w = 22 + s.name.length * 7.5;
      lx -= w;
      children.push(svg('line', { class: `legend-swatch${s.dashed ? ' dashed' : ''}`, x1: lx, x2: lx + 14, y1: 12, y2: 12, stroke: s.color }));
      children.push(svg('text', { class: 'legend-label', x: lx + 18, y: 16, text: s.name }));
    }

    if (!hasData) {
      children.push(svg('text', { class: 'chart-empty', x: MARGIN.left + plotW / 2, y: MARGIN.top + plotH / 2, 'text-anchor': 'middle', text: 'No data yet' }));
    }
    replaceChildren(this.svg, children);
  }
}
