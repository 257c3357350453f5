// Seed 004's Display 1: the workload mix sliders (A/B/C, kept summing to 100), the total rate,
// the presets, the live request counts, and auto mode (the scenario controller's phase with a
// countdown). Every change goes through the callbacks, which talk to the API; what the page
// shows follows the status messages, except while the user's hand is on a control.

import { setText } from './dom.js';
import * as fmt from './format.js';

const $ = (id) => document.getElementById(id);

export const CLASSES = ['A', 'B', 'C'];
export const PRESETS = {
  balanced: { A: 40, B: 30, C: 30 },
  prefill: { A: 0, B: 80, C: 20 },
  decode: { A: 0, B: 20, C: 80 },
};
// What Reset goes back to: Balanced at the booth's default rate (rate_rps of
// crates/workload/scenarios/seed004.toml).
export const DEFAULT_MIX = PRESETS.balanced;
export const DEFAULT_RATE_RPS = 2;
const DEBOUNCE_MS = 300;
const COUNTDOWN_TICK_MS = 250;

/** A mix from the API (`"A=40,B=30,C=30"` or `{"A": 40, ...}`) as {A, B, C}; null if neither. */
export function parseMix(mix) {
  const out = { A: 0, B: 0, C: 0 };
  if (typeof mix === 'string') {
    for (const part of mix.split(',')) {
      const [key, value] = part.split('=').map((s) => s.trim().toUpperCase());
      const n = Number(value);
      if (!CLASSES.includes(key) || !Number.isFinite(n)) return null;
      out[key] = n;
    }
    return out;
  }
  if (mix && typeof mix === 'object') {
    for (const key of CLASSES) out[key] = Number(mix[key] ?? mix[key.toLowerCase()] ?? 0) || 0;
    return out;
  }
  return null;
}

/** The mix in percent (the API's weights need not add up to 100). */
export function toPercent(mix) {
  const total = CLASSES.reduce((sum, k) => sum + mix[k], 0);
  if (total <= 0) return { ...DEFAULT_MIX };
  const out = {};
  for (const k of CLASSES) out[k] = Math.round((mix[k] * 100) / total);
  return fixTotal(out, null);
}

/** Moves the largest share other than `keep` so the three add up to exactly 100. */
function fixTotal(mix, keep) {
  const diff = 100 - CLASSES.reduce((sum, k) => sum + mix[k], 0);
  if (diff !== 0) {
    const others = CLASSES.filter((k) => k !== keep);
    const target = others.reduce((best, k) => (mix[k] > mix[best] ? k : best), others[0]);
    mix[target] = Math.max(0, mix[target] + diff);
  }
  return mix;
}

/**
 * Sets class `key` to `value` percent and shares the rest between the other two in the
 * proportion they had (evenly when both were 0), so the mix still adds up to 100.
 */
export function rebalance(mix, key, value) {
  const v = Math.min(100, Math.max(0, Math.round(value)));
  const others = CLASSES.filter((k) => k !== key);
  const rest = 100 - v;
  const had = others.reduce((sum, k) => sum + mix[k], 0);
  const out = { [key]: v };
  for (const k of others) out[k] = had > 0 ? Math.round((mix[k] * rest) / had) : Math.round(rest / 2);
  return fixTotal(out, key);
}

export function mixText(mix) {
  return CLASSES.map((k) => `${k}=${mix[k]}`).join(',');
}

function sameMix(a, b) {
  return !!a && !!b && CLASSES.every((k) => a[k] === b[k]);
}

/** Seconds as m:ss. */
export function countdown(s) {
  if (typeof s !== 'number' || !Number.isFinite(s)) return fmt.DASH;
  const whole = Math.max(0, Math.ceil(s));
  return `${Math.floor(whole / 60)}:${String(whole % 60).padStart(2, '0')}`;
}

export class Booth {
  /**
   * `onConfig(change, label)`: POST /api/workload/config with `change` ({mix} or {rate});
   * `onAuto(enabled)`: switch auto mode on or off. Both return promises and report their own
   * errors; `showError` is how they do it here too.
   */
  constructor({ onConfig, onAuto }) {
    this.onConfig = onConfig;
    this.onAuto = onAuto;
    this.mix = { ...DEFAULT_MIX };
    this.status = null;
    this.scenario = null;
    this.scenarioAt = 0; // Date.now() when the scenario's time_left_s was received
    this.scenarioStatusMs = null; // the status' time_ms of that scenario
    // Scenario seconds per wall second (the lanes' clock runs `time_scale` times faster
    // against a sped-up simulator), measured from two status messages of one phase.
    this.clockRate = 1;
    this.dragging = false;
    this.mixTimer = null;
    this.rateTimer = null;
    this.postsInFlight = 0;
    this.sliders = {};
    this.values = {};
    for (const k of CLASSES) {
      this.sliders[k] = $(`mix-${k.toLowerCase()}`);
      this.values[k] = $(`mix-${k.toLowerCase()}-value`);
    }
    this.rateSlider = $('rate-slider');
    this.rateInput = $('rate-input');
    this.setup();
    setInterval(() => this.renderCountdown(), COUNTDOWN_TICK_MS);
  }

  userBusy() {
    return this.dragging || this.mixTimer !== null || this.rateTimer !== null
      || this.postsInFlight > 0 || document.activeElement === this.rateInput;
  }

  send(change, label) {
    this.postsInFlight++;
    return Promise.resolve(this.onConfig(change, label)).finally(() => { this.postsInFlight--; });
  }

  setup() {
    const release = () => { this.dragging = false; };
    window.addEventListener('pointerup', release);
    window.addEventListener('pointercancel', release);
    for (const k of CLASSES) {
      const slider = this.sliders[k];
      slider.addEventListener('pointerdown', () => { this.dragging = true; });
      slider.addEventListener('input', () => {
        this.mix = rebalance(this.mix, k, Number(slider.value));
        this.renderMix();
        clearTimeout(this.mixTimer);
        this.mixTimer = setTimeout(() => {
          this.mixTimer = null;
          const mix = { ...this.mix };
          this.send({ mix }, `Mix ${mixText(mix).replaceAll(',', ' ')}`);
        }, DEBOUNCE_MS);
      });
    }
    for (const [name, mix] of Object.entries(PRESETS)) {
      $(`preset-${name}`).addEventListener('click', () => {
        clearTimeout(this.mixTimer);
        this.mixTimer = null;
        this.mix = { ...mix };
        this.renderMix();
        this.send({ mix: { ...mix } }, `Preset ${$(`preset-${name}`).textContent}`);
      });
    }
    this.rateSlider.addEventListener('pointerdown', () => { this.dragging = true; });
    this.rateSlider.addEventListener('input', () => {
      const rate = Number(this.rateSlider.value);
      this.rateInput.value = String(rate);
      clearTimeout(this.rateTimer);
      this.rateTimer = setTimeout(() => {
        this.rateTimer = null;
        this.send({ rate }, `Rate ${rate}/s`);
      }, DEBOUNCE_MS);
    });
    // The typed value goes to the server as it is: the API validates it and says what is
    // wrong (a rate of 0 or below, not a number).
    this.rateInput.addEventListener('change', () => {
      const raw = this.rateInput.value.trim();
      const rate = raw === '' ? NaN : Number(raw);
      if (Number.isFinite(rate)) this.rateSlider.value = String(rate);
      this.send({ rate: Number.isFinite(rate) ? rate : raw }, `Rate ${raw || '(empty)'}`);
    });
    $('auto-toggle').addEventListener('click', () => {
      const auto = this.scenario?.mode === 'auto';
      $('auto-toggle').disabled = true;
      Promise.resolve(this.onAuto(!auto)).finally(() => { $('auto-toggle').disabled = false; });
    });
  }

  /** Shows an API error in the panel (it stays until the next success). */
  showError(message) {
    const box = $('booth-error');
    setText(box, message);
    box.hidden = false;
  }

  clearError() {
    $('booth-error').hidden = true;
  }

  update(status) {
    this.status = status;
    const lane = status.lanes?.[0];
    const m = lane?.metrics || {};
    const running = !!status.running;
    setText($('booth-rps'), running ? fmt.rps(m.rps) : fmt.DASH);
    setText($('booth-in-flight'), fmt.integer(lanesSum(status, (l) => l.metrics?.in_flight)));
    setText($('booth-conversations'), fmt.integer(lanesSum(status, (l) => l.metrics?.active_conversations)));

    const auto = status.scenario?.mode === 'auto';
    if (!this.userBusy()) {
      const mix = parseMix(status.mix);
      if (mix) this.mix = toPercent(mix);
      this.renderMix();
      const rate = typeof status.rate === 'number' ? status.rate : null;
      setText($('rate-loop'), rate === null ? 'closed loop: set a rate to switch to arrivals' : 'sessions/s (open loop)');
      if (rate !== null) {
        this.rateSlider.value = String(rate);
        if (this.rateInput.value !== String(rate)) this.rateInput.value = String(rate);
      } else if (this.rateInput.value !== '') {
        this.rateInput.value = '';
      }
    }
    const current = parseMix(status.mix);
    for (const [name, mix] of Object.entries(PRESETS)) {
      const button = $(`preset-${name}`);
      button.classList.toggle('active', !!current && sameMix(toPercent(current), mix));
      button.disabled = auto;
    }
    for (const k of CLASSES) this.sliders[k].disabled = auto;
    this.rateSlider.disabled = auto;
    this.rateInput.disabled = auto;
    $('booth-auto-note').hidden = !auto;
    this.updateScenario(status.scenario);
  }

  renderMix() {
    for (const k of CLASSES) {
      if (this.sliders[k].value !== String(this.mix[k])) this.sliders[k].value = String(this.mix[k]);
      setText(this.values[k], `${this.mix[k]}%`);
    }
  }

  // ---- auto mode ----

  updateScenario(scenario) {
    const box = $('scenario-box');
    // An older backend has no scenario controller: nothing of auto mode is shown.
    const known = !!scenario && typeof scenario === 'object';
    box.hidden = !known;
    if (!known) {
      this.scenario = null;
      return;
    }
    const previous = this.scenario;
    const statusMs = typeof this.status?.time_ms === 'number' ? this.status.time_ms : null;
    if (previous && statusMs !== null && this.scenarioStatusMs !== null
      && previous.phase === scenario.phase && previous.index === scenario.index
      && previous.cycle === scenario.cycle) {
      const wallS = (statusMs - this.scenarioStatusMs) / 1000;
      const scenarioS = previous.time_left_s - scenario.time_left_s;
      if (wallS >= 0.5 && scenarioS > 0) this.clockRate = scenarioS / wallS;
    }
    this.scenario = scenario;
    this.scenarioAt = Date.now();
    this.scenarioStatusMs = statusMs;
    const auto = scenario.mode === 'auto';
    const toggle = $('auto-toggle');
    toggle.setAttribute('aria-pressed', String(auto));
    toggle.classList.toggle('on', auto);
    setText($('auto-state'), auto ? 'Auto' : 'Manual');
    setText($('scenario-phase'), typeof scenario.phase === 'string' ? scenario.phase : 'IDLE');
    setText($('scenario-note'), typeof scenario.note === 'string' ? scenario.note : '');
    const step = Number.isInteger(scenario.index) ? `phase ${scenario.index + 1}` : '';
    const cycle = Number.isInteger(scenario.cycle) ? `cycle ${scenario.cycle + 1}` : '';
    setText($('scenario-step'), [step, cycle].filter(Boolean).join(' · '));
    const pools = scenario.pools;
    setText($('scenario-pools'), pools && typeof pools === 'object'
      ? `Prefill ${fmt.integer(pools.prefill)} · Decode ${fmt.integer(pools.decode)}`
      : fmt.DASH);
    setText($('scenario-autoscaler'), autoscalerText(scenario.autoscaler));
    this.renderCountdown();
  }

  /** The phase's time left (scenario seconds), counted down between status messages. */
  renderCountdown() {
    const s = this.scenario;
    const node = $('scenario-countdown');
    if (!s || s.phase === 'IDLE' || typeof s.time_left_s !== 'number') {
      setText(node, fmt.DASH);
      return;
    }
    setText(node, countdown(s.time_left_s - ((Date.now() - this.scenarioAt) / 1000) * this.clockRate));
  }
}

function lanesSum(status, read) {
  let total = null;
  for (const lane of status.lanes || []) {
    const v = read(lane);
    if (typeof v === 'number') total = (total ?? 0) + v;
  }
  return total;
}

/** "prefill TTFT p95 0.61 s / 0.50 s · decode ITL p95 …", with "paused" in auto mode. */
function autoscalerText(autoscaler) {
  if (!autoscaler || typeof autoscaler !== 'object') return '';
  const parts = [];
  for (const [pool, metric] of [['prefill', 'TTFT'], ['decode', 'ITL']]) {
    const a = autoscaler[pool];
    if (!a || typeof a !== 'object') continue;
    const value = typeof a.value === 'number' ? `${fmt.ms(a.value * 1000)} ms` : fmt.DASH;
    const threshold = typeof a.threshold === 'number' ? `${fmt.ms(a.threshold * 1000)} ms` : fmt.DASH;
    parts.push(`${pool} ${metric} p95 ${value} / ${threshold}${a.paused ? ' (paused)' : ''}`);
  }
  return parts.length ? `Autoscaler: ${parts.join(' · ')}` : '';
}
