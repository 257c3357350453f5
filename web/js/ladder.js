// Seed 003's phase ladder on the dashboard: one button per phase (baseline, kv, draft,
// eagle3), the phase running now with its router and speculative decoding, and the switch in
// progress. Shown only when the status has a `ladder` (kvroute demo with one aggregated
// simulated cluster); a click POSTs /api/phase through `onSwitch`.

import { setText } from './dom.js';

const $ = (id) => document.getElementById(id);

export class Ladder {
  /** `onSwitch(phase)`: POST /api/phase; returns a promise, rejects with the API's error. */
  constructor({ onSwitch }) {
    this.onSwitch = onSwitch;
    this.names = '';
    this.pending = null; // the phase a click asked for, until the answer
    this.status = null;
  }

  update(status) {
    this.status = status;
    const ladder = status?.ladder;
    const known = !!ladder && typeof ladder === 'object' && Array.isArray(ladder.phases);
    $('ladder-panel').hidden = !known;
    if (!known) return;
    this.renderButtons(ladder.phases);
    const switching = typeof ladder.switching === 'string' ? ladder.switching : this.pending;
    const phase = $('ladder-phase');
    setText(phase, switching ? `switching to ${switching}…` : ladder.phase);
    phase.classList.toggle('switching', !!switching);
    setText($('ladder-setup'), switching ? ''
      : `router ${ladder.router} · speculative decoding ${ladder.spec_decode}`);
    for (const button of $('ladder-buttons').querySelectorAll('button')) {
      const name = button.dataset.phase;
      button.classList.toggle('active', !switching && name === ladder.phase);
      button.setAttribute('aria-pressed', String(!switching && name === ladder.phase));
      button.disabled = !!switching;
    }
    if (typeof ladder.error === 'string' && ladder.error) this.showError(ladder.error);
    else if (!this.pending) $('ladder-error').hidden = true;
  }

  /** One button per phase, rebuilt only when the phases change. */
  renderButtons(phases) {
    const names = phases.map((p) => p.name).join(',');
    if (names === this.names) return;
    this.names = names;
    const box = $('ladder-buttons');
    box.replaceChildren();
    for (const p of phases) {
      if (!p || typeof p.name !== 'string') continue;
      const button = document.createElement('button');
      button.type = 'button';
      button.className = 'btn btn-preset';
      button.dataset.phase = p.name;
      button.dataset.testid = `phase-${p.name}`;
      button.title = `router ${p.router}, speculative decoding ${p.spec_decode}`;
      button.textContent = p.name;
      button.addEventListener('click', () => this.switchTo(p.name));
      box.append(button);
    }
  }

  switchTo(name) {
    this.pending = name;
    $('ladder-error').hidden = true;
    setText($('ladder-phase'), `switching to ${name}…`);
    $('ladder-phase').classList.add('switching');
    for (const button of $('ladder-buttons').querySelectorAll('button')) button.disabled = true;
    Promise.resolve(this.onSwitch(name))
      .catch((err) => this.showError(`Switching to ${name} failed: ${err.message}`))
      .finally(() => {
        this.pending = null;
        if (this.status) this.update(this.status);
      });
  }

  showError(message) {
    const box = $('ladder-error');
    setText(box, message);
    box.hidden = false;
  }
}
