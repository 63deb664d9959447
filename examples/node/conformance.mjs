#!/usr/bin/env node
// Runs the producer vectors (tests/vectors/producer.json; its "about" says how to read
// them) against a Redis through ioredis and the shipped scripts, one JSON line per case.
//
//   ATD_REDIS_URL=redis://127.0.0.1:6390/0 node conformance.mjs <producer.json> --flush
//
// Every case starts from an empty database (FLUSHDB): run it on a private server only,
// hence --flush. It loads the scripts it calls (SCRIPT LOAD), as an operator would.
// Exit 0 when every case holds, 1 when one does not, 2 on a usage error.
import { readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { connect, decodeRequest } from './asynctaskd.mjs';

const HERE = dirname(fileURLToPath(import.meta.url));
const [path, flag] = process.argv.slice(2);
if (!path || flag !== '--flush') {
  process.stderr.write('usage: conformance.mjs <producer.json> --flush (it empties the database)\n');
  process.exit(2);
}
const vectors = JSON.parse(readFileSync(path, 'utf8'));
const scriptsDir = process.env.ATD_SCRIPTS ?? join(HERE, '..', '..', 'protocol', 'scripts');
const manifest = JSON.parse(readFileSync(join(scriptsDir, 'manifest.json'), 'utf8')).scripts;
const TIME = /^@(\w+)(?:\+(\d+))?$/;

class Mismatch extends Error {}

/** `got` as `expected` says; `@name` binds a server time within `window` (the vectors' rule). */
function match(expected, got, times, window, where) {
  const fail = () => {
    throw new Mismatch(`${where}: expected ${JSON.stringify(expected)}, got ${JSON.stringify(got)}`);
  };
  if (Array.isArray(expected)) {
    if (!Array.isArray(got) || got.length !== expected.length) fail();
    expected.forEach((e, i) => match(e, got[i], times, window, `${where}[${i}]`));
  } else if (expected !== null && typeof expected === 'object') {
    if (got === null || typeof got !== 'object') fail();
    const keys = (o) => Object.keys(o).sort().join('\n');
    if (keys(expected) !== keys(got)) fail();
    for (const k of Object.keys(expected)) match(expected[k], got[k], times, window, `${where}.${k}`);
  } else if (typeof expected === 'string' && TIME.test(expected)) {
    const [, name, plus] = expected.match(TIME);
    if (!/^\d+$/.test(String(got))) fail();
    const value = Number(got) - Number(plus ?? 0);
    if (!(name in times)) {
      if (value < window[0] || value > window[1]) fail();
      times[name] = value;
    }
    if (value !== times[name]) fail();
  } else if (got !== expected) {
    fail();
  }
}

async function serverMs(redis) {
  const [s, us] = await redis.time();
  return Number(s) * 1000 + Math.floor(Number(us) / 1000);
}

async function state(redis) {
  const out = {};
  for (const key of (await redis.keys('*')).sort()) {
    const type = await redis.type(key);
    if (type === 'list') out[key] = { type, value: await redis.lrange(key, 0, -1) };
    else if (type === 'hash') out[key] = { type, value: await redis.hgetall(key) };
    else if (/\}:new:[^:]+$/.test(key)) out[key] = { type, msgpack_pairs: decodeRequest(await redis.getBuffer(key)) };
    else out[key] = { type, value: await redis.get(key) };
  }
  return out;
}

async function runCase(redis, c) {
  await redis.flushdb();
  for (const name of new Set(c.steps.map((s) => s.script))) {
    const sha = await redis.script('LOAD', readFileSync(join(scriptsDir, `${name}.lua`), 'utf8'));
    if (sha !== manifest[name].sha1) throw new Mismatch(`${name}.lua loads as ${sha}, not the manifest's sha1`);
  }
  for (const command of c.given ?? []) await redis.call(...command);
  const times = {};
  for (const [i, step] of c.steps.entries()) {
    const before = await serverMs(redis);
    let reply = null;
    let error = null;
    try {
      reply = await redis.evalsha(manifest[step.script].sha1, step.keys.length, ...step.keys, ...step.argv);
    } catch (err) {
      error = String(err.message);
    }
    const window = [before, await serverMs(redis)];
    if ('error' in step) {
      if (error === null || !error.includes(step.error)) throw new Mismatch(`step ${i}: expected an error with ${step.error}, got ${error ?? JSON.stringify(reply)}`);
    } else {
      if (error !== null) throw new Mismatch(`step ${i}: ${error}`);
      match(step.reply, reply, times, window, `step ${i} reply`);
    }
    if ('state' in step) match(step.state, await state(redis), times, window, `step ${i} state`);
  }
}

const redis = connect(process.env.ATD_REDIS_URL ?? 'redis://127.0.0.1:6379/0');
let failed = 0;
try {
  for (const c of vectors.cases) {
    try {
      await runCase(redis, c);
      process.stdout.write(JSON.stringify({ name: c.name, ok: true }) + '\n');
    } catch (err) {
      if (!(err instanceof Mismatch)) throw err;
      failed++;
      process.stdout.write(JSON.stringify({ name: c.name, ok: false, why: err.message }) + '\n');
    }
  }
} finally {
  redis.disconnect();
}
process.exitCode = failed ? 1 : 0;
