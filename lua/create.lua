-- create: store a new task as PENDING_SUBMIT and make it due (SPEC section 4, C create).
--
-- KEYS[1] prefix   string  <ns>:{s<N>}:  shard prefix; every key below shares its tag
-- KEYS[2] task     hash    <ns>:{s<N>}:task:<id>
-- KEYS[3] dedup    string  <ns>:{s<N>}:dedup:<len(tenant)>:<tenant>:<dedup_key>, or
--                          <ns>:{s<N>}:dedup:- when the task has no dedup key
-- ARGV[1] task_id          ULID, with -<N> appended on shard N > 0
-- ARGV[2] handler          handler key
-- ARGV[3] provider         admission provider ('' = the provider the admission table
--                          names for the handler, else the handler key)
-- ARGV[4] tenant           '' for none
-- ARGV[5] account          '' for none
-- ARGV[6] priority         integer -100..100, higher first
-- ARGV[7] delay_ms         integer >= 0, due this long after server now
-- ARGV[8] not_before_ms    epoch ms, 0 for none; due = max(now + delay_ms, not_before_ms)
-- ARGV[9] timeout_ms       tracking timeout, integer > 0; deadline = created + timeout
-- ARGV[10] params          JSON text
-- ARGV[11] metadata        JSON text, '' for none
-- ARGV[12] dedup_key       '' for none; must match KEYS[3]
--
-- Returns {1, version, created_ms, due_ms} created, or one of
--   {2, existing_id}  ACCEPTED (deduped): a live task with the same tenant and dedup key exists
--   {-5}              EXISTS: the task id is taken
-- Invariant: nothing is written unless the task is created whole; the status index,
-- counters, deadline index and due set all agree with the hash when the script ends.

local tk = KEYS[2]
local id = ARGV[1]
local handler = ARGV[2]
if id == '' or handler == '' then error('asynctaskd: task id and handler must not be empty') end
local priority = int_arg(ARGV[6], 'priority', -100, 100)
local delay_ms = int_arg(ARGV[7], 'delay_ms', 0)
local not_before_ms = int_arg(ARGV[8], 'not_before_ms', 0)
local timeout_ms = int_arg(ARGV[9], 'timeout_ms', 1)
local dedup_key = ARGV[12]

if dedup_key ~= '' then
  local existing = redis.call('GET', KEYS[3])
  if existing then
    local st = redis.call('HGET', task_key(existing), 'status')
    if st and not TERMINAL[st] then return {2, existing} end
  end
end
if redis.call('EXISTS', tk) == 1 then return {-5} end

local due_ms = NOW + delay_ms
if not_before_ms > due_ms then due_ms = not_before_ms end
local deadline_ms = NOW + timeout_ms

local deadline_s = int_s(deadline_ms)
local fields = {'id', id, 'handler', handler, 'status', 'PENDING_SUBMIT',
  'priority', int_s(priority), 'created_ms', NOW_S, 'updated_ms', NOW_S,
  'deadline_ms', deadline_s, 'timeout_ms', int_s(timeout_ms), 'due_ms', int_s(due_ms),
  'version', '1', 'params', ARGV[10]}
if ARGV[3] ~= '' then fields[#fields + 1] = 'provider'; fields[#fields + 1] = ARGV[3] end
if ARGV[4] ~= '' then fields[#fields + 1] = 'tenant'; fields[#fields + 1] = ARGV[4] end
if ARGV[5] ~= '' then fields[#fields + 1] = 'account'; fields[#fields + 1] = ARGV[5] end
if ARGV[11] ~= '' then fields[#fields + 1] = 'metadata'; fields[#fields + 1] = ARGV[11] end
if dedup_key ~= '' then
  local suffix = string.sub(KEYS[3], #P + 7)  -- strip '<prefix>dedup:'
  fields[#fields + 1] = 'dedup'; fields[#fields + 1] = suffix
  redis.call('SET', KEYS[3], id)
end
redis.call('HSET', tk, unpack(fields))
move_status(tk, id, nil, 'PENDING_SUBMIT', handler)
redis.call('ZADD', P .. 'deadlines', deadline_s, id)
schedule(id, 'submit', due_ms, priority)
wake()
emit(id, 'PENDING_SUBMIT', 1)
return {1, 1, NOW, due_ms}
