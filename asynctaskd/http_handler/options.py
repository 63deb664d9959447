"""What a `type = "http"` handler's `[handlers.options]` may hold: the msgspec Structs, and
msgspec's validation errors turned into the key they are about (with a "did you mean")."""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, Final, Literal, get_args, get_origin

import msgspec

from asynctaskd.config import Duration

Method = Literal["GET", "POST", "PUT", "PATCH", "DELETE"]


class Timeouts(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per-request limits: connect (and pool wait), read (between bytes), total (whole call)."""

    connect: Duration = Duration(5)
    read: Duration = Duration(30)
    total: Duration = Duration(60)


class FilePart(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A file in a multipart body: its text (`content`, a template) or a list of JSON
    values written one per line (`jsonl`, exactly one placeholder such as
    "{params.requests}")."""

    filename: str
    content: str | None = None
    jsonl: str | None = None
    content_type: str = "application/octet-stream"


class StepOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[[handlers.options.submit.before]]`: a request sent before the create (an upload
    whose id the create names). Its answer's `keep` values are `{steps.<name>.<key>}` in
    the later steps and in the create."""

    name: str
    url: str
    method: Method = "POST"
    headers: dict[str, str] = {}
    body: Any = None  # JSON template, or
    multipart: dict[str, str | FilePart] | None = None  # field -> text template or a file
    keep: dict[str, str] = {}  # key -> JSON pointer into the answer


class SubmitOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[handlers.options.submit]`: the request that creates the vendor job, and the steps
    `before` it (not the job: see `steps`)."""

    url: str
    id: str  # JSON pointer to the external id in the answer
    method: Method = "POST"
    headers: dict[str, str] = {}
    body: Any = None  # JSON template; None: no body
    handle: dict[str, str] = {}  # name -> JSON pointer; kept for {handle.name}
    idempotency_header: str = "Idempotency-Key"  # sent when idempotent; "" not to
    before: list[StepOptions] = []


class QueryOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[handlers.options.query]`: the request that reads the job, and how to read the answer."""

    url: str
    status: str  # JSON pointer to the vendor status
    succeeded: list[str]
    running: list[str] = []
    failed: list[str] = []
    unknown: Literal["running", "error", "failed"] = "running"
    method: Method = "GET"
    headers: dict[str, str] = {}
    body: Any = None
    progress: str | None = None  # pointer to a number
    progress_total: str | None = None  # pointer: progress = value / total
    progress_scale: Annotated[float, msgspec.Meta(gt=0)] = 1.0  # 100 for percentages
    stage: str | None = None  # pointer; default: the vendor status
    message: str | None = None
    result: str | dict[str, str] = ""  # pointer, or name -> pointer; "" is the whole answer
    error_code: str | None = None  # pointers read when the status is a failed one
    error_message: str | None = None
    # Read `result` on a failed status too, and keep what it finds as the task's result
    # beside the error: a batch that expired or was cancelled keeps the part it completed
    # (and billed).
    failed_result: bool = False
    # Pointer to the vendor's mark that it deleted the job's data (Replicate's
    # /data_removed): a done job with it true fails (RESULT_REMOVED) instead of succeeding
    # with nothing, as a poll more than an hour late would on Replicate.
    gone: str | None = None
    # Failure codes (read at error_code, else the status) of a job that ended having done
    # nothing, where submitting it again is the fix (OpenAI's "token_limit_exceeded"): the
    # task is submitted again after `resubmit_after` (default: the error backoff), within
    # retry.max_submit_retries, instead of failing.
    resubmit: list[str] = []
    resubmit_after: Duration | None = None


class CancelOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[handlers.options.cancel]`: best-effort remote cancel."""

    url: str
    method: Method = "POST"
    headers: dict[str, str] = {}
    body: Any = None


class FindOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[handlers.options.find]`: list the vendor's jobs and pick the one this task's submit
    created, so that a task parked in SUBMIT_UNKNOWN is settled by asking (docs/protocol.md
    section 7, `reconcile`)."""

    url: str  # the listing; templates as in submit ({task_id}, {params.x}, {base_url}, ...)
    items: str  # JSON pointer to the list of jobs in the answer ("" if it is the list)
    match: str  # JSON pointer inside each job to the value that names our task
    equals: str  # template that value must equal, e.g. "{task_id}"
    id: str  # JSON pointer inside the job to its id (the external id)
    # How long after a submit started the vendor lists the job it created: the listing's
    # lag. The handler's timeouts.total (the longest a submit call can take) is added to it.
    visible_after: Duration
    method: Method = "GET"
    headers: dict[str, str] = {}
    body: Any = None
    handle: dict[str, str] = {}  # name -> JSON pointer inside the job, as submit.handle
    # A listing in pages: `more` points at the answer's "there is more" flag, `cursor` at
    # what the next page starts after, `next_url` is the next page's URL ({value}: the
    # cursor). A job not on the pages read while `more` is true is an error (never a
    # "none": it may be further back), and so is a page past `max_pages`.
    more: str | None = None
    cursor: str | None = None
    next_url: str | None = None
    # Or `next` points at the next page's whole URL in the answer (Replicate's /next), null
    # or absent on the last page. It must be on base_url's origin (the request carries the
    # handler's headers, credentials included): another is refused, never requested.
    next: str | None = None
    max_pages: Annotated[int, msgspec.Meta(ge=1, le=100)] = 10
    max_tries: Annotated[int, msgspec.Meta(ge=1, le=10000)] = 20
    give_up_after: Duration = Duration(86400)


class ErrorOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[handlers.options.errors]`: which HTTP statuses fail a task for good."""

    permanent: list[Annotated[int, msgspec.Meta(ge=300, le=599)]] | None = None
    retryable: list[Annotated[int, msgspec.Meta(ge=300, le=599)]] = []
    # Response headers that say how long a throttle lasts, as a duration ("6m0s", "1.5s",
    # "20ms") or seconds: on a 429 the longest of them, Retry-After and retry-after-ms wins.
    reset_headers: list[str] = []
    # A 429 whose JSON body holds one of these codes at `code_pointer` is no rate limit
    # but a refusal that waiting does not lift (OpenAI's "insufficient_quota"): it fails
    # the task for good, with that code.
    permanent_codes: list[str] = []
    code_pointer: str = "/error/code"


class FinalizeOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[handlers.options.finalize]`: copy result files to a durable place before SUCCEEDED."""

    files: list[str]  # pointers into the result: a URL (or id), or a list of them
    dir: str | None = None  # write <dir>/<task_id>-<n>.<ext>
    put: str | None = None  # or HTTP PUT to this template ({name}, {task_id})
    download: str | None = None  # template with {value}: turns an id into a download URL
    # Hosts result URLs may be downloaded from ("files.example.com", "*.example.com"), besides
    # the one the download template names; none by default.
    hosts: list[str] = []
    # Also download from private, loopback and link-local addresses (an internal vendor, or
    # a local fake in tests); off by default, whatever a host name resolves to.
    allow_private_addresses: bool = False
    headers: dict[str, str] = {}  # sent with each PUT (credentials allowed)
    attempts: Annotated[int, msgspec.Meta(ge=1, le=10)] = 3
    timeout: Duration = Duration(300)  # per copy: download and upload of one file
    max_bytes: Annotated[int, msgspec.Meta(ge=1)] = 256 * 1024 * 1024


class HttpOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything a `type = "http"` handler's options table may hold."""

    submit: SubmitOptions
    query: QueryOptions
    base_url: str = ""
    idempotent: bool = False
    headers: dict[str, str] = {}
    timeouts: Timeouts = Timeouts()
    max_connections: Annotated[int, msgspec.Meta(ge=1)] | None = None
    cancel: CancelOptions | None = None
    errors: ErrorOptions = ErrorOptions()
    finalize: FinalizeOptions | None = None
    find: FindOptions | None = None


def _dec_hook(type_: type, value: object) -> object:
    if type_ is Duration:
        return Duration.parse(value)
    raise NotImplementedError(f"no decoder for {type_!r}")


_AT: Final = re.compile(r"(.*?)(?: - at `\$([^`]*)`)?", re.DOTALL)


def _explain(error: str) -> tuple[str, str]:
    """(path relative to the options table, message) from a msgspec ValidationError."""
    m = _AT.fullmatch(error)
    assert m is not None  # the pattern matches any string
    message, path = m[1], (m[2] or "").removeprefix(".")
    if unknown := re.fullmatch(r"Object contains unknown field `([^`]*)`", message):
        name = unknown[1]
        close = difflib.get_close_matches(name, _fields_at(path), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return (f"{path}.{name}" if path else name), f"unknown key{hint}"
    if missing := re.fullmatch(r"Object missing required field `([^`]*)`", message):
        return (f"{path}.{missing[1]}" if path else missing[1]), "missing required key"
    message = message.replace("`object`", "table").replace("`str`", "string")
    message = re.sub(r"`([^`]*)`", r"\1", message)
    return path, message[:1].lower() + message[1:]


def _fields_at(path: str) -> list[str]:
    struct: Any = HttpOptions
    for name in re.findall(r"[^.\[\]]+", path):
        if name.isdigit():
            continue
        hint = next((f.type for f in msgspec.structs.fields(struct) if f.name == name), None)
        if hint is None:
            return []
        candidates = get_args(hint) if get_origin(hint) is not None else (hint,)
        struct = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, msgspec.Struct)), None
        )
        if struct is None:
            return []
    return [f.name for f in msgspec.structs.fields(struct)]
