// fedps dashboard: live snapshots by server-sent events, inline SVG charts, the runs of the
// state folder (live and ended ones drawn from the same record), the next-run form.
// Plain JavaScript, nothing loaded from elsewhere.
"use strict";

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : String(c));
  return node;
}

const fmt = {
  num: (x, d = 3) => (x === null || x === undefined ? "-" : Number(x).toFixed(d)),
  bytes: (b) => (b >= 1e6 ? (b / 1e6).toFixed(2) + " MB" : (b / 1e3).toFixed(1) + " kB"),
  duration: (s) => {
    if (s === null || s === undefined || !isFinite(s)) return "-";
    s = Math.max(0, Math.round(s));
    if (s < 60) return `${s} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
    return `${Math.floor(s / 3600)} h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")} min`;
  },
  time: (unix) => (unix ? new Date(unix * 1000).toLocaleString() : "-"),
};

// What the page knows: the latest snapshot, the session, and which run it shows
// (viewing: null for the live run, else the id of a run opened from the list).
const state = { snapshot: null, session: null, viewing: null, viewed: null, runs: [], runsSerial: null, launch: "" };
const ENDED = ["finished", "stopped", "failed", "interrupted"];

// ---------------------------------------------------------------- charts
const W = 400, H = 170, PAD = { l: 40, r: 10, t: 8, b: 30 };
const NS = "http://www.w3.org/2000/svg";

function svgEl(tag, attrs, text) {
  const node = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

// Round ticks from 0 to at least max: about count steps of 1, 2 or 5 times a power of ten.
function niceTicks(max, count) {
  const raw = Math.max(max, 1e-9) / count, mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((st) => st >= raw - 1e-12);
  const top = Math.ceil(max / step - 1e-9) * step || step;
  const values = [];
  for (let v = 0; v <= top + step / 2; v += step) values.push(v);
  return { top, values, digits: step >= 1 ? 0 : Math.min(4, Math.ceil(-Math.log10(step))) };
}

// Draw points [[round, value], ...] on the chart svgId: axes with ticks, the line, a dot per
// point (its value as a tooltip), a dashed budget line, and the value under the pointer in hoverId.
function drawChart(svgId, lineId, points, opts) {
  const svg = $(svgId), line = $(lineId), grid = svg.querySelector(".grid");
  const xs = points.map((p) => p[0]);
  const xMin = xs.length ? Math.min(...xs) : 1, xMax = xs.length ? Math.max(...xs) : 1;
  const highest = Math.max(0, ...points.map((p) => p[1]), opts.budget || 0);
  const y_ = niceTicks(opts.yMax || highest * 1.05 || 1, 5);
  const x = (v) => PAD.l + ((v - xMin) / Math.max(1, xMax - xMin)) * (W - PAD.l - PAD.r);
  const y = (v) => H - PAD.b - (v / y_.top) * (H - PAD.t - PAD.b);
  grid.replaceChildren();
  for (const v of y_.values) {
    grid.append(svgEl("line", { x1: PAD.l, x2: W - PAD.r, y1: y(v), y2: y(v) }),
      svgEl("text", { x: PAD.l - 4, y: y(v) + 3, "text-anchor": "end" }, v.toFixed(y_.digits)));
  }
  const step = Math.max(1, Math.ceil((xMax - xMin) / 6));
  for (let r = xMin; r <= xMax; r += step) {
    grid.append(svgEl("line", { class: "axis", x1: x(r), x2: x(r), y1: H - PAD.b, y2: H - PAD.b + 4 }),
      svgEl("text", { class: "xtick", x: x(r), y: H - PAD.b + 14, "text-anchor": "middle" }, r));
  }
  grid.append(svgEl("line", { class: "axis", x1: PAD.l, x2: W - PAD.r, y1: H - PAD.b, y2: H - PAD.b }),
    svgEl("text", { x: (PAD.l + W - PAD.r) / 2, y: H - 2, "text-anchor": "middle" },
      xs.length ? "round" : "no rounds yet"));
  const budget = svg.querySelector(".budget");
  if (budget) {
    const on = opts.budget !== null && opts.budget !== undefined;
    budget.setAttribute("visibility", on ? "visible" : "hidden");
    if (on) {
      for (const [k, v] of Object.entries({ x1: PAD.l, x2: W - PAD.r, y1: y(opts.budget), y2: y(opts.budget) })) budget.setAttribute(k, v);
      budget.dataset.value = String(opts.budget);
    }
  }
  line.setAttribute("points", points.map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" "));
  line.dataset.count = String(points.length);
  const say = (p) => `round ${p[0]}: ${opts.name} ${Number(p[1]).toFixed(opts.digits)}`;
  const dot = (p) => {
    const circle = svgEl("circle", { cx: x(p[0]).toFixed(1), cy: y(p[1]).toFixed(1), r: 2.5 });
    circle.append(svgEl("title", {}, say(p)));
    return circle;
  };
  svg.querySelector(".dots").replaceChildren(...points.map(dot));
  const cursor = svg.querySelector(".cursor");
  svg.onmousemove = (event) => {
    if (!points.length) return;
    const box = svg.getBoundingClientRect(), vx = ((event.clientX - box.left) / box.width) * W;
    const p = points.reduce((best, q) => (Math.abs(x(q[0]) - vx) < Math.abs(x(best[0]) - vx) ? q : best));
    cursor.replaceChildren(svgEl("line", { x1: x(p[0]), x2: x(p[0]), y1: PAD.t, y2: H - PAD.b }));
    $(opts.hoverId).textContent = say(p);
  };
  svg.onmouseleave = () => { cursor.replaceChildren(); $(opts.hoverId).textContent = ""; };
}

// ---------------------------------------------------------------- the run shown
// The record of the run to show: the live one, or the one opened from the list. Without a run
// store (an older snapshot) the live run is made into a record.
function shownRecord() {
  const s = state.snapshot;
  const live = s && s.record ? s.record : null;
  if (state.viewing !== null) return live && live.id === state.viewing ? live : state.viewed;
  if (live || !s || !s.run) return live;
  const settings = s.config ? { rounds: s.config.training.rounds, target_epsilon: s.config.privacy.target_epsilon } : {};
  return { id: s.run.run_id, status: s.run.finished ? "finished" : "training", run: s.run, settings };
}

function isLive(rec) {
  const s = state.snapshot;
  return Boolean(rec && s && s.record && s.record.id === rec.id);
}

function renderRecord() {
  const s = state.snapshot || {};
  const rec = shownRecord();
  const run = rec && rec.run ? rec.run : null;
  const settings = (rec && rec.settings) || {};
  const rounds = run ? run.rounds || settings.rounds : settings.rounds;
  $("run-id").textContent = rec ? `run ${rec.id}` : "";
  const hist = run ? run.history : [];
  const evaluated = hist.filter((r) => r.accuracy !== null);
  $("round").textContent = rec ? `${run ? run.round : 0} / ${rounds || "-"}` : "-";
  $("accuracy").textContent = evaluated.length ? fmt.num(evaluated[evaluated.length - 1].accuracy) : "-";
  $("epsilon").textContent = run ? fmt.num(run.max_epsilon, 2) : "-";
  const budget = settings.target_epsilon === undefined ? null : settings.target_epsilon;
  $("delta").textContent = run
    ? `${budget !== null ? `budget ${budget}, ` : ""}delta ${run.delta}, ${run.noise} noise` : "";
  $("registered").textContent = run ? run.registered : "-";
  $("bytes").textContent = run ? fmt.bytes(run.bytes_pushed) : "-";
  const coordinatorUp = s.coordinator && s.coordinator.up;
  let phase = rec ? rec.status : !s.config ? "no cluster" : coordinatorUp ? "training" : "down";
  if (rec && isLive(rec) && rec.status === "training" && !coordinatorUp) phase = "down";
  if (rec && rec.status === "starting" && s.launch && s.launch.message) phase = s.launch.message;
  $("phase").textContent = phase;
  renderTimes();

  drawChart("acc-chart", "acc-line", evaluated.map((r) => [r.round, r.accuracy]),
    { yMax: 1, name: "accuracy", digits: 3, hoverId: "acc-hover" });
  drawChart("eps-chart", "eps-line", hist.map((r) => [r.round, r.max_epsilon]),
    { budget, name: "max epsilon", digits: 2, hoverId: "eps-hover" });

  $("rounds").tBodies[0].replaceChildren(...hist.slice().reverse().map((r) =>
    el("tr", {}, el("td", {}, r.round + (r.abandoned ? " (abandoned)" : "")),
      el("td", {}, fmt.num(r.accuracy)), el("td", {}, fmt.num(r.loss)),
      el("td", {}, fmt.num(r.max_epsilon, 2)), el("td", {}, fmt.num(r.seconds, 1)),
      el("td", {}, fmt.bytes(r.bytes_pushed)), el("td", {}, r.contributors))));

  const clients = run ? run.clients : [];
  const most = Math.max(1, ...clients.map((c) => c.rounds));
  $("clients").tBodies[0].replaceChildren(...clients.map((c) =>
    el("tr", {}, el("td", {}, c.id + (c.spent ? " (spent)" : "") + (c.warned ? " \u26a0" : "")),
      el("td", {}, fmt.num(c.epsilon, 2)), el("td", {}, fmt.num(c.reported_epsilon, 2)),
      el("td", {}, c.rounds), el("td", {}, fmt.num(c.noise_multiplier, 2)),
      el("td", {}, el("div", { class: "bar", style: `width:${(100 * c.rounds) / most}%` })))));
  const warnings = run && run.privacy_warnings ? run.privacy_warnings : [];
  $("privacy-warnings").replaceChildren(...(warnings.length ? warnings.map((w) => el("li", {}, w))
    : [el("li", {}, "none")]));
  renderRunBar(rec);
}

// Elapsed and estimated remaining time of the run shown (redrawn every second).
function renderTimes() {
  const rec = shownRecord();
  const run = rec && rec.run;
  if (!rec || !rec.started_unix) {
    $("elapsed").textContent = "-";
    $("remaining").textContent = "-";
    return;
  }
  const ended = ENDED.includes(rec.status);
  const end = ended ? rec.ended_unix : Date.now() / 1000;
  $("elapsed").textContent = end ? fmt.duration(end - rec.started_unix) : "-";
  const recent = run ? run.history.filter((r) => !r.abandoned).slice(-5) : [];
  const rounds = run ? run.rounds || (rec.settings || {}).rounds : 0;
  if (ended) {
    $("remaining").textContent = rec.status === "finished" ? "done" : "-";
  } else if (recent.length && rounds) {
    const perRound = recent.reduce((t, r) => t + r.seconds, 0) / recent.length;
    $("remaining").textContent = "about " + fmt.duration(perRound * Math.max(0, rounds - run.round));
  } else {
    $("remaining").textContent = "-";
  }
}

// Which run is shown, the way back to the live one, the operator's stop button and downloads.
function renderRunBar(rec) {
  const s = state.snapshot || {};
  const live = isLive(rec) || (rec && state.viewing === null);
  $("shown").textContent = !rec ? "no run yet"
    : `${live ? "live: " : "opened: "}run ${rec.id} (${rec.status})${rec.error ? ": " + rec.error : ""}`;
  $("live").hidden = state.viewing === null;
  const launch = s.launch;
  const stoppable = Boolean(rec && state.session && state.session.can_start && launch && launch.running &&
    String(launch.number) === rec.id && !ENDED.includes(rec.status));
  $("stop").hidden = !stoppable;
  const line = rec ? state.runs.find((r) => r.id === rec.id) : null;
  const files = line ? line.files : { model: false, logs: [] };
  const links = [];
  if (rec && state.session && state.session.operator) {
    const base = `/api/runs/${encodeURIComponent(rec.id)}`;
    if (files.model) links.push(el("a", { id: "download-model", href: `${base}/model`, download: "" }, "model"));
    for (const name of files.logs) links.push(el("a", { class: "download-log", href: `${base}/logs/${encodeURIComponent(name)}`, download: "" }, name));
  }
  $("downloads").replaceChildren(...(links.length ? [el("span", { class: "muted" }, "download: "), ...links] : []));
}

// ---------------------------------------------------------------- the run list
async function refreshRuns() {
  const response = await fetch("/api/runs", { credentials: "same-origin" });
  if (!response.ok) return;
  state.runs = (await response.json()).runs;
  renderRuns();
  renderRunBar(shownRecord());
}

function renderRuns() {
  const shown = shownRecord();
  $("runs").tBodies[0].replaceChildren(...state.runs.map((r) => {
    const settings = r.settings || {};
    const took = r.ended_unix && r.started_unix ? fmt.duration(r.ended_unix - r.started_unix) : "-";
    const open = el("button", { type: "button", class: "open", "data-run": r.id }, "open");
    open.addEventListener("click", () => openRun(r.id));
    return el("tr", { class: shown && shown.id === r.id ? "shown" : "", "data-run": r.id },
      el("td", {}, r.id), el("td", { class: `status-${r.status}` }, r.status + (r.error ? ` (${r.error})` : "")),
      el("td", {}, fmt.time(r.started_unix)), el("td", {}, took),
      el("td", {}, `${r.round} / ${settings.rounds || "-"}`), el("td", {}, fmt.num(r.accuracy)),
      el("td", {}, fmt.num(r.max_epsilon, 2)), el("td", {}, settings.target_epsilon ?? "-"),
      el("td", {}, settings.clients ?? "-"), el("td", {}, settings.mode ?? "-"), el("td", {}, open));
  }));
}

async function openRun(id) {
  const s = state.snapshot;
  if (s && s.record && s.record.id === id) {
    state.viewing = null;
  } else {
    const response = await fetch(`/api/runs/${encodeURIComponent(id)}`, { credentials: "same-origin" });
    const answer = await response.json();
    if (!response.ok) {
      $("run-note").textContent = answer.error || `refused (${response.status})`;
      return;
    }
    state.viewing = id;
    state.viewed = answer;
  }
  $("run-note").textContent = "";
  renderRecord();
  renderRuns();
}

async function stopRun() {
  const rec = shownRecord();
  if (!rec || !window.confirm(`Stop run ${rec.id} and every process it started?`)) return;
  $("stop").disabled = true;
  $("run-note").textContent = `stopping run ${rec.id}...`;
  const response = await fetch(`/api/runs/${encodeURIComponent(rec.id)}/stop`, { method: "POST", credentials: "same-origin" });
  const answer = await response.json();
  $("run-note").textContent = response.ok ? `run ${rec.id} stopped` : answer.error || `refused (${response.status})`;
  $("stop").disabled = false;
}

// ---------------------------------------------------------------- snapshot
function render(s) {
  state.snapshot = s;
  renderRecord();
  if (s.runs_serial !== undefined && s.runs_serial !== state.runsSerial) {
    state.runsSerial = s.runs_serial;
    refreshRuns();
  }
  const launch = s.launch ? JSON.stringify(s.launch) : "";
  if (launch !== state.launch) {  // the form says what became of the last run started
    state.launch = launch;
    const l = s.launch;
    if (l && l.number) $("form-status").textContent = `run ${l.number}: ${l.error || l.message}`;
  }

  const run = s.run;
  const roles = [];
  const health = (r) => el("span", { class: r.up ? "up" : "down", title: r.error || "" }, r.up ? "up" : "down");
  if (s.coordinator) roles.push(el("tr", {}, el("td", {}, "coordinator"), el("td", {}, s.coordinator.address),
    el("td", {}, health(s.coordinator)), el("td", {}, run ? run.version : "-"), el("td", {}, ""), el("td", {}, ""),
    el("td", {}, "")));
  if (s.keyholder) {
    const k = s.keyholder;
    const q = k.quarantined && k.quarantined.length ? `quarantined: ${k.quarantined.join(", ")}` : "";
    roles.push(el("tr", {}, el("td", {}, "key holder"), el("td", {}, k.address), el("td", {}, health(k)),
      el("td", {}, k.up ? k.version : "-"), el("td", {}, ""), el("td", { class: q ? "warn" : "" }, q),
      el("td", {}, "")));
  }
  for (const p of s.parties || []) {  // key-holder parties: each holds a share of the key
    roles.push(el("tr", {}, el("td", {}, p.id), el("td", {}, p.address), el("td", {}, health(p)),
      el("td", {}, "-"), el("td", {}, ""), el("td", {}, ""), el("td", {}, "")));
  }
  for (const sh of s.shards) {
    const t = sh.quarantined ? `QUARANTINED (${sh.detections})` : sh.detections ? `suspect: ${sh.detections}` : "none";
    const m = sh.stalled ? `STALLED (${sh.misses})` : sh.misses ? `${sh.misses}` : "none";
    roles.push(el("tr", {}, el("td", {}, sh.id), el("td", {}, sh.address), el("td", {}, health(sh)),
      el("td", {}, sh.up ? sh.version : "-"),
      el("td", {}, sh.up ? `${sh.pushes_accepted} / ${sh.pushes_refused}` : "-"),
      el("td", { class: sh.detections ? "warn" : "" }, t),
      el("td", { class: sh.misses ? "warn" : "", title: "calls the shard did not answer within security.shard_deadline_s" }, m)));
  }
  $("roles").tBodies[0].replaceChildren(...roles);
  const reasons = (id, counts) => {
    const items = Object.entries(counts || {}).sort();
    $(id).replaceChildren(...(items.length ? items.map(([k, v]) => el("li", {}, `${k}: ${v}`)) : [el("li", { class: "muted" }, "none")]));
  };
  reasons("refusals", s.refusals);
  reasons("tampering", s.tampering);
  $("config").textContent = s.config ? JSON.stringify(s.config, null, 2) : "no configuration";
}

function connect() {
  const source = new EventSource("/api/events");
  source.onopen = () => { $("connection").textContent = "live"; $("connection").className = "pill up"; };
  source.onmessage = (e) => render(JSON.parse(e.data));
  source.onerror = () => { $("connection").textContent = "reconnecting"; $("connection").className = "pill down"; };
}

// ---------------------------------------------------------------- the next-run form
const LABELS = {
  "training.rounds": "rounds", "training.clients": "clients", "training.mode": "mode",
  "training.lr": "learning rate", "training.batch_size": "batch size",
  "training.local_epochs": "local epochs", "privacy.target_epsilon": "target epsilon",
  "privacy.noise_multiplier": "noise multiplier", "privacy.delta": "delta",
  "privacy.max_grad_norm": "max grad norm",
};

function buildForm(session) {
  const fields = $("run-fields");
  for (const [name, value] of Object.entries(session.defaults)) {
    const id = "f-" + name.replace(".", "-");
    let input;
    if (name === "training.mode") {
      input = el("select", { id, name }, el("option", { value: "sync" }, "sync"), el("option", { value: "async" }, "async"));
      input.value = value;
    } else {
      input = el("input", { id, name, type: "text", value: value === null ? "" : value });
    }
    fields.append(el("div", { class: "field" }, el("label", { for: id }, LABELS[name] || name), input,
      el("span", { class: "error", id: "error-" + name.replace(".", "-"), "data-field": name })));
  }
  fields.append(el("div", { class: "field" }, el("span", {}, ""), el("span", {}, ""),
    el("span", { class: "error", id: "error-form", "data-field": "form" })));
  if (session.can_start) {
    fields.disabled = false;
    $("start").disabled = false;
    $("form-note").textContent = session.local_clients
      ? "Starts the servers and the clients on this machine once no run is in progress, in a fresh state folder."
      : "Starts the servers here once no run is in progress; the deployment's clients join it.";
  } else {
    $("start").remove();
    $("form-note").textContent = session.reason;
  }
}

async function submitForm(event) {
  event.preventDefault();
  const body = {};
  for (const input of $("run-fields").querySelectorAll("input, select")) body[input.name] = input.value;
  for (const e of document.querySelectorAll(".error")) e.textContent = "";
  for (const i of document.querySelectorAll(".invalid")) i.classList.remove("invalid");
  $("form-status").textContent = "starting...";
  const response = await fetch("/api/runs", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    credentials: "same-origin",
  });
  const answer = await response.json();
  if (response.status === 422) {
    $("form-status").textContent = "fix the fields marked";
    for (const [field, message] of Object.entries(answer.errors)) {
      const key = field.replace(".", "-");
      const target = $("error-" + key) || $("error-form");
      target.textContent = (target.id === "error-form" && field !== "form" ? field + ": " : "") + message;
      const input = $("f-" + key);
      if (input) input.classList.add("invalid");
    }
  } else if (response.ok) {
    $("form-status").textContent = `run started in ${answer.state_dir}`;
  } else {
    $("form-status").textContent = answer.error || `refused (${response.status})`;
  }
}

async function init() {
  const response = await fetch("/api/session", { credentials: "same-origin" });
  const session = await response.json();
  if (!response.ok) {  // no token: the page says how to open it, and reads nothing
    $("viewer").textContent = "no access";
    $("connection").textContent = "no token";
    $("start").remove();
    $("form-note").textContent = session.error || `refused (${response.status})`;
    return;
  }
  $("viewer").textContent = session.operator ? "operator" : "read-only";
  state.session = session;
  buildForm(session);
  $("run-form").addEventListener("submit", submitForm);
  $("live").addEventListener("click", () => { state.viewing = null; renderRecord(); renderRuns(); });
  $("stop").addEventListener("click", stopRun);
  setInterval(renderTimes, 1000);
  connect();
}

init();
