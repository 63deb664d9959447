"""The fake vendor over real sockets: one subprocess for the module, reset before each test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from asynctaskd.devtools.fakevendor import Behaviour, FakeVendorProcess
from tests.conftest import wait_until_sync

# Non-default knobs, so that starting the module's server also checks the CLI flags.
STARTED_WITH = Behaviour(retry_after=2, ambiguous_delay=2.0, seed=7)
INPUT = {"prompt": "a cat", "n": [1, 2.5, None]}


@pytest.fixture(scope="module")
def vendor_process() -> Iterator[FakeVendorProcess]:
    with FakeVendorProcess.start(STARTED_WITH) as vendor:
        yield vendor
    assert vendor.process.returncode == 0, vendor.stderr()


@pytest.fixture
def vendor(vendor_process: FakeVendorProcess) -> FakeVendorProcess:
    vendor_process.configure(**msgspec.structs.asdict(STARTED_WITH))
    vendor_process.reset()
    return vendor_process


@pytest.fixture
def http(vendor: FakeVendorProcess) -> Iterator[httpx.Client]:
    # trust_env=False: a proxy from the environment must not see loopback traffic.
    with httpx.Client(base_url=vendor.url, trust_env=False, timeout=5.0) as client:
        yield client


def submit(http: httpx.Client, key: str | None = None, ref: str | None = "t1") -> httpx.Response:
    headers = {} if key is None else {"Idempotency-Key": key}
    return http.post("/v1/jobs", json={"input": INPUT, "ref": ref}, headers=headers)


def poll(http: httpx.Client, job_id: str) -> dict[str, Any]:
    response = http.get(f"/v1/jobs/{job_id}")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_started_with_cli_flags(vendor: FakeVendorProcess, http: httpx.Client) -> None:
    assert msgspec.convert(http.get("/_config").json(), Behaviour) == STARTED_WITH
    assert http.get("/_health").status_code == 200


def test_job_succeeds_on_its_kth_poll(vendor: FakeVendorProcess, http: httpx.Client) -> None:
    created = submit(http)
    assert created.status_code == 201
    job_id = created.json()["id"]
    assert created.json() == {"id": job_id, "status": "queued"}
    assert job_id.startswith("job_")

    assert poll(http, job_id) == {"id": job_id, "status": "running", "progress": 1 / 3}
    assert poll(http, job_id) == {"id": job_id, "status": "running", "progress": 2 / 3}
    done = poll(http, job_id)
    assert done == {
        "id": job_id,
        "status": "succeeded",
        "progress": 1.0,
        "result": {"output": INPUT, "ref": "t1"},
    }
    assert poll(http, job_id) == done  # terminal: further polls change nothing

    [job] = vendor.jobs()
    assert (job["id"], job["polls"], job["status"]) == (job_id, 3, "succeeded")
    [entry] = vendor.submit_log()
    assert entry["outcome"] == "created"
    assert (entry["job_id"], entry["ref"], entry["idempotency_key"]) == (job_id, "t1", None)
    assert abs(entry["at"] - time.time()) < 60


def test_idempotency_key_returns_the_same_job(
    vendor: FakeVendorProcess, http: httpx.Client
) -> None:
    first = submit(http, key="key-a")
    again = submit(http, key="key-a", ref="t1-retry")
    other = submit(http, key="key-b")

    assert (first.status_code, again.status_code, other.status_code) == (201, 200, 201)
    assert again.json()["id"] == first.json()["id"] != other.json()["id"]
    assert len(vendor.jobs()) == 2
    log = vendor.submit_log()
    assert [e["outcome"] for e in log] == ["created", "deduped", "created"]
    assert [e["idempotency_key"] for e in log] == ["key-a", "key-a", "key-b"]
    assert log[1]["job_id"] == first.json()["id"]


def test_throttled_answers_429_with_retry_after(
    vendor: FakeVendorProcess, http: httpx.Client
) -> None:
    job_id = submit(http).json()["id"]
    vendor.configure(throttle_rate=1.0, retry_after=7)

    throttled = submit(http, key="k")
    assert throttled.status_code == 429
    assert throttled.headers["Retry-After"] == "7"
    assert throttled.json()["error"]["code"] == "rate_limited"
    polled = http.get(f"/v1/jobs/{job_id}")
    assert (polled.status_code, polled.headers["Retry-After"]) == (429, "7")

    assert [j["polls"] for j in vendor.jobs()] == [0]  # a throttled poll does not count
    assert [e["outcome"] for e in vendor.submit_log()] == ["created", "throttled"]


def test_error_rate_answers_500_and_creates_nothing(
    vendor: FakeVendorProcess, http: httpx.Client
) -> None:
    job_id = submit(http).json()["id"]
    vendor.configure(error_rate=1.0)

    failed = submit(http, key="k")
    assert failed.status_code == 500
    assert failed.json()["error"]["code"] == "internal"
    assert http.get(f"/v1/jobs/{job_id}").status_code == 500

    assert [(j["id"], j["polls"]) for j in vendor.jobs()] == [(job_id, 0)]
    log = vendor.submit_log()
    assert [(e["outcome"], e["job_id"]) for e in log] == [("created", job_id), ("error", None)]


def test_ambiguous_submit_creates_the_job_the_client_never_hears_of(
    vendor: FakeVendorProcess, http: httpx.Client
) -> None:
    vendor.configure(ambiguous_rate=1.0, ambiguous_delay=2.0)
    http.timeout = httpx.Timeout(5.0, read=0.3)  # shorter than ambiguous_delay
    late, dropped = 0, 0
    # Half the answers come late, half never; seeded, so a few attempts show both.
    while (late == 0 or dropped == 0) and late + dropped < 12:
        with pytest.raises(httpx.TransportError) as raised:
            submit(http, key=f"key-{late + dropped}")
        if isinstance(raised.value, httpx.ReadTimeout):
            late += 1
        else:
            dropped += 1
    assert late > 0
    assert dropped > 0
    attempts = late + dropped

    def every_submit_logged() -> list[dict[str, Any]]:
        log = vendor.submit_log()
        return log if len(log) == attempts else []

    log = wait_until_sync(every_submit_logged, "every submit in the log")
    assert {e["outcome"] for e in log} == {"ambiguous"}
    assert [e["job_id"] for e in log] == [j["id"] for j in vendor.jobs()]

    # The caller retries with the same key and learns the job exists after all.
    vendor.configure(ambiguous_rate=0.0)
    retry = submit(http, key="key-0")
    assert (retry.status_code, retry.json()["id"]) == (200, log[0]["job_id"])
    assert len(vendor.jobs()) == attempts


def test_fail_fraction_ends_jobs_failed(vendor: FakeVendorProcess, http: httpx.Client) -> None:
    vendor.configure(fail_fraction=1.0, polls_to_done=2)
    job_id = submit(http).json()["id"]

    assert poll(http, job_id)["status"] == "running"
    assert poll(http, job_id) == {
        "id": job_id,
        "status": "failed",
        "progress": 1.0,
        "error": {"code": "job_failed", "message": "the fake vendor failed this job"},
    }


def test_never_finish_fraction_keeps_jobs_running(
    vendor: FakeVendorProcess, http: httpx.Client
) -> None:
    vendor.configure(never_finish_fraction=1.0, polls_to_done=2)
    job_id = submit(http).json()["id"]

    views = [poll(http, job_id) for _ in range(5)]
    assert {v["status"] for v in views} == {"running"}
    assert max(v["progress"] for v in views) < 1.0


def test_cancel(vendor: FakeVendorProcess, http: httpx.Client) -> None:
    running = submit(http).json()["id"]
    poll(http, running)
    canceled = http.post(f"/v1/jobs/{running}/cancel")
    assert canceled.status_code == 200
    assert canceled.json() == {"id": running, "status": "canceled", "progress": 1 / 3}
    assert poll(http, running)["status"] == "canceled"

    vendor.configure(polls_to_done=1)
    finished = submit(http).json()["id"]
    assert poll(http, finished)["status"] == "succeeded"
    assert http.post(f"/v1/jobs/{finished}/cancel").json()["status"] == "succeeded"

    assert http.post("/v1/jobs/job_999999/cancel").status_code == 404


def test_config_partial_update(vendor: FakeVendorProcess) -> None:
    first = vendor.configure(polls_to_done=1)
    assert first == msgspec.structs.replace(STARTED_WITH, polls_to_done=1)
    second = vendor.configure(fail_fraction=0.5, query_latency=0)
    assert second == msgspec.structs.replace(first, fail_fraction=0.5)

    with pytest.raises(ValueError, match="error_rate"):
        vendor.configure(error_rate=2)
    with pytest.raises(ValueError, match="unknown field"):
        vendor.configure(polls_to_done=5, colour="red")
    assert vendor.configure() == second  # rejected updates changed nothing


def test_unknown_job_is_404(http: httpx.Client) -> None:
    response = http.get("/v1/jobs/job_999999")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize(
    "path", ["/v1/job", "/v1/jobs/", "/v1/jobs/job_1/", "/v1/jobs/job_1/cancel/now", "/_logs"]
)
def test_a_path_nothing_serves_is_404(http: httpx.Client, path: str) -> None:
    submit(http)  # job_1 exists, whatever its number
    for method in ("GET", "POST"):
        response = http.request(method, path)
        assert response.status_code == 404, (method, path)
        assert response.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/v1/jobs", "POST"),
        ("POST", "/v1/jobs/job_1", "GET"),
        ("GET", "/v1/jobs/job_1/cancel", "POST"),
        ("DELETE", "/_config", "GET, POST"),
        ("GET", "/_reset", "POST"),
    ],
)
def test_a_method_a_path_does_not_take_is_405(
    http: httpx.Client, method: str, path: str, allow: str
) -> None:
    response = http.request(method, path)
    assert response.status_code == 405
    assert response.headers["Allow"] == allow
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_head_answers_as_get_without_a_body(http: httpx.Client) -> None:
    job_id = submit(http).json()["id"]
    head = http.head(f"/v1/jobs/{job_id}")
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["Content-Length"]) > 0  # the length a GET's body has
    assert http.head("/v1/jobs").status_code == 405  # no GET there either


def test_a_submit_body_over_a_mebibyte_is_taken(http: httpx.Client) -> None:
    # The server's body limit is 16 MiB: a 3 MiB prompt is taken.
    big = "x" * (3 * 1024 * 1024)
    created = http.post("/v1/jobs", json={"input": big, "ref": "big"})
    assert created.status_code == 201
    for _ in range(STARTED_WITH.polls_to_done):
        done = poll(http, created.json()["id"])
    assert done["status"] == "succeeded" and done["result"]["output"] == big


def test_invalid_submit_is_400_and_logged(vendor: FakeVendorProcess, http: httpx.Client) -> None:
    response = http.post("/v1/jobs", json={"ref": "no input"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_request"
    assert [e["outcome"] for e in vendor.submit_log()] == ["invalid"]
    assert vendor.jobs() == []


def test_reset_forgets_jobs_keys_and_log(vendor: FakeVendorProcess, http: httpx.Client) -> None:
    before = submit(http, key="k").json()["id"]
    vendor.reset()
    assert (vendor.jobs(), vendor.submit_log()) == ([], [])
    after = submit(http, key="k")
    assert after.status_code == 201
    assert after.json()["id"] != before  # ids are never reused
    assert http.get(f"/v1/jobs/{before}").status_code == 404


def test_cli_announces_port_and_exits_cleanly_on_sigterm(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    root = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.getenv("PYTHONPATH")])),
    }
    argv = [sys.executable, "-m", "asynctaskd.devtools.fakevendor", "--port", "0"]
    with subprocess.Popen(
        [*argv, "--port-file", str(port_file)], stdout=subprocess.PIPE, text=True, env=env
    ) as process:
        try:
            assert process.stdout is not None
            line = process.stdout.readline()
            port = port_file.read_text()
            assert line == f"fakevendor listening on http://127.0.0.1:{port}\n"
            with httpx.Client(trust_env=False) as client:
                assert client.get(f"http://127.0.0.1:{port}/_health").status_code == 200
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=5) == 0
        finally:
            process.kill()  # no-op once it has exited; otherwise Popen.__exit__ would hang


def test_start_reports_the_child_stderr() -> None:
    with pytest.raises(RuntimeError, match=r"exited with status 2(.|\n)*error_rate"):
        FakeVendorProcess.start(Behaviour(error_rate=2.0))
