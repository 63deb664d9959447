// The console's Controls page: pauses, limits, bulk requeue and cancel, handler groups
// and purge. Each action is the /api/v1 route's (which writes the audit stream), after a
// confirmation that says what will happen. Loaded before console.js, whose helpers
// (h, api, guard, confirmDialog, flash, route) it calls.
"use strict";


async function viewControls(view) {
  const [paused, limits, groups] = await Promise.all([api("GET", "/api/v1/pause"),
    api("GET", "/api/v1/limits"), api("GET", "/api/v1/groups")]);
  const dim = h("select", {name: "dimension"}, ["handler", "provider", "tenant", "account"]
    .map((d) => h("option", {value: d, text: d})));
  const value = h("input", {name: "value", placeholder: "e.g. ocr", required: true});
  const note = h("input", {name: "note", placeholder: "why (shown to everyone)", size: 30});
  const pauseForm = h("form.row", {id: "pause-form", onsubmit: (ev) => {
    ev.preventDefault();
    guard(async () => {
      const body = {[dim.value]: value.value.trim(), note: note.value};
      if (!(await confirmDialog(`Pause ${dim.value} ${body[dim.value]}?`,
        "Daemons stop claiming its new submits until it is resumed; tasks already at the " +
        "vendor are still tracked.", "Pause"))) return;
      await api("POST", "/api/v1/pause", body);
      flash(`${dim.value}:${body[dim.value]} paused`);
      route();
    });
  }}, h("label", {}, "Dimension", dim), h("label", {}, "Name", value), h("label", {}, "Note", note),
  h("button.warn", {type: "submit", text: "Pause"}));
  const label = (text, input) => h("label", {}, text, input);
  const names = Object.keys(paused.paused);
  const pausedTable = names.length ? h("table.spaced", {id: "paused"}, h("thead", {}, h("tr", {},
    ["paused", "note", "since", ""].map((x) => h("th", {text: x})))), h("tbody", {}, names.map((d) =>
    h("tr", {"data-dimension": d}, h("td.mono", {text: d}), h("td.small", {text: paused.paused[d].note || ""}),
      h("td.small", {text: fmtTime(paused.paused[d].at / 1000)}),
      h("td", {}, h("button.small", {"data-action": "resume", onclick: () => guard(async () => {
        const [kind, ...rest] = d.split(":");
        const r = await api("POST", "/api/v1/resume", {[kind]: rest.join(":")});
        flash(`${d} resumed; ${r.moved} held tasks put back`);
        route();
      })}, "Resume")))))) : h("p.mute", {text: "Nothing is paused."});
  const clear = (scope) => guard(async () => {
    if (!(await confirmDialog(`Clear the limits of ${scope}?`, "Its tasks are no longer held " +
      "back by these rates, caps or quota; the daemons apply the change within seconds.", "Clear"))) return;
    await api("DELETE", "/api/v1/limits?" + new URLSearchParams({scope}));
    flash(`limits of ${scope} cleared`);
    route();
  });
  const limitRows = limits.limits.map((e) => h("tr", {"data-scope": e.scope}, h("td.mono", {text: e.scope}),
    h("td", {text: e.source}), h("td.small", {text: plain(e.limit)}),
    h("td", {}, h("button.small.ghost", {type: "button", onclick: () => clear(e.scope)}, "Clear"))));
  const scope = h("select", {}, ["provider", "tenant"].map((d) => h("option", {value: d, text: d})));
  const scopeName = h("input", {placeholder: "name", required: true});
  const knobs = ["submit_rate", "submit_burst", "query_rate", "max_in_flight", "quota"]
    .map((k) => h("input", {name: k, placeholder: "—", size: 9}));
  const limitForm = h("form.row", {id: "limit-form", onsubmit: (ev) => {
    ev.preventDefault();
    guard(async () => {
      const body = {[scope.value]: scopeName.value.trim()};
      for (const k of knobs) if (k.value) body[k.name] = Number(k.value);
      await api("PUT", "/api/v1/limits", body);
      flash(`limits of ${scope.value}:${scopeName.value} saved`);
      route();
    });
  }}, label("Scope", scope), label("Name", scopeName),
  knobs.map((k) => label(k.name.replace(/_/g, " "), k)), h("button", {type: "submit", text: "Save limit"}));
  const action = h("select", {name: "action"}, h("option", {value: "requeue", text: "requeue"}),
    h("option", {value: "cancel", text: "cancel"}));
  const bstatus = h("select", {}, h("option", {value: "", text: "every status the action takes"}),
    STATUSES.map((s) => h("option", {value: s, text: s})));
  const bhandler = h("input", {placeholder: "handler (any)"});
  const btenant = h("input", {placeholder: "tenant (any)"});
  const bulkForm = h("form.row", {id: "bulk-form", onsubmit: (ev) => {
    ev.preventDefault();
    guard(async () => {
      const filter = {};
      if (bstatus.value) filter.status = bstatus.value;
      if (bhandler.value) filter.handler = bhandler.value.trim();
      if (btenant.value) filter.tenant = btenant.value.trim();
      const dry = await api("POST", "/api/v1/tasks/bulk", {action: action.value, filter, dry_run: true});
      if (!dry.matched) { flash("no task matches that filter"); return; }
      const n = dry.capped ? `more than ${dry.matched}` : String(dry.matched);
      if (!(await confirmDialog(`${action.value} ${n} tasks?`, `${n} tasks match. The first 1000 are ` +
        `${action.value === "requeue" ? "submitted to the vendor again" : "canceled"} now; run it ` +
        "again for the rest.", `${action.value} them`))) return;
      const r = await api("POST", "/api/v1/tasks/bulk", {action: action.value, filter, limit: 1000});
      flash(`${r.acted} tasks: ${action.value} done; ${r.failed} failed`, r.failed > 0);
    });
  }}, label("Action", action), label("Status", bstatus), label("Handler", bhandler),
  label("Tenant", btenant), h("button.warn", {type: "submit", text: "Count, then confirm…"}));
  view.append(h("h1", {text: "Controls"}),
    h("div.panel", {}, h("h2", {text: "Pause and resume"}), pauseForm, h("div", {}, pausedTable)),
    h("div.panel", {}, h("h2", {text: "Limits"}), limitRows.length ? h("table", {}, h("thead", {},
      h("tr", {}, ["scope", "source", "limit", ""].map((x) => h("th", {text: x})))), h("tbody", {}, limitRows))
      : h("p.mute", {text: "No limits."}), limitForm),
    h("div.panel", {}, h("h2", {text: "Bulk requeue or cancel"}), bulkForm),
    groupsPanel(groups.groups, label), purgePanel(label));
}

// "a, b=3" <-> [{handler: "a", weight: 1}, {handler: "b", weight: 3}] ("=" is in no
// handler's name; ":" is in many)
const membersText = (members) => members.map((m) => m.weight === 1 ? m.handler
  : `${m.handler}=${m.weight}`).join(", ");
function parseMembers(text) {
  return text.split(",").map((part) => part.trim()).filter(Boolean).map((part) => {
    const [handler, weight] = part.split("=", 2).map((x) => x.trim());
    return weight === undefined ? handler : {handler, weight: Number(weight)};
  });
}

function groupsPanel(groups, label) {
  const name = h("input", {name: "name", placeholder: "e.g. ocr", required: true});
  const policy = h("select", {name: "policy"}, ["round_robin", "weighted", "consistent_hash",
    "least_active"].map((p) => h("option", {value: p, text: p.replace(/_/g, " ")})));
  const members = h("input", {name: "members", size: 40, required: true,
    placeholder: "ocr:acme, ocr:eu=3 (=weight)"});
  const form = h("form.row", {id: "group-form", onsubmit: (ev) => {
    ev.preventDefault();
    guard(async () => {
      const group = name.value.trim(), body = {policy: policy.value, members: parseMembers(members.value)};
      const shown = body.members.map((m) => typeof m === "string" ? m : `${m.handler} (weight ${m.weight})`);
      const known = groups.some((g) => g.name === group);
      if (!(await confirmDialog(`${known ? "Change" : "Create"} handler group ${group}?`,
        `Submits to ${group} go to ${shown.join(", ")} by ${policy.value.replace(/_/g, " ")}, ` +
        "from the moment each client re-reads the groups (within 5 s); tasks already " +
        "submitted keep their handler.", known ? "Change it" : "Create it"))) return;
      await api("PUT", "/api/v1/groups/" + encodeURIComponent(group), body);
      flash(`handler group ${group} saved`);
      route();
    });
  }}, label("Group", name), label("Policy", policy), label("Members", members),
  h("button", {type: "submit", text: "Save group…"}));
  const remove = (group) => guard(async () => {
    if (!(await confirmDialog(`Delete handler group ${group}?`, `A submit to ${group} is then ` +
      "refused as an unknown handler (unless a handler has that name); tasks already " +
      "submitted through it keep their handler.", "Delete it"))) return;
    await api("DELETE", "/api/v1/groups/" + encodeURIComponent(group));
    flash(`handler group ${group} deleted`);
    route();
  });
  const edit = (g) => {
    name.value = g.name;
    policy.value = g.policy;
    members.value = membersText(g.members);
    members.focus();
  };
  const table = groups.length ? h("table.spaced", {id: "groups"}, h("thead", {}, h("tr", {},
    ["group", "policy", "members", ""].map((x) => h("th", {text: x})))), h("tbody", {}, groups.map((g) =>
    h("tr", {"data-group": g.name}, h("td.mono", {text: g.name}), h("td", {text: g.policy.replace(/_/g, " ")}),
      h("td.small.mono", {text: membersText(g.members)}),
      h("td.nowrap", {}, h("button.small.ghost", {type: "button", "data-action": "edit", onclick: () => edit(g)}, "Edit"),
        " ", h("button.small.ghost", {type: "button", "data-action": "delete", onclick: () => remove(g.name)},
          "Delete"))))))
    : h("p.mute", {text: "No handler groups."});
  return h("div.panel", {}, h("h2", {text: "Handler groups"}), table, form);
}

function purgePanel(label) {
  const age = h("input", {name: "age", type: "number", min: "0", step: "any", value: "30", size: 6, required: true});
  const unit = h("select", {name: "unit"}, [["days", 86400], ["hours", 3600], ["minutes", 60]]
    .map(([u, s]) => h("option", {value: s, text: u})));
  const limit = h("input", {name: "limit", type: "number", min: "1", max: "10000", value: "1000", size: 6, required: true});
  const form = h("form.row", {id: "purge-form", onsubmit: (ev) => {
    ev.preventDefault();
    guard(async () => {
      const body = {older_than: Number(age.value) * Number(unit.value), limit: Number(limit.value)};
      const name = unit.selectedOptions[0].text;
      const when = `${age.value} ${Number(age.value) === 1 ? name.slice(0, -1) : name}`;
      if (!(await confirmDialog(`Purge settled tasks finished over ${when} ago?`,
        `Up to ${body.limit} tasks that succeeded, failed, were canceled or timed out more than ` +
        `${when} ago are deleted from Redis for good. No archive is kept here ` +
        "(asynctaskd purge --archive FILE keeps one).", "Purge them"))) return;
      const r = await api("POST", "/api/v1/purge", body);
      flash(`${r.purged} tasks purged` + (r.purged === body.limit ? "; run it again for more" : ""));
    });
  }}, label("Finished more than", age), label("Unit", unit), label("At most", limit),
  h("button.danger", {type: "submit", text: "Purge…"}));
  return h("div.panel", {}, h("h2", {text: "Purge settled tasks"}), form);
}
