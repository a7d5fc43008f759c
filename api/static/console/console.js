// The operator console: an admin's session token, the overview (GET /v1/admin/overview) and
// the event stream (/v1/events). No framework, no build step, nothing from another origin
// (the page's Content-Security-Policy allows this origin only). docs/operations.md, "Console".
"use strict";

const REFRESH_MS = 5000; // the overview is read again this often, and after a peer or anchor event
const TAIL = 50; // events kept in the tail
const RATE_WINDOW_MS = 10000; // the write rate is over this window

const state = {
  token: sessionStorage.getItem("registryToken"),
  socket: null,
  timer: null,
  pending: null,
  head: 0,
  writes: [], // arrival times of recent entry events
};

const $ = (id) => document.getElementById(id);

function setText(id, value) {
  $(id).textContent = value === undefined || value === null || value === "" ? "-" : String(value);
}

function setError(message) {
  $("error").hidden = !message;
  $("error").textContent = message || "";
}

function setLive(on, text) {
  const live = $("live");
  live.className = "badge " + (on ? "on" : "off");
  live.textContent = text;
}

async function api(path) {
  const response = await fetch(path, { headers: { Authorization: "Bearer " + state.token } });
  const body = await response.json().catch(() => ({}));
  if (!response.ok) {
    const error = body.error || {};
    const failure = new Error(`${response.status} ${error.code || ""}: ${error.message || ""}`);
    failure.status = response.status;
    throw failure;
  }
  return body;
}

function cell(row, value, className) {
  const td = document.createElement("td");
  td.textContent = value === undefined || value === null ? "-" : String(value);
  if (className) td.className = className;
  row.append(td);
  return td;
}

function renderHealth(health, overview) {
  const status = $("status");
  status.textContent = `${health.status} (deep: ${overview.status})`;
  status.className = "state-" + overview.status;
  setText(
    "checks",
    Object.entries(overview.checks)
      .map(([name, value]) => `${name} ${value}`)
      .join(", "),
  );
  setText("registry", overview.registryDid);
  setHead(overview.logHead);
}

function renderPeers(peers) {
  const body = $("peers").tBodies[0];
  body.replaceChildren();
  $("no-peers").hidden = peers.length > 0;
  const quarantined = $("quarantined");
  quarantined.replaceChildren();
  for (const peer of peers) {
    const row = document.createElement("tr");
    row.dataset.peer = peer.peerDid;
    cell(row, peer.peerDid, "peer");
    cell(row, peer.breakerState, "breaker state-" + peer.breakerState);
    cell(row, peer.consecutiveFailures);
    cell(row, peer.cursor);
    cell(row, peer.lag);
    cell(row, peer.latencyMs === undefined ? undefined : peer.latencyMs + " ms");
    cell(row, peer.lastSuccessAt);
    cell(row, peer.nextAttemptAt);
    cell(row, peer.quarantines);
    body.append(row);
    for (const entry of peer.quarantined || []) {
      const item = document.createElement("li");
      item.textContent =
        `${peer.peerDid} #${entry.sequence} ${entry.entryDid || "-"}: ${entry.code} (${entry.reason})`;
      quarantined.append(item);
    }
  }
}

function renderAnchoring(anchoring) {
  if (!anchoring.enabled) {
    setText("anchor-pending", "anchoring is off");
    setText("anchor-oldest", null);
    setText("anchor-in-flight", null);
  } else {
    setText("anchor-pending", `${anchoring.pending} intent(s) pending`);
    setText("anchor-oldest", anchoring.oldestPendingAt);
    setText("anchor-in-flight", anchoring.batchesInFlight);
  }
  const list = $("anchor-batches");
  list.replaceChildren();
  for (const batch of anchoring.recentBatches) {
    const item = document.createElement("li");
    const where = batch.transactionId ? ` tx ${batch.transactionId}` : "";
    const height = batch.blockHeight === undefined ? "" : ` at height ${batch.blockHeight}`;
    item.textContent = `batch ${batch.batchId}: ${batch.state}, ${batch.intents} intent(s)${where}${height}`;
    list.append(item);
  }
}

function setHead(head) {
  if (head > state.head) state.head = head;
  setText("log-head", state.head);
}

async function refresh() {
  clearTimeout(state.timer);
  try {
    const [health, overview] = await Promise.all([
      fetch("/v1/health").then((response) => response.json()),
      api("/v1/admin/overview"),
    ]);
    renderHealth(health, overview);
    renderPeers(overview.peers);
    renderAnchoring(overview.anchoring);
    setError("");
  } catch (failure) {
    setError("Cannot read the overview: " + failure.message);
    if (failure.status === 401) {
      signOut();
      return;
    }
  }
  state.timer = setTimeout(refresh, REFRESH_MS);
}

function refreshSoon() {
  // Several events in a burst cause one read.
  if (state.pending === null) {
    state.pending = setTimeout(() => {
      state.pending = null;
      refresh();
    }, 250);
  }
}

function onEvent(event) {
  setHead(event.sequence);
  const now = Date.now();
  if (event.kind.startsWith("entry.")) state.writes.push(now);
  while (state.writes.length && state.writes[0] < now - RATE_WINDOW_MS) state.writes.shift();
  setText("write-rate", `${(state.writes.length / (RATE_WINDOW_MS / 1000)).toFixed(1)} entry versions/s`);
  const item = document.createElement("li");
  item.textContent = `#${event.sequence} ${event.at} ${event.kind} ${event.entryDid || ""}`;
  const tail = $("events");
  tail.prepend(item);
  while (tail.children.length > TAIL) tail.lastChild.remove();
  if (event.kind === "peer.status" || event.kind.startsWith("anchor.")) refreshSoon();
}

function connect() {
  const scheme = location.protocol === "https:" ? "wss://" : "ws://";
  const socket = new WebSocket(scheme + location.host + "/v1/events");
  state.socket = socket;
  socket.onopen = () => socket.send(JSON.stringify({ type: "auth", token: state.token }));
  socket.onmessage = (message) => {
    const data = JSON.parse(message.data);
    if (data.type === "authenticated") {
      socket.send(JSON.stringify({ type: "subscribe" }));
    } else if (data.type === "subscribed") {
      setLive(true, "live");
      setHead(data.fromSequence);
    } else if (data.type === "event") {
      onEvent(data);
    } else if (data.type === "error") {
      setError(`Event stream: ${data.error.code}: ${data.error.message}`);
    }
  };
  socket.onclose = (close) => {
    if (state.socket !== socket) return; // replaced, or signed out
    setLive(false, `reconnecting (closed ${close.code})`);
    setTimeout(() => {
      if (state.token && state.socket === socket) connect();
    }, 2000);
  };
}

function start() {
  $("signin").hidden = true;
  $("views").hidden = false;
  $("signout").hidden = false;
  setLive(false, "connecting");
  refresh();
  connect();
}

function signOut() {
  sessionStorage.removeItem("registryToken");
  state.token = null;
  const socket = state.socket;
  state.socket = null;
  if (socket) socket.close();
  clearTimeout(state.timer);
  $("views").hidden = true;
  $("signout").hidden = true;
  $("signin").hidden = false;
  setLive(false, "not connected");
  $("token").focus();
}

document.addEventListener("DOMContentLoaded", () => {
  $("signin-form").addEventListener("submit", (submitted) => {
    submitted.preventDefault();
    state.token = $("token").value.trim();
    $("token").value = "";
    if (!state.token) return;
    sessionStorage.setItem("registryToken", state.token);
    start();
  });
  $("signout").addEventListener("click", signOut);
  if (state.token) start();
});
