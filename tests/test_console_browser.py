"""The console end to end in a real headless Chromium (Debian's `chromium`, driven by
Playwright): `asynctaskd web` and `asynctaskd run` as processes, the fake vendor, the
test Redis. Log in, watch a task go live to SUCCEEDED, find it by its external id,
settle SUBMIT_UNKNOWN tasks both ways, pause and resume a handler, and a viewer that can
act on nothing (its requests without the CSRF token refused, with it refused by role).

Each page is photographed; with ASYNCTASKD_SCREENSHOTS=<dir> the pictures are kept there
(docs/console/ holds the ones docs/console.md shows).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from redis import Redis as SyncRedis

from asynctaskd.client import Client
from asynctaskd.devtools.fakevendor import Behaviour, FakeVendorProcess
from asynctaskd.embedded import ServerProcess, free_port
from asynctaskd.model import Status
from asynctaskd.web.tokens import Role, mint, tokens_key
from tests.configs import write_daemon_config
from tests.conftest import wait_until_sync

pytestmark = pytest.mark.slow

playwright_sync = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed: pip install -e '.[test]'"
)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SHOTS = os.environ.get("ASYNCTASKD_SCREENSHOTS")
VIEWPORT = {"width": 1360, "height": 860}


class Stack(msgspec.Struct):
    url: str
    redis: SyncRedis
    client: Client
    vendor: FakeVendorProcess

    def token(self, role: Role, tenant: str | None = None, note: str = "") -> str:
        token, record = mint(role, tenant, note)
        self.redis.hset(tokens_key("atd"), record.id, msgspec.json.encode(record))
        return token

    def status(self, task_id: str) -> Status | None:
        task = self.client.get(task_id)
        return None if task is None else task.status


def _wait_http(url: str, proc: subprocess.Popen[bytes], what: str) -> None:
    import httpx

    def up() -> bool:
        assert proc.poll() is None, f"{what} exited with {proc.returncode}"
        try:
            return httpx.get(url, timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    wait_until_sync(up, f"{what} to start", timeout=30)


@pytest.fixture(scope="module")
def stack(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if server.binary.name != "redis-server":
        pytest.skip("run once, on redis-server: the console reads the same on valkey")
    if CHROMIUM is None:
        pytest.skip("no Chromium: install Debian's chromium package (.ci/run does)")
    tmp = tmp_path_factory.mktemp("console")
    redis = SyncRedis.from_url(server.url)
    redis.flushdb()  # our own private server: safe
    vendor = FakeVendorProcess.start(Behaviour(polls_to_done=4, query_latency=0.2))
    web_port = free_port()
    config = write_daemon_config(tmp / "config.toml", server.url, vendor.url,
                                 worker={"lease": "5s"})  # fmt: skip
    config.write_text(config.read_text() + f'[web]\nlisten = "127.0.0.1:{web_port}"\n'
                      'token_cache = "100ms"\n')  # fmt: skip
    log = (tmp / "processes.log").open("wb")
    argv = [sys.executable, "-m", "asynctaskd"]
    procs = [
        subprocess.Popen(
            [*argv, cmd, "--config", str(config)], stdout=subprocess.DEVNULL, stderr=log
        )
        for cmd in ("run", "web")
    ]
    client = Client(redis, "atd")
    try:
        url = f"http://127.0.0.1:{web_port}"
        _wait_http(f"{url}/healthz", procs[1], "asynctaskd web")
        wait_until_sync(lambda: client.stats().daemons, "a live daemon", timeout=30)
        yield Stack(url, redis, client, vendor)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        vendor.stop()
        log.close()
        redis.close()


@pytest.fixture(scope="module")
def browser(stack: Stack) -> Iterator[Any]:
    with playwright_sync.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser: Any, stack: Stack) -> Iterator[Any]:
    context = browser.new_context(viewport=VIEWPORT, base_url=stack.url)
    page = context.new_page()
    page.set_default_timeout(15_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        yield page
    finally:
        context.close()
    assert not errors, f"the page raised: {errors}"


def shot(page: Any, name: str, *, full_page: bool = True) -> None:
    path = Path(SHOTS) / f"{name}.png" if SHOTS else None
    data = page.screenshot(full_page=full_page, path=path)
    assert len(data) > 1000


def login(page: Any, token: str) -> None:
    page.goto("/")
    page.fill("input[name=token]", token)
    page.click("button[type=submit]")
    page.wait_for_selector("#who:not([hidden])")


def confirm(page: Any, expected: str, photo: str = "") -> None:
    dialog = page.locator("dialog#confirm")
    dialog.wait_for(state="visible")
    assert expected in dialog.inner_text()
    if photo:  # the window from the top: the dialog's backdrop covers it, not the page
        page.evaluate("window.scrollTo(0, 0)")
        shot(page, photo, full_page=False)
    page.click("#confirm-yes")
    dialog.wait_for(state="hidden")


def submit(stack: Stack, **kw: Any) -> str:
    return stack.client.submit("demo", {"doc": "invoice.pdf", "pages": 3},
                               tracking_timeout=300, **kw).id  # fmt: skip


def test_log_in_and_watch_a_task_go_live_to_succeeded_then_find_it(page: Any, stack: Stack) -> None:
    page.goto("/")
    page.wait_for_selector("input[name=token]")
    assert not page.locator("nav").is_visible() and not page.locator("#logout").is_visible()
    shot(page, "login")
    page.fill("input[name=token]", "atd_0000000000000000_" + "x" * 43)
    page.click("button[type=submit]")
    page.wait_for_selector(".flash.error:not([hidden])")
    assert "unknown or revoked" in page.inner_text("#flash")
    login(page, stack.token("operator", note="ops on call"))
    assert "operator" in page.inner_text("#who-text")
    stack.vendor.configure(query_latency=0.6)  # slow enough to watch it move
    task_id = submit(stack, metadata={"customer": "acme", "order": 1234})
    page.goto(f"/#/task/{task_id}")
    page.wait_for_selector("#live .live")  # not settled when the page opened
    page.wait_for_selector("h1 .pill[data-status=SUCCEEDED]", timeout=30_000)
    statuses = page.locator("#timeline td .pill").all_inner_texts()
    assert statuses[-1] == "SUCCEEDED" and "SUBMITTED" in statuses, statuses
    assert stack.status(task_id) is Status.SUCCEEDED
    stack.vendor.configure(query_latency=0.0)
    shot(page, "task")
    # Find it by the vendor's id.
    task = stack.client.get(task_id)
    assert task is not None and task.external_id
    stack.vendor.configure(fail_fraction=0.3)  # a few more tasks, some of them failing
    for i in range(12):
        submit(stack, tenant="acme" if i % 2 else "globex")
    page.goto("/#/tasks")
    page.select_option("#finder select[name=by]", "external_id")
    page.fill("#finder input[name=q]", task.external_id)
    page.click("#finder button")
    page.wait_for_selector(f"#task-table tr[data-id='{task_id}']")
    assert page.locator("#task-table tbody tr").count() == 1

    def ended() -> int:
        counts = stack.client.stats().by_status
        return counts[Status.SUCCEEDED] + counts[Status.FAILED]

    wait_until_sync(lambda: ended() >= 13, "the other tasks to finish", timeout=30)
    stack.vendor.configure(fail_fraction=0.0)
    page.goto("/#/tasks")
    page.wait_for_selector("#task-table")
    assert page.locator("#task-table tbody tr").count() >= 13
    shot(page, "tasks")


def _parked(stack: Stack, wanted: int) -> list[str]:
    """Submit until `wanted` tasks are SUBMIT_UNKNOWN: the vendor now creates every job and
    cuts half of the connections before answering (an ambiguous submit)."""
    stack.vendor.configure(ambiguous_rate=1.0, ambiguous_delay=0.0)
    parked: list[str] = []
    ended = (Status.SUBMIT_UNKNOWN, Status.SUBMITTED, Status.RUNNING, Status.SUCCEEDED)
    try:
        for _ in range(40):
            task_id = submit(stack)
            wait_until_sync(lambda t=task_id: stack.status(t) in ended, "the submit", 20)
            if stack.status(task_id) is Status.SUBMIT_UNKNOWN:
                parked.append(task_id)
                if len(parked) == wanted:
                    return parked
    finally:
        stack.vendor.configure(ambiguous_rate=0.0)
    raise AssertionError("no submit was cut off in 40 tries")


def test_settle_submit_unknown_tasks_both_ways(page: Any, stack: Stack) -> None:
    first, second, third = _parked(stack, 3)
    login(page, stack.token("operator", note="ops on call"))
    page.goto("/#/inbox")
    for task_id in (first, second, third):
        page.wait_for_selector(f"#inbox tr[data-id='{first}']")
        assert page.locator(f"#inbox tr[data-id='{task_id}']").count() == 1
    page.wait_for_function("document.getElementById('inbox-count').textContent !== ''")
    shot(page, "inbox")
    # It exists: the vendor has the job the cut-off submit created; track that one.
    job = next(e for e in stack.vendor.submit_log() if e.get("ref") == first)
    page.goto(f"/#/task/{first}")
    page.fill("#give-external input[name=external_id]", job["job_id"])
    page.click("#give-external button")
    confirm(page, job["job_id"])
    wait_until_sync(lambda: stack.status(first) is Status.SUCCEEDED, "the tracked job", 30)
    task = stack.client.get(first)
    assert task is not None and task.external_id == job["job_id"] and task.submit_attempts == 1
    # It does not exist: submit again, two in bulk from the inbox.
    page.goto("/#/inbox")
    for task_id in (second, third):
        page.check(f"#inbox tr[data-id='{task_id}'] input[type=checkbox]")
    page.click("#bulk button[data-action=resubmit]")
    confirm(page, "submits these 2 tasks to the vendor again", "inbox-confirm")
    for task_id in (second, third):
        wait_until_sync(lambda t=task_id: stack.status(t) is Status.SUCCEEDED, "resubmit", 30)
        task = stack.client.get(task_id)
        assert task is not None and task.submit_attempts == 2
    page.wait_for_selector("#flash:not([hidden])")
    page.goto("/#/audit")
    page.wait_for_selector("#audit")
    audit = page.inner_text("#audit")
    assert audit.count("resolve") == 3 and "ops on call" in audit


def test_pause_and_resume_a_handler_and_the_overview(page: Any, stack: Stack) -> None:
    login(page, stack.token("operator", note="ops on call"))
    page.goto("/#/controls")
    page.select_option("#pause-form select[name=dimension]", "handler")
    page.fill("#pause-form input[name=value]", "demo")
    page.fill("#pause-form input[name=note]", "vendor maintenance until 14:00")
    page.click("#pause-form button[type=submit]")
    confirm(page, "stop claiming")
    page.wait_for_selector("#paused tr[data-dimension='handler:demo']")
    assert "handler:demo" in stack.client.paused()
    held = submit(stack)
    page.goto("/#/overview")
    page.wait_for_selector("#attention")
    assert "handler:demo" in page.inner_text("main")
    shot(page, "overview")
    page.fill("#tenant-form input[name=tenant]", "acme")
    page.click("#tenant-form button")
    page.wait_for_selector("#tenant-note")
    assert page.inner_text("h1") == "Tenant acme"
    page.goto("/#/controls")
    page.wait_for_selector("#paused")
    page.fill("#limit-form input[placeholder=name]", "demo")
    page.fill("#limit-form input[name=submit_rate]", "50")
    page.fill("#limit-form input[name=max_in_flight]", "200")
    page.click("#limit-form button[type=submit]")
    page.wait_for_selector("tr[data-scope='provider:demo']")
    limit = stack.client.limits()["provider:demo"].limit
    assert (limit.submit_rate, limit.max_in_flight) == (50, 200)
    shot(page, "controls")
    page.click("tr[data-scope='provider:demo'] button")
    confirm(page, "no longer held back")
    page.wait_for_selector("tr[data-scope='provider:demo']", state="detached")
    assert "provider:demo" not in stack.client.limits()
    page.click("#paused tr[data-dimension='handler:demo'] button[data-action=resume]")
    page.wait_for_selector("#paused", state="detached")
    assert stack.client.paused() == {}
    wait_until_sync(lambda: stack.status(held) is Status.SUCCEEDED, "the held task", 30)
    page.goto("/#/audit")
    page.wait_for_selector("#audit")
    actions = page.locator("#audit tbody td:nth-child(4)").all_inner_texts()
    assert actions[:4] == ["resume", "clear_limit", "set_limit", "pause"], actions
    shot(page, "audit")


def test_create_edit_and_delete_a_handler_group(page: Any, stack: Stack) -> None:
    login(page, stack.token("operator", note="ops on call"))
    page.goto("/#/controls")
    page.fill("#group-form input[name=name]", "ocr-pool")
    page.select_option("#group-form select[name=policy]", "weighted")
    page.fill("#group-form input[name=members]", "demo, demo-eu=3")
    page.click("#group-form button[type=submit]")
    confirm(page, "Submits to ocr-pool go to demo, demo-eu (weight 3) by weighted")
    page.wait_for_selector("#groups tr[data-group=ocr-pool]")
    group = stack.client.groups()["ocr-pool"]
    assert group.policy == "weighted"
    assert [(m.handler, m.weight) for m in group.members] == [("demo", 1), ("demo-eu", 3)]
    page.click("#groups tr[data-group=ocr-pool] button[data-action=edit]")
    assert page.input_value("#group-form input[name=members]") == "demo, demo-eu=3"
    page.fill("#group-form input[name=members]", "demo=2, demo-eu")
    page.click("#group-form button[type=submit]")
    confirm(page, "Change handler group ocr-pool", "group-confirm")
    wait_until_sync(lambda: [m.weight for m in stack.client.groups()["ocr-pool"].members]
                    == [2, 1], "the edit", 10)  # fmt: skip
    page.wait_for_selector("#groups tr[data-group=ocr-pool] td:has-text('demo=2')")
    page.click("#groups tr[data-group=ocr-pool] button[data-action=delete]")
    confirm(page, "Delete handler group ocr-pool?")
    page.wait_for_selector("#groups tr[data-group=ocr-pool]", state="detached")
    assert "ocr-pool" not in stack.client.groups()
    page.goto("/#/audit")
    page.wait_for_selector("#audit")
    rows = page.locator("#audit tbody tr").all_inner_texts()
    assert [r.split("\t")[3] for r in rows[:3]] == ["delete_group", "set_group", "set_group"]
    assert all("ocr-pool" in r for r in rows[:3])


def test_purge_settled_tasks_after_a_confirmation(page: Any, stack: Stack) -> None:
    done = submit(stack)
    wait_until_sync(lambda: stack.status(done) is Status.SUCCEEDED, "the task", 30)
    login(page, stack.token("operator", note="ops on call"))
    page.goto("/#/controls")
    page.fill("#purge-form input[name=age]", "1")
    page.select_option("#purge-form select[name=unit]", label="days")
    page.click("#purge-form button[type=submit]")
    confirm(page, "finished over 1 day ago?", "purge-confirm")
    page.wait_for_selector("#flash:not([hidden])")
    assert page.inner_text("#flash") == "0 tasks purged"  # none finished a day ago
    assert stack.status(done) is Status.SUCCEEDED
    page.fill("#purge-form input[name=age]", "0")
    page.click("#purge-form button[type=submit]")
    confirm(page, "Up to 1000 tasks that succeeded, failed, were canceled or timed out")
    page.locator("#flash", has_text=re.compile(r"^[1-9][0-9]* tasks purged")).wait_for()
    assert stack.status(done) is None
    page.goto("/#/audit")
    page.wait_for_selector("#audit")
    assert page.locator("#audit tbody tr").first.inner_text().split("\t")[3] == "purge"


def test_a_viewer_sees_its_tenant_and_can_act_on_nothing(page: Any, stack: Stack) -> None:
    mine = submit(stack, tenant="acme")
    theirs = submit(stack, tenant="globex")
    wait_until_sync(lambda: stack.status(mine) is Status.SUCCEEDED, "the task", 30)
    login(page, stack.token("viewer", "acme", note="acme support"))
    # Its overview: its own tenant's counts, from a walk that read every task here.
    page.wait_for_selector("#tenant-note")
    assert page.locator("nav a:visible").all_inner_texts() == ["Overview", "Tasks"]
    assert page.inner_text("h1") == "Tenant acme" and "Exact" in page.inner_text("#tenant-note")
    acme = stack.client.list(tenant="acme", status=Status.SUCCEEDED, limit=1000).tasks
    tile = page.locator(".tile.t-SUCCEEDED .n").inner_text()
    assert tile == f"{len(acme):,}", (tile, len(acme))
    shot(page, "tenant")
    page.goto("/#/tasks")
    page.wait_for_selector("#task-table")
    tenants = page.locator("#task-table tbody tr td:nth-child(4)").all_inner_texts()
    assert tenants and set(tenants) == {"acme"}
    page.goto(f"/#/task/{mine}")
    page.wait_for_selector("h1 .pill")
    assert page.locator("#actions").count() == 0
    # The API refuses the session's changes: without the CSRF token, and by role with it.
    results = page.evaluate(
        """async ([id]) => {
            const csrf = (await (await fetch('/console/api/session')).json()).csrf;
            const post = (headers) => fetch(`/api/v1/tasks/${id}/requeue`,
                {method: 'POST', headers}).then(async r => [r.status, (await r.json()).error.code]);
            return [await post({}), await post({'X-CSRF-Token': csrf})];
        }""",
        [mine],
    )
    assert results == [[403, "csrf"], [403, "forbidden"]]
    page.goto(f"/#/task/{theirs}")
    page.wait_for_selector(".flash.error:not([hidden])")
    assert "no task" in page.inner_text("#flash")
