// The Tandem dashboard: polls GET /v1/cluster and redraws. No framework, no build step; charts
// are uPlot (vendor/). Everything drawn comes from the one JSON document (README "Dashboard").
"use strict";

const params = new URLSearchParams(location.search);
const INTERVAL_S = Math.max(Number(params.get("interval")) || 2, 0.5);
const KEY_STORE = "tandem-api-key";
const ROLE_COLOR = { prefill: "#2f6fdf", decode: "#13a37a", colocated: "#8a56d6" };
const SVG_NS = "http://www.w3.org/2000/svg";

const $ = (id) => document.getElementById(id);
const fmt = (v, digits = 1) => (v === null || v === undefined || Number.isNaN(v)) ? "–" : Number(v).toFixed(digits);
const pct = (v) => (v === null || v === undefined) ? "–" : `${(100 * v).toFixed(1)}%`;
const pair = (p) => `${fmt(p.p50, 0)} / ${fmt(p.p99, 0)} ms`;

function bytes(n) {
  if (!n) return "0 B";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  const i = Math.min(Math.floor(Math.log2(n) / 10), units.length - 1);
  return `${(n / 2 ** (10 * i)).toFixed(i ? 1 : 0)} ${units[i]}`;
}

function svg(tag, attrs, parent) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  if (parent) parent.appendChild(el);
  return el;
}

function text(parent, x, y, content, cls) {
  const t = svg("text", { x, y, class: cls || "" }, parent);
  t.textContent = content;
  return t;
}

// -- fetching ---------------------------------------------------------------------------------
async function fetchCluster() {
  const key = sessionStorage.getItem(KEY_STORE);
  const headers = key ? { Authorization: `Bearer ${key}` } : {};
  const response = await fetch("/v1/cluster", { headers, cache: "no-store" });
  if (response.status === 401) {
    const err = new Error(key ? "that key was refused" : "");
    err.auth = true;
    throw err;
  }
  if (!response.ok) throw new Error(`GET /v1/cluster: ${response.status}`);
  return response.json();
}

// -- the deployment map -----------------------------------------------------------------------
function drawMap(data) {
  const map = $("map");
  map.replaceChildren();
  const width = map.clientWidth || 1000;
  const defs = svg("defs", {}, map);
  const marker = svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7,
    markerHeight: 7, orient: "auto-start-reverse" }, defs);
  svg("path", { d: "M 0 0 L 10 5 L 0 10 z", fill: ROLE_COLOR.prefill }, marker);

  const roles = ["prefill", "colocated", "decode"];
  const columns = roles.map((r) => data.workers.filter((w) => w.role === r)).filter((c) => c.length);
  const boxW = 210, boxH = 78, gapY = 14, top = data.router ? 96 : 16;
  const rows = Math.max(1, ...columns.map((c) => c.length));
  map.setAttribute("height", top + rows * (boxH + gapY) + 10);
  const colX = (i) => (width / (columns.length + 1)) * (i + 1) - boxW / 2;
  const where = {};
  columns.forEach((col, i) => col.forEach((w, j) => { where[w.id] = { x: colX(i), y: top + j * (boxH + gapY) }; }));

  if (data.router) {
    const rx = width / 2 - boxW / 2, ry = 10;
    for (const w of data.workers) {
      const p = where[w.id];
      svg("path", { class: "link", d: `M ${width / 2} ${ry + 56} C ${width / 2} ${ry + 80}, ${p.x + boxW / 2} ${p.y - 26}, ${p.x + boxW / 2} ${p.y}` }, map);
    }
    const g = svg("g", { class: "router", "data-worker-id": "router" }, map);
    svg("rect", { class: "node", x: rx, y: ry, width: boxW, height: 56, rx: 8, stroke: "#39404f" }, g);
    text(g, rx + 10, ry + 20, "router");
    text(g, rx + 10, ry + 37, `${data.router.address} · pid ${data.router.pid}`, "sub");
    text(g, rx + 10, ry + 51, `${data.router.in_flight} in flight · ${data.router.worker_deaths} deaths`, "sub");
  }

  for (const t of data.transfers || []) {
    const a = where[t.from], b = where[t.to];
    if (!a || !b) continue;
    const x1 = a.x + boxW, y1 = a.y + boxH / 2, x2 = b.x, y2 = b.y + boxH / 2;
    const widthPx = Math.min(1 + Math.log10(1 + t.bytes / 1e5), 6);
    svg("path", { class: "transfer", "stroke-width": widthPx,
      d: `M ${x1} ${y1} C ${(x1 + x2) / 2} ${y1}, ${(x1 + x2) / 2} ${y2}, ${x2 - 2} ${y2}` }, map);
    text(map, (x1 + x2) / 2 - 40, (y1 + y2) / 2 - 6, `KV ${t.count}× · ${bytes(t.bytes)}`, "sub");
  }

  for (const w of data.workers) {
    const p = where[w.id];
    const g = svg("g", { class: `worker ${w.state}`, "data-worker-id": w.id, "data-role": w.role,
      "data-state": w.state }, map);
    svg("rect", { class: "node", x: p.x, y: p.y, width: boxW, height: boxH, rx: 8, stroke: ROLE_COLOR[w.role] }, g);
    text(g, p.x + 10, p.y + 18, `${w.id}`);
    text(g, p.x + boxW - 10, p.y + 18, w.state, "sub").setAttribute("text-anchor", "end");
    const cores = w.cores ? `cores ${w.cores.join(",")}` : "cores ?";
    text(g, p.x + 10, p.y + 34, `${w.role} · ${cores} · pid ${w.pid ?? "?"}`, "sub");
    text(g, p.x + 10, p.y + 50, `${w.running} running · ${w.waiting} waiting · KV ${w.kv_used_blocks}/` +
      `${w.kv_total_blocks}`, "sub");
    const barW = boxW - 20, used = w.kv_total_blocks ? w.kv_used_blocks / w.kv_total_blocks : 0;
    svg("rect", { class: "kvbar-bg", x: p.x + 10, y: p.y + 60, width: barW, height: 8, rx: 4 }, g);
    svg("rect", { class: "kvbar", x: p.x + 10, y: p.y + 60, width: Math.max(barW * used, used ? 2 : 0), height: 8,
      rx: 4, fill: ROLE_COLOR[w.role] }, g);
  }
}

// -- panels -----------------------------------------------------------------------------------
function drawCards(data) {
  const t = data.totals, w = data.window;
  $("model").textContent = data.model;
  $("mode").textContent = data.mode;
  const health = $("health");
  health.textContent = data.health.status + (data.health.reasons.length ? `: ${data.health.reasons.join("; ")}` : "");
  health.className = `pill ${data.health.status}`;
  $("stat-running").textContent = t.running;
  $("stat-waiting").textContent = t.waiting;
  $("stat-kv-usage").textContent = pct(t.kv_usage);
  $("stat-kv-blocks").textContent = `${t.kv_used_blocks} of ${t.kv_total_blocks} blocks`;
  $("stat-prefix-hit").textContent = pct(t.prefix_hit_rate);
  $("stat-goodput").textContent = fmt(w.goodput_rps, 2);
  $("stat-attainment").textContent = pct(w.slo_attainment);
  $("stat-output-rate").textContent = fmt(w.output_tok_s, 1);
  $("stat-generation-tokens").textContent = t.generation_tokens;
  $("stat-ttft").textContent = pair(w.ttft_ms);
  $("stat-tpot").textContent = pair(w.tpot_ms);
  $("stat-itl").textContent = pair(w.itl_ms);
  $("slo-ttft").textContent = data.slo ? `SLO ${data.slo.ttft_ms} ms` : "no SLO set";
  $("slo-tpot").textContent = data.slo ? `SLO ${data.slo.tpot_ms} ms` : "no SLO set";
}

function drawStore(data) {
  const box = $("store");
  if (!data.store.length) return;
  box.replaceChildren();
  for (const s of data.store) {
    const row = document.createElement("div");
    row.className = "tier";
    row.dataset.tier = s.tier;
    row.innerHTML = `<b>${s.tier}</b><span class="bar"><span style="width:${(100 * s.usage).toFixed(1)}%"></span></span>
      <span>${bytes(s.used_bytes)} of ${bytes(s.capacity_bytes)}</span>
      <span class="muted">hits ${pct(s.hit_rate)} · ${s.hits} loaded · ${s.evictions} evicted</span>`;
    box.appendChild(row);
  }
}

function drawWorkers(data) {
  const body = $("workers").querySelector("tbody");
  body.replaceChildren();
  for (const w of data.workers) {
    const tr = document.createElement("tr");
    tr.dataset.workerId = w.id;
    const cells = [w.id, w.role, w.state, `${w.host} / ${w.pid ?? "?"}`, w.cores ? w.cores.join(",") : "?", w.running,
      w.waiting, `${w.kv_used_blocks} / ${w.kv_total_blocks}`, pct(w.prefix_hit_rate), w.requests_routed ?? "–",
      w.kv_bytes_sent === undefined ? "–" : bytes(w.kv_bytes_sent),
      w.kv_bytes_received === undefined ? "–" : bytes(w.kv_bytes_received)];
    for (const c of cells) {
      const td = document.createElement("td");
      td.textContent = c;
      tr.appendChild(td);
    }
    tr.children[1].className = `role-${w.role}`;
    body.appendChild(tr);
  }
}

function drawPlanner(data) {
  const box = $("planner");
  if (!data.planner) return;
  const actions = data.planner.actions;
  box.replaceChildren();
  const head = document.createElement("div");
  head.textContent = `on · decides every ${data.planner.interval_s} s · forecast ` +
    `${fmt(data.planner.forecast_prompt_tok_s, 0)} prompt tok/s · ${actions.length} actions`;
  box.appendChild(head);
  if (data.planner.predictive) drawPredictions(box, data.planner);
  if (!actions.length) return;
  box.appendChild(rowsTable(["time", "from", "to", "outcome", "why"], actions.slice().reverse().map((a) =>
    [new Date(a.t * 1000).toLocaleTimeString(), a.from_role || "(new)", a.to_role || "(released)", a.outcome,
      a.reason])));
}

function rowsTable(columns, rows) {
  const table = document.createElement("table");
  const head = document.createElement("tr");
  for (const c of columns) {
    const th = document.createElement("th");
    th.textContent = c;
    head.appendChild(th);
  }
  const thead = document.createElement("thead");
  thead.appendChild(head);
  table.appendChild(thead);
  const body = document.createElement("tbody");
  for (const row of rows) {
    const tr = document.createElement("tr");
    for (const c of row) {
      const td = document.createElement("td");
      td.textContent = c;
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
  table.appendChild(body);
  return table;
}

// The predictive planner: what it predicted each option would give at its last decision, and each
// prediction (an action's, or staying's once a horizon) against the goodput then measured.
function drawPredictions(box, planner) {
  const scores = document.createElement("div");
  scores.id = "planner-scores";
  scores.textContent = "last decision: " + (planner.last_scores || []).map((o) =>
    `${o.option} ${fmt(o.predicted_goodput, 3)} req/s`).join(" · ");
  box.appendChild(scores);
  const rows = (planner.predictions || []).slice().reverse().map((r) => [
    `${fmt(r.age_s, 0)} s ago`, r.acted ? r.label : `(stayed) ${r.label}`, fmt(r.predicted_goodput, 3),
    r.measured_goodput === null ? "pending" : fmt(r.measured_goodput, 3),
    r.error === null ? "" : `${r.error >= 0 ? "+" : ""}${fmt(100 * r.error, 0)}%`]);
  if (rows.length) {
    const table = rowsTable(["when", "prediction", "predicted goodput", "measured", "error"], rows);
    table.id = "planner-predictions";
    box.appendChild(table);
  }
}

// -- charts -----------------------------------------------------------------------------------
const charts = {};
let plannerMarks = [];

// Planner actions as dashed vertical lines on every time chart.
const markPlugin = {
  hooks: {
    draw: [(u) => {
      const ctx = u.ctx;
      ctx.save();
      ctx.strokeStyle = "#d99a1e";
      ctx.setLineDash([4, 4]);
      ctx.lineWidth = 1.5;
      for (const t of plannerMarks) {
        const x = u.valToPos(t, "x", true);
        if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
        ctx.beginPath();
        ctx.moveTo(x, u.bbox.top);
        ctx.lineTo(x, u.bbox.top + u.bbox.height);
        ctx.stroke();
      }
      ctx.restore();
    }],
  },
};

function chart(id, series, data, axes) {
  const el = $(id);
  if (!charts[id]) {
    const opts = {
      width: Math.max(el.clientWidth, 300), height: 200, plugins: [markPlugin],
      scales: { x: { time: true } },
      // Points show where buckets are few (uPlot's default); lines span the idle buckets between.
      series: [{}, ...series.map((s) => ({ spanGaps: true, width: 2, ...s }))],
      axes: axes || [{}, {}],
      legend: { live: false },
    };
    charts[id] = new uPlot(opts, data, el);
  } else {
    charts[id].setData(data);
  }
}

function drawCharts(data) {
  plannerMarks = data.planner ? data.planner.actions.map((a) => a.t) : [];
  const s = data.series;
  const t = s.map((b) => b.t + data.bucket_s / 2);
  const col = (f) => s.map(f);
  const slo = (v) => s.map(() => (data.slo ? v : null));
  const sloLine = { label: "SLO", stroke: "#d6453d", dash: [6, 4], width: 1.5 };
  chart("chart-ttft", [{ label: "p50", stroke: "#2f6fdf" }, { label: "p99", stroke: "#8a56d6" }, sloLine],
    [t, col((b) => b.ttft_ms.p50), col((b) => b.ttft_ms.p99), slo(data.slo && data.slo.ttft_ms)]);
  chart("chart-tpot", [{ label: "p50", stroke: "#13a37a" }, { label: "p99", stroke: "#8a56d6" }, sloLine],
    [t, col((b) => b.tpot_ms.p50), col((b) => b.tpot_ms.p99), slo(data.slo && data.slo.tpot_ms)]);
  chart("chart-itl", [{ label: "p50", stroke: "#13a37a" }, { label: "p99", stroke: "#8a56d6" }],
    [t, col((b) => b.itl_ms.p50), col((b) => b.itl_ms.p99)]);
  chart("chart-rate", [{ label: "output tok/s", stroke: "#2f6fdf", scale: "tok" },
    { label: "goodput req/s", stroke: "#13a37a", scale: "req" },
    { label: "finished req/s", stroke: "#9aa3b5", scale: "req", dash: [3, 3] }],
  [t, col((b) => b.output_tok_s), col((b) => b.goodput_rps), col((b) => b.finished / data.bucket_s)],
  [{}, { scale: "tok" }, { scale: "req", side: 1, grid: { show: false } }]);
  chart("chart-requests", [{ label: "running", stroke: "#13a37a" }, { label: "waiting", stroke: "#d99a1e" }],
    [t, col((b) => b.running ?? null), col((b) => b.waiting ?? null)]);
  // TTFT = waiting to be scheduled + computing the prompt (and, disaggregated, moving its KV).
  chart("chart-ttft-parts", [{ label: "queued", stroke: "#d99a1e", fill: "rgba(217,154,30,.15)" },
    { label: "TTFT", stroke: "#2f6fdf" }],
  [t, col((b) => b.queue_ms.p50), col((b) => b.ttft_ms.p50)]);
  chart("chart-kv", [{ label: "KV pool", stroke: "#8a56d6", fill: "rgba(138,86,214,.12)" }],
    [t, col((b) => (b.kv_usage === undefined ? null : 100 * b.kv_usage))]);
}

// -- the loop ---------------------------------------------------------------------------------
let polls = 0;

async function poll() {
  try {
    const data = await fetchCluster();
    $("auth").hidden = true;
    $("main").hidden = false;
    drawCards(data);
    drawMap(data);
    drawStore(data);
    drawWorkers(data);
    drawPlanner(data);
    drawCharts(data);
    polls += 1;
    document.body.dataset.polls = String(polls);
    $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    if (err.auth) {
      $("auth").hidden = false;
      $("main").hidden = true;
      $("auth-error").textContent = err.message;
    } else {
      $("health").textContent = "offline";
      $("health").className = "pill offline";
      $("updated").textContent = String(err.message || err);
    }
  }
}

$("auth").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(KEY_STORE, $("auth-key").value);
  poll();
});
$("interval").textContent = INTERVAL_S;
poll();
setInterval(poll, INTERVAL_S * 1000);
