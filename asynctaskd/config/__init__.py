"""TOML config decoded into frozen msgspec Structs; errors name the key and the file line.

The package holds: `tables`, the Structs of each table (`[redis]`, `[worker]`, ...,
`[[handlers]]`, `[[limits]]`) and the whole `Config`; `durations`, the `Duration` and
`Delay` types and the `decode_hook` every decoder of config data uses; `loading`,
`parse_config` and `load_config` with the rules msgspec cannot express; `messages`,
errors turned into the key and line they are about (`line_of`); `redaction`, what
`Config.redacted` masks.
"""

from __future__ import annotations

from .durations import Delay, Duration, decode_hook
from .loading import load_config, parse_config, parse_listen
from .messages import line_of
from .tables import (
    Config,
    HandlerConfig,
    LimitConfig,
    LogConfig,
    MetricsConfig,
    ReaperConfig,
    RedisConfig,
    RetryConfig,
    TelemetryConfig,
    WebConfig,
    WorkerConfig,
)

__all__ = [
    "Config",
    "Delay",
    "Duration",
    "HandlerConfig",
    "LimitConfig",
    "LogConfig",
    "MetricsConfig",
    "ReaperConfig",
    "RedisConfig",
    "RetryConfig",
    "TelemetryConfig",
    "WebConfig",
    "WorkerConfig",
    "decode_hook",
    "line_of",
    "load_config",
    "parse_config",
    "parse_listen",
]
