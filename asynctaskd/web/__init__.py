"""The HTTP API (`asynctaskd web`, docs/api.md): producers in any language submit, read,
watch and cancel tasks over JSON and Server-Sent Events, with bearer tokens bound to a
role and a tenant.

Nothing else in asynctaskd imports this package: producers using the Python client and
the daemons never load a web server. `make_app` gives the aiohttp Application, to run
inside another aiohttp server; `serve_web` runs it as a process of its own.
"""

from __future__ import annotations

from .app import ApiError, WebSettings, make_app
from .metrics import WebMetrics
from .server import run_web, serve_web

__all__ = ["ApiError", "WebMetrics", "WebSettings", "make_app", "run_web", "serve_web"]
