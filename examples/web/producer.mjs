// A producer in Node (>= 18, no npm packages): submit a task to `asynctaskd web`, then
// follow its Server-Sent Events until it settles, printing each state.
//
//   ATD_URL=http://127.0.0.1:8080 ATD_TOKEN=atd_... node producer.mjs HANDLER '{"n": 1}'
//
// Options: --no-strict (submit even if no daemon serves HANDLER yet), --key KEY (an
// Idempotency-Key: running it again returns the same task instead of a second one).
// Exit status: 0 if the task SUCCEEDED, 1 if it settled otherwise, 2 on a usage or API
// error. A dropped stream is resumed with Last-Event-ID, so no state is missed.

const SETTLED = new Set(["SUCCEEDED", "FAILED", "CANCELED", "TRACKING_TIMED_OUT", "SUBMIT_UNKNOWN"]);

function usage(message) {
  console.error(`producer.mjs: ${message}`);
  console.error("usage: ATD_URL=... ATD_TOKEN=... node producer.mjs HANDLER [PARAMS_JSON] [--no-strict] [--key KEY]");
  process.exit(2);
}

function parseArgs(argv) {
  const args = { strict: true, key: null, rest: [] };
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === "--no-strict") args.strict = false;
    else if (argv[i] === "--key") args.key = argv[++i] ?? usage("--key needs a value");
    else args.rest.push(argv[i]);
  }
  if (args.rest.length < 1 || args.rest.length > 2) usage("give a handler and, optionally, params as JSON");
  try {
    args.params = JSON.parse(args.rest[1] ?? "{}");
  } catch (err) {
    usage(`params are not JSON: ${err.message}`);
  }
  return args;
}

const base = (process.env.ATD_URL ?? "http://127.0.0.1:8080").replace(/\/+$/, "") + "/api/v1";
const token = process.env.ATD_TOKEN ?? usage("set ATD_TOKEN to a producer token");
const auth = { Authorization: `Bearer ${token}` };

async function apiError(response) {
  const body = await response.json().catch(() => null);
  const detail = body?.error ? `${body.error.code}: ${body.error.message}` : response.statusText;
  const retry = response.headers.get("Retry-After");
  return new Error(`HTTP ${response.status} ${detail}${retry ? ` (retry after ${retry} s)` : ""}`);
}

async function submit(handler, params, strict, key) {
  const headers = { ...auth, "Content-Type": "application/json" };
  if (key) headers["Idempotency-Key"] = key;
  const response = await fetch(`${base}/tasks`, {
    method: "POST",
    headers,
    body: JSON.stringify({ handler, params, tracking_timeout: 3600, strict }),
  });
  if (response.status !== 201 && response.status !== 200) throw await apiError(response);
  return response.json();
}

// Yields each SSE event of the task as {id, event, data}; ends when the server ends the
// stream. `lastId` resumes after that version.
async function* events(taskId, lastId) {
  const headers = { ...auth, Accept: "text/event-stream" };
  if (lastId) headers["Last-Event-ID"] = String(lastId);
  const response = await fetch(`${base}/tasks/${taskId}/events`, { headers });
  if (response.status === 204) return; // settled, and we saw its last state
  if (response.status !== 200) throw await apiError(response);
  let buffer = "";
  for await (const chunk of response.body.pipeThrough(new TextDecoderStream())) {
    buffer += chunk;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const event = {};
      for (const line of frame.split("\n")) {
        if (line.startsWith(":")) continue; // a keep-alive comment
        const colon = line.indexOf(":");
        const name = colon < 0 ? line : line.slice(0, colon);
        const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        event[name] = event[name] === undefined ? value : `${event[name]}\n${value}`;
      }
      if (event.data !== undefined) yield { ...event, data: JSON.parse(event.data) };
    }
  }
}

function show(data) {
  const parts = [data.status, `v${data.version}`];
  if (data.progress != null) parts.push(`${Math.round(data.progress * 100)}%`);
  if (data.stage) parts.push(data.stage);
  if (data.message) parts.push(`- ${data.message}`);
  console.log(parts.join(" "));
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const task = await submit(args.rest[0], args.params, args.strict, args.key);
  console.log(`task ${task.id} (${task.handler}, tenant ${task.tenant})`);
  let lastId = 0;
  let last = null;
  for (let attempt = 0; attempt < 10; attempt++) {
    try {
      for await (const event of events(task.id, lastId)) {
        lastId = Number(event.id);
        last = event.data;
        show(last);
        if (SETTLED.has(last.status)) break;
      }
    } catch (err) {
      if (err.message.startsWith("HTTP ")) throw err; // the API refused: do not retry
      console.error(`stream dropped (${err.message}); resuming after version ${lastId}`);
      await new Promise((resolve) => setTimeout(resolve, 1000));
      continue;
    }
    if (last === null || SETTLED.has(last.status)) break;
    // The server ended the stream before the task settled (it is restarting): resume.
  }
  // An event carries the state, not the result: read the task for it.
  const response = await fetch(`${base}/tasks/${task.id}`, { headers: auth });
  if (response.status !== 200) throw await apiError(response);
  const final = await response.json();
  if (final.status === "SUCCEEDED") {
    console.log(`result: ${JSON.stringify(final.result)}`);
    return 0;
  }
  console.log(`error: ${JSON.stringify(final.error)}`);
  return 1;
}

main().then(
  (code) => process.exit(code),
  (err) => {
    console.error(`producer.mjs: ${err.message}`);
    process.exit(2);
  },
);
