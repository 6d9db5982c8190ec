// The occupancy strip, shared by the dashboard and the offline live view (scripts/lib/live_view.py):
// each step one column, each sequence of it one cell, coloured prefill, decode or padding.
"use strict";

const STRIP_COLORS = ["#f28e2b", "#4e79a7", "#bab0ac"];  // prefill, decode, a finished row's pad decode
const CELL_WIDTH = 3;  // px per step column
const MIN_ROWS = 8;  // the strip's height in cells until a bigger batch is seen

// A labelled canvas appended to `container`; `columns` holds [prefill, decode(, padding)] per step.
function makeStrip(container, id) {
  const box = document.createElement("div");
  box.className = "strip";
  const label = document.createElement("div");
  label.className = "strip-label";
  const canvas = document.createElement("canvas");
  canvas.id = id;
  canvas.height = 160;
  box.append(label, canvas);
  container.append(box);
  return { canvas, label, columns: [], maxRows: MIN_ROWS };
}

// Append a snapshot's columns (a gap of empty columns for skipped steps) and grow the height.
function addColumns(s, columns, numDropped) {
  for (let i = 0; i < numDropped; i++) s.columns.push([0, 0]);
  for (const column of columns) {
    s.columns.push(column);
    s.maxRows = Math.max(s.maxRows, column.reduce((sum, n) => sum + n, 0));
  }
}

// Draw the newest columns that fit, right-aligned (the dashboard: newest at the right edge), or
// from the first column, left-aligned, at `columnWidth` px each (the live view: every strip on
// one scale, a fraction of a pixel per step once a run has more steps than the canvas has px).
function drawStrip(s, columnWidth = CELL_WIDTH, alignLeft = false) {
  const canvas = s.canvas;
  const width = canvas.clientWidth || 800;
  if (canvas.width !== width) canvas.width = width;
  const maxColumns = Math.floor(width / columnWidth);
  const first = alignLeft ? 0 : Math.max(0, s.columns.length - maxColumns);
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const cellHeight = canvas.height / s.maxRows;
  const gap = cellHeight >= 4 ? 1 : 0;  // cell borders while the cells are big enough to see them
  const cellWidth = columnWidth > 2 ? columnWidth - 1 : columnWidth;
  const x0 = alignLeft ? 0 : canvas.width - (s.columns.length - first) * columnWidth;
  for (let i = first; i < s.columns.length; i++) {
    const x = x0 + (i - first) * columnWidth;
    let row = 0;
    // Bottom up: decode, then prefill, then padding, so the busy rows stay at the bottom.
    for (const kind of [1, 0, 2]) {
      const count = s.columns[i][kind] || 0;
      ctx.fillStyle = STRIP_COLORS[kind];
      for (let k = 0; k < count; k++, row++) {
        const y = canvas.height - (row + 1) * cellHeight;
        ctx.fillRect(x, y + gap, cellWidth, cellHeight - gap);
      }
    }
  }
}
