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

// A usage's cost as the server shows it (pages.cost_text): never 0 for an unknown price.
function costText(usage) {
  if (usage.cost) return usage.cost.amount + " " + usage.cost.currency;
  return usage.requests ? "unpriced" : "—";
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
    cell(row, "cost").textContent = costText(data.usage);
  }
  if (data.discarded) {
    cell(row, "discarded").replaceChildren(...(data.discarded.length ? data.discarded.map((d) =>
      element("div", "discarded", d.model + ": " + d.steps + " step(s)" + (d.usage ? ", " + d.usage.input_tokens + "+" +
        d.usage.output_tokens + " tokens, " + costText(d.usage) : "") + " — " + d.reason)) : [document.createTextNode("—")]));
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
  const facts = document.getElementById("session-facts");
  if (facts && update.facts) facts.outerHTML = update.facts;
  const usage = document.getElementById("usage");
  if (usage && update.usage_table) usage.outerHTML = update.usage_table;
  setState(update.state);
  if (update.state !== "running" && update.state !== "awaiting_approval" && live.running === turnId) {
    live.running = null;  // it ended before this page's stream opened
    live.status.textContent = "Idle.";
    const cancel = document.getElementById("cancel-form");
    if (cancel) cancel.hidden = true;
  }
}

// The streaming area holds one block per (turn, run, step): the text of that model call as its
// deltas arrive (RFC 0000 §7). A step.reset empties its step's block, a turn.restarted every block
// of the runs before; either is marked discarded, so what stays is what the model said last.
function streamBlock(live, data) {
  const key = data.turn + "/" + data.run + "/" + data.step;
  let block = live.stream.querySelector('[data-key="' + CSS.escape(key) + '"]');
  if (!block) {
    // A later run of the turn takes back what its earlier runs streamed (RFC 0005 §8), announced
    // by turn.restarted or not (a re-run after a crash).
    discardRuns(live, data.turn, Number(data.run), "a later run of the turn took it back");
    block = element("div", "stream-step");
    block.dataset.key = key;
    block.dataset.turn = data.turn;
    block.dataset.run = data.run;
    block.dataset.step = data.step;
    const thinking = element("pre", "thinking");
    thinking.hidden = true;
    block.append(element("span", "step-label muted", stepLabel(block)), thinking, element("pre", "content"));
    live.stream.append(block);
  }
  return block;
}

function stepLabel(block) {
  return "step " + block.dataset.step + (block.dataset.run !== "0" ? " (run " + block.dataset.run + ")" : "");
}

// Empty a block's text: "reset" (its step starts over and streams again into it) or "discarded"
// (its run was thrown away: nothing more comes into it).
function clearBlock(block, mark, why) {
  block.classList.add(mark);
  block.querySelector("pre.content").textContent = "";
  const thinking = block.querySelector("pre.thinking");
  thinking.textContent = "";
  thinking.hidden = true;
  block.querySelector(".step-label").textContent = stepLabel(block) + ": text so far discarded (" + why + ")";
}

function discardRuns(live, turn, run, why) {
  for (const block of live.stream.querySelectorAll(".stream-step")) {
    if (block.dataset.turn === turn && Number(block.dataset.run) < run && !block.classList.contains("discarded")) {
      clearBlock(block, "discarded", why);
    }
  }
}

// A session's pending approvals and their forms, as the server renders them. A form already on
// the page is kept as it is (what the operator typed in it stays); new ones join, decided ones go.
async function refreshApprovals(live) {
  const section = document.getElementById("approvals");
  if (!section) return;
  const asked = ++live.approvalsAsked;
  let update;
  try {
    const response = await fetch(section.dataset.approvals, { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (!response.ok) { live.connection.textContent = "(reload the page to see its approvals)"; return; }
    update = await response.json();
  } catch (error) {
    live.connection.textContent = "(reload the page to see its approvals)";
    return;
  }
  if (asked !== live.approvalsAsked) return;  // a newer answer is on its way
  const list = document.getElementById("approvals-list");
  const fresh = document.createElement("template");
  fresh.innerHTML = update.approvals;
  const wanted = new Set();
  for (const article of fresh.content.querySelectorAll("article[data-approval]")) {
    wanted.add(article.dataset.approval);
    if (!list.querySelector('article[data-approval="' + CSS.escape(article.dataset.approval) + '"]')) list.append(article);
  }
  for (const article of list.querySelectorAll("article[data-approval]")) {
    if (!wanted.has(article.dataset.approval)) article.remove();
  }
  localizeTimes(list);
  section.hidden = update.count === 0;
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
    case "turn.restarted": return "turn restarted as run " + data.run + ": " + data.model_from + " → " + data.model_to;
    case "step.reset": return "step " + data.step + " starts over: " + data.reason;
    case "approval.requested": return "tool call " + data.tool + " waits for approval " + data.approval;
    case "approval.decided": return "approval " + data.approval + " " + data.status + (data.reason ? ": " + data.reason : "");
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
    live.running = data.turn;
    live.stream.replaceChildren();
    live.stream.hidden = true;
    setTurn(data.turn, { status: "pending" });
    const cancel = document.getElementById("cancel-form");
    if (cancel) cancel.hidden = false;
    setState("running");
  },
  // Token deltas of the reply being written: appended to their step's block as they come; the
  // entries replace them at turn.done.
  "delta": (live, data) => {
    const block = streamBlock(live, data);
    if (data.content) block.querySelector("pre.content").textContent += data.content;
    if (data.thinking) {
      const thinking = block.querySelector("pre.thinking");
      thinking.hidden = false;
      thinking.textContent += data.thinking;
    }
    live.stream.hidden = false;
  },
  "step.reset": (live, data) => {
    clearBlock(streamBlock(live, data), "reset", data.reason || "the model call starts over");
  },
  "turn.restarted": (live, data) => {
    discardRuns(live, data.turn, Number(data.run), "the turn restarted");
    setTurn(data.turn, { status: "pending", restarts: data.restarts });
  },
  "approval.requested": (live, data) => {
    setState("awaiting_approval");
    live.status.textContent = "Turn " + data.turn + " waits for approval of " + data.tool + ".";
    refreshApprovals(live);
  },
  "approval.decided": (live, data) => {
    refreshApprovals(live);
  },
  "step.done": (live, data) => {
    setTurn(data.turn, { status: "pending", steps: data.step });
  },
  "turn.done": (live, data) => {
    live.running = null;
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
    approvalsAsked: 0,
    running: section.dataset.running || null,
  };
  const source = new EventSource(section.dataset.events);
  // Nothing is replayed (RFC 0000 §7): what happened between the page's rendering (or a lost
  // connection) and this subscription is read once the stream is open; later events come by it.
  source.onopen = () => {
    live.connection.textContent = "(live)";
    if (live.running) refresh(live, live.running);
    refreshApprovals(live);
  };
  source.onerror = () => { live.connection.textContent = "(reconnecting…)"; };
  const names = new Set([...Object.keys(HANDLERS), "step.started", "tool.call", "tool.result", "transfer",
    "swap.parked", "swap.applied", "intel.waiting", "intel.recovered"]);
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
