"""The handlers' HTTP client: a stock `httpx.AsyncClient` over our own transport.

Handlers get `ctx.http`, an unmodified `httpx.AsyncClient`; httpx's own connection pool
degrades badly with hundreds of concurrent requests, so the client built by
`make_http_client` sends through `PoolTransport`, plugged in at httpx's public transport
seam (`httpx.AsyncBaseTransport`). A request whose body is in memory (nearly every vendor
call) goes through `asynctaskd.http1.Http1Pool`, whose answers llhttp parses; a request
whose body streams goes through an `aiohttp.ClientSession`. Origins the environment or the
handler routes through a proxy are mounted on httpx's own `httpx.AsyncHTTPTransport(proxy=...)`
(`proxy_map` says which, with httpx's own rules). Every route bounds the response body
at `max_response_bytes`, while reading (`ResponseTooLarge`).

httpx's client costs as much CPU per request again as the transport under it (URL parsing,
request and response models, auth and redirect machinery). `ctx.fetch` (a `Fetcher`) is
the fast way around it for the plain calls handlers make: method, URL, headers, a bytes
or JSON body, a `Reply` with status, headers and the whole body.

The worker reads the exception class to decide whether a failed submit may be sent again:
`httpx.ConnectError`, `httpx.ConnectTimeout` and `httpx.PoolTimeout` mean "the request
provably never reached the vendor" (safe to resubmit); every other `httpx.TransportError`
means "it may have arrived" (ambiguous: query or reconcile, never blindly resubmit). A
wrong "never sent" is a duplicate vendor job. `Http1Pool` raises those three only while
obtaining a connection, before any byte of the request is written. Through a proxy,
httpx's transport raises them only while connecting to the proxy (or, for https, while
opening the TLS session inside the tunnel); a proxy that refuses the tunnel (an answer
other than 2xx to CONNECT) becomes `ConnectError` too: the vendor never saw a byte. A
plain-http request goes to the proxy whole, so whatever happens after the proxy accepted
the connection is ambiguous, and a proxy's own error answer (502, say) is a response like
any other. On the aiohttp side, this module claims "never sent" only with two independent
pieces of evidence:

1. the aiohttp exception class is one aiohttp raises only while obtaining a connection, and
2. the request was still inside the connector's `connect()` (waiting for a pool slot or
   opening a connection) when it failed: none was ever handed to it. A connector of our
   own records that per request (aiohttp's `TraceConfig` signals could too, but any trace
   config makes aiohttp build and send a dozen trace events per request: a third more
   CPU per request, measured).

Everything else maps to an ambiguous error, including failures that in fact happened before
any byte was written but cannot be proved so (a reused keep-alive connection that the
server had already closed, or a proxy that closed the connection while answering CONNECT).

Known gaps, by design: neither the pool nor aiohttp enforces ``timeout.write`` (aiohttp has
no write timeout; `Http1Pool` hands the kernel the whole request at once); on the aiohttp
side ``timeout.pool`` and ``timeout.connect`` become one shared budget (see
`_client_timeout`); ``max_keepalive_connections`` counts only as 0 (no keep-alive) or not;
each route keeps its own pool of up to ``max_connections``; the ``trace``,
``sni_hostname`` and ``target`` request extensions are ignored outside the proxy route.
`max_response_bytes` bounds the bytes on the wire: httpx decodes a compressed body after
the transport, unbounded (`Fetcher` decodes gzip and deflate itself, within the bound).

The package holds three modules: `pool`, the transports (`PoolTransport`, and
`ProxyTransport` with `proxy_map`); `streamed`, the aiohttp route for streamed bodies and
the mapping of aiohttp's exceptions to httpx's; `fetcher`, the fast API (`Fetcher`,
`Reply`) and `make_http_client`, which puts them together.
"""

from __future__ import annotations

from asynctaskd.http1 import ResponseTooLarge

from .fetcher import Fetcher, Reply, fetcher_for, make_http_client
from .pool import DEFAULT_MAX_RESPONSE_BYTES, PoolTransport, ProxyTransport, proxy_map

__all__ = [
    "DEFAULT_MAX_RESPONSE_BYTES",
    "Fetcher",
    "PoolTransport",
    "ProxyTransport",
    "Reply",
    "ResponseTooLarge",
    "fetcher_for",
    "make_http_client",
    "proxy_map",
]
