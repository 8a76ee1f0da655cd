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

function setState(state) {
  const el = document.getElementById("state");
  if (el) { el.textContent = state; el.className = "state-" + state; }
}

// A turn ended: its entries and its row, as the server renders them (templates/entry.html,
// turn_row.html), from /console/sessions/{id}/update. New entries join the transcript only on
// its last page; elsewhere a link to it appears.
async function refresh(live, turnId) {
  const transcript = document.getElementById("transcript");
  const lastPage = transcript && transcript.dataset.lastPage === "true";
  const shown = transcript ? transcript.querySelectorAll("li.entry") : [];
  const after = shown.length ? shown[shown.length - 1].dataset.seq : (lastPage ? "0" : "999999999");
  const url = live.update + "?after=" + encodeURIComponent(after) + "&turn=" + encodeURIComponent(turnId);
  let update;
  try {
    const response = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (!response.ok) { live.connection.textContent = "(reload the page to see the newest entries)"; return; }
    update = await response.json();
  } catch (error) {
    live.connection.textContent = "(reload the page to see the newest entries)";
    return;
  }
  if (lastPage && update.entries) {
    transcript.insertAdjacentHTML("beforeend", update.entries);
    localizeTimes(transcript);
  }
  if (!lastPage || update.more) document.getElementById("newer").hidden = false;
  const count = document.getElementById("entry-count");
  if (count) count.textContent = update.total;
  if (update.turn) {
    const row = turnRow(turnId);
    row.insertAdjacentHTML("afterend", update.turn);
    row.remove();
    localizeTimes(document.getElementById("turns"));
  }
  setState(update.state);
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
    setState("running");
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
    const cancel = document.getElementById("cancel-form");
    if (cancel) cancel.hidden = true;
    refresh(live, data.turn);
  },
  "session.failed": (live, data) => {
    setState("failed");
    if (data.turn) refresh(live, data.turn);
  },
};

function watchSession(section) {
  const live = {
    status: document.getElementById("run-status"),
    stream: document.getElementById("streaming"),
    log: document.getElementById("live-log"),
    connection: document.getElementById("stream-status"),
    update: section.dataset.update,
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
