// fedps dashboard: live snapshots by server-sent events, inline SVG charts, the next-run form.
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
};

// ---------------------------------------------------------------- charts
const W = 400, H = 160, PAD = { l: 34, r: 8, t: 8, b: 20 };

function drawChart(svgId, lineId, points, yMax) {
  const svg = $(svgId), line = $(lineId), grid = svg.querySelector(".grid");
  const xs = points.map((p) => p[0]);
  const xMin = xs.length ? Math.min(...xs) : 0, xMax = xs.length ? Math.max(...xs) : 1;
  const top = yMax || Math.max(1e-9, ...points.map((p) => p[1]));
  const x = (v) => PAD.l + ((v - xMin) / Math.max(1, xMax - xMin)) * (W - PAD.l - PAD.r);
  const y = (v) => H - PAD.b - (v / top) * (H - PAD.t - PAD.b);
  grid.replaceChildren();
  const ns = "http://www.w3.org/2000/svg";
  for (const f of [0, 0.5, 1]) {
    const l = document.createElementNS(ns, "line");
    l.setAttribute("x1", PAD.l); l.setAttribute("x2", W - PAD.r);
    l.setAttribute("y1", y(f * top)); l.setAttribute("y2", y(f * top));
    const t = document.createElementNS(ns, "text");
    t.setAttribute("x", 2); t.setAttribute("y", y(f * top) + 3);
    t.textContent = (f * top).toFixed(top >= 10 ? 0 : 2);
    grid.append(l, t);
  }
  const label = document.createElementNS(ns, "text");
  label.setAttribute("x", W - PAD.r - 60); label.setAttribute("y", H - 4);
  label.textContent = xs.length ? `rounds ${xMin}-${xMax}` : "no rounds yet";
  grid.append(label);
  line.setAttribute("points", points.map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" "));
  line.dataset.count = String(points.length);
}

// ---------------------------------------------------------------- snapshot
function render(s) {
  const run = s.run;
  const coordinatorUp = s.coordinator && s.coordinator.up;
  $("run-id").textContent = run ? `run ${run.run_id}` : "";
  const hist = run ? run.history : [];
  const evaluated = hist.filter((r) => r.accuracy !== null);
  $("round").textContent = run ? `${run.round} / ${run.rounds}` : "-";
  $("accuracy").textContent = evaluated.length ? fmt.num(evaluated[evaluated.length - 1].accuracy) : "-";
  $("epsilon").textContent = run ? fmt.num(run.max_epsilon, 2) : "-";
  $("delta").textContent = run ? `delta ${run.delta}, ${run.noise} noise` : "";
  $("registered").textContent = run ? run.registered : "-";
  $("bytes").textContent = run ? fmt.bytes(run.bytes_pushed) : "-";
  const launch = s.launch;
  let phase = !s.config ? "no cluster" : !coordinatorUp ? "down" : run.finished ? "finished" : "training";
  if (launch && launch.running && !coordinatorUp) phase = launch.message || "starting";
  $("phase").textContent = phase;

  drawChart("acc-chart", "acc-line", evaluated.map((r) => [r.round, r.accuracy]), 1);
  drawChart("eps-chart", "eps-line", hist.map((r) => [r.round, r.max_epsilon]), 0);

  $("rounds").tBodies[0].replaceChildren(...hist.slice().reverse().map((r) =>
    el("tr", {}, el("td", {}, r.round + (r.abandoned ? " (abandoned)" : "")),
      el("td", {}, fmt.num(r.accuracy)), el("td", {}, fmt.num(r.loss)),
      el("td", {}, fmt.num(r.max_epsilon, 2)), el("td", {}, fmt.num(r.seconds, 1)),
      el("td", {}, fmt.bytes(r.bytes_pushed)), el("td", {}, r.contributors))));

  const clients = run ? run.clients : [];
  const most = Math.max(1, ...clients.map((c) => c.rounds));
  $("clients").tBodies[0].replaceChildren(...clients.map((c) =>
    el("tr", {}, el("td", {}, c.id), el("td", {}, fmt.num(c.epsilon, 2)), el("td", {}, c.rounds),
      el("td", {}, fmt.num(c.noise_multiplier, 2)),
      el("td", {}, el("div", { class: "bar", style: `width:${(100 * c.rounds) / most}%` })))));

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
  buildForm(session);
  $("run-form").addEventListener("submit", submitForm);
  connect();
}

init();
