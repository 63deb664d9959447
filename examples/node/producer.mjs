#!/usr/bin/env node
// The Node producer from the command line; every answer is one JSON line on stdout.
//
//   node producer.mjs submit <handler> <params-json> [--tenant T] [--dedup-key K]
//        [--priority P] [--timeout-ms MS] [--delay-ms MS] [--metadata JSON] [--count N]
//   node producer.mjs get <id> [--tenant T]
//   node producer.mjs cancel <id> [--tenant T]
//   node producer.mjs follow <id>...
//
// Environment: ATD_REDIS_URL (default redis://127.0.0.1:6379/0), ATD_NAMESPACE (atd),
// ATD_SHARDS (1: the daemons' [redis] shards), ATD_SCRIPTS (the directory of the shipped
// scripts, default ../../protocol/scripts from this file). Exit 0 when done, 2 when the
// input or the deployment is refused (nothing written), 1 on anything else.
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { connect, Producer, ProducerError } from './asynctaskd.mjs';

const HERE = dirname(fileURLToPath(import.meta.url));
const USAGE = 'usage: producer.mjs submit|get|cancel|follow ... (see the head of this file)';

function parse(argv) {
  const positional = [];
  const options = {};
  for (let i = 0; i < argv.length; i++) {
    if (!argv[i].startsWith('--')) {
      positional.push(argv[i]);
      continue;
    }
    if (i + 1 >= argv.length) throw new ProducerError(`${argv[i]} needs a value`);
    options[argv[i].slice(2)] = argv[++i];
  }
  return { positional, options };
}

function integer(options, name) {
  if (options[name] === undefined) return undefined;
  const value = Number(options[name]);
  if (!Number.isSafeInteger(value)) throw new ProducerError(`--${name} must be an integer`);
  return value;
}

function json(text, what) {
  try {
    return JSON.parse(text);
  } catch (err) {
    throw new ProducerError(`${what} is not JSON: ${err.message}`);
  }
}

const out = (value) => process.stdout.write(JSON.stringify(value) + '\n');

async function run(producer, command, positional, options) {
  const tenant = options.tenant;
  if (command === 'submit') {
    const [handler, params] = positional;
    if (params === undefined) throw new ProducerError('submit needs a handler and params');
    const count = integer(options, 'count') ?? 1;
    for (let i = 0; i < count; i++) {
      out(await producer.submit(handler, json(params, 'params'), {
        tenant,
        dedupKey: options['dedup-key'],
        priority: integer(options, 'priority'),
        trackingTimeoutMs: integer(options, 'timeout-ms') ?? 1800000,
        delayMs: integer(options, 'delay-ms'),
        metadata: options.metadata === undefined ? undefined : json(options.metadata, '--metadata'),
      }));
    }
  } else if (command === 'get') {
    out(await producer.get(positional[0], { tenant }));
  } else if (command === 'cancel') {
    out({ id: positional[0], ...(await producer.cancel(positional[0], { tenant })) });
  } else if (command === 'follow') {
    if (!positional.length) throw new ProducerError('follow needs at least one task id');
    for await (const change of producer.follow(positional)) out(change);
  } else {
    throw new ProducerError(USAGE);
  }
}

const { positional, options } = (() => {
  try {
    return parse(process.argv.slice(3));
  } catch (err) {
    process.stderr.write(`${err.message}\n`);
    process.exit(2);
  }
})();
const redis = connect(process.env.ATD_REDIS_URL ?? 'redis://127.0.0.1:6379/0');
try {
  const producer = new Producer(redis, {
    namespace: process.env.ATD_NAMESPACE ?? 'atd',
    shards: Number(process.env.ATD_SHARDS ?? '1'),
    scriptsDir: process.env.ATD_SCRIPTS ?? join(HERE, '..', '..', 'protocol', 'scripts'),
  });
  await run(producer, process.argv[2], positional, options);
  process.exitCode = 0;
} catch (err) {
  process.stderr.write(`${err instanceof ProducerError ? '' : 'error: '}${err.message}\n`);
  process.exitCode = err instanceof ProducerError ? 2 : 1;
} finally {
  redis.disconnect();
}
