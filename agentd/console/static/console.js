// The agentd console's one script: times in the browser's zone, and a running session live.
// Every page works without it; it only adds. Text is always set with textContent (never HTML).
"use strict";

function localizeTimes(root) {
  for (const el of root.querySelectorAll("time[datetime]")) {
    const when = new Date(el.getAttribute("datetime"));
    if (!isNaN(when)) {
      el.textContent = when.toLocaleString();
      el.title = el.getAttribute("datetime");
    }
  }
}

function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined && text !== null) el.textContent = String(text);
  return el;
}

// One transcript entry, as templates/entry.html renders it.
function entryElement(e) {
  const li = element("li", "entry role-" + e.role);
  li.id = "e" + e.seq;
  li.dataset.seq = e.seq;
  const meta = element("div", "meta");
  meta.append(element("span", "role", e.role));
  if (e.name) meta.append(element("span", "name", e.name));
  if (e.model) meta.append(element("span", "model", e.model));
  if (e.assistant) meta.append(element("span", "assistant", e.assistant));
  if (e.turn) meta.append(element("span", "turn", e.turn));
  if (e.tool_call_id) meta.append(element("span", "call", e.tool_call_id));
  if (e.is_error) meta.append(element("span", "flag error", "error"));
  if (e.replayed) meta.append(element("span", "flag", "replayed"));
  if (e.outcome_unknown) meta.append(element("span", "flag", "outcome unknown"));
  meta.append(element("span", "seq", "#" + e.seq));
  li.append(meta);
  if (e.thinking) {
    const details = element("details", "thinking");
    details.append(element("summary", null, "thinking"), element("pre", null, e.thinking));
    li.append(details);
  }
  if (e.content) li.append(element("pre", "content", e.content));
  if (e.images && e.images.length) li.append(element("p", "muted", e.images.length + " image(s)"));
  if (e.tool_calls && e.tool_calls.length) {
    const calls = element("ul", "calls");
    for (const call of e.tool_calls) {
      const item = element("li", "call");
      item.append(element("span", "tool", call.name), " ", element("span", "muted", call.id));
      item.append(element("pre", null, JSON.stringify(call.arguments || {}, null, 2)));
      calls.append(item);
    }
    li.append(calls);
  }
  return li;
}

// A turn's row in the turns table, made from the table's headings (th[data-col]) if it is new.
function turnRow(turnId) {
  const table = document.getElementById("turns");
  if (!table) return null;
  const body = table.tBodies[0];
  let row = body.querySelector('tr[data-turn="' + CSS.escape(turnId) + '"]');
  if (!row) {
    const none = body.querySelector("tr.none");
    if (none) none.remove();
    row = element("tr");
    row.dataset.turn = turnId;
    for (const heading of table.querySelectorAll("th[data-col]")) row.append(element("td", "col-" + heading.dataset.col));
    body.prepend(row);
  }
  return row;
}

function cell(row, name) {
  return row.querySelector("td.col-" + name) || element("td");
}

function setTurn(turnId, data) {
  const row = turnRow(turnId);
  if (!row) return;
  const status = data.status || "pending";
  cell(row, "turn").textContent = turnId;
  cell(row, "status").textContent = status;
  cell(row, "status").className = "col-status status status-" + status;
  if (data.models) cell(row, "models").textContent = data.models.join(", ");
  if (data.steps !== undefined) cell(row, "steps").textContent = data.steps;
  if (data.restarts !== undefined) cell(row, "restarts").textContent = data.restarts;
  if (data.usage) {
    cell(row, "input_tokens").textContent = data.usage.input_tokens;
    cell(row, "output_tokens").textContent = data.usage.output_tokens;
  }
  if (data.discarded) {
    cell(row, "discarded").replaceChildren(...(data.discarded.length ? data.discarded.map((d) =>
      element("div", "discarded", d.model + ": " + d.steps + " step(s) — " + d.reason)) : [document.createTextNode("—")]));
  }
  if (data.error !== undefined) cell(row, "error").textContent = data.error || "";
}

function summary(name, data) {
  switch (name) {
    case "turn.started": return "turn started on " + data.model;
    case "step.started": return "step " + data.step + " started (" + data.model + ")";
    case "step.done": return "step " + data.step + " done (" + data.model + ")" +
      (data.tool_calls && data.tool_calls.length ? ": calls " + data.tool_calls.join(", ") : "");
    case "tool.call": return "tool call " + data.name + " " + JSON.stringify(data.arguments || {});
    case "tool.result": return "tool result " + data.name + (data.is_error ? " (error)" : "") + ": " + (data.content || "");
    case "transfer": return "transfer " + data.from + " → " + data.to + " (" + data.mode + ")";
    case "swap.parked": return "swap parked: " + data.model_from + " → " + data.model_to;
    case "swap.applied": return "swap applied (generation " + data.generation + "): " + data.model_from + " → " + data.model_to;
    case "turn.restarted": return "turn restarted: " + data.model_from + " → " + data.model_to;
    case "intel.waiting": return "every endpoint of " + data.model + " is down: waiting";
    case "intel.recovered": return data.model + " answers again";
    case "turn.done": return "turn done: " + data.status;
    case "session.failed": return "session failed: " + data.error;
    default: return name;
  }
}

// What each session event (RFC 0000 §7) changes on the page besides the live log. A new event
// kind gets its entry here; one without an entry is only logged.
const HANDLERS = {
  "turn.started": (live, data) => {
    live.status.textContent = "Turn " + data.turn + " is running on " + data.model + ".";
    live.stream.textContent = "";
    live.stream.hidden = true;
    setTurn(data.turn, { status: "pending" });
    const cancel = document.getElementById("cancel-form");
    if (cancel) cancel.hidden = false;
    const state = document.getElementById("state");
    if (state) { state.textContent = "running"; state.className = "state-running"; }
  },
  // Token deltas of the reply being written: appended as they come, replaced by the entries at turn.done.
  "delta": (live, data) => {
    live.stream.hidden = false;
    live.stream.textContent += data.text || data.content || "";
  },
  "step.done": (live, data) => {
    setTurn(data.turn, { status: "pending", steps: data.step });
  },
  "turn.done": (live, data) => {
    live.status.textContent = "Turn " + data.turn + " ended " + data.status + ".";
    live.stream.hidden = true;
    setTurn(data.turn, data);
    const transcript = document.getElementById("transcript");
    const messages = data.messages || [];
    if (transcript && transcript.dataset.lastPage === "true") {
      for (const e of messages) {
        if (!document.getElementById("e" + e.seq)) transcript.append(entryElement(e));
      }
    } else if (messages.length) {
      document.getElementById("newer").hidden = false;
    }
    const cancel = document.getElementById("cancel-form");
    if (cancel) cancel.hidden = true;
    const state = document.getElementById("state");
    if (state) { state.textContent = "idle"; state.className = "state-idle"; }
  },
  "session.failed": (live) => {
    const state = document.getElementById("state");
    if (state) { state.textContent = "failed"; state.className = "state-failed"; }
  },
};

function watchSession(section) {
  const live = {
    status: document.getElementById("run-status"),
    stream: document.getElementById("streaming"),
    log: document.getElementById("live-log"),
    connection: document.getElementById("stream-status"),
  };
  const source = new EventSource(section.dataset.events);
  source.onopen = () => { live.connection.textContent = "(live)"; };
  source.onerror = () => { live.connection.textContent = "(reconnecting…)"; };
  const names = new Set([...Object.keys(HANDLERS), "step.started", "tool.call", "tool.result", "transfer",
    "swap.parked", "swap.applied", "turn.restarted", "intel.waiting", "intel.recovered"]);
  for (const name of names) {
    source.addEventListener(name, (event) => {
      const data = JSON.parse(event.data);
      if (name !== "delta") {
        const item = element("li", "event event-" + name.replace(".", "-"), summary(name, data));
        live.log.append(item);
      }
      if (HANDLERS[name]) HANDLERS[name](live, data);
    });
  }
  window.addEventListener("pagehide", () => source.close());
}

document.addEventListener("DOMContentLoaded", () => {
  localizeTimes(document);
  for (const el of document.querySelectorAll(".js-only")) el.hidden = false;
  const section = document.getElementById("live");
  if (section && window.EventSource) watchSession(section);
});
