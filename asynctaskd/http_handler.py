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
`{params}` and `{params.a.0.b}` (submit only), `{external_id}` and `{handle.x}` (query,
cancel), `{base_url}`, `{task_id}`, `{idempotency_key}`, and the credential sources
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
this module produces (httpx's request lines included) and in every value read from a
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
"""

from __future__ import annotations

import contextlib
import difflib
import email.utils
import logging
import math
import mimetypes
import os
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Final, Literal, NoReturn, get_args, get_origin
from urllib.parse import quote, urlsplit

import anyio
import httpx
import msgspec

from .config import Duration, HandlerConfig, line_of
from .downloads import DownloadFailed, DownloadRefused, Downloads, host_pattern, origin_of
from .errors import ConfigError, NotSent, PermanentError, RetryableError
from .handlers import Failed, HandlerContext, Running, Submitted, Succeeded
from .transport import DEFAULT_MAX_RESPONSE_BYTES, Reply, fetcher_for, make_http_client

__all__ = ["HttpHandler", "HttpOptions", "build", "builders", "parse_retry_after"]

Method = Literal["GET", "POST", "PUT", "PATCH", "DELETE"]

_EXCERPT_CHARS: Final = 200
_MASK: Final = "***"
_MIN_SECRET_CHARS: Final = 4  # shorter values are not redacted (they would mangle messages)


# ---- options: what [handlers.options] may hold ----------------------------------------------


class Timeouts(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per-request limits: connect (and pool wait), read (between bytes), total (whole call)."""

    connect: Duration = Duration(5)
    read: Duration = Duration(30)
    total: Duration = Duration(60)


class SubmitOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[handlers.options.submit]`: the request that creates the vendor job."""

    url: str
    id: str  # JSON pointer to the external id in the answer
    method: Method = "POST"
    headers: dict[str, str] = {}
    body: Any = None  # JSON template; None: no body
    handle: dict[str, str] = {}  # name -> JSON pointer; kept for {handle.name}
    idempotency_header: str = "Idempotency-Key"  # sent when idempotent; "" not to


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


# ---- JSON pointers (RFC 6901) -----------------------------------------------------------------


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Final[Any] = _Missing()


class _Pointer:
    __slots__ = ("text", "tokens")

    def __init__(self, text: str) -> None:
        if text and not text.startswith("/"):
            raise ValueError(
                f"a JSON pointer starts with '/' ('' is the whole answer), got {text!r}"
            )
        if re.search(r"~(?![01])", text):
            raise ValueError(f"'~' must be followed by 0 or 1 in a JSON pointer, got {text!r}")
        self.text = text
        self.tokens = tuple(t.replace("~1", "/").replace("~0", "~") for t in text.split("/")[1:])

    def get(self, doc: Any) -> Any:
        """The value the pointer names in `doc`, or _MISSING."""
        return _walk(doc, self.tokens)

    def set(self, doc: Any, value: Any) -> Any:
        """`doc` with the pointed-to value replaced (in place); returns the new document."""
        if not self.tokens:
            return value
        parent = _walk(doc, self.tokens[:-1])
        last = self.tokens[-1]
        if isinstance(parent, dict):
            parent[last] = value
        elif isinstance(parent, list) and _is_index(last) and int(last) < len(parent):
            parent[int(last)] = value
        return doc


def _is_index(token: str) -> bool:
    return token.isdigit() and (token == "0" or not token.startswith("0"))


# ---- templates ----------------------------------------------------------------------------------

_SECRET: Final = frozenset({"env", "file", "credential"})
_SECRET_REF: Final = re.compile(r"\{(env|file|credential):([^{}?]+)\??\}")
_TASK: Final = frozenset({"task_id", "idempotency_key"})
_NAMES: Final = frozenset(
    {"params", "handle", "external_id", "base_url", "idempotency_key", "task_id", "value", "name"}
)
_ENV_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CREDENTIAL_NAME: Final = re.compile(r"[A-Za-z0-9_.@-]+")
_HEADER_NAME: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
# A value placed in a URL must not be, or contain, a dot segment ("." or ".." alone or
# between slashes: once a server or proxy decodes %2F, "../x" climbs too), nor a control
# character (C0, DEL, C1). Percent-encoding would keep "%0A" out of the request line, but
# such a value is no id or name any vendor expects: it is refused, never sent.
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # C0, DEL, C1
_UNSAFE_IN_URL: Final = re.compile(_CONTROL.pattern + r"|(?:^|[/\\])\.\.?(?:[/\\]|$)")


class _TemplateError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class _Ref:
    """One placeholder: `{kind.path...}` or `{kind:arg}`, optional with a trailing `?`."""

    kind: str
    path: tuple[str, ...] = ()
    arg: str = ""
    optional: bool = False
    text: str = ""


@dataclass(frozen=True, slots=True)
class _Template:
    parts: tuple[str | _Ref, ...]
    source: str

    @property
    def whole(self) -> _Ref | None:
        if len(self.parts) == 1 and isinstance(self.parts[0], _Ref):
            return self.parts[0]
        return None

    def refs(self) -> Iterator[_Ref]:
        return (p for p in self.parts if isinstance(p, _Ref))


def _parse_ref(inner: str) -> _Ref:
    text = "{" + inner + "}"
    optional = inner.endswith("?")
    body = inner[:-1] if optional else inner
    if ":" in body:
        kind, arg = body.split(":", 1)
        if kind not in _SECRET:
            raise _TemplateError(
                f"unknown placeholder {text}: sources are env:, file:, credential:"
            )
        if kind == "env" and not _ENV_NAME.fullmatch(arg):
            raise _TemplateError(f"{text}: expected an environment variable name")
        if kind == "credential" and not _CREDENTIAL_NAME.fullmatch(arg):
            raise _TemplateError(f"{text}: expected a credential name (no '/')")
        if kind == "file" and not arg.startswith("/"):
            raise _TemplateError(f"{text}: expected an absolute path")
        return _Ref(kind, arg=arg, optional=optional, text=text)
    head, *path = body.split(".")
    if head not in _NAMES:
        close = difflib.get_close_matches(head, sorted(_NAMES), n=1)
        hint = f"; did you mean {{{close[0]}}}?" if close else ""
        raise _TemplateError(f"unknown placeholder {text}{hint}")
    if any(not part for part in path):
        raise _TemplateError(f"{text}: empty name after '.'")
    if head == "handle" and not path:
        raise _TemplateError(f"{text}: name a field, as in {{handle.region}}")
    if path and head not in ("params", "handle"):
        raise _TemplateError(f"{text}: {{{head}}} has no fields")
    return _Ref(head, tuple(path), optional=optional, text=text)


def _parse_template(source: str) -> _Template:
    parts: list[str | _Ref] = []
    literal: list[str] = []
    i, n = 0, len(source)
    while i < n:
        c = source[i]
        if source.startswith("{{", i) or source.startswith("}}", i):
            literal.append(c)
            i += 2
        elif c == "{":
            end = source.find("}", i)
            if end < 0 or "{" in source[i + 1 : end]:
                raise _TemplateError(f"unclosed '{{' in {source!r} (write '{{{{' for a brace)")
            if literal:
                parts.append("".join(literal))
                literal = []
            parts.append(_parse_ref(source[i + 1 : end]))
            i = end + 1
        elif c == "}":
            raise _TemplateError(f"unmatched '}}' in {source!r} (write '}}}}' for a brace)")
        else:
            literal.append(c)
            i += 1
    if literal or not parts:
        parts.append("".join(literal))
    return _Template(tuple(parts), source)


def _describe_scope(allowed: frozenset[str]) -> str:
    names = sorted(allowed - _SECRET)
    shown = [f"{{{n}}}" if n not in ("params", "handle") else f"{{{n}.x}}" for n in names]
    if allowed & _SECRET:
        shown.append("{env:NAME} {file:/path} {credential:NAME}")
    return " ".join(shown) or "none"


def _check_scope(ref: _Ref, allowed: frozenset[str], handle_names: frozenset[str]) -> None:
    if ref.kind not in allowed:
        if ref.kind in _SECRET:
            raise _TemplateError(f"{ref.text}: credentials may appear only in headers and base_url")
        if ref.kind == "params":
            raise _TemplateError(
                f"{ref.text}: task params exist only in submit; keep what later requests "
                "need with submit.handle and use {handle.x}"
            )
        raise _TemplateError(f"{ref.text} is not available here; use {_describe_scope(allowed)}")
    if ref.kind == "handle" and ref.path[0] not in handle_names:
        known = ", ".join(sorted(handle_names)) or "none"
        raise _TemplateError(f"{ref.text}: submit.handle has no {ref.path[0]!r} (it has {known})")


# ---- credentials --------------------------------------------------------------------------------


class _SecretMissing(Exception):
    pass


class _ValueMissing(Exception):
    def __init__(self, ref: _Ref) -> None:
        super().__init__(ref.text)
        self.ref = ref


class _ValueRefused(Exception):
    """A placeholder's value that must not land in a URL (see `_UNSAFE_IN_URL`)."""

    def __init__(self, ref: _Ref, value: str) -> None:
        if _CONTROL.search(value):
            why = "has a control character"
        else:
            why = "is or holds a dot segment ('.' or '..') that would change the URL's path"
        super().__init__(f"the value of {ref.text} {why}")
        self.ref = ref


class _UrlLogFilter(logging.Filter):
    """Masks credentials in the records of httpx's logger.

    httpx logs every request at INFO: the URL (credentials in `base_url`) and the answer's
    status line, whose reason phrase is the vendor's to write (one may quote the token).
    """

    def __init__(self) -> None:
        super().__init__()
        self.secrets: tuple[str, ...] = ()

    def protect(self, secret: str) -> None:
        if len(secret) >= _MIN_SECRET_CHARS and secret not in self.secrets:
            self.secrets = tuple(sorted({*self.secrets, secret}, key=len, reverse=True))
            logger = logging.getLogger("httpx")
            if self not in logger.filters:
                logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = message
        for secret in self.secrets:
            masked = masked.replace(secret, _MASK)
        if masked != message:
            record.msg, record.args = masked, None
        return True


_URL_LOG_FILTER: Final = _UrlLogFilter()


class _Secrets:
    """Credential values, read on first use and kept; `redact` masks every one seen."""

    def __init__(self) -> None:
        self._values: dict[tuple[str, str], str] = {}
        self._known: tuple[str, ...] = ()

    def get(self, kind: str, arg: str) -> str:
        value = self._values.get((kind, arg))
        if value is None:
            value = _read_secret(kind, arg)
            self._values[(kind, arg)] = value
            if len(value) >= _MIN_SECRET_CHARS:
                self._known = tuple(sorted({*self._known, value}, key=len, reverse=True))
            _URL_LOG_FILTER.protect(value)
        return value

    def preload(self, refs: Iterable[tuple[str, str]]) -> None:
        """Read every credential the handler's templates name, so that `redact` masks them
        even in text from a call that never sent them (a vendor's file host echoing one a
        query sent earlier in another process). A credential that cannot be read now is
        skipped: the call that needs it says so."""
        for kind, arg in refs:
            if (kind, arg) not in self._values:
                with contextlib.suppress(Exception):
                    self.get(kind, arg)

    def redact(self, text: str) -> str:
        for secret in self._known:
            if secret in text:
                text = text.replace(secret, _MASK)
        return text

    def scrub(self, doc: Any, raw: bytes) -> Any:
        """`doc`, decoded from `raw`, with every secret masked in its strings and keys.

        A vendor that quotes the request (an echoed header, a "bad token ..." message) would
        otherwise put the credential into handles, results and messages, and so into Redis.
        Only a body holding a secret as is, or any JSON escape that could spell one, is walked.
        """
        if not self._known or (
            b"\\" not in raw and not any(s.encode() in raw for s in self._known)
        ):
            return doc
        root = [doc]
        stack: list[tuple[Any, Any]] = [(root, 0)]
        while stack:  # iterative: answers may be nested as deep as the decoder allows
            parent, key = stack.pop()
            value = parent[key]
            if isinstance(value, str):
                parent[key] = self.redact(value)
            elif isinstance(value, list):
                stack.extend((value, i) for i in range(len(value)))
            elif isinstance(value, dict):
                items = [(self.redact(k), v) for k, v in value.items()]
                value.clear()
                value.update(items)
                stack.extend((value, k) for k in value)
        return root[0]


def _read_secret(kind: str, arg: str) -> str:
    if kind == "env":
        value = os.environ.get(arg)
        if value is None:
            raise _SecretMissing(f"environment variable {arg} is not set")
        return value
    if kind == "credential":
        directory = os.environ.get("CREDENTIALS_DIRECTORY")
        if not directory:
            raise _SecretMissing(
                f"credential {arg}: $CREDENTIALS_DIRECTORY is not set (systemd LoadCredential=)"
            )
        path = Path(directory) / arg
    else:
        path = Path(arg)
    try:
        return path.read_text(encoding="utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise _SecretMissing(f"cannot read {kind} {arg}: {reason}") from None


# ---- compiled requests --------------------------------------------------------------------------


@dataclass(slots=True)
class _Vars:
    task_id: str
    idempotency_key: str
    base_url: str = ""
    params: Any = _MISSING
    external_id: str = ""
    handle: Mapping[str, Any] = field(default_factory=dict)
    value: Any = None
    name: str = ""


@dataclass(frozen=True, slots=True)
class _Request:
    method: str
    url: _Template
    headers: tuple[tuple[str, _Template], ...]
    body: Any  # a compiled JSON tree, or _MISSING for no body


@dataclass(frozen=True, slots=True)
class _FindPlan:
    request: _Request
    items: _Pointer
    match: _Pointer
    equals: _Template
    id: _Pointer
    handle: tuple[tuple[str, _Pointer], ...]
    more: _Pointer | None
    cursor: _Pointer | None
    next_url: _Template | None


@dataclass(frozen=True, slots=True)
class _Plan:
    """HttpOptions compiled: templates parsed, pointers split, status names indexed."""

    options: HttpOptions
    base_url: _Template
    base_headers: tuple[tuple[str, _Template], ...]
    submit: _Request
    submit_id: _Pointer
    submit_handle: tuple[tuple[str, _Pointer], ...]
    query: _Request
    status: _Pointer
    outcomes: Mapping[str, str]  # vendor status -> "running" | "succeeded" | "failed"
    progress: _Pointer | None
    progress_total: _Pointer | None
    stage: _Pointer | None
    message: _Pointer | None
    result: _Pointer | tuple[tuple[str, _Pointer], ...]
    error_code: _Pointer | None
    error_message: _Pointer | None
    gone: _Pointer | None
    cancel: _Request | None
    finalize_files: tuple[_Pointer, ...]
    finalize_download: _Template | None
    finalize_hosts: tuple[str, ...]
    finalize_put: _Template | None
    finalize_headers: tuple[tuple[str, _Template], ...]
    find: _FindPlan | None = None


_FINALIZE_DEPTH: Final = 8  # objects and lists below a finalize pointer, searched this deep
_FINALIZE_FILES: Final = 100  # files one result may hold


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return msgspec.json.encode(value).decode()


def _walk(doc: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if isinstance(doc, dict):
            doc = doc.get(key, _MISSING)
        elif isinstance(doc, list) and _is_index(key) and int(key) < len(doc):
            doc = doc[int(key)]
        else:
            return _MISSING
        if doc is _MISSING:
            return _MISSING
    return doc


def _code_of(exc: BaseException) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(exc).__name__).upper()


def _origin(url: str) -> tuple[str, str]:
    try:
        parts = urlsplit(url)
    except ValueError:
        return ("", "")
    return (parts.scheme.lower(), parts.netloc.lower())


_DURATION_PART: Final = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNIT_SECONDS: Final = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def parse_reset(value: str | None) -> float | None:
    """Seconds from a rate-limit reset header: a duration as vendors write them ("6m0s",
    "1.5s", "20ms", "1h2m") or plain seconds; None when it is neither."""
    if value is None:
        return None
    text = value.strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)


def throttle_wait(
    header: Callable[[str], str | None], reset_headers: Sequence[str] = ()
) -> float | None:
    """How long a throttled answer asks to wait: the longest of `retry-after-ms` (the
    OpenAI SDK reads it first), Retry-After and the handler's `reset_headers`."""
    waits = []
    ms = header("retry-after-ms")
    if ms is not None and re.fullmatch(r"\s*\d+(\.\d+)?\s*", ms):
        waits.append(float(ms) / 1000)
    if (after := parse_retry_after(header("retry-after"))) is not None:
        waits.append(after)
    waits += [w for name in reset_headers if (w := parse_reset(header(name))) is not None]
    return max(waits) if waits else None


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header: delay-seconds or an HTTP-date; else None."""
    if value is None:
        return None
    text = value.strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        seconds = float(text)
        return seconds if math.isfinite(seconds) else None
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


# ---- the handler --------------------------------------------------------------------------------


class HttpHandler:
    """A Handler driven by `HttpOptions`; build it with `build()` (checks every template).

    With per-handler limits (`max_connections`, or the handler's `concurrency`) it sends
    through its own client, created on first use inside the event loop and closed by
    `aclose()`; otherwise through the shared `ctx.http`.
    """

    def __init__(
        self,
        key: str,
        plan: _Plan,
        *,
        max_connections: int | None = None,
        proxy: str | None = None,
        max_response_bytes: int | None = None,
    ) -> None:
        self.key = key
        self.plan = plan
        self.options = plan.options
        self.idempotent_submit = plan.options.idempotent
        t = plan.options.timeouts
        self._timeout = httpx.Timeout(
            connect=float(t.connect), read=float(t.read), write=float(t.read), pool=float(t.connect)
        )
        self._total = float(t.total)
        self._max_connections = max_connections
        self._proxy = proxy
        self._max_response_bytes = max_response_bytes or DEFAULT_MAX_RESPONSE_BYTES
        self._http: httpx.AsyncClient | None = None
        self._secrets = _Secrets()
        # every {env:..}, {file:..} and {credential:..} the options name, for redaction
        self._secret_refs = tuple(
            dict.fromkeys(
                _SECRET_REF.findall(
                    msgspec.json.encode(plan.options, enc_hook=float).decode()  # Duration
                )
            )
        )
        self._base_url: str | None = None
        self._base_origin: tuple[str, str, int | None] | None = None
        self._download_home: tuple[str, str, int | None] | _Missing | None = _MISSING
        errors = plan.options.errors
        self._permanent = None if errors.permanent is None else frozenset(errors.permanent)
        self._retryable = frozenset(errors.retryable)
        self._reset_headers = tuple(h.lower() for h in errors.reset_headers)
        self._permanent_codes = frozenset(errors.permanent_codes)
        self._code_pointer = _Pointer(errors.code_pointer)
        idem = plan.options.submit.idempotency_header
        self._idempotency_header = idem if plan.options.idempotent and idem else ""
        if (f := plan.options.find) is not None:
            # Only a handler with a find section has find() (the worker looks it up), and
            # its window counts from the start mark: the submit call itself may take up to
            # timeouts.total before the vendor creates the job.
            self.find = self._find
            self.find_visible_after = float(f.visible_after) + self._total
            self.find_max_tries = f.max_tries
            self.find_give_up_after = float(f.give_up_after)

    def __repr__(self) -> str:
        return f"HttpHandler(key={self.key!r})"

    # --- Handler protocol ------------------------------------------------------------------

    async def submit(self, params: Any, ctx: HandlerContext) -> Submitted:
        """POST the job; the answer's id (and handle fields) become the task's handle."""
        v = _Vars(ctx.task_id, ctx.idempotency_key, params=params)
        url, headers, content = self._prepare(self.plan.submit, v, "submit")
        if self._idempotency_header:
            headers[self._idempotency_header] = ctx.idempotency_key
        response = await self._send(ctx, "submit", self.plan.submit.method, url, headers, content)
        self._check_status(response, "submit")
        doc = self._decode(response, "submit")
        raw = self.plan.submit_id.get(doc)
        if isinstance(raw, str) and raw:
            external_id = raw
        elif isinstance(raw, int) and not isinstance(raw, bool):
            external_id = str(raw)
        else:
            found = "nothing" if raw is _MISSING else f"{type(raw).__name__} {raw!r}"[:80]
            raise RetryableError(
                f"submit: expected the job id (a string) at {self.plan.submit_id.text or '/'} "
                f"of the vendor's {response.status} answer, found {found}; the job may "
                f"exist; body: {self._excerpt(response.content)}",
                code="VENDOR_GARBAGE",
            )
        handle = {}
        for name, pointer in self.plan.submit_handle:
            value = pointer.get(doc)
            handle[name] = None if value is _MISSING else value
        return Submitted(external_id, handle)

    async def query(
        self, handle: dict[str, Any], ctx: HandlerContext
    ) -> Running | Succeeded | Failed:
        """GET the job and map its vendor status to Running, Succeeded or Failed."""
        plan = self.plan
        v = _Vars(
            ctx.task_id,
            ctx.idempotency_key,
            handle=handle,
            external_id=str(handle.get("external_id") or ""),
        )
        url, headers, content = self._prepare(plan.query, v, "query")
        response = await self._send(ctx, "query", plan.query.method, url, headers, content)
        self._check_status(response, "query")
        doc = self._decode(response, "query")
        raw = plan.status.get(doc)
        if isinstance(raw, str):
            status = raw
        elif isinstance(raw, int) and not isinstance(raw, bool):
            status = str(raw)
        else:
            found = "nothing" if raw is _MISSING else f"{type(raw).__name__} {raw!r}"[:80]
            raise RetryableError(
                f"query: expected the vendor status (a string) at {plan.status.text or '/'}, "
                f"found {found}; body: {self._excerpt(response.content)}",
                code="VENDOR_GARBAGE",
            )
        outcome = plan.outcomes.get(status) or plan.options.query.unknown
        if outcome == "succeeded":
            if plan.gone is not None and plan.gone.get(doc) is True:
                return Failed(
                    "RESULT_REMOVED",
                    f"the vendor reports the job {status!r}, but deleted its output before "
                    "it was read (a poll after the vendor's retention window)",
                )
            return Succeeded(self._result(doc))
        if outcome == "failed":
            code = _text_at(plan.error_code, doc) or status
            if status not in plan.outcomes:
                code = "UNKNOWN_STATUS"
            message = _text_at(plan.error_message, doc) or f"vendor status {status!r}"
            partial = self._result(doc) if plan.options.query.failed_result else None
            if isinstance(partial, dict) and not any(v is not None for v in partial.values()):
                partial = None  # nothing was made
            return Failed(code[:200], self._secrets.redact(message), partial)
        if outcome == "error":
            raise RetryableError(
                f"query: vendor status {status!r} is not in running, succeeded or failed",
                code="UNKNOWN_STATUS",
            )
        note = _text_at(plan.message, doc)
        return Running(
            progress=self._progress(doc),
            stage=_text_at(plan.stage, doc) or status,
            message=None if note is None else self._secrets.redact(note),
        )

    async def _find(self, params: Any, ctx: HandlerContext) -> Submitted | None:
        """List the vendor's jobs; the one whose `match` value equals `equals` is ours."""
        plan = self.plan.find
        assert plan is not None  # find is only set with a find section
        v = _Vars(ctx.task_id, ctx.idempotency_key, params=params)
        url, headers, content = self._prepare(plan.request, v, "find")
        want = self._render_text(plan.equals, v)
        options = self.options.find
        assert options is not None
        for page in range(1, options.max_pages + 1):
            response = await self._send(ctx, "find", plan.request.method, url, headers, content)
            self._check_status(response, "find")
            doc = self._decode(response, "find")
            items = plan.items.get(doc)
            if not isinstance(items, list):
                found = "nothing" if items is _MISSING else type(items).__name__
                raise RetryableError(
                    f"find: expected a list of jobs at {plan.items.text or '/'}, found "
                    f"{found}; body: {self._excerpt(response.content)}",
                    code="VENDOR_GARBAGE",
                )
            job = self._our_job(items, want)
            if job is not None:
                return job
            if plan.more is None or plan.more.get(doc) is not True:
                return None  # the whole listing was read: the vendor has no job of ours
            cursor = plan.cursor.get(doc) if plan.cursor is not None else _MISSING
            if plan.next_url is None or cursor is _MISSING or cursor is None:
                break
            if page < options.max_pages:
                v.value = cursor
                url = self._render_text(plan.next_url, v, url=True)
        raise RetryableError(
            "find: the job is not on the listing's pages read, and the vendor says there is "
            "more: it may be further back (no resubmit on a listing read in part)",
            code="FIND_INCOMPLETE",
        )

    def _our_job(self, items: list[Any], want: str) -> Submitted | None:
        plan = self.plan.find
        assert plan is not None
        for item in items:
            value = plan.match.get(item)
            if value is _MISSING or _as_text(value) != want:
                continue
            raw = plan.id.get(item)
            if isinstance(raw, int) and not isinstance(raw, bool):
                raw = str(raw)
            if not isinstance(raw, str) or not raw:
                raise RetryableError(
                    f"find: our job is listed without an id at {plan.id.text or '/'}",
                    code="VENDOR_GARBAGE",
                )
            handle = {}
            for name, pointer in plan.handle:
                got = pointer.get(item)
                handle[name] = None if got is _MISSING else got
            return Submitted(raw, handle)
        return None

    async def cancel(self, handle: dict[str, Any], ctx: HandlerContext) -> None:
        """Send the configured cancel request (best effort: errors are raised for the log)."""
        request = self.plan.cancel
        if request is None:
            return
        v = _Vars(
            ctx.task_id,
            ctx.idempotency_key,
            handle=handle,
            external_id=str(handle.get("external_id") or ""),
        )
        url, headers, content = self._prepare(request, v, "cancel")
        response = await self._send(ctx, "cancel", request.method, url, headers, content)
        self._check_status(response, "cancel")

    async def finalize(self, result: Any, ctx: HandlerContext) -> Any:
        """Copy result files to `dir` or a `put` target; the result then points at the copies.

        Each `files` pointer names a value or a list of values. Without `download`, only
        http(s) URLs are copied (other values, such as text output, are left alone); with
        it, every value is turned into a URL first (e.g. a file id). In objects below the
        pointer (a model's output may be {"image": url, "mask": url}) every http(s) URL is
        copied, up to 8 levels deep and 100 files a result.

        The vendor chooses these URLs, so they are fetched only from `hosts` (and the host
        the `download` template names), never from a private, loopback or link-local
        address unless `allow_private_addresses` (`asynctaskd.downloads` says how, DNS
        included), and without the vendor's credentials unless the `download` template
        made the URL on `base_url`'s origin. A URL refused so fails the task for good
        (PermanentError, FINALIZE_REFUSED; an unsafe `{value}`, UNSAFE_VALUE): nothing is
        sent. Any other failure raises RetryableError: the task stays RUNNING and the
        worker retries.
        """
        options = self.plan.options.finalize
        if options is None:
            return result
        result = msgspec.json.decode(msgspec.json.encode(result))  # a private copy
        t = self.options.timeouts
        downloads = Downloads(
            self.plan.finalize_hosts,
            allow_private=options.allow_private_addresses,
            connect=float(t.connect),
            read=float(t.read),
        )
        count = [0]

        async def copy(value: Any, depth: int, in_object: bool) -> Any:
            """`value` with its files copied: a value or a list of values at the pointer
            (ids too, with a download template), and URLs anywhere in objects below it
            (a model's output may be {"image": url, "mask": url}), up to a bound."""
            if isinstance(value, dict | list):
                if depth >= _FINALIZE_DEPTH:
                    return value
                pairs = value.items() if isinstance(value, dict) else enumerate(value)
                for key, item in list(pairs):
                    inner = in_object or isinstance(value, dict)
                    value[key] = await copy(item, depth + 1, inner)
                return value
            if isinstance(value, bool) or not isinstance(value, str | int):
                return value
            is_url = isinstance(value, str) and _origin(value)[0] in ("http", "https")
            if not is_url and (in_object or self.plan.finalize_download is None):
                return value
            if count[0] >= _FINALIZE_FILES:
                raise PermanentError(
                    f"finalize: the result holds more than {_FINALIZE_FILES} files",
                    code="FINALIZE_REFUSED",
                )
            count[0] += 1
            return await self._copy_with_retries(str(value), count[0] - 1, options, ctx, downloads)

        async with downloads:
            for pointer in self.plan.finalize_files:
                found = pointer.get(result)
                if found is _MISSING or found is None:
                    continue
                result = pointer.set(result, await copy(found, 0, False))
        return result

    async def aclose(self) -> None:
        """Close the handler's own client, if it made one."""
        client, self._http = self._http, None
        if client is not None:
            await client.aclose()

    # --- requests ----------------------------------------------------------------------------

    def _client(self, ctx: HandlerContext) -> httpx.AsyncClient:
        if self._max_connections is None:
            return ctx.http
        if self._http is None:
            # Created here, inside the running loop; the transport binds to it on first use.
            self._http = make_http_client(
                max_connections=self._max_connections,
                timeout=self._timeout,
                proxy=self._proxy,
                max_response_bytes=self._max_response_bytes,
            )
        return self._http

    def _base(self) -> str:
        if self._base_url is None:
            self._base_url = self._render_text(self.plan.base_url, _Vars("", ""))
            self._base_origin = origin_of(self._base_url)
        return self._base_url

    def _download_origin(self) -> tuple[str, str, int | None] | None:
        """The origin every URL the `download` template makes has, or None when a value
        lands in its scheme or authority (then its host must be in `finalize.hosts`)."""
        if isinstance(self._download_home, _Missing):
            template = self.plan.finalize_download
            assert template is not None
            fixed: list[str] = []
            for part in template.parts:
                if isinstance(part, str):
                    fixed.append(part)
                elif part.kind == "base_url":
                    fixed.append(self._base())
                else:
                    break
            text = "".join(fixed)
            whole = re.match(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*[/?#]", text)
            self._download_home = origin_of(text) if whole else None
        return self._download_home

    def _prepare(
        self, request: _Request, v: _Vars, what: str
    ) -> tuple[str, dict[str, str], bytes | None]:
        try:
            v.base_url = self._base()
            url = self._render_text(request.url, v, url=True)
            headers = self._render_headers(request.headers, v)
            content = None
            if request.body is not _MISSING:
                content = msgspec.json.encode(self._render_json(request.body, v))
        except _SecretMissing as exc:
            message = f"{what}: {exc}"
            if what == "submit":
                raise NotSent(message, code="CREDENTIAL_MISSING") from None
            raise RetryableError(message, code="CREDENTIAL_MISSING") from None
        except _ValueMissing as exc:
            source = "the task params" if exc.ref.kind == "params" else "the task's handle"
            raise PermanentError(
                f"{what}: {exc.ref.text} has no value in {source}", code="MISSING_VALUE"
            ) from None
        except _ValueRefused as exc:
            # Producer input (or a vendor's id): it would be refused on every attempt.
            raise PermanentError(f"{what}: {exc}; nothing was sent", code="UNSAFE_VALUE") from None
        return url, headers, content

    def _render_headers(
        self, templates: tuple[tuple[str, _Template], ...], v: _Vars
    ) -> dict[str, str]:
        headers: dict[str, str] = {}
        for name, template in templates:
            value = self._render_text(template, v)
            # ASCII and printable: no control character (a space is printable). Two C calls,
            # not a regex search: every request renders its headers.
            if not (value.isascii() and value.isprintable()):
                raise PermanentError(
                    f"header {name}: the value has a control or a non-ASCII character",
                    code="INVALID_HEADER",
                )
            headers[name] = value
        return headers

    def _value(self, ref: _Ref, v: _Vars) -> Any:
        kind = ref.kind
        if kind == "params":
            value = _walk(v.params, ref.path)
        elif kind == "handle":
            value = _walk(v.handle, ref.path)
        elif kind in _SECRET:
            value = self._secrets.get(kind, ref.arg)
        else:
            value = getattr(v, kind)
        if value is _MISSING and not ref.optional:
            raise _ValueMissing(ref)
        return value

    def _render_text(self, template: _Template, v: _Vars, *, url: bool = False) -> str:
        parts = template.parts
        if len(parts) == 1 and isinstance(parts[0], str):
            return parts[0]
        out: list[str] = []
        for part in parts:
            if isinstance(part, str):
                out.append(part)
                continue
            value = self._value(part, v)
            text = "" if value is _MISSING else _as_text(value)
            if url and part.kind != "base_url":
                # Most values hold no dot and no control character (isprintable is False for
                # every one): the search runs only for the rest.
                if ("." in text or not text.isprintable()) and _UNSAFE_IN_URL.search(text):
                    raise _ValueRefused(part, text)
                text = quote(text, safe="")
            out.append(text)
        return "".join(out)

    def _render_json(self, node: Any, v: _Vars) -> Any:
        if isinstance(node, _Template):
            whole = node.whole
            if whole is not None:
                return self._value(whole, v)  # _MISSING when optional and absent
            return self._render_text(node, v)
        if isinstance(node, dict):
            out = {}
            for key, child in node.items():
                value = self._render_json(child, v)
                if value is not _MISSING:
                    out[key] = value
            return out
        if isinstance(node, list):
            return [None if (x := self._render_json(c, v)) is _MISSING else x for c in node]
        return node

    async def _send(
        self,
        ctx: HandlerContext,
        what: str,
        method: str,
        url: str,
        headers: dict[str, str],
        content: bytes | None,
    ) -> Reply:
        fetch = fetcher_for(self._client(ctx))
        try:
            # A bare cancel scope: cheaper than fail_after (measured 13 vs 17 µs a call).
            with anyio.CancelScope(deadline=anyio.current_time() + self._total):
                return await fetch(
                    method, url, headers=headers, content=content, timeout=self._timeout
                )
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise NotSent(f"{what}: never sent: {self._explain(exc)}", code=_code_of(exc)) from None
        except (httpx.LocalProtocolError, httpx.InvalidURL, ValueError) as exc:
            # Refused before anything was written: a URL or header the templates made
            # unusable (the client checks a request whole before sending any of it).
            raise PermanentError(
                f"{what}: cannot build the request: {self._explain(exc)}", code="INVALID_REQUEST"
            ) from None
        except httpx.UnsupportedProtocol as exc:
            raise PermanentError(
                f"{what}: unusable URL: {self._explain(exc)}", code="INVALID_REQUEST"
            ) from None
        except httpx.HTTPError as exc:
            raise RetryableError(
                f"{what}: {self._explain(exc)}; the request may have reached the vendor",
                code=_code_of(exc),
            ) from None
        except Exception as exc:
            # A transport that fails in a way httpx does not name: ambiguous, as the worker
            # would treat it anyway, but with credentials masked in the message.
            raise RetryableError(
                f"{what}: {self._explain(exc)}; the request may have reached the vendor",
                code="TRANSPORT_FAILURE",
            ) from None
        # Only the scope's own deadline ends up here (an outer cancellation propagates).
        raise RetryableError(
            f"{what}: no complete answer within {self._total:g}s (timeouts.total); "
            "the request may have reached the vendor",
            code="TOTAL_TIMEOUT",
        )

    def _explain(self, exc: BaseException) -> str:
        self._secrets.preload(self._secret_refs)
        return self._secrets.redact(f"{type(exc).__name__}: {exc}".rstrip(": "))

    def _excerpt(self, content: bytes) -> str:
        # Redact before cutting, so no secret is left half-visible at the edge.
        self._secrets.preload(self._secret_refs)
        text = self._secrets.redact(content[:4096].decode("utf-8", "replace"))
        cut = text[:_EXCERPT_CHARS]
        return repr(cut + ("..." if len(text) > _EXCERPT_CHARS or len(content) > 4096 else ""))

    def _check_status(self, response: Reply, what: str) -> None:
        status = response.status
        if 200 <= status < 300:
            return
        code = f"HTTP_{status}"
        body = self._excerpt(response.content)
        if status in self._retryable:
            raise RetryableError(f"{what}: vendor answered {status}: {body}", code=code)
        has_retry_after = response.header("retry-after") is not None
        if status == 429 and self._permanent_codes:
            vendor_code = self._vendor_code(response)
            if vendor_code in self._permanent_codes:
                raise PermanentError(
                    f"{what}: vendor refused ({status} {vendor_code}): {body}",
                    code=vendor_code.upper()[:200],
                )
        if status == 429 or (status == 503 and has_retry_after):
            raise RetryableError(
                f"{what}: throttled by the vendor ({status}): {body}",
                code=code,
                retry_after=throttle_wait(response.header, self._reset_headers),
                throttled=True,
            )
        if self._permanent is not None:
            permanent = status in self._permanent
        else:
            permanent = 400 <= status < 500 and status not in (408, 429)
        if permanent:
            raise PermanentError(f"{what}: vendor refused ({status}): {body}", code=code)
        raise RetryableError(f"{what}: vendor answered {status}: {body}", code=code)

    def _vendor_code(self, response: Reply) -> str:
        """The code at `errors.code_pointer` in a JSON error body, or ''."""
        try:
            value = self._code_pointer.get(msgspec.json.decode(response.content[:65536]))
        except (msgspec.DecodeError, RecursionError, ValueError, TypeError, KeyError):
            return ""
        return value if isinstance(value, str) else ""

    def _decode(self, response: Reply, what: str) -> Any:
        try:
            doc = msgspec.json.decode(response.content)
        except (msgspec.DecodeError, RecursionError) as exc:
            # msgspec raises RecursionError for arrays or objects nested deeper than the
            # interpreter's recursion limit allows: vendor garbage like any other.
            why = "nested too deeply" if isinstance(exc, RecursionError) else "not JSON"
            maybe = "; the job may exist" if what == "submit" else ""
            raise RetryableError(
                f"{what}: the vendor's {response.status} answer is {why}{maybe}; "
                f"body: {self._excerpt(response.content)}",
                code="VENDOR_GARBAGE",
            ) from None
        return self._secrets.scrub(doc, response.content)

    # --- reading answers ---------------------------------------------------------------------

    def _result(self, doc: Any) -> Any:
        result = self.plan.result
        if isinstance(result, _Pointer):
            value = result.get(doc)
            return None if value is _MISSING else value
        out = {}
        for name, pointer in result:
            value = pointer.get(doc)
            out[name] = None if value is _MISSING else value
        return out

    def _progress(self, doc: Any) -> float | None:
        plan = self.plan
        if plan.progress is None:
            return None
        value = _number(plan.progress.get(doc))
        if value is None:
            return None
        if plan.progress_total is not None:
            total = _number(plan.progress_total.get(doc))
            if not total:
                return None
            value /= total
        return value / plan.options.query.progress_scale

    # --- finalize ------------------------------------------------------------------------------

    async def _copy_with_retries(
        self,
        value: str,
        n: int,
        options: FinalizeOptions,
        ctx: HandlerContext,
        downloads: Downloads,
    ) -> str:
        last = ""
        for attempt in range(options.attempts):
            if attempt:
                await anyio.sleep(min(5.0, 0.2 * 2 ** (attempt - 1)))
            try:
                return await self._copy(value, n, options, ctx, downloads)
            except DownloadRefused as exc:
                # Every attempt would be refused the same way: fail the task, say why.
                why = self._secrets.redact(str(exc))
                raise PermanentError(
                    f"finalize: result file {n}: {why}; nothing was sent",
                    code="FINALIZE_REFUSED",
                ) from None
            except (
                httpx.HTTPError,  # the PUT
                httpx.InvalidURL,
                ValueError,
                OSError,
                DownloadFailed,
                _CopyError,
                _SecretMissing,
            ) as exc:
                last = self._explain(exc)
                ctx.logger.warning(
                    "finalize: copy %d failed (attempt %d of %d): %s",
                    n,
                    attempt + 1,
                    options.attempts,
                    last,
                )
        raise RetryableError(
            f"finalize: copying result file {n} failed {options.attempts} times; last: {last}",
            code="FINALIZE_FAILED",
        )

    async def _copy(
        self,
        value: str,
        n: int,
        options: FinalizeOptions,
        ctx: HandlerContext,
        downloads: Downloads,
    ) -> str:
        plan = self.plan
        v = _Vars(ctx.task_id, ctx.idempotency_key, base_url=self._base(), value=value)
        home = None
        try:
            if plan.finalize_download is not None:
                source = self._render_text(plan.finalize_download, v, url=True)
                home = self._download_origin()
            else:
                source = value
        except _ValueMissing as exc:
            raise _CopyError(f"{exc.ref.text} has no value") from None
        except _ValueRefused as exc:
            raise PermanentError(
                f"finalize: {exc}; nothing was sent", code="UNSAFE_VALUE"
            ) from None
        url = downloads.check(source, also=None if home is None else home[1])
        headers: dict[str, str] = {}
        if home is not None and home == self._base_origin and origin_of(str(url)) == home:
            # Vendor credentials go only with a URL our own template made on the vendor's
            # origin: never to another host, nor to a path a vendor's answer chose.
            headers = self._render_headers(plan.base_headers, v)
        client = self._client(ctx)
        with anyio.fail_after(float(options.timeout)):
            async with downloads.get(url, headers) as response:
                if not 200 <= response.status < 300:
                    raise _CopyError(f"download answered {response.status}")
                length = response.headers.get("content-length")
                if length and length.isdigit() and int(length) > options.max_bytes:
                    raise _CopyError(f"file is {length} bytes, over finalize.max_bytes")
                content_type = response.headers.get("content-type", "")
                v.name = f"{ctx.task_id}-{n}{_extension(source, content_type)}"
                if options.dir is not None:
                    return await self._write_file(response.chunks(), options, v.name)
                data = bytearray()
                async for chunk in response.chunks():
                    data += chunk
                    if len(data) > options.max_bytes:
                        raise _CopyError("file is over finalize.max_bytes")
            assert plan.finalize_put is not None  # checked when built: dir or put
            target = self._render_text(plan.finalize_put, v, url=True)
            put_headers = self._render_headers(plan.finalize_headers, v)
            if content_type:
                put_headers.setdefault("Content-Type", content_type)
            answer = await client.put(
                target, content=bytes(data), headers=put_headers, timeout=self._timeout
            )
            if not 200 <= answer.status_code < 300:
                raise _CopyError(
                    f"PUT answered {answer.status_code}: {self._excerpt(answer.content)}"
                )
            return target

    async def _write_file(
        self, chunks: AsyncIterator[bytes], options: FinalizeOptions, name: str
    ) -> str:
        assert options.dir is not None
        directory = anyio.Path(options.dir)
        await directory.mkdir(parents=True, exist_ok=True)
        final = directory / name
        partial = directory / f".{name}.partial"
        size = 0
        async with await anyio.open_file(partial, "wb") as out:
            async for chunk in chunks:
                size += len(chunk)
                if size > options.max_bytes:
                    raise _CopyError("file is over finalize.max_bytes")
                await out.write(chunk)
        await partial.rename(final)  # atomic: a reader never sees half a file
        return str(final)


class _CopyError(Exception):
    pass


def _number(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _text_at(pointer: _Pointer | None, doc: Any) -> str | None:
    if pointer is None:
        return None
    value = pointer.get(doc)
    if value is _MISSING or value is None:
        return None
    return _as_text(value)


def _extension(url: str, content_type: str) -> str:
    suffix = PurePosixPath(urlsplit(url).path).suffix
    if re.fullmatch(r"\.[A-Za-z0-9]{1,8}", suffix):
        return suffix.lower()
    guessed = (
        mimetypes.guess_extension(content_type.split(";")[0].strip()) if content_type else None
    )
    return guessed or ".bin"


# ---- building: options -> plan, every error with its key path and line --------------------------


class _Builder:
    def __init__(self, hc: HandlerConfig, index: int | None, text: str | None, source: str) -> None:
        self.hc = hc
        self.index = index
        self.text = text
        self.source = source

    def fail(self, path: str, message: str) -> NoReturn:
        """Raise ConfigError for `path` (relative to the options table, e.g. "submit.url")."""
        if self.index is not None:
            key = f"handlers[{self.index}].options" + (f".{path}" if path else "")
            line = self._line(key)
            where = self.source + (f":{line}" if line is not None else "")
            raise ConfigError(f"{where}: {key}: {message}" if where else f"{key}: {message}")
        key = "options" + (f".{path}" if path else "")
        raise ConfigError(f"handler {self.hc.key!r}: {key}: {message}")

    def _line(self, key: str) -> int | None:
        if self.text is None:
            return None
        path = "$." + key
        while True:
            line = line_of(self.text, path)
            if line is not None:
                return line
            cut = max(path.rfind("."), path.rfind("["))
            if cut <= 1:
                return None
            path = path[:cut]

    def decode(self) -> HttpOptions:
        try:
            return msgspec.convert(self.hc.options, HttpOptions, dec_hook=_dec_hook)
        except msgspec.ValidationError as exc:
            path, message = _explain(str(exc))
            self.fail(path, message)

    def template(
        self, text: str, path: str, allowed: frozenset[str], handles: frozenset[str] = frozenset()
    ) -> _Template:
        try:
            template = _parse_template(text)
            for ref in template.refs():
                _check_scope(ref, allowed, handles)
        except _TemplateError as exc:
            self.fail(path, str(exc))
        return template

    def pointer(self, text: str, path: str) -> _Pointer:
        try:
            return _Pointer(text)
        except ValueError as exc:
            self.fail(path, str(exc))

    def json(self, node: Any, path: str, allowed: frozenset[str], handles: frozenset[str]) -> Any:
        if isinstance(node, str):
            return self.template(node, path, allowed, handles)
        if isinstance(node, dict):
            return {k: self.json(c, f"{path}.{k}", allowed, handles) for k, c in node.items()}
        if isinstance(node, list):
            return [self.json(c, f"{path}[{i}]", allowed, handles) for i, c in enumerate(node)]
        return node

    def headers(
        self,
        headers: Mapping[str, str],
        path: str,
        allowed: frozenset[str],
        handles: frozenset[str] = frozenset(),
    ) -> tuple[tuple[str, _Template], ...]:
        out = []
        for name, value in headers.items():
            if not _HEADER_NAME.fullmatch(name):
                self.fail(f"{path}.{name}", f"{name!r} is not a valid header name")
            out.append((name, self.template(value, f"{path}.{name}", allowed, handles)))
        return tuple(out)

    def url(
        self, text: str, path: str, allowed: frozenset[str], handles: frozenset[str] = frozenset()
    ) -> _Template:
        template = self.template(text, path, allowed, handles)
        first = template.parts[0]
        absolute = isinstance(first, str) and first.startswith(("http://", "https://"))
        if not absolute and not (isinstance(first, _Ref) and first.kind == "base_url"):
            self.fail(
                path, f"expected an http(s):// URL or one starting with {{base_url}}, got {text!r}"
            )
        return template

    def request(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        body: Any,
        path: str,
        scope: frozenset[str],
        base_headers: tuple[tuple[str, _Template], ...],
        handles: frozenset[str] = frozenset(),
    ) -> _Request:
        own = self.headers(headers, f"{path}.headers", (scope - {"base_url"}) | _SECRET, handles)
        names = {n.lower() for n, _ in own}
        merged = [(n, t) for n, t in base_headers if n.lower() not in names] + list(own)
        compiled_body: Any = _MISSING
        if body is not None:
            compiled_body = self.json(body, f"{path}.body", scope, handles)
            if "content-type" not in {n.lower() for n, _ in merged}:
                merged.append(("Content-Type", _Template(("application/json",), "")))
        return _Request(
            method, self.url(url, f"{path}.url", scope, handles), tuple(merged), compiled_body
        )

    def plan(self, o: HttpOptions) -> _Plan:
        base_url = self.template(o.base_url, "base_url", _SECRET)
        if o.base_url:
            first = base_url.parts[0]
            if isinstance(first, str) and not first.startswith(("http://", "https://")):
                self.fail("base_url", f"expected an http:// or https:// URL, got {o.base_url!r}")
        base_headers = self.headers(o.headers, "headers", _SECRET | _TASK)
        self.pointer(o.errors.code_pointer, "errors.code_pointer")
        for name in o.errors.reset_headers:
            if not _HEADER_NAME.fullmatch(name):
                self.fail("errors.reset_headers", f"{name!r} is not a header name")
        if o.submit.idempotency_header and not _HEADER_NAME.fullmatch(o.submit.idempotency_header):
            self.fail("submit.idempotency_header", "not a valid header name")
        submit_scope = _TASK | {"params", "base_url"}
        submit = self.request(
            o.submit.method,
            o.submit.url,
            o.submit.headers,
            o.submit.body,
            "submit",
            submit_scope,
            base_headers,
        )
        handles = frozenset(o.submit.handle)
        if "external_id" in handles:
            self.fail("submit.handle.external_id", "external_id is always kept; pick another name")
        query_scope = _TASK | {"external_id", "handle", "base_url"}
        q = o.query
        query = self.request(
            q.method, q.url, q.headers, q.body, "query", query_scope, base_headers, handles
        )
        cancel = None
        if o.cancel is not None:
            c = o.cancel
            cancel = self.request(
                c.method, c.url, c.headers, c.body, "cancel", query_scope, base_headers, handles
            )
        outcomes: dict[str, str] = {}
        for outcome in ("running", "succeeded", "failed"):
            for i, name in enumerate(getattr(q, outcome)):
                if name in outcomes:
                    self.fail(
                        f"query.{outcome}[{i}]",
                        f"{name!r} is already listed in query.{outcomes[name]}",
                    )
                outcomes[name] = outcome
        if not q.succeeded:
            self.fail("query.succeeded", "list at least one vendor status that means done")
        self._check_errors(o.errors)

        def optional(text: str | None, path: str) -> _Pointer | None:
            return None if text is None else self.pointer(text, path)

        result: _Pointer | tuple[tuple[str, _Pointer], ...]
        if isinstance(q.result, str):
            result = self.pointer(q.result, "query.result")
        else:
            result = tuple((k, self.pointer(p, f"query.result.{k}")) for k, p in q.result.items())
        files: tuple[_Pointer, ...] = ()
        hosts: list[str] = []
        download = put = None
        finalize_headers: tuple[tuple[str, _Template], ...] = ()
        if (f := o.finalize) is not None:
            if (f.dir is None) == (f.put is None):
                self.fail("finalize", "set exactly one of dir (a local directory) or put (a URL)")
            if f.dir is not None and not f.dir.startswith("/"):
                self.fail("finalize.dir", f"expected an absolute path, got {f.dir!r}")
            if not f.files:
                self.fail("finalize.files", "list at least one JSON pointer into the result")
            files = tuple(self.pointer(p, f"finalize.files[{i}]") for i, p in enumerate(f.files))
            if f.download is not None:
                download = self.url(f.download, "finalize.download", _TASK | {"base_url", "value"})
            for i, entry in enumerate(f.hosts):
                try:
                    hosts.append(host_pattern(entry))
                except ValueError as exc:
                    self.fail(f"finalize.hosts[{i}]", str(exc))
            if f.put is not None:
                put = self.url(f.put, "finalize.put", _TASK | {"name"})
            finalize_headers = self.headers(
                f.headers, "finalize.headers", _TASK | _SECRET | {"name"}
            )
        find = None
        if (fo := o.find) is not None:
            find = _FindPlan(
                request=self.request(
                    fo.method, fo.url, fo.headers, fo.body, "find", submit_scope, base_headers
                ),
                items=self.pointer(fo.items, "find.items"),
                match=self.pointer(fo.match, "find.match"),
                equals=self.template(fo.equals, "find.equals", submit_scope - {"base_url"}),
                id=self.pointer(fo.id, "find.id"),
                handle=tuple(
                    (k, self.pointer(p, f"find.handle.{k}")) for k, p in fo.handle.items()
                ),
                more=optional(fo.more, "find.more"),
                cursor=optional(fo.cursor, "find.cursor"),
                next_url=None
                if fo.next_url is None
                else self.url(fo.next_url, "find.next_url", _TASK | {"base_url", "value"}),
            )
            if (fo.next_url is None) != (fo.cursor is None):
                self.fail("find", "set both next_url and cursor (a paged listing), or neither")
            if set(fo.handle) != handles:
                self.fail(
                    "find.handle", f"name the same fields as submit.handle: {sorted(handles)}"
                )
        uses_base = any(
            ref.kind == "base_url"
            for request in (submit, query, cancel, find.request if find else None)
            if request is not None
            for ref in request.url.refs()
        ) or (download is not None and any(r.kind == "base_url" for r in download.refs()))
        if uses_base and not o.base_url:
            self.fail("base_url", "the URLs use {base_url}: set it")
        return _Plan(
            options=o,
            base_url=base_url,
            base_headers=base_headers,
            submit=submit,
            submit_id=self.pointer(o.submit.id, "submit.id"),
            submit_handle=tuple(
                (k, self.pointer(p, f"submit.handle.{k}")) for k, p in o.submit.handle.items()
            ),
            query=query,
            status=self.pointer(q.status, "query.status"),
            outcomes=outcomes,
            progress=optional(q.progress, "query.progress"),
            progress_total=optional(q.progress_total, "query.progress_total"),
            stage=optional(q.stage, "query.stage"),
            message=optional(q.message, "query.message"),
            result=result,
            error_code=optional(q.error_code, "query.error_code"),
            error_message=optional(q.error_message, "query.error_message"),
            gone=optional(q.gone, "query.gone"),
            cancel=cancel,
            finalize_files=files,
            finalize_download=download,
            finalize_hosts=tuple(hosts),
            finalize_put=put,
            finalize_headers=finalize_headers,
            find=find,
        )

    def _check_errors(self, errors: ErrorOptions) -> None:
        both = set(errors.permanent or ()) & set(errors.retryable)
        if both:
            self.fail("errors", f"{sorted(both)} are listed as both permanent and retryable")


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


def build(
    hc: HandlerConfig, *, index: int | None = None, text: str | None = None, source: str = ""
) -> HttpHandler:
    """Build the handler for one `type = "http"` entry; ConfigError names the bad key.

    `index` (the entry's position in `handlers`), `text` (the TOML source) and `source`
    (its file name) make messages read `config.toml:14: handlers[1].options.submit.url: ...`.
    """
    builder = _Builder(hc, index, text, source)
    options = builder.decode()
    plan = builder.plan(options)
    limit = options.max_connections or hc.concurrency
    return HttpHandler(
        hc.key,
        plan,
        max_connections=limit,
        proxy=hc.proxy,
        max_response_bytes=hc.max_response_bytes,
    )


def builders(
    configs: Sequence[HandlerConfig],
    path: str | os.PathLike[str] | None = None,
    *,
    text: str | None = None,
    source: str | None = None,
) -> dict[str, Callable[[HandlerConfig], HttpHandler]]:
    """The `builders` argument of `load_handlers`: {"http": ...}, with errors naming lines.

    Pass the config file's `path` (read again, for line numbers) or its `text` and `source`.
    """
    if text is None and path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            text = None
    if source is None:
        source = str(path) if path is not None else ("<config>" if text is not None else "")

    def build_one(hc: HandlerConfig) -> HttpHandler:
        index = next((i for i, c in enumerate(configs) if c is hc), None)
        if index is None:
            index = next((i for i, c in enumerate(configs) if c == hc), None)
        return build(hc, index=index, text=text, source=source)

    return {"http": build_one}
