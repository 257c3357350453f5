// The Trace panel: a trace replayed by `kvroute loadgen --trace` (status.trace,
// docs/LOADGEN-API.md). Shown only when the status has a `trace`; the workload controls (mix,
// rate, concurrency), which do not apply to a replay, are hidden then.

import * as fmt from './format.js';
import { el, replaceChildren, setText } from './dom.js';

const $ = (id) => document.getElementById(id);

const STATE_TEXT = {
  idle: 'waiting for Start',
  running: 'replaying',
  finished: 'finished',
  stopped: 'stopped',
};

/** Which requests the hit rate and its bound are over: those that finished with usage. */
function hitOver(n) {
  if (!(n > 0)) return 'no request finished yet';
  return n === 1 ? 'on the 1 finished request' : `on the ${n} finished requests`;
}

/** `done` of `total` as a percentage 0..100 (0 without a total). */
function share(done, total) {
  return total > 0 ? Math.min(100, (100 * done) / total) : 0;
}

export class TracePanel {
  update(status) {
    const t = status?.trace;
    const known = !!t && typeof t === 'object';
    $('trace-panel').hidden = !known;
    // The chat workload's controls do not apply to a replay.
    $('booth-panel').hidden = known;
    document.querySelector('#live-panel .slider-box').hidden = known;
    $('btn-reset').hidden = known;
    if (!known) return;

    setText($('trace-file'), t.requests === t.requests_in_file
      ? `${t.file} (${t.requests} requests)`
      : `${t.file} (first ${t.requests} of ${t.requests_in_file} requests)`);
    setText($('trace-speed'), `${t.speed}\u00d7`);
    const state = $('trace-state');
    setText(state, STATE_TEXT[t.state] || String(t.state));
    state.dataset.state = t.state;

    const pct = share(t.issued, t.requests);
    $('trace-bar-fill').style.width = `${pct.toFixed(1)}%`;
    $('trace-bar').setAttribute('aria-valuenow', pct.toFixed(0));
    setText($('trace-sent'), `${t.issued} / ${t.requests}`);
    setText($('trace-time'), `${fmt.duration(t.trace_time_s)} of ${fmt.duration(t.trace_duration_s)}`);
    setText($('trace-elapsed'), t.state === 'idle' ? fmt.DASH : fmt.duration(t.elapsed_s));
    setText($('trace-eta'), t.state === 'running' ? fmt.duration(t.eta_s) : fmt.DASH);
    setText($('trace-in-flight'), fmt.integer(t.in_flight));
    setText($('trace-finished'), fmt.integer(t.finished));
    setText($('trace-failed'), fmt.integer(t.failed));
    $('trace-failed').classList.toggle('error', t.failed > 0);
    setText($('trace-dropped'), fmt.integer(t.dropped));
    const late = t.lateness_ms?.p95;
    setText($('trace-lateness'), typeof late === 'number' ? `${fmt.ms(late)} ms` : fmt.DASH);
    setText($('trace-ttft'), `${fmt.ms(t.ttft_ms?.p50)} / ${fmt.ms(t.ttft_ms?.p95)} ms`);
    // The server's rate against the bound over the same finished requests; the whole trace's
    // bound is over other requests until the last one finished.
    setText($('trace-hit'), fmt.kvHit(t.kv_hit_rate));
    setText($('trace-bound-finished'), fmt.kvHit(t.oracle_hit_rate_finished));
    // The server's rate above its bound (decided by the load generator, `above_bound`).
    const above = t.above_bound === true;
    const over = $('trace-hit-over');
    setText(over, hitOver(t.usage_requests)
      + (above ? ' (above it: the server\u2019s cache was not empty at the start)' : ''));
    over.parentElement.classList.toggle('error', above);
    setText($('trace-bound'), fmt.kvHit(t.oracle_prefix_hit_rate));

    const ended = t.state === 'finished' || t.state === 'stopped';
    const summary = $('trace-summary');
    summary.hidden = !ended;
    if (ended) {
      const cancelled = t.cancelled > 0 ? `, ${t.cancelled} in flight cancelled` : '';
      setText(summary, `Replay ${t.state}: ${t.issued} of ${t.requests} requests sent in `
        + `${fmt.duration(t.elapsed_s)}; ${t.finished} finished, ${t.failed} failed, `
        + `${t.dropped} dropped${cancelled}. Prefix hit ${fmt.kvHit(t.kv_hit_rate)} of prompt `
        + `tokens, of a possible ${fmt.kvHit(t.oracle_hit_rate_finished)} `
        + `${hitOver(t.usage_requests)} `
        + `(the whole trace's bound: ${fmt.kvHit(t.oracle_prefix_hit_rate)}); `
        + `TTFT p50 ${fmt.ms(t.ttft_ms?.p50)} ms, p95 ${fmt.ms(t.ttft_ms?.p95)} ms.`);
    }
    const errors = Array.isArray(t.errors) ? t.errors : [];
    const list = $('trace-errors');
    list.hidden = errors.length === 0;
    if (list.dataset.errors !== errors.join('\n')) {
      list.dataset.errors = errors.join('\n');
      replaceChildren(list, errors.map((e) => el('li', { text: `error: ${e}` })));
    }
  }
}
