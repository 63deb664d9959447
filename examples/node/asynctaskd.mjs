// A producer for asynctaskd in Node.js: create, deduplicate, read, cancel and follow tasks
// straight on Redis, through the shipped scripts (protocol/scripts/). Written from
// docs/protocol.md alone; section numbers below are that document's.
import { randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import Redis from 'ioredis';

export const PROTOCOL_VERSION = 1;
const NAME = /^[A-Za-z0-9_.:-]{1,64}$/; // handler, provider, tenant, account (section 3)
const NAMESPACE = /^[A-Za-z0-9_.-]{1,32}$/;
const MAX_PAYLOAD = 256 * 1024; // params, metadata: compact JSON, UTF-8 bytes (section 7)
const MAX_MS = 316224000000; // 10 years: delay and timeout ranges of `create`
const TERMINAL = new Set(['SUCCEEDED', 'FAILED', 'CANCELED', 'TRACKING_TIMED_OUT']);
// what a follower waits for: terminal, or parked for a lookup or an operator (section 5)
const SETTLED = new Set([...TERMINAL, 'SUBMIT_UNKNOWN']);

/** A call that cannot be made as asked: bad input, or a deployment this producer does not fit. */
export class ProducerError extends Error {}

// ---- section 3: ids and shards --------------------------------------------------------

const CROCKFORD = '0123456789ABCDEFGHJKMNPQRSTVWXYZ';
let last = { ms: 0n, rand: 0n };

/** A ULID (48 bits of this machine's clock in ms, 80 random bits), `-<shard>` on shard > 0.
 * Ids made in the same millisecond add 1 to the random part, so they still increase. */
export function newTaskId(shard) {
  let ms = BigInt(Date.now());
  let rand;
  if (ms <= last.ms) {
    ms = last.ms;
    rand = (last.rand + 1n) & ((1n << 80n) - 1n);
  } else {
    rand = BigInt('0x' + randomBytes(10).toString('hex')) >> 1n; // room to increment
  }
  last = { ms, rand };
  let value = (ms << 80n) | rand;
  let id = '';
  for (let i = 0; i < 26; i++) {
    id = CROCKFORD[Number(value & 31n)] + id;
    value >>= 5n;
  }
  return shard === 0 ? id : `${id}-${shard}`;
}

/** The shard in an id: none after a '-' means shard 0. */
export function shardOf(id) {
  const dash = id.lastIndexOf('-');
  return dash < 0 ? 0 : Number(id.slice(dash + 1));
}

const CRC_TABLE = Array.from({ length: 256 }, (_, n) => {
  let c = n;
  for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
  return c >>> 0;
});

/** CRC-32 (IEEE 802.3, reflected, as zlib) of a byte array. */
export function crc32(bytes) {
  let c = 0xffffffff;
  for (const b of bytes) c = CRC_TABLE[(c ^ b) & 0xff] ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}

/** The shard of a task with a dedup key: CRC-32 of utf8(tenant) NUL utf8(dedup key), mod S. */
export function dedupShard(tenant, dedupKey, shards) {
  return crc32(Buffer.from(`${tenant}\0${dedupKey}`, 'utf8')) % shards;
}

// ---- section 4: a create request is a cmsgpack array of strings -----------------------

/** Decodes what `create` stores in new:<id>: a msgpack array of strings, to an object. */
export function decodeRequest(buf) {
  let at = 0;
  const uint = (n) => {
    const v = buf.readUIntBE(at, n);
    at += n;
    return v;
  };
  const head = uint(1);
  let count;
  if ((head & 0xf0) === 0x90) count = head & 0x0f;
  else if (head === 0xdc) count = uint(2);
  else if (head === 0xdd) count = uint(4);
  else throw new ProducerError(`create request: not a msgpack array (0x${head.toString(16)})`);
  const items = [];
  for (let i = 0; i < count; i++) {
    const t = uint(1);
    let len;
    if ((t & 0xe0) === 0xa0) len = t & 0x1f;
    else if (t === 0xd9 || t === 0xc4) len = uint(1);
    else if (t === 0xda || t === 0xc5) len = uint(2);
    else if (t === 0xdb || t === 0xc6) len = uint(4);
    else throw new ProducerError(`create request: item ${i} is not a string (0x${t.toString(16)})`);
    items.push(buf.toString('utf8', at, at + len));
    at += len;
  }
  const out = {};
  for (let i = 0; i + 1 < items.length; i += 2) out[items[i]] = items[i + 1];
  return out;
}

// ---- checks of section 3 and section 7 `create`, before anything is written ------------

function checkName(what, value, optional) {
  if (optional && (value === undefined || value === null || value === '')) return '';
  if (typeof value !== 'string' || !NAME.test(value)) {
    throw new ProducerError(`${what} must be 1-64 of A-Z a-z 0-9 _ . : -, got ${JSON.stringify(value)}`);
  }
  return value;
}

function checkInt(what, value, lo, hi) {
  if (!Number.isSafeInteger(value) || value < lo || value > hi) {
    throw new ProducerError(`${what} must be an integer from ${lo} to ${hi}, got ${value}`);
  }
  return value;
}

// a UTF-16 surrogate without its other half: text UTF-8 cannot encode
const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;

function checkDedupKey(key) {
  if (key === undefined || key === null) return '';
  const points = typeof key === 'string' ? [...key].length : 0; // code points, not bytes
  if (points < 1 || points > 200 || LONE_SURROGATE.test(key)) {
    throw new ProducerError(`dedupKey must be 1-200 characters of text UTF-8 can encode, got ${JSON.stringify(key)}`);
  }
  return key;
}

function payload(what, value, optional) {
  if (optional && value === undefined) return '';
  let text;
  try {
    text = JSON.stringify(value, (_, v) => {
      if (typeof v === 'number' && !Number.isFinite(v)) throw new Error('NaN or Infinity');
      return v;
    });
  } catch (err) {
    throw new ProducerError(`${what} must be JSON data: ${err.message}`);
  }
  if (text === undefined) throw new ProducerError(`${what} must be JSON data`);
  if (Buffer.byteLength(text, 'utf8') > MAX_PAYLOAD) {
    throw new ProducerError(`${what} is over 256 KiB as compact JSON`);
  }
  return text;
}

// ---- the producer ---------------------------------------------------------------------

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

export class Producer {
  /**
   * @param {Redis} redis an ioredis client (standalone; for a cluster, one per slot's node)
   * @param {{namespace?: string, shards?: number, scriptsDir: string}} options
   */
  constructor(redis, { namespace = 'atd', shards = 1, scriptsDir }) {
    if (!NAMESPACE.test(namespace)) throw new ProducerError(`namespace ${namespace} must be 1-32 of A-Z a-z 0-9 _ . -`);
    checkInt('shards', shards, 1, 1024);
    const manifest = JSON.parse(readFileSync(join(scriptsDir, 'manifest.json'), 'utf8'));
    if (manifest.protocol !== PROTOCOL_VERSION) {
      throw new ProducerError(`${scriptsDir} holds protocol ${manifest.protocol} scripts, this producer speaks ${PROTOCOL_VERSION}`);
    }
    this.redis = redis;
    this.ns = namespace;
    this.shards = shards;
    this.sha = Object.fromEntries(Object.entries(manifest.scripts).map(([n, s]) => [n, s.sha1]));
    this.checked = false;
  }

  prefix(shard) {
    return `${this.ns}:{s${shard}}:`;
  }

  /** Section 3: refuse, before the first write, a namespace whose daemons run another shard
   * count or protocol. No record yet (no daemon ran) is not checked. */
  async checkDeployment() {
    if (this.checked) return;
    const raw = await this.redis.get(`${this.ns}:deployment`);
    if (raw !== null) {
      let record;
      try {
        record = JSON.parse(raw);
      } catch {
        throw new ProducerError(`${this.ns}:deployment is not a deployment record: ${raw.slice(0, 80)}`);
      }
      if (record.protocol !== PROTOCOL_VERSION) {
        throw new ProducerError(`namespace ${this.ns} speaks protocol ${record.protocol}, this producer speaks ${PROTOCOL_VERSION}`);
      }
      if (record.shards !== this.shards) {
        throw new ProducerError(`namespace ${this.ns} has ${record.shards} shard(s) (its daemons' [redis] shards), but this producer was configured with ${this.shards}`);
      }
    }
    this.checked = true;
  }

  /** EVALSHA; on NOSCRIPT wait (up to 10 s) for a daemon to load the script: a producer may
   * not load scripts (section 7, "Calling the scripts"). */
  async call(name, keys, args) {
    const sha = this.sha[name];
    for (let waited = 0; ; waited += 100) {
      try {
        return await this.redis.evalsha(sha, keys.length, ...keys, ...args);
      } catch (err) {
        if (!String(err.message).startsWith('NOSCRIPT') || waited >= 10000) throw err;
        await sleep(100);
      }
    }
  }

  /**
   * Section 7 `create`. Returns {id, created}: created false when a live task of the same
   * tenant and dedup key exists (its id is returned).
   */
  async submit(handler, params, opts = {}) {
    const tenant = checkName('tenant', opts.tenant, true);
    const args = [
      checkName('handler', handler, false),
      checkName('provider', opts.provider, true),
      tenant,
      checkName('account', opts.account, true),
      checkInt('priority', opts.priority ?? 0, -100, 100),
      checkInt('delayMs', opts.delayMs ?? 0, 0, MAX_MS),
      checkInt('notBeforeMs', opts.notBeforeMs ?? 0, 0, 2 ** 53 - 1),
      checkInt('trackingTimeoutMs', opts.trackingTimeoutMs, 1, MAX_MS),
      payload('params', params, false),
      payload('metadata', opts.metadata, true),
      checkDedupKey(opts.dedupKey),
    ];
    const dedupKey = args[10];
    await this.checkDeployment();
    const shard = dedupKey ? dedupShard(tenant, dedupKey, this.shards) : Math.floor(Math.random() * this.shards);
    const p = this.prefix(shard);
    const id = newTaskId(shard);
    const dedup = dedupKey ? `${p}dedup:${tenant.length}:${tenant}:${dedupKey}` : `${p}dedup:-`;
    if (tenant) await this.countQuota(tenant, dedupKey ? dedup : null);
    for (let tries = 0; ; tries++) {
      const reply = await this.call('create', [p, `${p}task:${id}`, dedup], [id, ...args]);
      if (reply[0] === 1) return { id, created: true };
      if (reply[0] === 2) return { id: reply[1], created: false };
      // -12: the key names a task that is gone; a daemon frees it, send again shortly
      if (reply[0] === -12 && tries < 50) {
        await sleep(100);
        continue;
      }
      throw new ProducerError(`create ${id}: reply ${JSON.stringify(reply)}`);
    }
  }

  /** Section 7 `quota`: count this submit against the tenant's quota, or refuse it (nothing
   * written). A duplicate of a live task is no new submit: it is not counted. */
  async countQuota(tenant, dedupKeyName) {
    const existing = dedupKeyName && (await this.redis.get(dedupKeyName));
    if (existing) {
      const task = await this.get(existing);
      if (task && !TERMINAL.has(task.status)) return; // live: create answers with it
    }
    const [counted, waitMs] = await this.call('quota', [`${this.ns}:{adm}:`], [tenant]);
    if (counted === 0) {
      throw new ProducerError(`tenant ${tenant} is over its submit quota: one more fits in ${waitMs} ms`);
    }
  }

  /** Section 4, "Reading a task": the request first, then the hash. Null when there is no
   * such task, or it is another tenant's (when `tenant` is given). */
  async get(id, { tenant } = {}) {
    const p = this.prefix(shardOf(id));
    const [[e1, request], [e2, hash]] = await this.redis
      .pipeline()
      .getBuffer(`${p}new:${id}`)
      .hgetall(`${p}task:${id}`)
      .exec();
    if (e1 || e2) throw e1 || e2;
    const fields = Object.keys(hash).length ? hash : request ? decodeRequest(request) : null;
    if (!fields) return null;
    if (tenant !== undefined && (fields.tenant ?? '') !== tenant) return null;
    return snapshot(fields);
  }

  /** Section 7 `cancel`: {outcome: 'requested', version} (a daemon carries it out),
   * {outcome: 'terminal', status} or {outcome: 'not_found'}. */
  async cancel(id, { tenant } = {}) {
    const p = this.prefix(shardOf(id));
    const check = tenant === undefined ? ['0', ''] : ['1', tenant];
    const reply = await this.call('cancel', [p, `${p}task:${id}`], [id, ...check]);
    if (reply[0] === 2) return { outcome: 'requested', version: reply[1] };
    if (reply[0] === -9) return { outcome: 'terminal', status: reply[1] };
    if (reply[0] === -1) return { outcome: 'not_found' };
    throw new ProducerError(`cancel ${id}: reply ${JSON.stringify(reply)}`);
  }

  /**
   * Section 8, many tasks at once: one stream position per shard, one XREAD over every
   * shard's stream. Yields {id, status, version} for each change (the snapshot first) and
   * returns when every task is settled (terminal, or SUBMIT_UNKNOWN).
   */
  async *follow(ids, { blockMs = 1000 } = {}) {
    const reader = this.redis.duplicate(); // XREAD BLOCK holds its connection
    try {
      const byShard = new Map();
      for (const id of ids) {
        const s = shardOf(id);
        if (!byShard.has(s)) byShard.set(s, []);
        byShard.get(s).push(id);
      }
      const known = new Map(); // id -> last version taken
      const position = new Map(); // shard -> last stream id read
      const snapshot = async (shard, wanted) => {
        const p = this.prefix(shard);
        // the stream position first, then the tasks (section 8 step 1: no MULTI needed)
        const tx = reader.pipeline().xrevrange(`${p}events`, '+', '-', 'COUNT', 1);
        for (const id of wanted) tx.getBuffer(`${p}new:${id}`).hgetall(`${p}task:${id}`);
        const replies = (await tx.exec()).map(([err, value]) => {
          if (err) throw err;
          return value;
        });
        position.set(shard, replies[0].length ? replies[0][0][0] : '0-0');
        const out = [];
        wanted.forEach((id, i) => {
          const request = replies[1 + 2 * i];
          const hash = replies[2 + 2 * i];
          const fields = Object.keys(hash).length ? hash : request ? decodeRequest(request) : null;
          if (!fields) throw new ProducerError(`follow: no task ${id}`);
          out.push({ id, status: fields.status, version: Number(fields.version) });
        });
        return out;
      };
      const take = function* (change) {
        if (!known.has(change.id) || change.version <= known.get(change.id)) return;
        known.set(change.id, change.version);
        yield change;
        if (SETTLED.has(change.status)) known.delete(change.id);
      };
      for (const [shard, wanted] of byShard) {
        for (const change of await snapshot(shard, wanted)) {
          known.set(change.id, change.version - 1);
          yield* take(change);
        }
      }
      while (known.size) {
        const shards = [...byShard.keys()].filter((s) => byShard.get(s).some((id) => known.has(id)));
        const streams = shards.map((s) => `${this.prefix(s)}events`);
        const tx = reader.pipeline().xread('COUNT', 1000, 'BLOCK', blockMs, 'STREAMS', ...streams, ...shards.map((s) => position.get(s)));
        for (const s of shards) {
          const at = position.get(s);
          tx.xrevrange(`${this.prefix(s)}events`, at, at);
        }
        const replies = await tx.exec();
        for (const [err] of replies) if (err) throw err;
        for (const [stream, entries] of replies[0][1] ?? []) {
          const shard = shards[streams.indexOf(stream)];
          for (const [entryId, flat] of entries) {
            position.set(shard, entryId);
            const event = {};
            for (let i = 0; i + 1 < flat.length; i += 2) event[flat[i]] = flat[i + 1];
            yield* take({ id: event.task, status: event.status, version: Number(event.version) });
          }
        }
        // section 8 step 3: the entry at the old position is gone (trimmed, or 0-0):
        // changes may be missing, so read the hashes again
        for (const [i, shard] of shards.entries()) {
          if (replies[1 + i][1].length) continue;
          const wanted = byShard.get(shard).filter((id) => known.has(id));
          for (const change of await snapshot(shard, wanted)) yield* take(change);
        }
      }
    } finally {
      reader.disconnect();
    }
  }
}

/** The fields a producer reads, as the hash (or the request) holds them (section 4). */
function snapshot(f) {
  const json = (v) => (v === undefined || v === '' ? null : JSON.parse(v));
  const int = (v) => (v === undefined || v === '' ? null : Number(v));
  return {
    id: f.id,
    handler: f.handler,
    status: f.status,
    version: int(f.version),
    tenant: f.tenant ?? '',
    account: f.account ?? '',
    priority: int(f.priority) ?? 0,
    params: json(f.params),
    metadata: json(f.metadata),
    result: json(f.result),
    externalId: f.external_id || null,
    error: f.error_code ? { code: f.error_code, message: f.error_message ?? '' } : null,
    progress: f.progress ? Number(f.progress) : null,
    createdMs: int(f.created_ms),
    deadlineMs: int(f.deadline_ms),
    finishedMs: int(f.finished_ms),
    cancelRequested: f.cancel_requested === '1',
  };
}

/** An ioredis client for a redis:// URL, with the protocol's RESP2 replies. */
export function connect(url) {
  return new Redis(url, { lazyConnect: false, maxRetriesPerRequest: 2 });
}
