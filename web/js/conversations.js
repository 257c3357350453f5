// The Conversations page (list, refreshed every 5 s) and the conversation detail page
// (transcript with per-turn metrics, refreshed every 3 s while the conversation is active).
// Message text is rendered with textContent (CSS keeps the newlines), never as HTML.

import { el, replaceChildren, setText } from './dom.js';
import * as fmt from './format.js';
import { getConversations, getConversation } from './api.js';

const LIST_REFRESH_MS = 5000;
const DETAIL_REFRESH_MS = 3000;
const STATUSES = ['active', 'completed', 'error'];

const $ = (id) => document.getElementById(id);

function badge(status) {
  const known = STATUSES.includes(status) ? status : 'unknown';
  return el('span', { class: `badge badge-${known}`, testid: 'status-badge', text: status || 'unknown' });
}

function turns(c) {
  return `${fmt.integer(c.turns_done)} / ${fmt.integer(c.turns_planned)}`;
}

function openConversation(id) {
  location.hash = `#/conversations/${encodeURIComponent(id)}`;
}

export class Conversations {
  /** `isCompare()` says whether the load generator runs two lanes (adds a Lane column). */
  constructor({ isCompare }) {
    this.isCompare = isCompare;
    this.timer = null;
    this.generation = 0; // drops answers that arrive after the page changed
    this.lastDetailJson = null;
  }

  stop() {
    clearTimeout(this.timer);
    this.timer = null;
    this.generation++;
  }

  // ---- list ----

  showList() {
    this.stop();
    const gen = this.generation;
    const tick = async () => {
      try {
        const answer = await getConversations(200);
        if (gen !== this.generation) return;
        this.renderList(answer);
      } catch (err) {
        if (gen !== this.generation) return;
        const placeholder = $('conversations-placeholder');
        placeholder.hidden = false;
        setText(placeholder, `Could not load conversations: ${err.message}`);
      }
      if (gen === this.generation) this.timer = setTimeout(tick, LIST_REFRESH_MS);
    };
    tick();
  }

  renderList(answer) {
    const list = answer?.conversations || [];
    const lanes = new Set(list.map((c) => c.lane));
    const withLane = this.isCompare() || lanes.size > 1;
    const table = $('conversations-table');
    const placeholder = $('conversations-placeholder');
    const count = typeof answer?.total === 'number'
      ? `${fmt.integer(list.length)} shown, ${fmt.integer(answer.kept)} kept, ${fmt.integer(answer.total)} since start; refreshed every 5 s`
      : '';
    setText($('conversations-count'), count);
    if (!list.length) {
      table.hidden = true;
      placeholder.hidden = false;
      setText(placeholder, 'No conversations yet. Start the workload to create some.');
      return;
    }
    placeholder.hidden = true;
    table.hidden = false;
    replaceChildren($('conversations-head'), el('tr', {},
      ['Status', 'Topic', withLane ? 'Lane' : null, 'Turns', 'Duration', 'Started']
        .filter((h) => h)
        .map((h) => el('th', { scope: 'col', class: ['Turns', 'Duration'].includes(h) ? 'num' : '', text: h }))));
    replaceChildren($('conversations-body'), list.map((c) => el('tr', {
      class: 'clickable',
      testid: 'conversation-row',
      'data-id': c.id,
      tabindex: 0,
      onclick: () => openConversation(c.id),
      onkeydown: (e) => { if (e.key === 'Enter') openConversation(c.id); },
    },
    el('td', {}, badge(c.status)),
    el('td', { class: 'topic', text: c.topic || '' }),
    withLane ? el('td', { text: c.lane || '' }) : null,
    el('td', { class: 'num', text: turns(c) }),
    el('td', { class: 'num', text: fmt.duration(c.duration_s) }),
    el('td', { text: fmt.localTime(c.started_at_ms) }))));
  }

  // ---- detail ----

  showDetail(id) {
    this.stop();
    this.lastDetailJson = null;
    const gen = this.generation;
    const box = $('conversation-detail');
    replaceChildren(box, el('p', { class: 'placeholder', text: 'Loading conversation…' }));
    const tick = async () => {
      let active = false;
      try {
        const conversation = await getConversation(id);
        if (gen !== this.generation) return;
        active = conversation.status === 'active';
        const json = JSON.stringify(conversation);
        if (json !== this.lastDetailJson) {
          this.lastDetailJson = json;
          this.renderDetail(conversation);
        }
      } catch (err) {
        if (gen !== this.generation) return;
        if (err.status === 404) {
          replaceChildren(box, el('p', { class: 'placeholder', text: `Conversation ${id} not found (it may have been dropped from the kept set).` }));
          return;
        }
        // Keep what is shown; retry.
        active = true;
        if (this.lastDetailJson === null) {
          replaceChildren(box, el('p', { class: 'placeholder', text: `Could not load conversation: ${err.message}` }));
        }
      }
      if (active && gen === this.generation) this.timer = setTimeout(tick, DETAIL_REFRESH_MS);
    };
    tick();
  }

  renderDetail(c) {
    const box = $('conversation-detail');
    const facts = [
      ['Turns', turns(c)],
      ['Duration', fmt.duration(c.duration_s)],
      ['Started', fmt.localTime(c.started_at_ms)],
    ];
    if (this.isCompare()) facts.push(['Lane', c.lane || '']);
    const header = el('div', { class: 'detail-head' },
      el('div', { class: 'detail-title' }, el('h2', { text: c.topic || `Conversation ${c.id}` }), badge(c.status)),
      el('dl', { class: 'facts' }, facts.map(([k, v]) => el('div', {}, el('dt', { text: k }), el('dd', { text: v })))));
    const system = c.system
      ? el('details', { class: 'system-prompt' }, el('summary', { text: 'System message' }), el('p', { class: 'message-text', text: c.system }))
      : null;
    const turnNodes = (c.turns || []).map((t) => this.renderTurn(t));
    replaceChildren(box, header, system,
      turnNodes.length ? turnNodes : el('p', { class: 'placeholder', text: 'No turn has started yet.' }));
  }

  renderTurn(t) {
    const metric = (label, testid, value, unit) => el('div', { class: 'turn-metric' },
      el('span', { class: 'turn-metric-label', text: label }),
      el('span', { class: 'turn-metric-value', testid, text: value }),
      unit ? el('span', { class: 'turn-metric-unit', text: unit }) : null);
    const strip = el('div', { class: 'turn-metrics' },
      el('span', { class: 'turn-index', text: `Turn ${fmt.integer((t.index ?? 0) + 1)}` }),
      metric('TTFT', 'turn-ttft', fmt.ms(t.ttft_ms), 'ms'),
      metric('ITL', 'turn-itl', fmt.ms(t.itl_ms), 'ms'),
      metric('Tokens', 'turn-tokens', fmt.integer(t.tokens), null),
      metric('Latency', 'turn-latency', fmt.seconds(t.latency_s), 's'),
      t.worker ? metric('Worker', 'turn-worker', t.worker, null) : null,
      t.state === 'streaming' ? el('span', { class: 'turn-state streaming', text: 'streaming…' }) : null,
      t.state === 'failed' ? el('span', { class: 'turn-state failed', text: 'failed' }) : null);
    const streaming = t.state === 'streaming';
    return el('article', { class: `turn turn-${t.state || 'done'}`, testid: 'turn' },
      strip,
      t.error ? el('div', { class: 'turn-error', text: t.error }) : null,
      el('div', { class: 'bubble-row user' },
        el('div', { class: 'bubble-who', text: 'User' }),
        el('div', { class: 'bubble bubble-user message-text', testid: 'bubble-user', text: t.user ?? '' })),
      el('div', { class: 'bubble-row assistant' },
        el('div', { class: 'bubble-who', text: 'Assistant' }),
        el('div', {
          class: `bubble bubble-assistant message-text${streaming ? ' pending' : ''}`,
          testid: 'bubble-assistant',
          text: t.assistant ?? '',
        })));
  }
}
