// The dashboard page: polls the server every 2 s for the rows it lacks (since=) and draws each panel on a canvas.
// No library: a few line charts do not need one, and the page must work with no network beyond its own server.
"use strict";

const POLL_MS = 2000;
const FACTS_EVERY = 3; // polls between reading the list of folders and the selected one's facts
const REFETCH_ABOVE = 4000; // points held in one series before asking for the whole (thinned again) from row 0
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
const RUN_PANELS = [
  { title: "reward per step", keys: ["reward/mean", "eval/reward/mean"], prefix: "eval/pass@" },
  { title: "loss", keys: ["loss"] },
  { title: "step time (s)", keys: ["time/step_s", "time/wait_for_batch_s", "time/train_s", "time/publish_s"] },
  { title: "staleness (versions) and stale drops", keys: ["policy/staleness_mean", "policy/staleness_max", "rollouts/dropped_stale"] },
  { title: "gradient norm", keys: ["optim/grad_norm"] },
  { title: "trained tokens per second", keys: ["perf/tokens_per_s"] },
  { title: "restarts and faults (cumulative)", keys: [], prefix: "derived/events/", steps: true },
];
const CLIENT_PANELS = [
  { title: "loss per forward_backward call", keys: ["loss"] },
  { title: "gradient norm per optim_step", keys: ["grad_norm"] },
  { title: "seconds per call", keys: [], prefix: "seconds/" },
];

const token = new URLSearchParams(location.search).get("token");
const headers = token ? { Authorization: "Bearer " + token } : {};
let state = fresh(null);
let tick = 0;

function fresh(id) {
  return { id: id, kind: null, key: "", rows: 0, evalRows: 0, series: {}, evalSeries: {} };
}

async function getJSON(path, params) {
  const query = new URLSearchParams(params || {}).toString();
  const resp = await fetch(path + (query ? "?" + query : ""), { headers: headers, cache: "no-store" });
  if (!resp.ok) throw new Error(path + ": HTTP " + resp.status + " " + (await resp.text()).slice(0, 200));
  return resp.json();
}

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function age(unix) {
  if (!unix) return "nothing written yet";
  const s = Math.max(0, Date.now() / 1000 - unix);
  if (s < 90) return "updated " + Math.round(s) + " s ago";
  if (s < 5400) return "updated " + Math.round(s / 60) + " min ago";
  if (s < 172800) return "updated " + Math.round(s / 3600) + " h ago";
  return "updated " + Math.round(s / 86400) + " days ago";
}

function fmt(v) {
  if (typeof v !== "number") return v === null || v === undefined ? "–" : String(v);
  if (v !== 0 && (Math.abs(v) >= 1e5 || Math.abs(v) < 1e-3)) return v.toExponential(2);
  return String(Math.round(v * 1000) / 1000);
}

function merge(held, got, replace) {
  const out = replace ? {} : held;
  for (const [name, pair] of Object.entries(got)) {
    const line = out[name] || (out[name] = { x: [], y: [] });
    for (let i = 0; i < pair[0].length; i++) {
      line.x.push(pair[0][i]);
      line.y.push(pair[1][i]);
    }
  }
  return out;
}

function tooLong(series) {
  return Object.values(series).some((line) => line.x.length > REFETCH_ABOVE);
}

async function pollSeries() {
  if (!state.id) return;
  const asked = state.id;
  const got = await getJSON("api/series", { id: asked, since: state.rows, eval_since: state.evalRows, key: state.key });
  if (state.id !== asked) return; // another folder was picked meanwhile
  state.kind = got.kind;
  state.key = got.key;
  state.series = merge(state.series, got.series, got.since === 0);
  state.evalSeries = merge(state.evalSeries, got.eval_series, got.eval_since === 0);
  state.rows = got.rows;
  state.evalRows = got.eval_rows;
  if (tooLong(state.series) || tooLong(state.evalSeries)) {
    state.rows = 0; // the next answer holds everything again, thinned by the server
    state.evalRows = 0;
  }
  showProblems(got.problems);
  drawCharts();
}

function panelLines(panel) {
  const all = Object.assign({}, state.series, state.evalSeries);
  const names = panel.keys.filter((k) => all[k]);
  if (panel.prefix) names.push(...Object.keys(all).filter((k) => k.startsWith(panel.prefix)).sort());
  return names.map((name) => ({ name: name, line: all[name] }));
}

function drawCharts() {
  if (!state.kind) return; // nothing read yet
  const box = document.getElementById("charts");
  const panels = state.kind === "client" ? CLIENT_PANELS : RUN_PANELS;
  if (box.dataset.kind !== state.kind) {
    box.replaceChildren();
    box.dataset.kind = state.kind;
    for (const panel of panels) {
      const card = el("div", null, "chart");
      card.append(el("h4", panel.title), el("canvas"), el("div", "", "caption"));
      box.append(card);
    }
  }
  panels.forEach((panel, i) => {
    const card = box.children[i];
    const lines = panelLines(panel);
    const points = lines.reduce((n, l) => n + l.line.x.length, 0);
    const canvas = card.querySelector("canvas");
    canvas.dataset.points = String(points);
    card.dataset.title = panel.title;
    const last = lines.map((l) => short(l.name, panel) + " " + fmt(l.line.y[l.line.y.length - 1]));
    card.querySelector(".caption").textContent = points
      ? points + " points · last: " + last.join(", ")
      : "no points yet";
    plot(canvas, lines, panel);
  });
}

function short(name, panel) {
  return panel.prefix && name.startsWith(panel.prefix) && panel.keys.length === 0 ? name.slice(panel.prefix.length) : name;
}

function plot(canvas, lines, panel) {
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  canvas.width = Math.round(w * ratio);
  canvas.height = Math.round(h * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, w, h);
  ctx.font = "11px system-ui, sans-serif";
  if (!lines.length) {
    ctx.fillStyle = "#8a929c";
    ctx.fillText("no data yet", w / 2 - 30, h / 2);
    return;
  }
  let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
  for (const { line } of lines) {
    for (let i = 0; i < line.x.length; i++) {
      x0 = Math.min(x0, line.x[i]); x1 = Math.max(x1, line.x[i]);
      y0 = Math.min(y0, line.y[i]); y1 = Math.max(y1, line.y[i]);
    }
  }
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const pad = { l: 52, r: 10, t: 8 + 14 * Math.ceil(lines.length / 3), b: 22 };
  const px = (x) => pad.l + ((x - x0) / (x1 - x0)) * (w - pad.l - pad.r);
  const py = (y) => h - pad.b - ((y - y0) / (y1 - y0)) * (h - pad.t - pad.b);
  axes(ctx, { x0, x1, y0, y1, px, py, w, h, pad });
  lines.forEach(({ name, line }, k) => {
    const color = COLORS[k % COLORS.length];
    ctx.strokeStyle = color;
    ctx.fillStyle = color;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    for (let i = 0; i < line.x.length; i++) {
      const x = px(line.x[i]), y = py(line.y[i]);
      if (i === 0) ctx.moveTo(x, y);
      else if (panel.steps) { ctx.lineTo(x, py(line.y[i - 1])); ctx.lineTo(x, y); }
      else ctx.lineTo(x, y);
    }
    ctx.stroke();
    if (line.x.length <= 200) {
      for (let i = 0; i < line.x.length; i++) ctx.fillRect(px(line.x[i]) - 1.5, py(line.y[i]) - 1.5, 3, 3);
    }
    const lx = pad.l + (k % 3) * ((w - pad.l) / 3), ly = 12 + 14 * Math.floor(k / 3);
    ctx.fillRect(lx, ly - 7, 10, 3);
    ctx.fillStyle = "#1d2430";
    ctx.fillText(short(name, panel), lx + 14, ly - 2);
  });
}

function ticks(lo, hi) {
  // Round values 1, 2 or 5 x 10^k apart, four to ten of them: labels a person reads at a glance.
  const raw = (hi - lo) / 5, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Math.round(v / step) * step);
  return out;
}

function axes(ctx, a) {
  ctx.strokeStyle = "#e3e6ea";
  ctx.fillStyle = "#5b6573";
  ctx.lineWidth = 1;
  for (const yv of ticks(a.y0, a.y1)) {
    const y = a.py(yv);
    ctx.beginPath(); ctx.moveTo(a.pad.l, y); ctx.lineTo(a.w - a.pad.r, y); ctx.stroke();
    ctx.fillText(fmt(yv), 4, y + 4);
  }
  for (const xv of ticks(a.x0, a.x1)) {
    const label = fmt(xv), x = a.px(xv);
    ctx.fillText(label, Math.min(x - ctx.measureText(label).width / 2, a.w - a.pad.r - ctx.measureText(label).width), a.h - 6);
  }
}

function showProblems(problems) {
  const list = document.getElementById("problems");
  list.replaceChildren(...(problems || []).map((p) => el("li", p)));
}

function rowsOf(table, pairs) {
  table.replaceChildren(
    ...pairs.map(([k, v]) => {
      const tr = el("tr");
      tr.append(el("td", k), el("td", fmt(v)));
      return tr;
    }),
  );
}

async function pollFacts() {
  if (!state.id) return;
  const asked = state.id;
  const f = await getJSON("api/facts", { id: asked });
  if (state.id !== asked) return;
  document.getElementById("title").textContent = (f.kind === "client" ? "service client " : "run ") + f.name;
  document.getElementById("where").textContent = f.path + " · " + f.rows + " rows · " + age(f.updated_unix);
  if (f.kind === "client") {
    const s = f.summary;
    rowsOf(document.getElementById("latest"), [
      ["model", s.model_id], ["calls", Object.entries(s.calls).map(([k, n]) => k + " " + n).join(", ")],
      ["optim steps", s.optim_steps], ["tokens trained", s.tokens_trained], ["tokens sampled", s.tokens_sampled],
      ["loss first → last", fmt(s.loss_first) + " → " + fmt(s.loss_last)],
    ]);
    rowsOf(document.getElementById("saved"), Object.entries(f.saved).map(([k, v]) => [k, names(v)]));
    rowsOf(document.getElementById("faults"), []);
  } else {
    rowsOf(document.getElementById("latest"), Object.entries(f.latest).map(([k, v]) => ["latest " + k, v]));
    const c = f.checkpoints;
    rowsOf(document.getElementById("saved"), [
      ["resume loads", c.latest_checkpoint], ["newest checkpoints", names(c.newest_checkpoints)],
      ["adapters", c.adapter_versions], ["newest adapters", names(c.newest_adapters)],
    ]);
    const faults = Object.entries(f.faults).filter(([, v]) => v);
    faults.push(["trainer starts", f.segments]);
    rowsOf(document.getElementById("faults"), faults);
  }
  document.getElementById("saved-title").textContent =
    f.kind === "client" ? "Saved states (newest first)" : "Checkpoints and adapters";
  document.getElementById("faults-box").hidden = f.kind === "client";
  document.getElementById("config-title").hidden = f.kind === "client";
  document.getElementById("config").hidden = f.kind === "client";
  document.getElementById("config").textContent = f.config || "(no config.yaml)";
}

function names(entries) {
  return entries && entries.length ? entries.map((e) => e.name).join(", ") : "none yet";
}

async function pollSources() {
  const got = await getJSON("api/sources");
  document.getElementById("roots").textContent = "watching " + got.roots.join(", ");
  for (const kind of ["run", "client"]) {
    const list = document.getElementById(kind === "run" ? "runs" : "clients");
    const items = got.sources.filter((s) => s.kind === kind);
    list.replaceChildren(
      ...(items.length ? items : [null]).map((s) => {
        if (!s) return el("li", "none found", "muted");
        const li = el("li", s.name, s.id === state.id ? "sel" : "");
        li.dataset.id = s.id;
        li.title = s.path;
        li.append(el("span", age(s.updated_unix), "age"));
        li.onclick = () => { location.hash = encodeURIComponent(s.id); };
        return li;
      }),
    );
  }
}

function pick() {
  const id = decodeURIComponent(location.hash.slice(1)) || null;
  state = fresh(id);
  document.getElementById("view").hidden = !id;
  document.getElementById("empty").hidden = !!id;
  document.getElementById("charts").dataset.kind = "";
  for (const li of document.querySelectorAll(".list li")) li.classList.toggle("sel", li.dataset.id === id);
  needAll = true;
  poll();
}

let busy = false;
let needAll = true;
async function poll() {
  if (busy) return; // a slow answer is not asked for twice
  busy = true;
  const status = document.getElementById("status");
  try {
    if (needAll || tick % FACTS_EVERY === 0) {
      needAll = false;
      await Promise.all([pollSources(), pollFacts()]);
    }
    await pollSeries();
    status.textContent = "live · polled " + new Date().toLocaleTimeString();
  } catch (err) {
    status.textContent = "cannot reach the dashboard: " + err.message;
  } finally {
    busy = false;
    tick++;
  }
}

window.addEventListener("hashchange", pick);
window.addEventListener("resize", drawCharts);
pick();
setInterval(poll, POLL_MS);
