"""HttpOptions compiled by the builder: templates parsed, pointers split, statuses indexed."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .options import HttpOptions
from .templates import _Pointer, _Template


@dataclass(frozen=True, slots=True)
class _Request:
    method: str
    url: _Template
    headers: tuple[tuple[str, _Template], ...]
    body: Any  # a compiled JSON tree, or _MISSING for no body


@dataclass(frozen=True, slots=True)
class _FileSpec:
    """A multipart file part: its text, or a list rendered one JSON value per line."""

    filename: str
    content: _Template | None
    jsonl: _Template | None  # exactly one placeholder
    content_type: str


@dataclass(frozen=True, slots=True)
class _Step:
    """A request the submit sends before the create (`submit.before`)."""

    name: str
    request: _Request
    multipart: tuple[tuple[str, _Template | _FileSpec], ...] | None
    keep: tuple[tuple[str, _Pointer], ...]


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
    next: _Pointer | None = None


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
    steps: tuple[_Step, ...] = ()
