// Conveyor's dashboard: every page reads and acts through the /v1 API, with
// the session cookie the sign-in set; live parts follow the API's
// Server-Sent Event streams. No framework, no build step.
"use strict";

const STATUSES = ["PENDING", "IN_PROGRESS", "COMPLETED", "FAILED", "CANCELLED"];
const TERMINAL = new Set(["COMPLETED", "FAILED", "CANCELLED"]);
const main = document.getElementById("main");
let me = null; // the signed-in principal (GET /v1/whoami)

// h builds an element: h("a", {href: "/"}, "text", child…). Text is always
// text, never HTML.
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === false || v === null || v === undefined) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

// fill replaces el's children with the given ones, leaving out null,
// undefined and false and flattening arrays (the DOM's replaceChildren would
// print them).
function fill(el, ...children) {
  // A redraw keeps the keyboard's place: what had the focus (a link, an
  // element with an id) is found again among the new children.
  const had = el.contains(document.activeElement) ? document.activeElement : null;
  el.replaceChildren(...children.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false));
  if (had && !el.contains(had)) {
    const href = had.getAttribute("href");
    const again = had.id ? el.querySelector("#" + CSS.escape(had.id))
      : href !== null ? el.querySelector(`[href="${CSS.escape(href)}"]`) : null;
    if (again) again.focus();
  }
  return el;
}

function svg(tag, attrs) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  return el;
}

// api calls the API as the signed-in person. A 401 sends them to sign in.
async function api(method, path, body) {
  const opts = { method, credentials: "same-origin", headers: { "X-Conveyor-UI": "1" } };
  if (body !== undefined) {
    opts.headers["Content-Type"] = "application/json";
    opts.body = JSON.stringify(body);
  }
  const resp = await fetch(path, opts);
  if (resp.status === 401 && !location.pathname.startsWith("/ui/login")) {
    location.assign("/ui/login?next=" + encodeURIComponent(location.pathname + location.search));
    throw new Error("signed out");
  }
  const text = await resp.text();
  // A refusal that is not the API's JSON (the error page of a proxy while
  // the API is down) is told by its status, not by a parse error.
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch (err) {
    if (resp.ok) throw err;
  }
  if (!resp.ok) {
    const err = new Error((data && (data.detail || data.title)) || `HTTP ${resp.status} ${resp.statusText}`.trim());
    err.status = resp.status;
    err.data = data;
    throw err;
  }
  return data;
}

const mayWrite = () => me && (me.role === "writer" || me.role === "admin");

// decoded is s with its percent-escapes decoded, or s itself when they
// are malformed (a hand-typed %E0): the API then says what it makes of
// it, instead of the page stopping at an exception.
function decoded(s) {
  try {
    return decodeURIComponent(s);
  } catch {
    return s;
  }
}

function when(ts) {
  if (!ts) return "";
  const d = new Date(ts);
  // The zone is shown: the filters are in UTC, the times in the browser's.
  return h("time", { datetime: ts, title: d.toISOString() }, d.toLocaleString(undefined, { timeZoneName: "short" }));
}

function ago(ts) {
  const s = Math.max(0, (Date.now() - new Date(ts).getTime()) / 1000);
  if (s < 60) return Math.round(s) + "s ago";
  if (s < 3600) return Math.round(s / 60) + "m ago";
  if (s < 86400) return Math.round(s / 3600) + "h ago";
  return Math.round(s / 86400) + "d ago";
}

function statusBadge(status) {
  return h("span", { class: "status " + status, "data-status": status }, status);
}

// traceLink is the Trace of a task or a run: a link to its trace in Jaeger,
// or a dash when the trace was not exported (the API then gives no
// trace_url).
function traceLink(v) {
  return v.trace_url ? h("a", { href: v.trace_url, rel: "noopener", target: "_blank", class: "trace" }, "Open in Jaeger") : "—";
}

function showError(where, err) {
  fill(where, h("p", { class: "error", role: "alert" }, err.message || String(err)));
}

// follow opens an EventSource and calls onEvent with each task event. The
// browser resumes a dropped stream with Last-Event-ID by itself, but gives
// up for good when a reconnect is answered with anything but a stream, and
// does not say what the answer was: follow asks the stream itself. A 204
// is a stream that had ended (its end frame lost with the connection): it
// ends, as with that frame. A 401 is a session that is over (the key
// revoked, signed out elsewhere): api() sends the person to sign in (and
// the stream is asked for again, in case it was not). Any
// other refusal but a 429 will not change (a filter the API refuses): it
// stops. Otherwise (a 503 while the API restarts, a 429, no answer) it
// opens a new stream after a pause (the answer's Retry-After, when it has
// one), from the last event it saw. While it waits, onPause is told why
// (the page would otherwise look live and not change), and told null once
// a stream is open again.
// liveNote is where a page says its live updates are paused: an element,
// hidden while they are not, and the onPause to give follow.
function liveNote() {
  const el = h("p", { role: "status", class: "muted", id: "live", hidden: true });
  return [el, (why) => { el.textContent = why || ""; el.hidden = !why; }];
}

function follow(url, onEvent, onEnd, onPause) {
  const pause = (why) => { if (onPause) onPause(why); };
  // gen counts the times the page was hidden: what was under way then
  // (a question of the stream, a reopening) is dropped.
  let es, last = "", ended = false, retry = 2000, timer, gen = 0;
  // from is the stream's URL, resuming after the last event seen.
  const from = () => url + (last ? (url.includes("?") ? "&" : "?") + "last_event_id=" + encodeURIComponent(last) : "");
  const open = () => {
    es = new EventSource(from(), { withCredentials: true });
    es.addEventListener("open", () => pause(null));
    // The ready frame carries where the stream starts: a stream reopened
    // before its first task event resumes from there, not from "now".
    es.addEventListener("ready", (m) => { last = m.lastEventId || last; });
    es.addEventListener("task", (m) => { last = m.lastEventId || last; retry = 2000; onEvent(JSON.parse(m.data)); });
    es.addEventListener("end", (m) => { ended = true; es.close(); if (onEnd) onEnd(JSON.parse(m.data)); });
    es.addEventListener("error", async () => {
      if (es.readyState !== EventSource.CLOSED || ended) return;
      const at = gen;
      const { status, after } = await answer(from());
      if (ended || at !== gen) return;
      if (status === 204) {
        ended = true;
        if (onEnd) onEnd(null);
        return;
      }
      if (status === 401) {
        api("GET", "/v1/whoami").catch(() => {});
      } else if (status >= 400 && status < 500 && status !== 429) {
        ended = true;
        return;
      }
      const wait = after > 0 ? after * 1000 : retry;
      pause((status === 429 ? "Live updates paused: the API serves its most live streams for this org (close another page)."
        : "Live updates lost.") + ` Trying again in ${Math.round(wait / 1000)} s.`);
      timer = setTimeout(() => { if (!ended) open(); }, wait);
      retry = Math.min(retry * 2, 30000);
    });
  };
  // answer is the status a stream's request gets now (0 for none) and its
  // Retry-After in seconds (0 for none), read from its headers: the stream
  // itself, if it opens, is let go at once.
  const answer = async (streamURL) => {
    const ctrl = new AbortController();
    try {
      const resp = await fetch(streamURL, { credentials: "same-origin", signal: ctrl.signal,
        headers: { Accept: "text/event-stream", "X-Conveyor-UI": "1" } });
      const after = parseInt(resp.headers.get("Retry-After") || "", 10);
      return { status: resp.status, after: after > 0 ? Math.min(after, 300) : 0 };
    } catch {
      return { status: 0, after: 0 };
    } finally {
      ctrl.abort();
    }
  };
  open();
  // A page left for another is closed, its stream with it; but the browser
  // may keep it in its back-forward cache, and show it again on Back as it
  // was left, without running it again: its stream, unless it had ended,
  // then opens again from the last event seen (or, with none seen, the
  // page loads again).
  let hidden = false;
  window.addEventListener("pagehide", () => {
    hidden = !ended;
    ended = true;
    gen++;
    clearTimeout(timer);
    es.close();
  });
  window.addEventListener("pageshow", (e) => {
    if (!e.persisted || !hidden) return;
    hidden = false;
    // A stream that had seen no event has no place to resume from: what
    // happened while the page was away would be missed, so it is read
    // again whole.
    if (!last) {
      location.reload();
      return;
    }
    ended = false;
    open();
  });
}

// ---- sign-in ------------------------------------------------------------

function renderLogin() {
  document.title = "Sign in · Conveyor";
  const msg = h("p", { role: "alert", class: "error" });
  const key = h("input", { id: "key", name: "key", type: "password", autocomplete: "off", required: true, placeholder: "cvk_…" });
  const form = h("form", {
    onsubmit: async (e) => {
      e.preventDefault();
      msg.textContent = "";
      try {
        const resp = await fetch("/ui/session", {
          method: "POST", credentials: "same-origin",
          headers: { "X-Conveyor-UI": "1", "Content-Type": "application/json" },
          body: JSON.stringify({ key: key.value }),
        });
        if (!resp.ok) {
          const p = await resp.json().catch(() => ({}));
          throw new Error(p.detail || resp.statusText);
        }
        const next = new URLSearchParams(location.search).get("next");
        location.assign(next && next.startsWith("/ui/") ? next : "/ui/");
      } catch (err) {
        msg.textContent = "Sign-in failed: " + err.message;
      }
    },
  },
    h("label", { for: "key" }, "API key"), key,
    h("button", { class: "primary", type: "submit" }, "Sign in"), msg);
  fill(main, h("section", { class: "login" },
    h("h1", {}, "Sign in to Conveyor"),
    h("p", { class: "muted" }, "Paste an API key of your org (an admin makes one with ",
      h("code", {}, "conveyor keys create"), "). It is kept in a cookie this site alone can read, until you sign out or close the browser."),
    form));
  key.focus();
}

// ---- overview -------------------------------------------------------------

async function renderOverview() {
  document.title = "Overview · Conveyor";
  const body = h("div", {});
  fill(main, h("h1", {}, "Overview"), body);
  const draw = async () => {
    let o;
    try {
      o = await api("GET", "/v1/overview");
    } catch (err) {
      showError(body, err);
      return;
    }
    // A large org's overview is shared by its viewers for a few seconds:
    // say when it was read.
    fill(body,
      h("p", { class: "muted", id: "as-of" }, "As of " + new Date(o.as_of).toLocaleTimeString()),
      countCards(o.counts),
      h("div", { class: "grid2" },
        h("section", { "aria-labelledby": "hour" }, h("h2", { id: "hour" }, "The last hour"),
          h("p", {}, `${o.last_hour.completed} completed, ${o.last_hour.failed} failed (${o.last_hour.throughput_per_minute.toFixed(1)} a minute)`),
          hourChart(o.last_hour.minutes || o.last_hour.buckets || [])),
        h("section", { "aria-labelledby": "outbox" }, h("h2", { id: "outbox" }, "Outbox"),
          h("p", { id: "outbox-line" }, `${o.outbox.depth} messages waiting`,
            o.outbox.depth ? `, the oldest for ${Math.round(o.outbox.oldest_age_seconds)}s` : "",
            o.outbox.parked ? `; ${o.outbox.parked} parked until a worker of their type starts` : ""))),
      h("section", { "aria-labelledby": "types" }, h("h2", { id: "types" }, "Queues by type"), typesTable(o.types || [])),
      h("section", { "aria-labelledby": "workers" }, h("h2", { id: "workers" }, "Workers"), workersTable(o.workers || [], o.leader)));
  };
  await draw();
  setInterval(draw, 5000);
}

// countCards without counts (not read yet) keeps their place with a dash
// for each number: what is below them does not move when they come.
function countCards(counts, unread) {
  return h("ul", { class: "cards", "aria-label": "Tasks by status" },
    STATUSES.map((s) => h("li", {},
      h("a", { href: "/ui/tasks?status=" + s }, h("span", { class: "n", "data-count": unread ? null : s },
        unread ? "–" : String((counts || {})[s] || 0)), statusBadge(s)))));
}

function hourChart(minutes) {
  const w = 600, hgt = 100, max = Math.max(1, ...minutes.map((m) => (m.completed || 0) + (m.failed || 0)));
  const chart = svg("svg", { class: "chart", viewBox: `0 0 ${w} ${hgt}`, preserveAspectRatio: "none", role: "img",
    "aria-label": "Tasks completed (green) and failed (red) per minute over the last hour" });
  const bw = w / Math.max(60, minutes.length);
  minutes.forEach((m, i) => {
    const c = ((m.completed || 0) / max) * hgt, f = ((m.failed || 0) / max) * hgt;
    chart.append(svg("rect", { class: "completed", x: i * bw, y: hgt - c - f, width: bw - 1, height: c }));
    chart.append(svg("rect", { class: "failed", x: i * bw, y: hgt - f, width: bw - 1, height: f }));
  });
  return chart;
}

function typesTable(types) {
  if (!types.length) return h("p", { class: "muted" }, "No task is waiting or running.");
  return h("div", { class: "table-wrap" }, h("table", {},
    h("thead", {}, h("tr", {}, ["Type", "Waiting", "Scheduled", "Running", "Oldest waiting"].map((t) => h("th", { scope: "col" }, t)))),
    h("tbody", {}, types.map((t) => h("tr", {},
      h("td", {}, h("a", { href: "/ui/tasks?type=" + encodeURIComponent(t.type) }, t.type)),
      h("td", {}, String(t.pending)), h("td", {}, String(t.scheduled)), h("td", {}, String(t.running)),
      h("td", {}, t.pending ? Math.round(t.oldest_pending_age_seconds) + "s" : "—"))))));
}

function workersTable(workers, leader) {
  if (!workers.length) return h("p", { class: "muted" }, "No worker is running.");
  return h("div", { class: "table-wrap" }, h("table", {},
    h("thead", {}, h("tr", {}, ["Worker", "Types", "Concurrency", "Heartbeat", "Running"].map((t) => h("th", { scope: "col" }, t)))),
    h("tbody", {}, workers.map((w) => h("tr", {},
      h("td", { class: "id" }, w.id, w.id === leader ? h("span", { class: "muted" }, " (maintenance leader)") : ""),
      h("td", {}, (w.types || []).join(", ")), h("td", {}, String(w.concurrency)),
      h("td", {}, ago(w.last_heartbeat_at)),
      h("td", {}, (w.running || []).length ? (w.running || []).map((r) => h("a", { href: "/ui/tasks/" + r.id, title: r.type }, r.id.slice(-6) + " ")) : "idle"))))));
}

// ---- tasks ----------------------------------------------------------------

const FILTERS = ["status", "type", "created_after", "created_before", "q"];

async function renderTasks() {
  document.title = "Tasks · Conveyor";
  const params = new URLSearchParams(location.search);
  const filter = {};
  for (const f of FILTERS) if (params.get(f)) filter[f] = params.get(f);

  const counts = h("div", {}, countCards(null, true));
  const rows = h("tbody", {});
  const more = h("button", { type: "button", hidden: true }, "Older tasks");
  const note = h("p", { role: "status", class: "muted" });
  const [liveEl, onPause] = liveNote();
  const table = h("div", { class: "table-wrap" }, h("table", { "aria-describedby": "tasks-h" },
    h("thead", {}, h("tr", {}, ["Task", "Type", "Status", "Progress", "State", "Updated"].map((t, i) =>
      h("th", { scope: "col", class: i === 5 ? "hide-narrow" : null }, t)))),
    rows));
  // The counts follow the tasks as the rows do: read again every 5 s (as
  // the overview is) and at once after a bulk action.
  const drawCounts = () => api("GET", "/v1/overview").then((o) => fill(counts, countCards(o.counts))).catch(() => {});
  fill(main, h("h1", { id: "tasks-h" }, "Tasks"), counts, filterForm(filter),
    mayWrite() ? bulkPanel(filter, note, drawCounts) : null, mayWrite() ? submitPanel() : null,
    note, liveEl, table, more);

  drawCounts();
  setInterval(drawCounts, 5000);

  const byID = new Map();
  const row = (t) => {
    const bar = h("progress", { max: 100, value: t.progress, "aria-label": `Progress of ${t.id}` }, t.progress + "%");
    const r = h("tr", { "data-task": t.id },
      h("td", { class: "id" }, h("a", { href: "/ui/tasks/" + t.id }, t.id)),
      h("td", {}, t.type), h("td", { class: "st" }, statusBadge(t.status)), h("td", {}, bar),
      h("td", { class: "state" }, t.state), h("td", { class: "hide-narrow upd" }, ago(t.updated_at || t.created_at)));
    byID.set(t.id, { r, bar, at: Date.parse(t.updated_at || t.created_at) });
    return r;
  };
  // "Updated" says how long ago, which grows while the page stays open.
  setInterval(() => {
    for (const { r, at } of byID.values()) r.querySelector(".upd").textContent = ago(at);
  }, 5000);
  let cursor = "";
  const load = async () => {
    const q = new URLSearchParams({ ...filter, limit: "50" });
    if (cursor) q.set("cursor", cursor);
    more.disabled = true; // a second click would load the same page again
    try {
      const page = await api("GET", "/v1/tasks?" + q);
      // An earlier try's error (a 429, the API restarting) is over.
      if (note.querySelector(".error")) note.replaceChildren();
      rows.append(...page.tasks.map(row));
      cursor = page.next_cursor || "";
      more.hidden = !cursor;
      if (!rows.children.length) note.textContent = "No task matches.";
    } catch (err) {
      showError(note, err);
    }
    more.disabled = false;
  };
  more.addEventListener("click", load);

  // Live: rows change as their tasks do; new tasks appear on top. The
  // stream opens before the first page loads, so that no change made
  // meanwhile is missed; what it brings before then waits for the page,
  // and an event older than a row's own state is skipped.
  const live = new URLSearchParams();
  if (filter.type) live.set("type", filter.type);
  const onEvent = (e) => {
    const known = byID.get(e.task_id);
    if (known) {
      const at = Date.parse(e.created_at);
      if (at < known.at) return;
      known.at = at;
      known.r.querySelector(".st").replaceChildren(statusBadge(e.status));
      known.bar.value = e.progress;
      known.r.querySelector(".state").textContent = e.state;
      known.r.querySelector(".upd").textContent = ago(e.created_at);
    } else if (e.status === "PENDING" && !filter.created_before && !filter.q &&
      (!filter.status || filter.status === "PENDING") && isNew(e.task_id)) {
      // Task ids are UUIDv7, in order of creation: a task newer than the
      // page's newest is a new one, not an older one queued again.
      rows.prepend(row({ id: e.task_id, type: e.type, status: e.status, progress: e.progress, state: e.state, created_at: e.created_at }));
      note.textContent = "";
    }
  };
  const newest = () => (rows.firstElementChild ? rows.firstElementChild.dataset.task : "");
  // isNew says a task is newer than any the page lists; with none listed,
  // one made after the filter's created_after (a UUIDv7's first 48 bits
  // are when it was made, in ms), not an older one queued again (a retry).
  const isNew = (id) => {
    if (rows.firstElementChild) return id > newest();
    const after = Date.parse(filter.created_after || "");
    return Number.isNaN(after) || parseInt(id.replace(/-/g, "").slice(0, 12), 16) >= after;
  };
  let early = [];
  follow("/v1/events/stream?" + live, (e) => (early ? early.push(e) : onEvent(e)), null, onPause);
  await load();
  const waiting = early;
  early = null;
  waiting.forEach(onEvent);
}

function filterForm(filter) {
  const f = (name, label, input) => h("label", { for: "f-" + name }, label, input);
  // A time the browser cannot read (typed or pasted into the address)
  // leaves its field empty instead of stopping the page: the listing then
  // shows the API's own error for it.
  const local = (ts) => {
    const d = new Date(ts || NaN);
    // To the second: a moment given in the address keeps its seconds
    // when the form is sent again.
    return Number.isNaN(d.getTime()) ? "" : d.toISOString().slice(0, 19);
  };
  return h("form", { class: "filters", role: "search", "aria-label": "Filter tasks",
    onsubmit: (e) => {
      e.preventDefault();
      const q = new URLSearchParams();
      const data = new FormData(e.target);
      for (const name of FILTERS) {
        let v = (data.get(name) || "").trim();
        if (v && name.startsWith("created_")) v = new Date(v + "Z").toISOString();
        if (v) q.set(name, v);
      }
      location.assign("/ui/tasks" + (q.toString() ? "?" + q : ""));
    } },
    f("status", "Status", h("select", { id: "f-status", name: "status" }, h("option", { value: "" }, "any"),
      STATUSES.map((s) => h("option", { value: s, selected: filter.status === s }, s)))),
    f("type", "Type", h("input", { id: "f-type", name: "type", value: filter.type || "", placeholder: "demo.sleep" })),
    f("created_after", "Created after (UTC)", h("input", { id: "f-created_after", name: "created_after", type: "datetime-local", step: 1, value: local(filter.created_after) })),
    f("created_before", "Created before (UTC)", h("input", { id: "f-created_before", name: "created_before", type: "datetime-local", step: 1, value: local(filter.created_before) })),
    f("q", "Task id, or metadata key=value", h("input", { id: "f-q", name: "q", value: filter.q || "", type: "search" })),
    h("button", { type: "submit", class: "primary" }, "Filter"),
    h("a", { href: "/ui/tasks" }, "Clear"));
}

function bulkPanel(filter, note, onDone) {
  const act = (verb, path) => async () => {
    try {
      const dry = await api("POST", path, { filter, dry_run: true });
      if (!dry.matched) { note.textContent = `No task to ${verb}.`; return; }
      if (!confirm(`${verb[0].toUpperCase() + verb.slice(1)} ${dry.matched} task(s) matching this filter?`)) return;
      const done = await api("POST", path, { filter, expected: dry.matched });
      note.textContent = `${done.cancelled ?? done.retried ?? 0} task(s) ${verb === "cancel" ? "cancelled" : "retried"}` +
        (done.skipped ? `, ${done.skipped} skipped (they changed meanwhile)` : "") + (done.more ? "; more match: run it again." : ".");
      onDone();
    } catch (err) {
      note.textContent = `Could not ${verb}: ${err.message}`;
    }
  };
  return h("details", { class: "panel" }, h("summary", {}, "Act on every task this filter matches"),
    h("div", { class: "row" },
      h("button", { type: "button", class: "danger", onclick: act("cancel", "/v1/tasks/cancel") }, "Cancel matching…"),
      h("button", { type: "button", onclick: act("retry", "/v1/tasks/retry") }, "Retry matching (failed or cancelled)…")));
}

function submitPanel() {
  const msg = h("p", { role: "alert", class: "error" });
  return h("details", { class: "panel" }, h("summary", {}, "Submit a task"),
    h("form", { onsubmit: async (e) => {
      e.preventDefault();
      const d = new FormData(e.target);
      try {
        const body = { type: d.get("type"), payload: JSON.parse(d.get("payload") || "{}"), dedupe: false };
        if (d.get("priority")) body.priority = Number(d.get("priority"));
        if (d.get("max_attempts")) body.max_attempts = Number(d.get("max_attempts"));
        if (d.get("delay")) body.delay = d.get("delay").trim();
        const t = await api("POST", "/v1/tasks", body);
        location.assign("/ui/tasks/" + t.id);
      } catch (err) {
        msg.textContent = "Not submitted: " + err.message;
      }
    } },
    h("div", { class: "row" },
      h("label", { for: "s-type" }, "Type", h("input", { id: "s-type", name: "type", required: true, placeholder: "demo.sleep" })),
      h("label", { for: "s-priority" }, "Priority (0–9)", h("input", { id: "s-priority", name: "priority", type: "number", min: 0, max: 9 })),
      h("label", { for: "s-attempts" }, "Max attempts", h("input", { id: "s-attempts", name: "max_attempts", type: "number", min: 1, max: 100 })),
      h("label", { for: "s-delay" }, "Delay (such as 90s; empty: now)", h("input", { id: "s-delay", name: "delay", placeholder: "0s" }))),
    h("label", { for: "s-payload" }, "Payload (JSON)", h("textarea", { id: "s-payload", name: "payload" }, '{"steps": 10, "step_ms": 500}')),
    h("div", { class: "row" }, h("button", { type: "submit", class: "primary" }, "Submit")), msg));
}

// ---- one task ---------------------------------------------------------------

async function renderTask(id) {
  document.title = "Task · Conveyor";
  let t;
  try {
    t = await api("GET", "/v1/tasks/" + encodeURIComponent(id));
  } catch (err) {
    // A refusal (404, or 400 for an address that names no task) says
    // there is no such task; a 429, a 503 while the API restarts or no
    // answer at all will pass.
    const none = err.status >= 400 && err.status < 500 && err.status !== 429;
    fill(main, h("h1", {}, none ? "Task not found" : "Could not load the task"),
      h("p", { role: "alert" }, err.status === 404 ? "There is no such task, or it is not yours to see." : err.message),
      h("p", {}, h("a", { href: "/ui/tasks" }, "All tasks")));
    return;
  }
  document.title = `${t.type} ${t.id.slice(-6)} · Conveyor`;
  const badge = h("span", { id: "status" }, statusBadge(t.status));
  const bar = h("progress", { id: "bar", max: 100, value: t.progress, "aria-labelledby": "bar-label" }, t.progress + "%");
  const label = h("span", { id: "bar-label", "aria-live": "polite" });
  const setBar = (p, state) => { bar.value = p; label.textContent = `${p}% · ${state}`; };
  setBar(t.progress, t.state);
  const actions = h("div", { class: "row" });
  const details = h("div", {});
  const timeline = h("ol", { class: "timeline", id: "timeline", "aria-label": "Events, oldest first" });
  const [liveEl, onPause] = liveNote();

  // refused is why the last action failed: it stays through the redraws
  // until the next action, which replaces it (clicked again, the button
  // does not stack the same message).
  let refused = "";
  const drawActions = () => {
    // fill, not replaceChildren: a redraw leaves the focus on the button.
    fill(actions, !mayWrite() ? null
      // A cancel already asked of a running task waits for its handler to
      // stop: asking again would change nothing. A pending one (handed
      // back since) is cancelled at once by asking again.
      : t.status === "IN_PROGRESS" && t.cancel_requested_at ? h("p", { class: "muted", id: "cancel-requested", role: "status" },
        "Cancel requested ", when(t.cancel_requested_at), "; the handler is told to stop.")
      : !TERMINAL.has(t.status) ? h("button", { type: "button", class: "danger", id: "cancel", onclick: () => act("cancel") }, "Cancel task")
      : t.status !== "COMPLETED" ? h("button", { type: "button", id: "retry", onclick: () => act("retry") }, "Retry task")
      : null,
    refused ? h("p", { class: "error", role: "alert" }, refused) : null);
  };
  const act = async (verb) => {
    if (!confirm(verb === "cancel" ? "Cancel this task? A running handler is told to stop." : "Run this task again from its first attempt?")) return;
    refused = "";
    try {
      t = await api("POST", `/v1/tasks/${t.id}/${verb}`);
      drawDetails();
      if (verb === "retry") location.reload(); // a new run: follow it from the start
    } catch (err) {
      refused = err.message;
      drawActions();
    }
  };
  const drawDetails = () => {
    badge.replaceChildren(statusBadge(t.status));
    drawActions();
    fill(details, 
      h("dl", { class: "details" },
        h("dt", {}, "Type"), h("dd", {}, t.type),
        h("dt", {}, "Attempt"), h("dd", {}, `${t.attempt} of ${t.max_attempts}`),
        h("dt", {}, "Priority"), h("dd", {}, String(t.priority)),
        h("dt", {}, "Worker"), h("dd", {}, t.worker_id || "—"),
        h("dt", {}, "Created"), h("dd", {}, when(t.created_at)),
        h("dt", {}, "Started"), h("dd", {}, t.started_at ? when(t.started_at) : "—"),
        h("dt", {}, "Finished"), h("dd", {}, t.completed_at ? when(t.completed_at) : "—"),
        h("dt", {}, "Visible to"), h("dd", {}, t.visibility.length ? t.visibility.join(", ") : "the whole org"),
        h("dt", {}, "Trace"), h("dd", {}, traceLink(t))),
      t.error ? [h("h2", {}, "Error"), h("pre", { class: "error", id: "error" }, t.error)] : null,
      t.result !== undefined && t.result !== null ? [h("h2", {}, "Result"), h("pre", { id: "result" }, JSON.stringify(t.result, null, 2))] : null,
      h("h2", {}, "Payload"), h("pre", {}, JSON.stringify(t.payload, null, 2)),
      t.metadata && Object.keys(t.metadata).length ? [h("h2", {}, "Metadata"), h("pre", {}, JSON.stringify(t.metadata, null, 2))] : null);
  };

  fill(main, 
    h("h1", {}, "Task ", h("span", { class: "id" }, t.id), " ", badge),
    h("div", { class: "bar" }, bar, label), actions,
    h("div", { class: "grid2" }, h("section", {}, details),
      h("section", { "aria-labelledby": "events-h" }, h("h2", { id: "events-h" }, "Events"), liveEl, timeline)));
  drawDetails();

  // reread draws the task as it now is, once the events that came
  // together (the history the stream replays first) are in; of reads
  // that overlap, only the last one asked is drawn.
  let reads = 0, pause = 0;
  const reread = () => {
    clearTimeout(pause);
    pause = setTimeout(async () => {
      const n = ++reads;
      try {
        const now = await api("GET", "/v1/tasks/" + t.id);
        if (n !== reads) return;
        t = now;
        drawDetails();
      } catch { /* the page still shows the stream */ }
    }, 200);
  };

  // The stream replays the task's history from its first event, then
  // follows it live, and ends after its terminal event.
  follow(`/v1/tasks/${t.id}/stream`, (e) => {
    timeline.append(h("li", { "data-event": e.id },
      when(e.created_at), statusBadge(e.status), " ", e.state, ` · ${e.progress}%`,
      h("span", { class: "muted" }, " — ", e.by ? `${e.by.name} (${e.by.kind})` : e.actor.toLowerCase()),
      e.error ? h("div", { class: "error" }, e.error) : null));
    setBar(e.progress, e.state);
    if (e.status !== t.status) {
      t.status = e.status;
      badge.replaceChildren(statusBadge(e.status));
      drawActions();
      // A new status comes with a new worker, attempt, start or error:
      // the details are read again.
      reread();
    } else if (e.state === "Cancel requested" && !t.cancel_requested_at) {
      // Asked elsewhere (the CLI, another page): the status stays, and the
      // task is read again for the cancel's time.
      reread();
    }
  }, () => {
    reread();
    watchEnded();
  }, onPause);

  // The stream ends with the task, but a retry made elsewhere (the CLI,
  // another person, the list's bulk action) starts it again: the task is
  // read every 5 s, and one running again, or changed since the last read,
  // reloads the page, whose new stream follows the new run from the start.
  let seen = null;
  const watchEnded = () => {
    setTimeout(async () => {
      try {
        const now = await api("GET", "/v1/tasks/" + t.id);
        if (!TERMINAL.has(now.status) || (seen !== null && now.version !== seen)) {
          location.reload();
          return;
        }
        seen = now.version;
      } catch (err) {
        // Gone (deleted by retention) or refused for good: nothing to follow.
        if (err.status >= 400 && err.status < 500 && err.status !== 429) return;
      }
      watchEnded();
    }, 5000);
  };
}

// ---- workflows --------------------------------------------------------------

async function renderWorkflows() {
  document.title = "Workflows · Conveyor";
  const body = h("div", {});
  fill(main, h("h1", {}, "Workflows"), body);
  let flows;
  try {
    flows = (await api("GET", "/v1/workflows")).workflows || [];
  } catch (err) {
    showError(body, err);
    return;
  }
  if (!flows.length) {
    fill(body, h("p", { class: "muted" }, "No workflow yet: declare one under ", h("code", {}, "workflows:"),
      " in a jobs file and apply it (", h("code", {}, "conveyor apply -f FILE"), ")."));
    return;
  }
  const lists = flows.map((wf) => ({ wf, where: h("div", {}) }));
  fill(body, lists.map(({ wf, where }) => workflowSection(wf, where)));
  const target = location.hash && document.getElementById(decoded(location.hash.slice(1)));
  if (target) target.scrollIntoView();

  // Each workflow's latest runs, kept fresh.
  const draw = () => Promise.all(lists.map(async ({ wf, where }) => {
    try {
      const page = await api("GET", `/v1/workflows/${encodeURIComponent(wf.name)}/runs?limit=5`);
      fill(where, runsTable(wf, page.runs || []));
    } catch (err) {
      showError(where, err);
    }
  }));
  await draw();
  setInterval(draw, 5000);
}

function workflowSection(wf, runs) {
  const id = "wf-" + wf.name;
  const nodes = wf.nodes || [];
  const src = wf.source;
  const facts = [`${nodes.length} node${nodes.length === 1 ? "" : "s"}`, `on failure: ${wf.on_failure}`,
    wf.memoize ? "memoizes" : null,
    src ? `${src.kind} ${src.schedule}${src.timezone && src.timezone !== "UTC" ? " " + src.timezone : ""}${wf.active ? "" : " (paused)"}` : null];
  return h("section", { id, class: "workflow", "data-workflow": wf.name, "aria-labelledby": id + "-h" },
    h("h2", { id: id + "-h" }, wf.name),
    h("p", { class: "muted" }, facts.filter(Boolean).join(" · "), wf.next_tick_at ? [" · next run ", when(wf.next_tick_at)] : null),
    mayWrite() ? runForm(wf) : null,
    h("details", { class: "panel" }, h("summary", {}, "Graph"), h("div", { class: "dag-wrap" }, dag(nodes).el)),
    runs);
}

// runForm starts a run of wf, with optional params and force, and opens it.
function runForm(wf) {
  const p = "run-" + wf.name;
  const msg = h("p", { role: "alert", class: "error" });
  return h("form", { class: "run", "data-run-form": wf.name, "aria-label": "Run " + wf.name,
    onsubmit: async (e) => {
      e.preventDefault();
      msg.textContent = "";
      const d = new FormData(e.target);
      try {
        const raw = (d.get("params") || "").trim();
        const run = await api("POST", `/v1/workflows/${encodeURIComponent(wf.name)}/runs`,
          { params: raw ? JSON.parse(raw) : {}, force: d.get("force") === "on" });
        location.assign("/ui/runs/" + run.id);
      } catch (err) {
        msg.textContent = "Not started: " + err.message;
      }
    } },
    h("div", { class: "row" },
      h("label", { for: p + "-params" }, "Params (a JSON object, optional)",
        h("input", { id: p + "-params", name: "params", class: "mono", placeholder: '{"date": "2024-01-31"}', size: 36 })),
      h("label", { class: "check", for: p + "-force" },
        h("input", { id: p + "-force", name: "force", type: "checkbox" }), "Force (ignore memoized results)"),
      h("button", { type: "submit", class: "primary" }, "Run")),
    msg);
}

function runsTable(wf, runs) {
  if (!runs.length) return h("p", { class: "muted" }, "No run yet.");
  return h("div", { class: "table-wrap" }, h("table", { "aria-label": "Latest runs of " + wf.name },
    h("thead", {}, h("tr", {}, ["Run", "Status", "Started", "Finished"].map((t) => h("th", { scope: "col" }, t)))),
    h("tbody", {}, runs.map((r) => h("tr", { "data-run": r.id },
      h("td", { class: "id" }, h("a", { href: "/ui/runs/" + r.id }, r.id)),
      h("td", { title: r.error || null }, statusBadge(r.status)),
      h("td", {}, when(r.created_at), r.scheduled_at ? h("span", { class: "muted" }, " (scheduled)") : null),
      h("td", {}, r.finished_at ? when(r.finished_at) : "—"))))));
}

// dag draws a workflow's nodes as a graph, each parent left of its
// children: a node's column is its depth (0 for a root, else one more than
// its deepest parent's), and an edge runs from each parent to each child.
// It returns the SVG and update, which shows where a run's nodes stand (the
// shape of the graph never changes during a run).
let dags = 0;
function dag(nodes) {
  const W = 168, H = 52, GX = 64, GY = 18, PAD = 6;
  const byName = new Map(nodes.map((n) => [n.name, n]));
  const depth = new Map();
  const depthOf = (name, seen) => {
    if (depth.has(name)) return depth.get(name);
    const n = byName.get(name);
    if (!n || seen.has(name)) return 0; // a stranger or a cycle: the API allows neither
    seen.add(name);
    const d = 1 + Math.max(-1, ...(n.depends_on || []).map((p) => depthOf(p, seen)));
    depth.set(name, d);
    return d;
  };
  const cols = [];
  for (const n of nodes) (cols[depthOf(n.name, new Set())] ||= []).push(n);
  // Within a column, children sit near the middle of their parents.
  const row = new Map();
  cols.forEach((col, d) => {
    if (d > 0) {
      const mid = (n) => {
        const ps = (n.depends_on || []).filter((p) => row.has(p));
        return ps.length ? ps.reduce((s, p) => s + row.get(p), 0) / ps.length : 0;
      };
      col.sort((a, b) => mid(a) - mid(b));
    }
    col.forEach((n, i) => row.set(n.name, i - (col.length - 1) / 2));
  });
  const tallest = Math.max(1, ...cols.map((c) => c.length));
  const width = PAD * 2 + cols.length * W + Math.max(0, cols.length - 1) * GX;
  const height = PAD * 2 + tallest * H + (tallest - 1) * GY;
  const pos = (name) => ({ x: PAD + depth.get(name) * (W + GX), y: height / 2 - H / 2 + row.get(name) * (H + GY) });

  const arrow = "dag-arrow-" + (++dags);
  const el = svg("svg", { class: "dag", width, height, viewBox: `0 0 ${width} ${height}`, role: "group",
    "aria-label": `Graph of ${nodes.length} node${nodes.length === 1 ? "" : "s"}, parents left of their children` });
  const defs = svg("defs");
  const marker = svg("marker", { id: arrow, viewBox: "0 0 10 10", refX: 10, refY: 5, markerWidth: 8, markerHeight: 8, orient: "auto-start-reverse" });
  marker.append(svg("path", { d: "M0,0 L10,5 L0,10 z" }));
  defs.append(marker);
  el.append(defs);
  for (const n of nodes) {
    for (const p of n.depends_on || []) {
      if (!byName.has(p)) continue;
      const a = pos(p), b = pos(n.name);
      const x1 = a.x + W, y1 = a.y + H / 2, x2 = b.x - 1, y2 = b.y + H / 2;
      el.append(svg("path", { class: "edge", "data-from": p, "data-to": n.name, "marker-end": `url(#${arrow})`,
        d: `M${x1},${y1} C${x1 + GX / 2},${y1} ${x2 - GX / 2},${y2} ${x2},${y2}` }));
    }
  }
  const parts = new Map();
  for (const n of nodes) {
    const { x, y } = pos(n.name);
    const link = svg("a");
    const g = svg("g", { class: "node", "data-node": n.name, transform: `translate(${x},${y})` });
    const title = svg("title");
    // Text sits in a box of its own, which clips what would overflow.
    const label = svg("svg", { x: 10, y: 0, width: W - 16, height: H });
    const name = svg("text", { class: "name", x: 0, y: 21 });
    name.textContent = n.name.length > 18 ? n.name.slice(0, 17) + "…" : n.name;
    const st = svg("text", { class: "st", x: 0, y: 40 });
    label.append(name, st);
    const bar = svg("rect", { class: "bar", x: 6, y: H - 6, height: 3, rx: 1.5, width: 0 });
    const memo = svg("g", { class: "memo", transform: `translate(${W - 70},29)`, display: "none" });
    const badge = svg("text", { x: 32, y: 12, "text-anchor": "middle" });
    badge.textContent = "memoized";
    memo.append(svg("rect", { width: 64, height: 16, rx: 8 }), badge);
    g.append(title, svg("rect", { class: "box", width: W, height: H, rx: 6 }), bar, label, memo);
    link.append(g);
    el.append(link);
    parts.set(n.name, { link, g, title, st, bar, memo });
  }

  const update = (nodes) => {
    for (const n of nodes) {
      const p = parts.get(n.name);
      if (!p) continue;
      const status = n.status || "";
      p.g.setAttribute("class", "node " + status);
      p.g.setAttribute("data-status", status);
      const running = status === "IN_PROGRESS";
      p.st.textContent = running ? `${status} · ${n.progress}%` : status || "job " + n.job;
      p.bar.setAttribute("width", running ? ((W - 12) * Math.min(100, Math.max(0, n.progress))) / 100 : 0);
      p.memo.setAttribute("display", n.memoized ? "inline" : "none");
      p.title.textContent = `${n.name} (job ${n.job})` + (status ? `: ${status}` : "") + (n.memoized ? ", memoized" : "") +
        (n.task_id ? " · open its task" : "");
      if (n.task_id) {
        p.link.setAttribute("href", "/ui/tasks/" + n.task_id);
        p.link.setAttribute("aria-label", p.title.textContent);
      } else {
        p.link.removeAttribute("href");
        p.link.removeAttribute("aria-label");
      }
    }
  };
  update(nodes);
  return { el, update };
}

// ---- one run ----------------------------------------------------------------

async function renderRun(id) {
  document.title = "Run · Conveyor";
  let r;
  try {
    r = await api("GET", "/v1/runs/" + encodeURIComponent(id));
  } catch (err) {
    // A refusal (404, or 400 for an address that names no run) says
    // there is no such run; a 429, a 503 while the API restarts or no
    // answer at all will pass.
    const none = err.status >= 400 && err.status < 500 && err.status !== 429;
    fill(main, h("h1", {}, none ? "Run not found" : "Could not load the run"),
      h("p", { role: "alert" }, err.status === 404 ? "There is no such run, or it is not yours to see." : err.message),
      h("p", {}, h("a", { href: "/ui/workflows" }, "All workflows")));
    return;
  }
  document.title = `${r.workflow} run ${r.id.slice(-6)} · Conveyor`;
  const badge = h("span", { id: "run-status", "aria-live": "polite" });
  const actions = h("div", { class: "row" });
  const details = h("div", {});
  const graph = dag(r.nodes || []);
  graph.el.id = "dag";
  const table = h("div", {});

  let timer = 0;
  // refused is why the last action failed: it stays through the redraws
  // (every 1.5 s while the run runs) until the next action.
  let refused = "";
  // inFlight: nodes whose task has not ended. A run that failed or was
  // cancelled with some is still stopping: it is retried once they end,
  // and a cancel stops them now rather than at the scheduler's next sweep.
  const inFlight = () => (r.nodes || []).some((n) => !n.memoized && (n.status === "PENDING" || n.status === "IN_PROGRESS"));
  const drawActions = () => {
    const ended = r.status === "FAILED" || r.status === "CANCELLED";
    // fill, not replaceChildren: a redraw leaves the focus on the button.
    fill(actions, !mayWrite() ? null
      : r.status === "RUNNING" ? h("button", { type: "button", class: "danger", id: "cancel-run", onclick: () => act("cancel") }, "Cancel run")
      : ended && inFlight() ? h("button", { type: "button", class: "danger", id: "stop-run-tasks", onclick: () => act("stop") }, "Stop its tasks")
      : ended ? h("button", { type: "button", id: "retry-run", onclick: () => act("retry") }, "Retry run")
      : null,
    refused ? h("p", { class: "error", role: "alert" }, refused) : null);
  };
  const act = async (verb) => {
    if (!confirm(verb === "cancel" ? "Cancel this run? Its running tasks are told to stop, and its waiting nodes will not run."
      : verb === "stop" ? "Stop this run's tasks still in flight? Running ones are told to stop."
      : "Retry this run? Its nodes that did not complete run again.")) return;
    if (verb === "stop") verb = "cancel";
    refused = "";
    try {
      r = await api("POST", `/v1/runs/${r.id}/${verb}`);
    } catch (err) {
      refused = err.message;
    }
    draw();
  };
  const draw = () => {
    badge.replaceChildren(statusBadge(r.status));
    drawActions();
    graph.update(r.nodes || []);
    const params = r.params && Object.keys(r.params).length ? r.params : null;
    fill(details, h("dl", { class: "details" },
      h("dt", {}, "Workflow"), h("dd", {}, h("a", { href: "/ui/workflows#wf-" + encodeURIComponent(r.workflow) }, r.workflow)),
      h("dt", {}, "Started"), h("dd", {}, when(r.created_at), r.scheduled_at ? [" (scheduled for ", when(r.scheduled_at), ")"] : null),
      h("dt", {}, "Finished"), h("dd", {}, r.finished_at ? when(r.finished_at) : "—"),
      h("dt", {}, "On failure"), h("dd", {}, r.on_failure),
      h("dt", {}, "Memoize"), h("dd", {}, r.memoize ? (r.force ? "yes, but this run is forced" : "yes") : "no"),
      h("dt", {}, "Trace"), h("dd", {}, traceLink(r))),
    r.error ? [h("h2", {}, "Error"), h("pre", { class: "error", id: "run-error" }, r.error)] : null,
    params ? [h("h2", {}, "Params"), h("pre", {}, JSON.stringify(params, null, 2))] : null);
    fill(table, h("div", { class: "table-wrap" }, h("table", { "aria-labelledby": "nodes-h" },
      h("thead", {}, h("tr", {}, ["Node", "Job", "Status", "Progress", "Attempt", "Task"].map((t) => h("th", { scope: "col" }, t)))),
      h("tbody", {}, (r.nodes || []).map((n) => h("tr", { "data-node": n.name },
        h("td", {}, n.name), h("td", {}, n.job),
        h("td", { title: n.memoized ? "Its result is that of an earlier run's task" : null }, statusBadge(n.status)),
        h("td", {}, n.task_id && !n.memoized ? h("progress", { max: 100, value: n.progress, "aria-label": `Progress of ${n.name}` }, n.progress + "%") : "—"),
        h("td", {}, n.attempt ? String(n.attempt) : "—"),
        h("td", { class: "id" }, n.task_id ? h("a", { href: "/ui/tasks/" + n.task_id }, n.task_id.slice(-12)) : "—")))))));
    // A running run is read again every 1.5 s, and so is one that ended
    // (cancelled, or failed and stopping) while tasks of it are still in
    // flight: a running task stops only when its worker hears of it.
    clearTimeout(timer);
    if (r.status === "RUNNING" || inFlight()) timer = setTimeout(poll, 1500);
  };
  const poll = async () => {
    try {
      r = await api("GET", "/v1/runs/" + r.id);
    } catch { /* try again at the next tick */ }
    draw();
  };

  fill(main,
    h("h1", {}, "Run ", h("span", { class: "id" }, r.id), " ", badge),
    actions,
    h("section", { "aria-labelledby": "graph-h" }, h("h2", { id: "graph-h" }, "Graph"),
      h("p", { class: "muted" }, "A node with a task opens it."), h("div", { class: "dag-wrap" }, graph.el)),
    h("div", { class: "grid2" },
      h("section", { "aria-labelledby": "nodes-h" }, h("h2", { id: "nodes-h" }, "Nodes"), table),
      h("section", { "aria-labelledby": "run-h" }, h("h2", { id: "run-h" }, "Details"), details)));
  draw();
}

// ---- jobs -------------------------------------------------------------------

async function renderJobs() {
  document.title = "Jobs · Conveyor";
  const body = h("div", {});
  fill(main, h("h1", {}, "Jobs"), body);
  let jobs = null;
  // refused is why the last action on a job failed, and made the task its
  // last trigger made: each shows beside that job's buttons through the
  // redraws (every 5 s) until the next action replaces it.
  let refused = null, made = null;
  const act = async (j, verb) => {
    if (!confirm(verb === "trigger" ? `Trigger ${j.name} now? It makes a task of the job.`
      : verb === "pause" ? `Pause ${j.name}? Its new tasks wait and its schedule does not tick until it is resumed.`
      : `Resume ${j.name}?`)) return;
    refused = null;
    made = null;
    try {
      const done = await api("POST", `/v1/jobs/${encodeURIComponent(j.name)}/${verb}`);
      if (verb === "trigger") made = { name: j.name, id: done.id };
    } catch (err) {
      refused = { name: j.name, message: err.message };
    }
    await draw();
  };
  const limits = (j) => [j.max_concurrency ? `${j.max_concurrency} at once` : null,
    j.max_concurrency_per_key ? `${j.max_concurrency_per_key} per key` : null].filter(Boolean).join(", ") || "—";
  const row = (j) => h("tr", { "data-job": j.name },
    h("td", {}, j.name),
    h("td", {}, h("a", { href: "/ui/tasks?type=" + encodeURIComponent(j.type), title: `Tasks of type ${j.type} (of every job)` }, j.type)),
    h("td", {}, j.source ? [h("code", {}, j.source.schedule), " ", h("span", { class: "muted" }, j.source.timezone)] : h("span", { class: "muted" }, "on trigger")),
    h("td", { "data-paused": String(j.paused) }, j.paused ? ["paused ", h("span", { class: "muted" }, ago(j.paused_at))]
      : j.active ? "active" : "inactive"),
    h("td", {}, j.next_tick_at ? when(j.next_tick_at) : "—"),
    h("td", {}, limits(j)),
    mayWrite() ? h("td", {}, h("div", { class: "row" },
      j.paused ? h("button", { type: "button", id: "resume-" + j.name, onclick: () => act(j, "resume") }, "Resume")
        : h("button", { type: "button", id: "pause-" + j.name, onclick: () => act(j, "pause") }, "Pause"),
      h("button", { type: "button", id: "trigger-" + j.name, onclick: () => act(j, "trigger") }, "Trigger"),
      made && made.name === j.name ? h("span", { role: "status" }, "Made ", h("a", { href: "/ui/tasks/" + made.id }, "task " + made.id.slice(-6))) : null,
      refused && refused.name === j.name ? h("p", { class: "error", role: "alert" }, refused.message) : null)) : null);
  const draw = async () => {
    try {
      jobs = (await api("GET", "/v1/jobs")).jobs || [];
    } catch (err) {
      // A list already shown stays; a first read that failed says why.
      if (jobs === null) showError(body, err);
      return;
    }
    // fill, not replaceChildren: a redraw leaves the focus on the button.
    fill(body, !jobs.length ? h("p", { class: "muted" }, "The org has no job: an admin declares them in a jobs file (",
      h("code", {}, "conveyor apply -f jobs.yaml"), ").")
      : h("div", { class: "table-wrap" }, h("table", { "aria-label": "Jobs" },
        h("thead", {}, h("tr", {}, ["Name", "Type", "Schedule", "State", "Next tick", "Limits", mayWrite() ? "Actions" : null]
          .filter(Boolean).map((t) => h("th", { scope: "col" }, t)))),
        h("tbody", {}, jobs.map(row)))));
  };
  await draw();
  setInterval(draw, 5000);
}

// ---- frame ----------------------------------------------------------------

function theme() {
  const btn = document.getElementById("theme");
  const apply = (v) => {
    if (v) document.documentElement.dataset.theme = v; else delete document.documentElement.dataset.theme;
    const dark = v ? v === "dark" : matchMedia("(prefers-color-scheme: dark)").matches;
    // A toggle's name stays the same: its state is aria-pressed, which a
    // screen reader reads with the name ("Dark theme, pressed").
    btn.setAttribute("aria-pressed", String(dark));
    btn.textContent = "Dark theme";
  };
  apply(localStorage.getItem("theme"));
  btn.addEventListener("click", () => {
    const dark = btn.getAttribute("aria-pressed") === "true";
    localStorage.setItem("theme", dark ? "light" : "dark");
    apply(dark ? "light" : "dark");
  });
}

async function start() {
  theme();
  const path = location.pathname.replace(/\/+$/, "") || "/ui";
  for (const a of document.querySelectorAll("[data-nav]")) {
    const on = (a.dataset.nav === "overview" && path === "/ui") || (a.dataset.nav === "tasks" && path.startsWith("/ui/tasks")) ||
      (a.dataset.nav === "workflows" && (path === "/ui/workflows" || path.startsWith("/ui/runs/"))) ||
      (a.dataset.nav === "jobs" && path === "/ui/jobs");
    if (on) a.setAttribute("aria-current", "page");
  }
  if (path === "/ui/login") return renderLogin();
  try {
    me = await api("GET", "/v1/whoami");
  } catch (err) {
    return showError(main, err);
  }
  // A page the browser kept and shows again on Back was drawn for a
  // session that may be over (signed out since, the key revoked): it is
  // asked again, and a 401 sends the person to sign in rather than leaving
  // what the page showed to whoever uses the browser next.
  window.addEventListener("pageshow", (e) => {
    if (e.persisted) api("GET", "/v1/whoami").catch(() => {});
  });
  document.getElementById("who").textContent = `${me.name} · ${me.org} · ${me.role}`;
  const out = document.getElementById("signout");
  out.hidden = false;
  out.addEventListener("click", async () => {
    // The session ends only when the API clears its cookie: a sign-out
    // that did not reach it (the API down) says so, rather than showing
    // the sign-in page as if the next person at the browser were not
    // still signed in as this one.
    const resp = await fetch("/ui/logout", { method: "POST", credentials: "same-origin", headers: { "X-Conveyor-UI": "1" } })
      .catch(() => null);
    if (!resp || !resp.ok) {
      document.getElementById("who").textContent = "Not signed out: the API could not be reached, or refused. Try again.";
      return;
    }
    location.assign("/ui/login");
  });
  const task = path.match(/^\/ui\/tasks\/([^/]+)$/);
  if (task) return renderTask(decoded(task[1]));
  if (path === "/ui/tasks") return renderTasks();
  const run = path.match(/^\/ui\/runs\/([^/]+)$/);
  if (run) return renderRun(decoded(run[1]));
  if (path === "/ui/workflows") return renderWorkflows();
  if (path === "/ui/jobs") return renderJobs();
  return renderOverview();
}

start();
