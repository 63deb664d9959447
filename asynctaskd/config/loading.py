"""Reading a config: `parse_config` and `load_config` decode TOML into `Config` and check
the rules msgspec cannot express; `parse_listen` splits a host:port."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

import msgspec
import msgspec.toml

from asynctaskd.connection import SCHEMES, connection_problems
from asynctaskd.errors import ConfigError
from asynctaskd.keys import HANDLER_KEY_RE, SETTINGS

from .durations import decode_hook
from .messages import _explain, _format, _format_syntax, line_of
from .tables import Config

__all__ = ["load_config", "parse_config", "parse_listen"]

_NAMESPACE: Final = re.compile(r"[A-Za-z0-9_.\-]{1,32}")
_FACTORY: Final = re.compile(r"[\w.]+:[\w.]+")
_REDIS_SCHEMES: Final = frozenset(SCHEMES)


def parse_listen(listen: str) -> tuple[str, int]:
    """Split "host:port" (IPv6 as "[::1]:9464") into host and port; ValueError if malformed."""
    host, sep, port_text = listen.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"expected host:port with IPv6 in brackets, got {listen!r}")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"expected host:port with a port in 0..65535, got {listen!r}")
    return host, int(port_text)


def load_config(path: Path) -> Config:
    """Read and validate a TOML config file; ConfigError names the file, line and key."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from exc
    return parse_config(text, source=str(path))


def parse_config(text: str, source: str = "<string>") -> Config:
    """Decode and validate TOML text; `source` names it in ConfigError messages."""
    try:
        config = msgspec.toml.decode(text, type=Config, dec_hook=decode_hook)
    except msgspec.ValidationError as exc:
        path, message = _explain(str(exc))
        raise ConfigError(_format(source, text, [path], message)) from exc
    except msgspec.DecodeError as exc:
        raise ConfigError(_format_syntax(source, str(exc))) from exc
    problems = [_format(source, text, paths, msg) for paths, msg in _check(config, text)]
    if problems:
        raise ConfigError("\n".join(problems))
    return config


def _check(config: Config, text: str) -> Iterator[tuple[list[str], str]]:
    """Rules msgspec cannot express: each problem with the key paths that locate it."""
    if config.redis.url != "embedded" and _scheme(config.redis.url) not in _REDIS_SCHEMES:
        yield (
            ["$.redis.url"],
            "expected a redis://, rediss://, unix://, redis+sentinel://, rediss+sentinel://, "
            "redis+cluster:// or rediss+cluster:// URL, or 'embedded'",
        )
    elif config.redis.url != "embedded":
        for field, message in connection_problems(config.redis.url, config.redis.tls):
            key = f"tls_{field}" if field in ("ca", "cert", "key", "verify") else "url"
            yield [f"$.redis.{key}"], message
    else:
        for key in ("tls_ca", "tls_cert", "tls_key", "tls_verify"):
            if getattr(config.redis, key) is not None:
                yield [f"$.redis.{key}"], "the embedded server speaks plain TCP: remove tls_*"
                break
    if not _NAMESPACE.fullmatch(config.redis.namespace):
        yield ["$.redis.namespace"], "expected 1-32 characters of A-Z a-z 0-9 _ . -"
    if config.worker.lease < 1:
        yield ["$.worker.lease"], f"must be at least 1s, got {float(config.worker.lease):g}s"
    if config.worker.claim_linger > 1:
        yield (
            ["$.worker.claim_linger"],
            f"must be at most 1s, got {float(config.worker.claim_linger):g}s: it delays "
            "due work after every claim round that found little (a few ms is plenty)",
        )
    first, most = config.retry.first_error_delay, config.retry.max_error_delay
    if first > most:
        yield (
            ["$.retry.first_error_delay", "$.retry.max_error_delay"],
            f"{float(first):g}s must not exceed retry.max_error_delay ({float(most):g}s)",
        )
    # the daemons write it to each shard's settings as retention_ms (docs/protocol.md)
    retention_ms, (lo, hi) = round(float(config.reaper.retention) * 1000), SETTINGS["retention_ms"]
    if not lo <= retention_ms <= hi:
        yield (
            ["$.reaper.retention"],
            f"must be from 1ms to {hi // 86_400_000}d (10 years), "
            f"got {float(config.reaper.retention):g}s",
        )
    try:
        parse_listen(config.metrics.listen)
    except ValueError as exc:
        yield ["$.metrics.listen"], str(exc)
    try:
        parse_listen(config.web.listen)
    except ValueError as exc:
        yield ["$.web.listen"], str(exc)
    if config.web.metrics_listen:
        try:
            _, port = parse_listen(config.web.metrics_listen)
        except ValueError as exc:
            yield ["$.web.metrics_listen"], str(exc)
        else:
            if port and config.web.metrics_listen == config.web.listen:
                yield ["$.web.metrics_listen"], "must not be web.listen: the API's listener"
    if not 0 < config.web.token_cache <= 300:
        yield ["$.web.token_cache"], "must be more than 0s and at most 5m"
    if not 1 <= config.web.keepalive <= 300:
        yield ["$.web.keepalive"], "must be from 1s to 5m"
    first_seen: dict[str, int] = {}
    for i, handler in enumerate(config.handlers):
        at = f"$.handlers[{i}]"
        if not HANDLER_KEY_RE.fullmatch(handler.key):
            yield [f"{at}.key"], "expected 1-64 characters of A-Z a-z 0-9 _ . : -"
        elif handler.key in first_seen:
            other = first_seen[handler.key]
            where = line_of(text, f"$.handlers[{other}].key")
            also = f"line {where}" if where is not None else f"handlers[{other}]"
            yield [f"{at}.key"], f"duplicate handler key {handler.key!r} (also at {also})"
        else:
            first_seen[handler.key] = i
        if handler.provider and not HANDLER_KEY_RE.fullmatch(handler.provider):
            yield [f"{at}.provider"], "expected 1-64 characters of A-Z a-z 0-9 _ . : -"
        if handler.type == "python":
            if not handler.factory:
                yield [f"{at}.factory", at], "required for python handlers"
            elif not _FACTORY.fullmatch(handler.factory):
                yield (
                    [f"{at}.factory"],
                    f"expected 'package.module:callable', got {handler.factory!r}",
                )
        else:
            if handler.factory:
                yield [f"{at}.factory"], "only python handlers take a factory"
            if not handler.options:
                yield [f"{at}.options", at], "http handlers need an options table"
    scopes: dict[str, int] = {}
    for i, limit in enumerate(config.limits):
        at = f"$.limits[{i}]"
        for name, message in limit.problems():
            yield [f"{at}.{name}", at], message
        if limit.scope in scopes:
            yield [at], f"a second entry for {limit.scope} (also limits[{scopes[limit.scope]}])"
        scopes.setdefault(limit.scope, i)


def _scheme(url: str) -> str:
    try:
        return urlsplit(url).scheme
    except ValueError:  # e.g. an unclosed IPv6 bracket
        return ""
