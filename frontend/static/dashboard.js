// The dashboard: counters and one occupancy strip per engine core, redrawn from
// GET /dashboard/events (a few JSON snapshots a second, read with fetch so the key can be sent).
"use strict";

const strips = [];  // per engine: {canvas, label, columns: [[prefill, decode], ...], maxRows}

const el = (id) => document.getElementById(id);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function setText(id, value) {
  el(id).textContent = String(value);
}

function strip(index) {
  while (strips.length <= index) strips.push(makeStrip(el("strips"), `strip-${strips.length}`));
  return strips[index];
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
  updateSpecDecode(totals.spec_decode || {});
  for (const engine of snapshot.engines) {
    const s = strip(engine.index);
    addColumns(s, engine.steps, engine.num_steps_dropped);
    // Keep what a wide window can show; the oldest columns go.
    if (s.columns.length > 4096) s.columns.splice(0, s.columns.length - 4096);
    s.label.textContent = `engine ${engine.index}${engine.is_alive ? "" : " (dead)"}: `
      + `${engine.num_running} running, ${engine.num_waiting} waiting, `
      + `${engine.num_kv_blocks_used}/${engine.num_kv_blocks} KV blocks, `
      + `${Math.round(engine.tokens_out_per_s)} tokens/s out; strip height ${s.maxRows} sequences`;
    drawStrip(s);
  }
}

// One row per method that has drafted (n-gram lookup, a draft model, requests' predictions).
function updateSpecDecode(byMethod) {
  const methods = Object.keys(byMethod);
  el("spec-decode").hidden = methods.length === 0;
  const rows = methods.map((method) => {
    const s = byMethod[method];
    const cells = [method, s.num_proposed_tokens, s.num_accepted_tokens,
      `${(100 * s.acceptance_rate).toFixed(1)}%`, s.num_emitted_tokens, s.tokens_per_draft.toFixed(2)];
    const row = document.createElement("tr");
    for (const value of cells) {
      const cell = document.createElement("td");
      cell.textContent = String(value);
      row.appendChild(cell);
    }
    return row;
  });
  el("spec-decode-rows").replaceChildren(...rows);
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
window.addEventListener("resize", () => strips.forEach((s) => drawStrip(s)));
