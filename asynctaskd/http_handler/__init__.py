"""Declarative HTTP handlers: integrate a "POST creates a job, GET reads it" vendor from TOML.

A `[[handlers]]` entry with `type = "http"` is built by `build()` (or the `builders()`
mapping handed to `handlers.load_handlers`) into an `HttpHandler`::

    [[handlers]]
    key = "ocr:acme"
    type = "http"
    [handlers.options]
    base_url = "https://api.acme.example"
    idempotent = true                         # sends Idempotency-Key: {idempotency_key}
    headers = { Authorization = "Bearer {env:ACME_TOKEN}" }
    timeouts = { connect = "5s", read = "30s", total = "60s" }
    [handlers.options.submit]
    url = "{base_url}/v1/jobs"
    body = { input = "{params.url}", pages = "{params.pages}" }
    id = "/id"                                # JSON pointer (RFC 6901) to the external id
    handle = { region = "/region" }           # more fields the queries need
    [handlers.options.query]
    url = "{base_url}/v1/jobs/{external_id}?region={handle.region}"
    status = "/status"
    running = ["queued", "processing"]
    succeeded = ["done"]
    failed = ["error"]
    result = "/output"

Template language (no eval, checked when the config is loaded). Placeholders:
`{params}` and `{params.a.0.b}` (submit only), `{steps.name.x}` (what an earlier
`submit.before` step kept), `{external_id}` and `{handle.x}` (query, cancel), `{base_url}`,
`{task_id}`, `{idempotency_key}`, `{submit_attempt}` (submit and find: which submit of
the task, so that a find tells a resubmitted task's jobs apart), and the credential sources
`{env:NAME}`, `{file:/abs/path}`, `{credential:NAME}` (`$CREDENTIALS_DIRECTORY/NAME`,
systemd's LoadCredential=). `{x?}` is optional: missing, it renders as "" in text and drops
the key from a JSON object. `{{` and `}}` are literal braces. A string that is exactly one
placeholder keeps the JSON type of its value (numbers stay numbers, objects stay objects);
inside text, values are rendered as text and, in URLs, percent-encoded (`{base_url}` is
inserted as is). Values from task params are data: they are never expanded again. A value
that would land in a URL as a dot segment (`.` or `..`, alone or between slashes) or with a
control character, or in a header with a control or non-ASCII character, is refused: the
task fails (`UNSAFE_VALUE`, `INVALID_HEADER`) and nothing is sent.

Credentials may appear only in headers and in `base_url`; they are read on first use and
then kept, never stored in Redis, and replaced by `***` in every error message and log line
this package produces (httpx's request lines included) and in every value read from a
vendor's answer (a vendor may quote the request). They are sent only to `base_url`'s origin;
finalize sends them only with a URL its `download` template made there, never with a URL a
vendor's answer chose.

Finalize downloads URLs the vendor chose, so only from hosts the handler declares
(`finalize.hosts`, and the host the `download` template names) and never from a private,
loopback or link-local address unless `finalize.allow_private_addresses` (see
`asynctaskd.downloads`, which also says how DNS is handled).

How HTTP outcomes map to the worker's classification (`retry.classify_submit_error`):
connect errors (a proxy that cannot be reached or refuses the tunnel included), DNS, pool
timeouts and unreadable credentials raise `NotSent` (provably never sent); a request the
templates made unsendable (a missing param, an unsafe value, a bad URL or header) raises
`PermanentError` before anything is sent; read timeouts, resets, protocol errors, an
answer over the handler's `max_response_bytes` (`RESPONSE_TOO_LARGE`) and the total
timeout raise a plain `RetryableError` (ambiguous in submit);
429, and 503 with Retry-After, raise `RetryableError(throttled=True, retry_after=...)`;
other 5xx a plain `RetryableError`; 4xx (except 408 and 429, or the `errors.permanent` list)
`PermanentError`. A 2xx answer that is not JSON, lacks the id or status, or has them of the
wrong type is vendor garbage: a `RetryableError` quoting the first 200 characters of the
body (ambiguous in submit: the job may exist; an error-budget error in query).

A submit may send requests before the create (`submit.before`: an upload whose id the
create names, in JSON or multipart). They are not the vendor job, so a lost answer to one
raises `NotSent` (the submit runs again whole) instead of parking the task; see `steps`.
A failure code listed in `query.resubmit` (a job that ended having done nothing, such as
OpenAI's `token_limit_exceeded`) makes query return `Resubmit`: the task is submitted
again after `query.resubmit_after`.

The package holds: `options`, the Structs of `[handlers.options]` and msgspec's errors
explained; `templates`, JSON pointers and placeholders (parsed, checked, rendered);
`credentials`, credential reading and redaction; `plan`, the options compiled;
`classify`, answers to errors (status codes, throttle and reset headers, permanent
codes); `steps`, the requests before the create; `find`, the listing lookup of parked
tasks; `finalize`, result files copied; `handler`, `HttpHandler` itself; `builder`,
`build` and `builders` (config to handler).
"""

from __future__ import annotations

from .builder import build, builders
from .classify import parse_reset, parse_retry_after, throttle_wait
from .handler import HttpHandler
from .options import (
    CancelOptions,
    ErrorOptions,
    FilePart,
    FinalizeOptions,
    FindOptions,
    HttpOptions,
    Method,
    QueryOptions,
    StepOptions,
    SubmitOptions,
    Timeouts,
)

__all__ = [
    "CancelOptions",
    "ErrorOptions",
    "FilePart",
    "FinalizeOptions",
    "FindOptions",
    "HttpHandler",
    "HttpOptions",
    "Method",
    "QueryOptions",
    "StepOptions",
    "SubmitOptions",
    "Timeouts",
    "build",
    "builders",
    "parse_reset",
    "parse_retry_after",
    "throttle_wait",
]
