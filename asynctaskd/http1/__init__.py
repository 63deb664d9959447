"""A lean HTTP/1.1 connection pool behind the shared client's transport.

Nearly every vendor call a handler makes is a small request whose whole answer arrives at
once. aiohttp's client and httpx's own pool spend several times this pool's CPU on such a
call (docs/performance-history.md, fifth pass); this pool
writes the request with one `transport.write` and feeds the answer to llhttp (the parser
of Node.js, through `httptools`, as uvicorn uses it) in `data_received`. An answer that is
complete when its first bytes have been parsed comes back whole; a longer one comes back
after its head, its body streaming from the connection with flow control
(`ResponseBody`). Either way no more than `max_response_bytes` of body are accepted: a
larger Content-Length is refused before its body is read, and a body that grows past the
limit fails the exchange and closes the connection (`ResponseTooLarge`).

"Never sent" is exact here: `PoolTimeout`, `ConnectTimeout` and `ConnectError` are raised
only while obtaining a connection, before the first byte of the request is written. Every
failure after that is ambiguous (`ReadTimeout`, `ReadError`, `RemoteProtocolError`), and
nothing is ever resent: a reused keep-alive connection that the server closed while the
request was on its way fails as `RemoteProtocolError`, like httpx's own pool reports it.
A close that already reached the socket is caught before reuse (see `_stirred`).

What it does not do, by design: HTTP/2, proxies (`asynctaskd.transport` routes proxied
origins elsewhere), request bodies that are not in memory, `Expect: 100-continue` waits
(the body is sent at once; an interim 1xx answer is skipped), protocol upgrades (a 101
answer ends the exchange and the connection), and a write timeout (the body is handed to
the kernel whole; the read timeout starts once it is). A HEAD answer's connection is not
reused (llhttp cannot be told that a HEAD answer's Content-Length announces no body).

The package holds two modules: `protocol`, one connection (an `asyncio.Protocol` that
writes a request and feeds the answer to llhttp, the answer and its streamed body), and
`pool`, the pool of those connections per origin (request checks, reuse, limits).
"""

from __future__ import annotations

from .pool import Http1Pool
from .protocol import Answer, ResponseBody, ResponseTooLarge

__all__ = ["Answer", "Http1Pool", "ResponseBody", "ResponseTooLarge"]
