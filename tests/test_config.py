"""Config: decoding, defaults, Duration, error locations, line_of and redaction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from asynctaskd.config import (
    Config,
    Delay,
    Duration,
    HandlerConfig,
    LimitConfig,
    WorkerConfig,
    line_of,
    load_config,
    parse_config,
    parse_listen,
)
from asynctaskd.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parent.parent / "config.example.toml"

PYTHON_HANDLER = '[[handlers]]\nkey = "demo"\nfactory = "pkg.mod:make"\n'


def error_of(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="config.toml")
    return str(info.value)


# ---- the example file and defaults ----


def test_example_decodes_to_the_defaults_plus_one_handler() -> None:
    config = load_config(EXAMPLE)
    assert msgspec.structs.replace(config, handlers=[]) == Config()
    assert config.handlers == [
        HandlerConfig(
            key="demo",
            type="python",
            factory="asynctaskd.devtools.demo:make_handler",
            options={"base_url": "http://127.0.0.1:8080"},
        )
    ]


def test_example_documents_every_key() -> None:
    text = EXAMPLE.read_text(encoding="utf-8")
    sections = {f.name: f.type for f in msgspec.structs.fields(Config)}
    for section, struct in sections.items():
        if section == "limits":  # the example shows [[limits]] commented out
            for field in msgspec.structs.fields(LimitConfig):
                assert f"# {field.name} = " in text, field.name
            continue
        if section == "handlers":
            struct, prefix = HandlerConfig, "$.handlers[0]"
        else:
            prefix = f"$.{section}"
        for field in msgspec.structs.fields(struct):
            if field.default is None:  # TOML has no null: shown commented out
                assert f"# {field.name} = " in text, field.name
            else:
                assert line_of(text, f"{prefix}.{field.name}") is not None, field.name


def test_empty_text_gives_defaults() -> None:
    assert parse_config("") == Config()


def test_structs_are_frozen_and_keyword_only() -> None:
    config = Config()
    with pytest.raises(AttributeError):
        config.worker = WorkerConfig()  # type: ignore[misc]  # frozen: the point of the test
    with pytest.raises(TypeError):
        WorkerConfig("w1")  # type: ignore[call-arg]  # kw_only: the point of the test


# ---- Duration ----


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (30, 30.0),
        (2.5, 2.5),
        ("250ms", 0.25),
        ("30s", 30.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("7d", 604800.0),
        ("1.5h", 5400.0),
        (" 10 s ", 10.0),
    ],
)
def test_duration_parses(value: object, seconds: float) -> None:
    duration = Duration.parse(value)
    assert isinstance(duration, Duration)
    assert duration == pytest.approx(seconds)


@pytest.mark.parametrize(
    "value",
    ["soon", 0, -1, True, "5 parsecs", "", "30", "-5s", "0s", "5M", float("inf"), None, [5]],
)
def test_duration_rejects(value: object) -> None:
    with pytest.raises(ValueError, match="duration"):
        Duration.parse(value)


def test_duration_from_toml() -> None:
    config = parse_config('[worker]\nlease = "2m"\n[retry]\npoll_interval = 0.5\n')
    assert config.worker.lease == 120.0
    assert isinstance(config.worker.lease, Duration)
    assert config.retry.poll_interval == 0.5
    handler = parse_config(PYTHON_HANDLER + 'poll_interval = "10s"\n').handlers[0]
    assert handler.poll_interval == 10.0


@pytest.mark.parametrize(("value", "seconds"), [(0, 0.0), (0.0, 0.0), ("0ms", 0.0), ("2ms", 0.002)])
def test_a_delay_may_be_zero(value: object, seconds: float) -> None:
    delay = Delay.parse(value)
    assert isinstance(delay, Delay) and delay == seconds


@pytest.mark.parametrize("value", [-1, "-2ms", "soon", True, None, float("nan")])
def test_a_delay_rejects(value: object) -> None:
    with pytest.raises(ValueError, match="expected 0 or a duration"):
        Delay.parse(value)


def test_claim_linger_and_poll_jitter_defaults_and_bounds() -> None:
    config = parse_config("")
    assert (config.worker.claim_linger, config.retry.poll_jitter) == (0.002, 0.05)
    config = parse_config("[worker]\nclaim_linger = 0\n[retry]\npoll_jitter = 0\n")
    assert (config.worker.claim_linger, config.retry.poll_jitter) == (0.0, 0.0)
    assert error_of('[worker]\nclaim_linger = "2s"\n').startswith(
        "config.toml:2: worker.claim_linger: must be at most 1s, got 2s"
    )
    assert error_of("[retry]\npoll_jitter = 0.6\n").startswith(
        "config.toml:2: retry.poll_jitter: expected float <= 0.5"
    )


# ---- errors name the file, the line and the key ----


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            '[worker]\nlease = "soon"\n',
            "config.toml:2: worker.lease: expected seconds or a duration like '30s' or '5m',"
            " got 'soon'",
            id="bad-duration",
        ),
        pytest.param(
            "# comment\n[worker]\nmax_inflight = 3\nconcurency = 4\n",
            "config.toml:4: worker.concurency: unknown key",
            id="unknown-key",
        ),
        pytest.param(
            PYTHON_HANDLER + "concurency = 4\n",
            "config.toml:4: handlers[0].concurency: unknown key; did you mean 'concurrency'?",
            id="unknown-handler-key",
        ),
        pytest.param(
            "[metrics]\nenabled = true\n\n[workers]\nid = 'x'\n",
            "config.toml:4: workers: unknown key; did you mean 'worker'?",
            id="unknown-table",
        ),
        pytest.param(
            '[worker]\nbatch_size = "100"\n',
            "config.toml:2: worker.batch_size: expected integer, got string",
            id="wrong-type",
        ),
        pytest.param(
            "worker = 3\n",
            "config.toml:1: worker: expected table, got integer",
            id="table-expected",
        ),
        pytest.param(
            '[log]\nlevel = "loud"\n',
            "config.toml:2: log.level: invalid enum value 'loud'; expected one of 'debug',"
            " 'info', 'warning', 'error'",
            id="bad-literal",
        ),
        pytest.param(
            PYTHON_HANDLER + PYTHON_HANDLER,
            "config.toml:5: handlers[1].key: duplicate handler key 'demo' (also at line 2)",
            id="duplicate-handler-key",
        ),
        pytest.param(
            '[[handlers]]\nkey = "a"\nfactory = "x:y"\n[[handlers]]\nkey = "b"\n',
            "config.toml:4: handlers[1].factory: required for python handlers",
            id="missing-factory",
        ),
        pytest.param(
            '[[handlers]]\nkey = "a"\nfactory = "not a factory"\n',
            "config.toml:3: handlers[0].factory: expected 'package.module:callable',"
            " got 'not a factory'",
            id="bad-factory",
        ),
        pytest.param(
            '[[handlers]]\nfactory = "x:y"\n',
            "config.toml:1: handlers[0].key: missing required key",
            id="missing-handler-key",
        ),
        pytest.param(
            '[[handlers]]\nkey = "has space"\nfactory = "x:y"\n',
            "config.toml:2: handlers[0].key: expected 1-64 characters",
            id="bad-handler-key",
        ),
        pytest.param(
            '[[handlers]]\nkey = "h"\ntype = "http"\n',
            "config.toml:1: handlers[0].options: http handlers need an options table",
            id="http-without-options",
        ),
        pytest.param(
            '[metrics]\nlisten = "localhost"\n',
            "config.toml:2: metrics.listen: expected host:port",
            id="bad-listen",
        ),
        pytest.param(
            '[metrics]\nlisten = "127.0.0.1:70000"\n',
            "config.toml:2: metrics.listen: expected host:port with a port in 0..65535",
            id="listen-port-range",
        ),
        pytest.param(
            "[retry]\nmax_error_delay = 0.5\n",
            "config.toml:2: retry.first_error_delay: 1s must not exceed retry.max_error_delay",
            id="first-error-delay-over-max",
        ),
        pytest.param(
            "worker.lease = 0.5\n",
            "config.toml:1: worker.lease: must be at least 1s, got 0.5s",
            id="short-lease-dotted-key",
        ),
        pytest.param(
            '[redis]\nnamespace = "a b"\n',
            "config.toml:2: redis.namespace: expected 1-32 characters",
            id="bad-namespace",
        ),
        pytest.param(
            '[redis]\nurl = "http://localhost"\n',
            "config.toml:2: redis.url: expected a redis://",
            id="bad-url",
        ),
        pytest.param(
            '[redis]\nurl = "redis://[::1"\n',
            "config.toml:2: redis.url: expected a redis://",
            id="malformed-url",
        ),
        pytest.param(
            "bogus = 1\n",
            "config.toml:1: bogus: unknown key",
            id="unknown-top-level",
        ),
    ],
)
def test_error_names_file_line_and_key(text: str, expected: str) -> None:
    assert error_of(text).startswith(expected)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[worker]\nbatch_size = 0\n", "worker.batch_size: expected integer >= 1"),
        ("[worker]\nbatch_size = 1001\n", "worker.batch_size: expected integer <= 1000"),
        ("[worker]\nmax_inflight = 0\n", "worker.max_inflight: expected integer >= 1"),
        ("[redis]\nshards = 0\n", "redis.shards: expected integer >= 1"),
        ("[redis]\nwait_replicas = -1\n", "redis.wait_replicas: expected integer >= 0"),
        ("[retry]\njitter = 1.5\n", "retry.jitter: expected float <= 1"),
        ("[reaper]\nbatch = 0\n", "reaper.batch: expected integer >= 1"),
        (PYTHON_HANDLER + "concurrency = 0\n", "handlers[0].concurrency: expected integer >= 1"),
    ],
)
def test_msgspec_constraints_name_the_key(text: str, key: str) -> None:
    message = error_of(text)
    assert message.startswith(f"config.toml:{text.count(chr(10))}: {key}"), message


def test_post_decode_problems_are_all_reported() -> None:
    message = error_of('[metrics]\nlisten = "x"\n[[handlers]]\nkey = "a"\n')
    assert message.splitlines() == [
        "config.toml:2: metrics.listen: expected host:port with a port in 0..65535, got 'x'",
        "config.toml:3: handlers[0].factory: required for python handlers",
    ]


def test_toml_syntax_error_keeps_its_line() -> None:
    message = error_of('[worker]\nlease = "10s"\n[retry\n')
    assert message.startswith("config.toml:3:7: invalid TOML: ")


def test_constraints_run_on_convert_not_on_construction() -> None:
    # STYLE section 4, note 2: build configs in tests through msgspec.convert.
    assert WorkerConfig(batch_size=0).batch_size == 0
    with pytest.raises(msgspec.ValidationError, match=r"\$\.worker\.batch_size"):
        msgspec.convert({"worker": {"batch_size": 0}}, Config)


def test_load_config_reports_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=r"nope\.toml: cannot read config"):
        load_config(missing)
    bad = tmp_path / "bad.toml"
    bad.write_text('[worker]\n\nlease = "soon"\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"^.*bad\.toml:3: worker\.lease: expected seconds"):
        load_config(bad)
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(binary)


# ---- line_of ----

TOML = """\
# leading comment
title = "x"

[redis]
url = "redis://h"   # trailing comment

[worker]
  lease = "10s"
"quoted" = 1
a.b.c = 2

[[handlers]]
key = "first"
options = { list = [
  1,
  2,
] }
after = 1

[[handlers]]
key = "second"
note = '''
[worker]
lease = 1
'''
factory = "p.m:f"

[handlers.options]
token = "t"
"""


@pytest.mark.parametrize(
    ("path", "line"),
    [
        ("$.title", 2),
        ("$.redis", 4),
        ("$.redis.url", 5),
        ("$.worker", 7),
        ("$.worker.lease", 8),
        ("worker.lease", 8),
        ("$.worker.quoted", 9),
        ("$.worker.a", 10),
        ("$.worker.a.b.c", 10),
        ("$.handlers", 12),
        ("$.handlers[0]", 12),
        ("$.handlers[0].key", 13),
        ("$.handlers[0].options", 14),
        ("$.handlers[0].after", 18),
        ("$.handlers[1]", 20),
        ("$.handlers[1].key", 21),
        ("$.handlers[1].factory", 26),
        ("$.handlers[1].options", 28),
        ("$.handlers[1].options.token", 29),
    ],
)
def test_line_of(path: str, line: int) -> None:
    assert line_of(TOML, path) == line


@pytest.mark.parametrize(
    "path", ["$.handlers[2]", "$.handlers[0].factory", "$.worker.batch_size", "$.metrics"]
)
def test_line_of_missing_path(path: str) -> None:
    assert line_of(TOML, path) is None


# ---- parse_listen ----


@pytest.mark.parametrize(
    ("listen", "expected"),
    [
        ("127.0.0.1:9464", ("127.0.0.1", 9464)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
        ("localhost:65535", ("localhost", 65535)),
        ("[::1]:9464", ("::1", 9464)),
    ],
)
def test_parse_listen(listen: str, expected: tuple[str, int]) -> None:
    assert parse_listen(listen) == expected


@pytest.mark.parametrize(
    "listen", ["9464", ":9464", "host:", "host:port", "host:65536", "::1:9464", "h:-1"]
)
def test_parse_listen_rejects(listen: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        parse_listen(listen)


# ---- redaction for check-config ----


def test_redacted_masks_url_password_and_secret_options() -> None:
    config = parse_config(
        '[redis]\nurl = "redis://app:hunter2@db:6379/0"\n'
        "[[handlers]]\n"
        'key = "ocr"\n'
        'factory = "p.m:f"\n'
        "options = { api_key = 'k1', base_url = 'https://u:pw@vendor', timeout = 5,"
        " headers = { Authorization = 'Bearer t', Accept = 'json' },"
        " accounts = [{ client_secret = 's', name = 'n' }], password = 'p', Token = 't' }\n"
    )
    data = config.redacted()
    assert data["redis"]["url"] == "redis://app:***@db:6379/0"
    handler = data["handlers"][0]
    assert handler["key"] == "ocr"
    assert handler["options"] == {
        "api_key": "***",
        "base_url": "https://u:***@vendor",
        "timeout": 5,
        "headers": {"Authorization": "***", "Accept": "json"},
        "accounts": [{"client_secret": "***", "name": "n"}],
        "password": "***",
        "Token": "***",
    }
    assert "hunter2" not in repr(data)
    assert config.handlers[0].options["api_key"] == "k1"  # the config itself is untouched


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
        ("rediss://h:6380/1", "rediss://h:6380/1"),
        ("redis://h/0?password=pw&db=1", "redis://h/0?password=***&db=1"),
        ("embedded", "embedded"),
    ],
)
def test_redacted_redis_urls(url: str, shown: str) -> None:
    data = parse_config(f'[redis]\nurl = "{url}"\n').redacted()
    assert data["redis"]["url"] == shown


def test_redacted_is_plain_data() -> None:
    data: dict[str, Any] = load_config(EXAMPLE).redacted()
    assert type(data["worker"]["lease"]) is float
    assert data["worker"]["lease"] == 10.0
    assert msgspec.json.decode(msgspec.json.encode(data)) == data


def test_limits_are_checked_with_the_key_and_line() -> None:
    message = error_of("""
[[limits]]
provider = "openai"
submit_rate = 5

[[limits]]
tenant = "acme"
submit_rate = 5
""")
    assert "config.toml:8: limits[1].submit_rate: rates apply to a provider or account" in message
    assert "name exactly one of provider" in error_of('[[limits]]\nprovider = "p"\ntenant = "t"\n')
    assert "a burst needs submit_rate" in error_of(
        '[[limits]]\nprovider = "p"\nmax_in_flight = 2\nsubmit_burst = 3\n'
    )
    assert "a second entry for provider:p" in error_of(
        '[[limits]]\nprovider = "p"\nmax_in_flight = 2\n'
        '[[limits]]\nprovider = "p"\nquery_rate = 1\n'
    )
    assert "limits[0].quota_period: expected seconds or a duration" in error_of(
        '[[limits]]\ntenant = "*"\nquota = 5\nquota_period = "x"\n'
    )
    assert "set at least one" in error_of('[[limits]]\ntenant = "*"\n')


@pytest.mark.parametrize("retention", ['"0.5ms"', '"3661d"'])
def test_a_retention_the_scripts_would_refuse_is_a_config_error(retention: str) -> None:
    """It is written to each shard's settings as retention_ms, which every script that
    finishes a task checks: an out-of-range value must stop the daemon at start-up."""
    with pytest.raises(ConfigError, match=r"reaper\.retention: must be from 1ms to 3660d"):
        parse_config(f"[reaper]\nretention = {retention}\n")
    assert parse_config('[reaper]\nretention = "3660d"\n').reaper.retention == 3660 * 86400
