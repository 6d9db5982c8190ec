// The offline live view (scripts/lib/live_view.py): one occupancy strip per benchmark mode, filled
// from GET /live/events as the modes run one after another, every strip on the same scale.
"use strict";

const el = (id) => document.getElementById(id);
const strips = new Map();  // mode name -> strip (strip.js)

function columnWidth() {
  const width = el("strips").clientWidth || 800;
  const longest = Math.max(1, ...[...strips.values()].map((s) => s.columns.length));
  return Math.min(CELL_WIDTH, width / longest);
}

function redraw() {
  const w = columnWidth();
  strips.forEach((s) => drawStrip(s, w, true));
}

function update(snapshot) {
  for (const run of snapshot.runs) {
    if (!strips.has(run.name)) strips.set(run.name, makeStrip(el("strips"), `strip-${run.name}`));
    const s = strips.get(run.name);
    addColumns(s, run.steps, run.num_steps_dropped);
    const rate = run.tokens_per_s ? `, ${Math.round(run.tokens_per_s)} tokens/s (prompt + output)` : "";
    s.label.textContent = run.state === "waiting" ? `${run.name}: waiting for the modes before it`
      : `${run.name}: ${run.state}, ${run.num_steps} steps in ${run.elapsed_s.toFixed(1)} s${rate}, `
        + `${run.num_kv_blocks_used} KV blocks used; strip height ${s.maxRows} sequences`;
  }
  redraw();
  el("feed-status").textContent = snapshot.runs.every((r) => r.state === "done") ? "run finished" : "live";
}

async function follow() {
  try {
    const response = await fetch("/live/events");
    if (!response.ok) throw new Error(`${response.status} ${response.statusText}`);
    el("feed-status").textContent = "live";
    await tokenloom.readEvents(response, update);  // common.js
  } catch (e) {
    el("feed-status").textContent = `disconnected (${e.message})`;
  }
}

follow();
window.addEventListener("resize", redraw);
