"""Config errors as people read them: a msgspec error turned into the key it is about
and a message, and `line_of`, the line of the TOML text where a key path is set."""

from __future__ import annotations

import difflib
import re
from typing import Final, Literal, get_args, get_origin

import msgspec

from .tables import Config

__all__ = ["line_of"]

_KeyPath = tuple[str | int, ...]  # ("handlers", 1, "factory") for $.handlers[1].factory


# ---- error messages: msgspec path -> key and line ----

_UNKNOWN: Final = re.compile(r"Object contains unknown field `([^`]*)`")
_MISSING: Final = re.compile(r"Object missing required field `([^`]*)`")
_AT: Final = re.compile(r"(.*?)(?: - at `(\$[^`]*)`)?", re.DOTALL)
_SEGMENT: Final = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_TOML_TYPES: Final = {"object": "table", "str": "string", "int": "integer", "bool": "boolean"}


def _explain(error: str) -> tuple[str, str]:
    """Turn a msgspec ValidationError message into (path of the offending key, message)."""
    m = _AT.fullmatch(error)
    assert m is not None  # the pattern matches any string
    message, path = m[1], m[2] or "$"
    if unknown := _UNKNOWN.fullmatch(message):
        name = unknown[1]
        close = difflib.get_close_matches(name, _field_names(_segments(path)), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"{path}.{name}", f"unknown key{hint}"
    if missing := _MISSING.fullmatch(message):
        return f"{path}.{missing[1]}", "missing required key"
    if message.startswith("Invalid enum value"):
        choices = _literal_choices(_segments(path))
        if choices:
            message += f"; expected one of {', '.join(map(repr, choices))}"
    message = re.sub(r"`([^`]*)`", lambda t: _TOML_TYPES.get(t[1], t[1]), message)
    return path, message[:1].lower() + message[1:]


def _format(source: str, text: str, paths: list[str], message: str) -> str:
    line = _locate(text, paths)
    where = source if line is None else f"{source}:{line}"
    key = _display(paths[0])
    return f"{where}: {key}: {message}" if key else f"{where}: {message}"


def _format_syntax(source: str, error: str) -> str:
    m = re.fullmatch(r"(.*) \(at line (\d+), column (\d+)\)", error, re.DOTALL)
    if m is None:
        return f"{source}: invalid TOML: {error}"
    return f"{source}:{m[2]}:{m[3]}: invalid TOML: {m[1]}"


def _display(path: str) -> str:
    return path.removeprefix("$").removeprefix(".")


def _segments(path: str) -> _KeyPath:
    """("handlers", 1, "factory") for "$.handlers[1].factory" or "handlers[1].factory"."""
    path = path.removeprefix("$")
    if path and path[0] not in ".[":
        path = f".{path}"
    return tuple(int(index) if index else name for name, index in _SEGMENT.findall(path))


def _struct_at(segments: _KeyPath) -> type[msgspec.Struct] | None:
    struct: type[msgspec.Struct] = Config
    for segment in segments:
        if isinstance(segment, int):
            continue  # list indices: the element type was taken at the list field
        field = next((f for f in msgspec.structs.fields(struct) if f.name == segment), None)
        if field is None:
            return None
        field_type = field.type
        if get_origin(field_type) is list:
            field_type = get_args(field_type)[0]
        if not (isinstance(field_type, type) and issubclass(field_type, msgspec.Struct)):
            return None
        struct = field_type
    return struct


def _field_names(segments: _KeyPath) -> list[str]:
    struct = _struct_at(segments)
    return [] if struct is None else [f.name for f in msgspec.structs.fields(struct)]


def _literal_choices(segments: _KeyPath) -> tuple[object, ...]:
    struct = _struct_at(segments[:-1])
    if struct is None:
        return ()
    for field in msgspec.structs.fields(struct):
        if field.name != segments[-1]:
            continue
        if get_origin(field.type) is Literal:
            return get_args(field.type)
        for member in get_args(field.type):  # Literal[...] | None
            if get_origin(member) is Literal:
                return get_args(member)
    return ()


# ---- line_of: where a key path is set in TOML text ----

_KEY_PART: Final = r"""(?:[A-Za-z0-9_\-]+|"(?:[^"\\]|\\.)*"|'[^']*')"""
_DOTTED_KEY: Final = rf"{_KEY_PART}(?:\s*\.\s*{_KEY_PART})*"
_ARRAY_HEADER: Final = re.compile(rf"\s*\[\[\s*({_DOTTED_KEY})\s*\]\]")
_TABLE_HEADER: Final = re.compile(rf"\s*\[\s*({_DOTTED_KEY})\s*\]")
_KEY_LINE: Final = re.compile(rf"\s*({_DOTTED_KEY})\s*=")
_KEY_PART_RE: Final = re.compile(_KEY_PART)


def line_of(text: str, path: str) -> int | None:
    """The 1-based line of `text` where a key path like `$.handlers[1].factory` is set.

    Tables count from their header (`[worker]`, the second `[[handlers]]`), keys from
    `key =` (dotted keys and `[a.b]` headers included). None when the path is not in text.
    """
    return _key_lines(text).get(_segments(path))


def _locate(text: str, paths: list[str]) -> int | None:
    """The line of the first path found in text, else of the nearest enclosing table."""
    lines = _key_lines(text)
    for path in paths:
        if (line := lines.get(_segments(path))) is not None:
            return line
    for path in paths:
        segments = _segments(path)
        while segments:
            segments = segments[:-1]
            if (line := lines.get(segments)) is not None:
                return line
    return None


def _key_lines(text: str) -> dict[_KeyPath, int]:
    lines: dict[_KeyPath, int] = {}
    table: _KeyPath = ()
    last_index: dict[_KeyPath, int] = {}  # array-of-tables path -> last index
    depth, delimiter = 0, ""
    for number, line in enumerate(text.split("\n"), start=1):
        if depth or delimiter:  # inside a multi-line array, inline table or string
            depth, delimiter = _skip_value(line, depth, delimiter)
            continue
        if m := _ARRAY_HEADER.match(line):
            path = _resolve(_split_key(m[1]), last_index)
            index = last_index[path] = last_index.get(path, -1) + 1
            lines.setdefault(path, number)
            table = (*path, index)
            lines.setdefault(table, number)
        elif m := _TABLE_HEADER.match(line):
            table = _resolve(_split_key(m[1]), last_index)
            lines.setdefault(table, number)
        elif m := _KEY_LINE.match(line):
            keys = _split_key(m[1])
            for n in range(1, len(keys) + 1):
                lines.setdefault((*table, *keys[:n]), number)
            depth, delimiter = _skip_value(line[m.end() :], 0, "")
    return lines


def _split_key(dotted: str) -> list[str]:
    parts = [m[0] for m in _KEY_PART_RE.finditer(dotted)]
    return [p[1:-1] if p[0] in "\"'" else p for p in parts]


def _resolve(keys: list[str], last_index: dict[_KeyPath, int]) -> _KeyPath:
    """A header's path, with the current index after each array-of-tables prefix."""
    path: _KeyPath = ()
    for key in keys[:-1]:
        path = (*path, key)
        if path in last_index:
            path = (*path, last_index[path])
    return (*path, keys[-1])


def _skip_value(text: str, depth: int, delimiter: str) -> tuple[int, str]:
    """Scan part of a value: return the bracket depth and open multi-line string, if any."""
    i, n = 0, len(text)
    while i < n:
        if delimiter:
            if delimiter == '"""' and text[i] == "\\":
                i += 2
            elif text.startswith(delimiter, i):
                i, delimiter = i + 3, ""
            else:
                i += 1
            continue
        c = text[i]
        if c == "#":
            break
        if text.startswith('"""', i) or text.startswith("'''", i):
            i, delimiter = i + 3, text[i : i + 3]
        elif c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
        elif c == "'":
            end = text.find("'", i + 1)
            i = n if end < 0 else end + 1
        else:
            depth += (c in "[{") - (c in "]}")
            i += 1
    return max(depth, 0), delimiter
