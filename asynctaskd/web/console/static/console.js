// The asynctaskd operator console: plain DOM, no framework, no build step. Every page
// reads JSON from /console/api (console reads) or /api/v1 (the HTTP API), with the
// session cookie; every change sends the session's CSRF token in X-CSRF-Token.
"use strict";

const STATUSES = ["PENDING_SUBMIT", "SUBMITTING", "SUBMITTED", "RUNNING", "SUBMIT_UNKNOWN",
  "SUCCEEDED", "FAILED", "CANCELED", "TRACKING_TIMED_OUT"];
const FOLD = 600; // JSON longer than this is folded on the task page
let me = null;
let stream = null;

// h("tag.class", {attr: value, onclick: fn}, ...children): a DOM element; text is text.
function h(spec, attrs, ...kids) {
  const [tag, ...classes] = spec.split(".");
  const el = document.createElement(tag);
  if (classes.length) el.className = classes.join(" ");
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "text") el.textContent = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const kid of kids.flat(Infinity)) {
    if (kid === null || kid === undefined || kid === false) continue;
    el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return el;
}

class ApiError extends Error {
  constructor(status, body) {
    super((body && body.error && body.error.message) || `HTTP ${status}`);
    this.status = status;
    this.code = body && body.error && body.error.code;
  }
}

async function api(method, path, body) {
  const headers = {};
  if (method !== "GET") {
    if (me) headers["X-CSRF-Token"] = me.csrf;
    if (body !== undefined) headers["Content-Type"] = "application/json";
  }
  const r = await fetch(path, {method, headers, credentials: "same-origin",
    body: body === undefined ? undefined : JSON.stringify(body)});
  const data = r.status === 204 ? null : await r.json().catch(() => null);
  if (r.status === 401 && me) { me = null; location.hash = "#/login"; }
  if (!r.ok) throw new ApiError(r.status, data);
  return data;
}

function flash(text, error) {
  const el = document.getElementById("flash");
  el.textContent = text;
  el.className = error ? "flash error" : "flash";
  el.hidden = !text;
}

function confirmDialog(title, text, verb) {
  const dlg = document.getElementById("confirm");
  document.getElementById("confirm-title").textContent = title;
  document.getElementById("confirm-text").textContent = text;
  document.getElementById("confirm-yes").textContent = verb || "Confirm";
  dlg.returnValue = "";
  dlg.showModal();
  return new Promise((resolve) => dlg.addEventListener("close",
    () => resolve(dlg.returnValue === "yes"), {once: true}));
}

const pad = (n) => String(n).padStart(2, "0");
// Local time as 2026-01-31 14:05:09: sortable, the same in every browser locale.
const fmtTime = (s) => {
  if (!s) return "";
  const d = new Date(s * 1000);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ` +
    `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
};
const plain = (obj) => Object.entries(obj || {}).filter(([, v]) => v !== null && v !== "")
  .map(([k, v]) => `${k}: ${typeof v === "object" ? JSON.stringify(v) : v}`).join(" · ");
const fmtAge = (s) => s < 90 ? `${s.toFixed(1)} s` : s < 5400 ? `${(s / 60).toFixed(0)} min`
  : `${(s / 3600).toFixed(1)} h`;
const pill = (status) => h("span.pill.s-" + status, {"data-status": status, text: status});
const taskLink = (id) => h("a.mono", {href: "#/task/" + encodeURIComponent(id), text: id});
const isOperator = () => me && me.role === "operator";

// Show the page at `hash`: a change of hash routes (hashchange), the same hash routes
// again; never both, or the page would be drawn twice.
function go(hash) {
  if (location.hash === hash) route();
  else location.hash = hash;
}

async function guard(fn) {
  try { await fn(); } catch (e) { flash(e.message, true); }
}

// ---- login ------------------------------------------------------------------------

function viewLogin(view) {
  document.getElementById("nav").hidden = true;
  document.getElementById("who").hidden = true;
  const input = h("input", {type: "password", name: "token", autocomplete: "off",
    placeholder: "atd_…", required: true});
  const form = h("form.panel", {onsubmit: (ev) => {
    ev.preventDefault();
    guard(async () => {
      me = await api("POST", "/console/api/login", {token: input.value});
      flash("");
      go("#/overview");
    });
  }},
    h("h1", {text: "Log in"}),
    h("p.mute", {text: "Paste an operator or viewer token (asynctaskd token create --role operator). " +
      "The console keeps a session cookie; the token is not stored in the browser."}),
    h("label", {}, "Token", input),
    h("div.row.end", {}, h("button", {type: "submit", text: "Log in"})));
  view.append(h("div.login", {}, form));
  input.focus();
}

// ---- overview ---------------------------------------------------------------------

function chart(series) {
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", "0 0 600 120");
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("class", "chart");
  const top = Math.max(1, ...series.succeeded.map((v, i) => v + series.failed[i]));
  series.succeeded.forEach((ok, i) => {
    const bad = series.failed[i];
    const x = i * 10 + 1;
    const hOk = (ok / top) * 110, hBad = (bad / top) * 110;
    for (const [y, hh, color] of [[118 - hOk, hOk, "#1f8a4c"], [118 - hOk - hBad, hBad, "#c2372f"]]) {
      if (hh <= 0) continue;
      const r = document.createElementNS(ns, "rect");
      r.setAttribute("x", x); r.setAttribute("y", y); r.setAttribute("width", 8);
      r.setAttribute("height", hh); r.setAttribute("fill", color);
      svg.append(r);
    }
  });
  const base = document.createElementNS(ns, "line");
  for (const [k, v] of [["x1", 0], ["x2", 600], ["y1", 118.5], ["y2", 118.5], ["stroke", "#cfd4de"]])
    base.setAttribute(k, v);
  svg.append(base);
  return svg;
}

function attentionPanel(items, calm, inbox) {
  return h("div.panel.attention" + (items.length ? "" : ".calm"), {id: "attention"},
    h("h2", {text: items.length ? "Needs a human" : "Nothing needs a human"}),
    items.length ? h("ul", {}, items.map((a) => h("li", {"data-kind": a.kind}, a.text,
      a.kind === "submit_unknown" ? [" — ", h("a", {href: inbox, text: "see them"})] : null)))
      : h("p.mute", {text: calm}));
}

function throughputPanel(series) {
  const sum = (a) => a.reduce((x, y) => x + y, 0);
  const ok = sum(series.succeeded), bad = sum(series.failed);
  const rate = ok + bad ? ((100 * bad) / (ok + bad)).toFixed(1) : "0.0";
  const partial = series.since > series.start + 1
    ? h("p.small.mute", {text: `tasks that ended before ${fmtTime(series.since)} were not read`})
    : null;
  return h("div.panel", {},
    h("h2", {text: "Last hour: tasks finished per minute"}),
    h("div.legend.small", {}, h("span", {}, h("i.sw.ok"), `succeeded ${ok}`),
      h("span", {}, h("i.sw.bad"), `failed ${bad}`), h("span.mute", {text: `failure rate ${rate}%`})),
    chart(series), h("div.axis.small.mute", {}, h("span", {text: "60 min ago"}),
      h("span", {text: "30 min"}), h("span", {text: "now"})), partial);
}

async function viewOverview(view, params) {
  if (!isOperator() || params.get("tenant")) return viewTenant(view, me.tenant || params.get("tenant"));
  const o = await api("GET", "/console/api/overview");
  const att = attentionPanel(o.attention,
    "No parked tasks, stalls, quarantined tasks or durability risks.", "#/inbox");
  const tiles = h("div.tiles", {}, STATUSES.map((s) => h("a.tile.t-" + s, {href: `#/tasks?status=${s}`},
    h("div.n", {text: o.by_status[s].toLocaleString()}),
    h("div.l", {text: s.replace(/_/g, " ").toLowerCase()}))));
  const through = throughputPanel(o.series);
  const handlers = Object.keys(o.by_handler);
  const byHandler = h("div.panel", {}, h("h2", {text: "By handler"}),
    handlers.length ? h("table", {}, h("thead", {}, h("tr", {}, h("th", {text: "handler"}),
      STATUSES.map((s) => h("th.num", {text: s.replace(/_/g, " ").toLowerCase()})))),
    h("tbody", {}, handlers.map((name) => h("tr", {}, h("td", {},
      h("a", {href: `#/tasks?handler=${encodeURIComponent(name)}`, text: name})),
    STATUSES.map((s) => h("td.num", {text: o.by_handler[name][s] || ""}))))))
      : h("p.empty", {text: "No tasks yet."}));
  const daemons = h("div.panel", {}, h("h2", {text: `Live daemons (${o.daemons.length})`}),
    o.daemons.length ? h("table", {}, h("thead", {}, h("tr", {}, ["daemon", "version", "in flight",
      "completed", "heartbeat", "durability gate", "handlers"].map((t) => h("th", {text: t})))),
    h("tbody", {}, o.daemons.map((d) => h("tr", {},
      h("td.mono", {text: d.id}), h("td", {text: d.version}), h("td.num", {text: d.inflight}),
      h("td.num", {text: d.completed}), h("td", {text: fmtAge(d.heartbeat_age) + " ago"}),
      h("td", {title: d.gate_detail || "", text: `${d.gate || "?"} (marks ${d.marks || "?"})` +
        (d.draining ? ", draining" : "")}),
      h("td.small", {text: (d.handlers || []).join(", ")})))))
      : h("p.empty", {text: "No daemon has sent a heartbeat in the last 30 s."}));
  const pausedNames = Object.keys(o.paused);
  const paused = h("div.panel", {}, h("h2", {text: "Paused"}),
    pausedNames.length ? h("ul", {}, pausedNames.map((d) => h("li", {}, h("b.mono", {text: d}), " ",
      h("span.mute", {text: o.paused[d].note || ""}))))
      : h("p.mute", {text: "Nothing is paused."}),
    h("p.small", {}, h("a", {href: "#/controls", text: "Pause or resume…"})));
  const counts = h("div.panel", {}, h("h2", {text: "Tasks by status"}), tiles,
    h("p.small.mute", {text: `${o.requests} create or cancel requests not yet taken in · ` +
      `${o.parked_for_lookup} parked tasks wait for a vendor lookup, ${o.parked_for_operator} ` +
      `for an operator · ${o.quarantined} quarantined`}), tenantForm());
  view.append(h("h1", {text: "Overview"}), att, counts, h("div.grid.g2", {}, through, paused),
    daemons, byHandler);
}


function tenantForm() {
  const name = h("input", {name: "tenant", placeholder: "tenant", required: true});
  return h("form.row", {id: "tenant-form", onsubmit: (ev) => {
    ev.preventDefault();
    location.hash = "#/overview?" + new URLSearchParams({tenant: name.value.trim()});
  }}, h("label", {}, "One tenant's overview", name), h("button.ghost", {type: "submit", text: "Open"}));
}

// A tenant's overview: its viewers' (and an operator's, with ?tenant=). No counter is kept
// per tenant: the server walks the status indexes within a budget, and a count it could
// not finish is a lower bound, whole for the tasks that entered the status since a time.
async function viewTenant(view, tenant) {
  const o = await api("GET", "/console/api/tenant?" + new URLSearchParams({tenant}));
  const partial = STATUSES.filter((s) => o.whole_since[s] !== null);
  const tiles = h("div.tiles", {}, STATUSES.map((s) => h("a.tile.t-" + s,
    {href: `#/tasks?status=${s}` + (isOperator() ? `&tenant=${encodeURIComponent(tenant)}` : ""),
      title: o.whole_since[s] === null ? "exact" : `at least: of the tasks that entered ${s} ` +
        `since ${fmtTime(o.whole_since[s])}`},
    h("div.n", {text: (o.whole_since[s] === null ? "" : "≥ ") + o.by_status[s].toLocaleString()}),
    h("div.l", {text: s.replace(/_/g, " ").toLowerCase()}))));
  const oldest = Math.max(...partial.map((s) => o.whole_since[s]));
  const read = o.scanned === null ? "" : ` (${o.scanned.toLocaleString()} tasks of all tenants read)`;
  const note = partial.length
    ? `Counted newest first within a bounded read${read}: a count marked ≥ is of the ` +
      `tasks that entered the status since a time (hover the tile; for all of them: ` +
      `since ${fmtTime(oldest)}); the others are exact.`
    : `Exact: every stored task was read${read}.`;
  const paused = Object.keys(o.paused);
  const counts = h("div.panel", {}, h("h2", {text: "Tasks by status"}), tiles,
    h("p.small.mute", {id: "tenant-note", text: note + ` · ${o.parked_for_lookup} parked ` +
      `tasks wait for a vendor lookup, ${o.parked_for_operator} for an operator`}));
  const state = h("div.panel", {}, h("h2", {text: "Paused"}), paused.length
    ? h("ul", {}, paused.map((d) => h("li", {}, h("b.mono", {text: d}), " ",
      h("span.mute", {text: o.paused[d].note || ""}))))
    : h("p.mute", {text: `Tenant ${tenant} is not paused.`}));
  view.append(h("h1", {text: `Tenant ${tenant}`}), attentionPanel(o.attention,
    "None of its tasks is parked for an operator or stalled, and it is not paused.",
    isOperator() ? "#/inbox" : "#/tasks?status=SUBMIT_UNKNOWN"),
  counts, h("div.grid.g2", {}, throughputPanel(o.series), state));
}

// ---- task browser -----------------------------------------------------------------

function taskTable(tasks, extra) {
  if (!tasks.length) return h("p.empty", {text: "No tasks match."});
  return h("table", {id: "task-table"}, h("thead", {}, h("tr", {},
    ["task", "status", "handler", "tenant", "external id", "created", "updated", "note"]
      .map((t) => h("th", {text: t})))),
  h("tbody", {}, tasks.map((t) => h("tr", {"data-id": t.id}, h("td", {}, taskLink(t.id)),
    h("td", {}, pill(t.status)), h("td", {text: t.handler}), h("td", {text: t.tenant}),
    h("td.mono", {text: t.external_id || ""}), h("td.small", {text: fmtTime(t.created_at)}),
    h("td.small", {text: fmtTime(t.updated_at)}),
    h("td.small.mute", {text: t.error || (t.status === "RUNNING" ? t.stage || "" : "")}),
    extra ? extra(t) : null))));
}

const toEpoch = (v) => v ? String(Date.parse(v) / 1000) : "";

async function viewTasks(view, params) {
  const field = (name, label, input) => h("label", {}, label, input);
  const text = (name, ph) => h("input", {name, value: params.get(name) || "", placeholder: ph || "any"});
  const status = h("select", {name: "status"}, h("option", {value: "", text: "any status"}),
    STATUSES.map((s) => h("option", {value: s, selected: params.get("status") === s, text: s})));
  const since = h("input", {type: "datetime-local", name: "since"});
  const until = h("input", {type: "datetime-local", name: "until"});
  const filters = h("form.filters.panel", {id: "filters", onsubmit: (ev) => {
    ev.preventDefault();
    const q = new URLSearchParams();
    for (const el of filters.elements) {
      if (!el.name || !el.value) continue;
      q.set(el.name, el.type === "datetime-local" ? toEpoch(el.value) : el.value);
    }
    location.hash = "#/tasks?" + q.toString();
  }}, field("status", "Status", status), field("handler", "Handler", text("handler")),
  me.tenant ? null : field("tenant", "Tenant", text("tenant")),
  field("account", "Account", text("account")), field("since", "Entered status after", since),
  field("until", "Entered status before", until), h("button", {type: "submit", text: "Filter"}));
  const by = h("select", {name: "by"}, [["id", "task id"], ["external_id", "external id"],
    ["dedup_key", "dedup key"], ["metadata", "metadata field=value"]].map(([v, t]) =>
    h("option", {value: v, selected: params.get("by") === v, text: t})));
  const q = h("input", {name: "q", value: params.get("q") || "", placeholder: "what to find",
    size: 36});
  const ftenant = me.tenant ? null : h("input", {name: "tenant", value: params.get("tenant") || "",
    placeholder: "optional", size: 14});
  const finder = h("form.filters.panel", {id: "finder", onsubmit: (ev) => {
    ev.preventDefault();
    const sp = new URLSearchParams({by: by.value, q: q.value});
    if (ftenant && ftenant.value.trim()) sp.set("tenant", ftenant.value.trim());
    location.hash = "#/tasks?" + sp.toString();
  }}, field("by", "Find by", by), field("q", "Value", q),
  ftenant ? field("tenant", "Tenant", ftenant) : null, h("button", {type: "submit", text: "Find"}));
  view.append(h("h1", {text: me.tenant ? `Tasks of tenant ${me.tenant}` : "Tasks"}), finder, filters);
  const results = h("div.panel", {id: "results"}, h("p.mute", {text: "Loading…"}));
  view.append(results);
  if (params.get("q")) {
    const sp = new URLSearchParams({by: params.get("by") || "id", q: params.get("q")});
    for (const name of ["start", "tenant"]) if (params.get(name)) sp.set(name, params.get(name));
    const found = await api("GET", "/console/api/find?" + sp);
    results.replaceChildren(h("h2", {text: `Found ${found.tasks.length}`}),
      h("p.small.mute", {text: `${found.scanned.toLocaleString()} tasks looked at`}),
      taskTable(found.tasks), found.next === null ? null : h("div.pager", {},
        h("a", {href: "#/tasks?" + new URLSearchParams({...Object.fromEntries(sp), start: found.next}),
          text: "Search older tasks →"})));
    return;
  }
  const sp = new URLSearchParams(params);
  sp.delete("by"); sp.delete("q");
  const started = performance.now();
  const page = await api("GET", "/console/api/tasks?" + sp);
  const took = performance.now() - started;
  results.replaceChildren(h("h2", {text: `${page.tasks.length} tasks`},
    h("span.small.mute", {text: `  · ${took.toFixed(0)} ms`})), taskTable(page.tasks),
  h("div.pager", {}, page.cursor ? h("a", {id: "next", href: "#/tasks?" + new URLSearchParams(
    {...Object.fromEntries(sp), cursor: page.cursor}), text: "Next page →"}) : null));
}

// ---- task page --------------------------------------------------------------------

function jsonBlock(label, value) {
  if (value === null || value === undefined) return null;
  const text = JSON.stringify(value, null, 2);
  const pre = h("pre.json", {text});
  if (text.length <= FOLD) return h("div", {}, h("h3.small", {text: label}), pre);
  return h("details", {}, h("summary", {text: `${label} (${text.length.toLocaleString()} characters)`}), pre);
}

function timelineRow(e) {
  const extra = [e.stage, e.message, e.progress !== null && e.progress !== undefined
    ? `${Math.round(e.progress * 100)}%` : null].filter(Boolean).join(" · ");
  return h("tr", {}, h("td.num", {text: e.version}), h("td.small", {text: fmtTime(e.at)}),
    h("td", {}, pill(e.status)), h("td.small", {text: extra}));
}

async function actionsPanel(task, actions, reload) {
  if (!actions) return null;
  const buttons = [];
  const act = (label, cls, title, text, fn) => buttons.push(h("button." + cls, {
    "data-action": label, onclick: () => guard(async () => {
      if (!(await confirmDialog(title, text, label))) return;
      await fn();
      flash(`${label}: done`);
      await reload();
    })}, label));
  if (actions.cancel) act("Cancel", "danger", "Cancel this task?",
    "The daemon stops tracking it and asks the vendor to cancel the job (if its handler can).",
    () => api("POST", `/api/v1/tasks/${task.id}/cancel`));
  if (actions.requeue) act("Requeue", "warn", "Requeue this task?",
    "It goes back to PENDING_SUBMIT and is submitted to the vendor again as a new attempt.",
    () => api("POST", `/api/v1/tasks/${task.id}/requeue`));
  const resolves = actions.resolve || [];
  if (resolves.length) return h("div.panel", {id: "actions"}, h("h2", {text: "Settle this parked task"}),
    settleForm([task], reload));
  if (!buttons.length) return h("div.panel", {id: "actions"}, h("h2", {text: "Actions"}),
    h("p.mute", {text: `Nothing can be done to a ${task.status} task.`}));
  return h("div.panel", {id: "actions"}, h("h2", {text: "Actions"}), h("div.actions", {}, buttons));
}

async function viewTask(view, id) {
  const holder = h("div");
  view.append(holder);
  const reload = async () => {
    const data = await api("GET", `/console/api/tasks/${encodeURIComponent(id)}`);
    const t = data.task;
    const fields = ["id", "handler", "status", "tenant", "account", "provider", "priority",
      "external_id", "dedup_key", "created_at", "updated_at", "due_at", "deadline_at", "finished_at",
      "version", "progress", "stage", "message", "submit_attempts", "poll_count",
      "consecutive_errors", "throttles", "lookups", "cancel_requested", "fence", "started_fence",
      "owner", "reclaims", "idempotent"].filter((k) => k in t && t[k] !== null && t[k] !== "");
    const value = (k) => k === "status" ? pill(t[k]) : k.endsWith("_at") ? fmtTime(t[k])
      : k === "id" ? h("span.mono", {text: t[k]}) : String(t[k]);
    const timeline = data.timeline === null
      ? h("p.mute", {text: "The events stream no longer holds this task's whole history."})
      : h("table", {id: "timeline"}, h("thead", {}, h("tr", {}, ["version", "time", "status", "detail"]
        .map((x) => h("th", {text: x})))), h("tbody", {}, data.timeline.map(timelineRow)));
    const settled = ["SUCCEEDED", "FAILED", "CANCELED", "TRACKING_TIMED_OUT", "SUBMIT_UNKNOWN"]
      .includes(t.status);
    holder.replaceChildren(
      h("h1", {}, "Task ", h("span.mono", {text: t.id}), " ", pill(t.status)),
      h("p.small.mute", {id: "live"}, settled ? "settled" : [h("i.live"), "live: updates as the daemon works"]),
      await actionsPanel(t, data.actions, reload),
      h("div.grid.g2", {},
        h("div.panel", {}, h("h2", {text: "Fields"}), h("dl.fields", {}, fields.map((k) =>
          [h("dt", {text: k.replace(/_/g, " ")}), h("dd", {"data-field": k}, value(k))]))),
        h("div.panel", {}, h("h2", {text: "Data"}), jsonBlock("params", t.params),
          jsonBlock("metadata", t.metadata), jsonBlock("vendor handle", t.handle),
          jsonBlock("result", t.result), jsonBlock("error", t.error),
          [t.params, t.metadata, t.handle, t.result, t.error].every((v) => v === null || v === undefined)
            ? h("p.mute", {text: "No data."}) : null)),
      h("div.panel", {}, h("h2", {text: "Timeline"}), timeline,
        h("p.small.mute", {text: "Versions count every change; the fence above is the lease " +
          "generation of the last claim."})));
    if (!settled) follow(t, reload);
  };
  await reload();
}

function follow(task, reload) {
  if (stream) stream.close();
  // Same origin: the session cookie goes along; ids are versions (Last-Event-ID on reconnect).
  stream = new EventSource(`/api/v1/tasks/${encodeURIComponent(task.id)}/events`);
  let last = task.version;
  stream.addEventListener("task", (ev) => {
    const e = JSON.parse(ev.data);
    if (e.version <= last) return;
    last = e.version;
    guard(reload);
  });
  stream.onerror = () => { if (stream && stream.readyState === EventSource.CLOSED) stream = null; };
}

// ---- SUBMIT_UNKNOWN inbox ---------------------------------------------------------

function settleForm(tasks, done) {
  const one = tasks.length === 1;
  const ext = h("input", {name: "external_id", placeholder: "the vendor's job id", size: 28});
  const go = (target, body, title, text) => guard(async () => {
    if (!(await confirmDialog(title, text, "Yes, do it"))) return;
    let failed = 0;
    for (const t of tasks) {
      try { await api("POST", `/api/v1/tasks/${t.id}/resolve`, {status: target, ...body}); }
      catch (e) { failed += 1; flash(`${t.id}: ${e.message}`, true); }
    }
    if (!failed) flash(`${tasks.length} task(s) settled as ${target}`);
    await done();
  });
  const what = one ? "this task" : `these ${tasks.length} tasks`;
  return h("div.actions", {},
    one ? h("form.row", {id: "give-external", onsubmit: (ev) => {
      ev.preventDefault();
      if (!ext.value.trim()) { flash("give the vendor's external id", true); return; }
      go("SUBMITTED", {external_id: ext.value.trim(), message: "settled in the console"},
        "The job exists at the vendor",
        `The task becomes SUBMITTED with external id ${ext.value.trim()}; the daemon polls that ` +
        "job from now on. Nothing is sent to the vendor's submit endpoint again.");
    }}, ext, h("button", {type: "submit", "data-action": "give", text: "It exists: track it"})) : null,
    h("button.warn", {type: "button", "data-action": "resubmit", onclick: () => go("PENDING_SUBMIT",
      {message: "resubmitted from the console"}, "Submit again?",
      `${one ? "The task goes" : "The tasks go"} back to PENDING_SUBMIT and the daemon submits ` +
      `${what} to the vendor again. If the first submit did create a job, the vendor now runs ` +
      "it twice (unless it deduplicates by the idempotency key).")}, "It does not exist: submit again"),
    h("button.danger", {type: "button", "data-action": "fail", onclick: () => go("FAILED",
      {message: "given up in the console"}, "Give up?",
      `${what[0].toUpperCase() + what.slice(1)} end${one ? "s" : ""} as FAILED; nothing is sent ` +
      "to the vendor. A job the first submit may have created is left as it is.")}, "Give up: fail"));
}

async function viewInbox(view) {
  const page = await api("GET", "/console/api/tasks?status=SUBMIT_UNKNOWN&limit=200");
  view.append(h("h1", {text: "SUBMIT_UNKNOWN inbox"}), h("p.mute", {text:
    "A daemon stopped after it started these submits, and no vendor lookup can tell whether " +
    "the job was created. Check at the vendor (by the idempotency key or the task id), then " +
    "choose one way out."}));
  if (!page.tasks.length) {
    view.append(h("div.panel", {}, h("p.empty", {text: "Nothing is parked."})));
    return;
  }
  if (page.cursor) view.append(h("p.flash", {text: "Showing the newest 200 parked tasks: " +
    "settle these, and the next ones appear."}));
  const chosen = new Set();
  const bulk = h("div.panel", {id: "bulk"});
  const renderBulk = () => {
    const tasks = page.tasks.filter((t) => chosen.has(t.id));
    bulk.replaceChildren(h("h2", {text: tasks.length ? `${tasks.length} selected`
      : "Select tasks to settle them together"}));
    if (tasks.length) bulk.append(settleForm(tasks, () => route()));
  };
  const table = h("table", {id: "inbox"}, h("thead", {}, h("tr", {}, h("th"), ["task", "handler",
    "tenant", "parked", "submit attempts", "how it ended", "idempotency key", ""].map((x) =>
    h("th", {text: x})))), h("tbody", {}, page.tasks.map((t) => h("tr", {"data-id": t.id},
    h("td", {}, h("input", {type: "checkbox", onchange: (ev) => {
      if (ev.target.checked) chosen.add(t.id); else chosen.delete(t.id);
      renderBulk();
    }})), h("td", {}, taskLink(t.id)), h("td", {text: t.handler}), h("td", {text: t.tenant}),
    h("td.small", {text: fmtTime(t.updated_at)}), h("td.num", {text: t.submit_attempts}),
    h("td.small", {}, h("b", {text: t.error || ""}), t.error_message ? h("div.mute", {text: t.error_message}) : null),
    h("td.mono.small", {text: t.id}),
    h("td", {}, h("a", {href: "#/task/" + t.id, text: "settle →"}))))));
  renderBulk();
  view.append(h("div.panel", {}, table), bulk);
}

// ---- audit ------------------------------------------------------------------------

async function viewAudit(view, params) {
  const sp = new URLSearchParams({limit: "100"});
  if (params.get("before")) sp.set("before", params.get("before"));
  const page = await api("GET", "/console/api/audit?" + sp);
  view.append(h("h1", {text: "Audit"}), h("div.panel", {}, page.entries.length ? h("table", {id: "audit"},
    h("thead", {}, h("tr", {}, ["when", "who", "via", "action", "target", "detail"].map((x) => h("th", {text: x})))),
    h("tbody", {}, page.entries.map((e) => h("tr", {}, h("td.small", {text: fmtTime(e.at)}),
      h("td.small", {}, h("span.mono", {text: e.token}), e.note ? ` (${e.note})` : ""),
      h("td", {text: e.via}), h("td", {}, h("b", {text: e.action})),
      h("td.mono.small", {}, /^[0-9A-Z]{26}/.test(e.target) ? taskLink(e.target) : e.target),
      h("td.small", {text: e.detail === null ? "" : plain(e.detail)})))))
    : h("p.empty", {text: "No operator action yet."}),
  page.before ? h("div.pager", {}, h("a", {href: "#/audit?before=" + page.before, text: "Older →"})) : null));
}

// ---- router -----------------------------------------------------------------------

const VIEWS = {overview: viewOverview, tasks: viewTasks, inbox: viewInbox,
  controls: viewControls, audit: viewAudit};

async function refreshInboxCount() {
  if (!isOperator()) return;
  const page = await api("GET", "/console/api/tasks?status=SUBMIT_UNKNOWN&limit=100").catch(() => null);
  if (page) document.getElementById("inbox-count").textContent =
    page.tasks.length ? (page.cursor ? "100+" : String(page.tasks.length)) : "";
}

async function route() {
  if (stream) { stream.close(); stream = null; }
  // Each route draws into a container of its own: one still waiting for its data when
  // the next begins (a click, a hash change) then draws into a detached one, unseen.
  const view = h("div.page");
  document.getElementById("view").replaceChildren(view);
  const [path, query] = location.hash.slice(2).split("?");
  const params = new URLSearchParams(query || "");
  if (!me) {
    try { me = await api("GET", "/console/api/session"); } catch (e) { me = null; }
  }
  if (!me || path === "login") {
    if (me) { location.hash = "#/tasks"; return; }
    viewLogin(view);
    return;
  }
  document.getElementById("nav").hidden = false;
  document.getElementById("who").hidden = false;
  document.getElementById("who-text").textContent =
    `${me.role}${me.tenant ? " of " + me.tenant : ""}${me.note ? " · " + me.note : ""}`;
  for (const a of document.querySelectorAll("[data-role=operator]")) a.hidden = !isOperator();
  const [name, arg] = (path || "overview").split("/");
  for (const a of document.querySelectorAll("nav a"))
    a.classList.toggle("active", a.dataset.nav === name || (name === "task" && a.dataset.nav === "tasks"));
  await guard(async () => {
    if (name === "task") await viewTask(view, decodeURIComponent(arg || ""));
    else await (VIEWS[name] || viewTasks)(view, params);
  });
  refreshInboxCount();
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("logout").addEventListener("click", () => guard(async () => {
    await api("POST", "/console/api/logout");
    me = null;
    go("#/login");
  }));
  window.addEventListener("hashchange", () => { flash(""); route(); });
  route();
});
