"""Templates and JSON pointers: placeholders parsed and checked when the config is loaded,
rendered per request (values percent-encoded in URLs, unsafe ones refused)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import quote

import msgspec

from asynctaskd.errors import PermanentError

from .credentials import _Secrets

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


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return msgspec.json.encode(value).decode()


# ---- templates ----------------------------------------------------------------------------------


_SECRET: Final = frozenset({"env", "file", "credential"})


_SECRET_REF: Final = re.compile(r"\{(env|file|credential):([^{}?]+)\??\}")


_TASK: Final = frozenset({"task_id", "idempotency_key"})


_NAMES: Final = frozenset(
    {
        "params", "handle", "external_id", "base_url", "idempotency_key", "task_id", "value",
        "name", "steps", "submit_attempt",
    }
)  # fmt: skip


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
    if head == "steps" and len(path) != 2:
        raise _TemplateError(f"{text}: name a step and a kept value, as in {{steps.upload.id}}")
    if path and head not in ("params", "handle", "steps"):
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
    fields = {"params": "{params.x}", "handle": "{handle.x}", "steps": "{steps.name.x}"}
    shown = [fields.get(n, f"{{{n}}}") for n in names]
    if allowed & _SECRET:
        shown.append("{env:NAME} {file:/path} {credential:NAME}")
    return " ".join(shown) or "none"


def _check_scope(
    ref: _Ref,
    allowed: frozenset[str],
    handle_names: frozenset[str],
    steps: Mapping[str, frozenset[str]] | None = None,
) -> None:
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
    if ref.kind == "steps":
        steps = steps or {}
        name, key = ref.path
        if name not in steps:
            known = ", ".join(sorted(steps)) or "none"
            raise _TemplateError(f"{ref.text}: no step {name!r} comes before this ({known} do)")
        if key not in steps[name]:
            known = ", ".join(sorted(steps[name])) or "none"
            raise _TemplateError(f"{ref.text}: step {name!r} keeps no {key!r} (it keeps {known})")


# ---- rendering ----------------------------------------------------------------------------------


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


@dataclass(slots=True)
class _Vars:
    task_id: str
    idempotency_key: str
    base_url: str = ""
    params: Any = _MISSING
    external_id: str = ""
    handle: Mapping[str, Any] = field(default_factory=dict)
    steps: Mapping[str, Any] = field(default_factory=dict)  # step name -> {key: kept value}
    submit_attempt: int = 0  # which submit of the task this is (1, 2, ...): submit and find
    value: Any = None
    name: str = ""


class _Rendering:
    """HttpHandler's rendering of compiled templates with one request's values."""

    _secrets: _Secrets

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
        elif kind == "steps":
            value = _walk(v.steps, ref.path)
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
