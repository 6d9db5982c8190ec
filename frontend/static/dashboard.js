// The dashboard: counters and one occupancy strip per engine core, redrawn from
// GET /dashboard/events (a few JSON snapshots a second, read with fetch so the key can be sent).
"use strict";

const PREFILL_COLOR = "#f28e2b";
const DECODE_COLOR = "#4e79a7";
const CELL_WIDTH = 3;  // px per step column
const MIN_ROWS = 8;  // the strip's height in cells until a bigger batch is seen

const strips = [];  // per engine: {canvas, label, columns: [[prefill, decode], ...], maxRows}

const el = (id) => document.getElementById(id);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function setText(id, value) {
  el(id).textContent = String(value);
}

function strip(index) {
  while (strips.length <= index) {
    const i = strips.length;
    const box = document.createElement("div");
    box.className = "strip";
    const label = document.createElement("div");
    label.className = "strip-label";
    const canvas = document.createElement("canvas");
    canvas.id = `strip-${i}`;
    canvas.height = 160;
    box.append(label, canvas);
    el("strips").append(box);
    strips.push({ canvas, label, columns: [], maxRows: MIN_ROWS });
  }
  return strips[index];
}

function draw(s) {
  const canvas = s.canvas;
  const width = canvas.clientWidth || 800;
  if (canvas.width !== width) canvas.width = width;
  const maxColumns = Math.floor(width / CELL_WIDTH);
  if (s.columns.length > maxColumns) s.columns.splice(0, s.columns.length - maxColumns);
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const cellHeight = canvas.height / s.maxRows;
  const gap = cellHeight >= 4 ? 1 : 0;  // cell borders while the cells are big enough to see them
  const x0 = canvas.width - s.columns.length * CELL_WIDTH;
  s.columns.forEach(([prefill, decode], i) => {
    const x = x0 + i * CELL_WIDTH;
    for (let row = 0; row < prefill + decode; row++) {
      ctx.fillStyle = row < decode ? DECODE_COLOR : PREFILL_COLOR;
      const y = canvas.height - (row + 1) * cellHeight;
      ctx.fillRect(x, y + gap, CELL_WIDTH - (CELL_WIDTH > 2 ? 1 : 0), cellHeight - gap);
    }
  });
}

function update(snapshot) {
  const totals = snapshot.totals;
  setText("num-running", totals.num_running);
  setText("num-waiting", totals.num_waiting);
  setText("kv-used", totals.num_kv_blocks_used);
  setText("kv-total", snapshot.engines.reduce((sum, e) => sum + e.num_kv_blocks, 0));
  setText("kv-cached", totals.num_cached_blocks);
  setText("prefix-hits", totals.num_prefix_cache_hits);
  const queries = totals.num_prefix_cache_queries;
  setText("prefix-hit-rate", queries ? Math.round(100 * totals.num_prefix_cache_hits / queries) : 0);
  setText("tokens-in", Math.round(snapshot.prompt_tokens_per_s));
  setText("tokens-out", Math.round(snapshot.generation_tokens_per_s));
  setText("num-preemptions", totals.num_preemptions);
  for (const engine of snapshot.engines) {
    const s = strip(engine.index);
    for (let i = 0; i < engine.num_steps_dropped; i++) s.columns.push([0, 0]);  // a gap marks skipped steps
    for (const column of engine.steps) {
      s.columns.push(column);
      s.maxRows = Math.max(s.maxRows, column[0] + column[1]);
    }
    s.label.textContent = `engine ${engine.index}${engine.is_alive ? "" : " (dead)"}: `
      + `${engine.num_running} running, ${engine.num_waiting} waiting, `
      + `${engine.num_kv_blocks_used}/${engine.num_kv_blocks} KV blocks, `
      + `${Math.round(engine.tokens_out_per_s)} tokens/s out; strip height ${s.maxRows} sequences`;
    draw(s);
  }
}

let isFollowing = false;  // one feed at a time, however often the key is entered

async function follow() {
  if (isFollowing) return;
  isFollowing = true;
  try {
    await followFeed();
  } finally {
    isFollowing = false;
  }
}

async function followFeed() {
  for (;;) {
    try {
      const response = await fetch("/dashboard/events", { headers: tokenloom.headers() });
      if (response.status === 401) {
        el("feed-status").textContent = "needs the API key";
        tokenloom.askKey("The server refused the key; enter it again.");
        return;  // the key form calls follow() again
      }
      if (!response.ok) throw new Error(await tokenloom.errorMessage(response));
      el("feed-status").textContent = "live";
      await tokenloom.readEvents(response, update);
      el("feed-status").textContent = "feed ended; reconnecting…";
    } catch (e) {
      el("feed-status").textContent = `disconnected (${e.message}); reconnecting…`;
    }
    await sleep(1000);
  }
}

tokenloom.setUpKeyForm(follow);
if (!tokenloom.needsKey || tokenloom.apiKey()) follow();
window.addEventListener("resize", () => strips.forEach(draw));
