// Number and time formatting for every value the UI shows. One place, so browser tests can
// compare the page's text with the API's JSON using the rules written here.
//
// Rules (null, undefined or a non-finite number always gives DASH):
//   ms(v)           integer milliseconds, no thousands separators: 1234.5 -> "1235"
//   seconds(v)      two decimals: 26.126 -> "26.13"
//   rps(v)          two decimals: 2.4 -> "2.40"
//   tops(v)         integer: 2100.4 -> "2100"
//   integer(v)      integer: 1234 -> "1234" (Requests, Errors, Queued, Tokens)
//   kvHit(rate)     rate 0..1 as a percent with one decimal and "%": 0.9734 -> "97.3%"
//   percent(v)      a value already in percent, integer with "%": 63.4 -> "63%" (GPU boxes)
//   acceptance(rate) rate 0..1 as a percent with one decimal: 0.775 -> "77.5%" (as kvHit)
//   perStep(v)      two decimals: 3.456 -> "3.46" (tokens per step)
//   improvement(rr, kv)  (rr - kv) / rr in percent, one decimal, "+" when positive:
//                   (655, 446) -> "+31.9%", (50, 55) -> "-10.0%", equal -> "0.0%"
// Rounding is JavaScript's Math.round / toFixed: half rounds up for positive values (2.5 -> "3").

/** What every formatter prints when there is no value. */
export const DASH = '\u2014';

function isNumber(v) {
  return typeof v === 'number' && Number.isFinite(v);
}

function roundInt(v) {
  // Math.round(-0.2) is -0, which prints as "0" anyway; keep it explicit.
  const r = Math.round(v);
  return Object.is(r, -0) ? 0 : r;
}

export function ms(v) {
  return isNumber(v) ? String(roundInt(v)) : DASH;
}

export function seconds(v) {
  return isNumber(v) ? v.toFixed(2) : DASH;
}

export function rps(v) {
  return isNumber(v) ? v.toFixed(2) : DASH;
}

export function tops(v) {
  return isNumber(v) ? String(roundInt(v)) : DASH;
}

export function integer(v) {
  return isNumber(v) ? String(roundInt(v)) : DASH;
}

export function kvHit(rate) {
  return isNumber(rate) ? `${(rate * 100).toFixed(1)}%` : DASH;
}

export function acceptance(rate) {
  return kvHit(rate);
}

export function perStep(v) {
  return isNumber(v) ? v.toFixed(2) : DASH;
}

export function percent(v) {
  return isNumber(v) ? `${roundInt(v)}%` : DASH;
}

/** The improvement of `kv` over `rr` in percent (positive: kv is lower, i.e. better). */
export function improvementPct(rr, kv) {
  if (!isNumber(rr) || !isNumber(kv) || rr === 0) return null;
  return ((rr - kv) / rr) * 100;
}

export function improvement(rr, kv) {
  const pct = improvementPct(rr, kv);
  if (pct === null) return DASH;
  const text = pct.toFixed(1);
  if (text === '0.0' || text === '-0.0') return '0.0%';
  return pct > 0 ? `+${text}%` : `${text}%`;
}

/** A conversation's duration: "53.2 s" under a minute, else "2 min 05 s". */
export function duration(s) {
  if (!isNumber(s) || s < 0) return DASH;
  if (Math.round(s * 10) / 10 < 60) return `${s.toFixed(1)} s`;
  const whole = Math.round(s);
  const minutes = Math.floor(whole / 60);
  const rest = String(whole % 60).padStart(2, '0');
  return `${minutes} min ${rest} s`;
}

/** Local wall-clock time of an epoch-millisecond instant, with the date when not today. */
export function localTime(epochMs) {
  if (!isNumber(epochMs)) return DASH;
  const d = new Date(epochMs);
  const today = new Date();
  const time = d.toLocaleTimeString();
  if (d.toDateString() === today.toDateString()) return time;
  return `${d.toLocaleDateString()} ${time}`;
}

/** Axis label of a time tick: HH:MM:SS in local time (24 h). */
export function clock(epochMs) {
  const d = new Date(epochMs);
  const two = (n) => String(n).padStart(2, '0');
  return `${two(d.getHours())}:${two(d.getMinutes())}:${two(d.getSeconds())}`;
}

/**
 * The SLO class of a latency value: "slo-red" over the SLO, "slo-yellow" at or above 90% of it,
 * "slo-ok" below that; "" when the value or the SLO is missing.
 */
export function sloClass(value, slo) {
  if (!isNumber(value) || !isNumber(slo) || slo <= 0) return '';
  if (value > slo) return 'slo-red';
  if (value >= 0.9 * slo) return 'slo-yellow';
  return 'slo-ok';
}

/** GPU utilisation class: green under 30%, amber 30-70%, red over 70%. */
export function utilClass(pct) {
  if (!isNumber(pct)) return '';
  if (pct > 70) return 'util-high';
  if (pct >= 30) return 'util-mid';
  return 'util-low';
}
