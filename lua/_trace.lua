-- _trace: the W3C trace context a producer stores on a task (an include).
--
-- `trace` is the caller's traceparent, then, after one space, its tracestate if it has
-- one (asynctaskd/tracing.py writes it). The daemon reads it only to parent its vendor
-- call spans, through OpenTelemetry's own parser, which ignores a malformed value; this
-- check keeps what a producer can store small and printable: the traceparent's shape
-- (version 00 is 55 characters), printable ASCII, at most 600 bytes (W3C lets tracestate
-- be cut to 512 characters).
local TRACE_HEAD = '^%x%x%-' .. string.rep('%x', 32) .. '%-' .. string.rep('%x', 16) .. '%-%x%x'
local function trace_ok(v)
  return type(v) == 'string' and #v <= 600 and string.find(v, TRACE_HEAD) ~= nil
         and string.find(v, '[^\32-\126]') == nil
end
