"""Turns a Redis URL and TLS options into redis-py clients: TCP, TLS, unix socket or Sentinel.

URLs:
  redis://[user[:password]@]host[:port][/db][?option=value...]
  rediss://...                      the same over TLS
  unix://[user[:password]@]/path/to/redis.sock[?db=N]
  embedded:///path/to/data_dir[?db=N]   the embedded server of a daemon's redis.data_dir
  redis+sentinel://[user[:password]@]host[:port][,host[:port]...]/service[/db][?sentinel_auth=yes]
  rediss+sentinel://...             the same, with TLS to the sentinels and to the master
  redis+cluster://[user[:password]@]host[:port][,host[:port]...]   Redis Cluster seeds
  rediss+cluster://...              the same, with TLS to every node

Options in the query of a redis:// or rediss:// URL are those redis-py reads (`db`,
`ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`, `ssl_cert_reqs`, `ssl_check_hostname`, ...).
TLS files can also come from `TlsOptions` (the daemon's `[redis]` keys `tls_ca`, `tls_cert`,
`tls_key`, `tls_verify`); one setting in both places is an error, never a silent override.

Through Sentinel the client asks the sentinels for the master of `service` before each new
connection, so after a failover it reconnects to the promoted replica. User name and
password (from the URL or the credentials passed in) authenticate to the Redis nodes; the
sentinels get them too with `sentinel_auth=yes`. An asyncio client only ever uses
connections to the master the sentinels named last, and `follow_master` (run by the
daemon) asks them again every so often, so a failover is followed even while the old
master still answers.

Bad settings raise `ConfigError` before any connection is made: TLS files are read and
parsed up front, so a missing CA file or a key that does not fit its certificate is named
at start rather than at the first command.

The package holds three modules: `urls`, a URL and its TLS options checked and split into
what redis-py takes (`TlsOptions`, `connection_problems`, `local_url`); `clients`, the
clients and their pools (`open_async`, `open_sync`, connection classes that say what to
check when a handshake fails); `sentinel`, Sentinel's waiting pool that follows the
master (`follow_master`, `master_address`) and the options of Sentinel and Cluster nodes.
"""

from __future__ import annotations

from .clients import open_async, open_sync
from .sentinel import follow_master, master_address
from .urls import SCHEMES, TlsOptions, connection_problems
from .urls import SOCKET_NAME as SOCKET_NAME
from .urls import local_url as local_url
from .urls import socket_path as socket_path

__all__ = [
    "SCHEMES",
    "TlsOptions",
    "connection_problems",
    "follow_master",
    "master_address",
    "open_async",
    "open_sync",
]
