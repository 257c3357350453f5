// Tiny DOM helpers. Every text goes through textContent, never innerHTML, so API strings
// (topics, chat messages, worker names) can never inject markup.

const SVG_NS = 'http://www.w3.org/2000/svg';

function applyAttrs(node, attrs) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === 'text') node.textContent = value;
    else if (key === 'class') node.setAttribute('class', value);
    else if (key === 'testid') node.setAttribute('data-testid', value);
    else if (key.startsWith('on') && typeof value === 'function') {
      node.addEventListener(key.slice(2), value);
    } else node.setAttribute(key, value === true ? '' : String(value));
  }
}

function append(node, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

/** An HTML element: el('td', {class: 'muted', testid: 'cell-x', text: '12'}, ...children). */
export function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  applyAttrs(node, attrs);
  append(node, children);
  return node;
}

/** An SVG element, same calling convention as `el`. */
export function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  applyAttrs(node, attrs);
  append(node, children);
  return node;
}

/** Replaces all children of `node`. */
export function replaceChildren(node, ...children) {
  node.replaceChildren();
  append(node, children);
}

/** Sets text only when it changed, so unchanged cells are not re-laid out every second. */
export function setText(node, text) {
  if (node.textContent !== text) node.textContent = text;
}

/**
 * Sets the one class of a group (e.g. slo-red / slo-yellow / slo-ok) on a node, removing the
 * others of the group; an empty `wanted` removes them all.
 */
export function setClassFrom(node, group, wanted) {
  for (const name of group) {
    if (name !== wanted) node.classList.remove(name);
  }
  if (wanted) node.classList.add(wanted);
}

export function byTestId(id, root = document) {
  return root.querySelector(`[data-testid="${id}"]`);
}
