"""The operator dashboard: in a real headless Chromium (Debian's, driven by Selenium through the system chromedriver:
nothing is downloaded), and its guards over plain HTTP (no session, a tenant key, actions without the CSRF token,
escaping of user data).

The browser test signs in, watches a task go QUEUED -> SUCCEEDED and a failure land in the dead letters without a
reload, then replays the dead letter through its button and its confirmation dialog and sees the replay run. With
TASKGATE_SCREENSHOT=1 it also writes docs/dashboard.png (the README's picture); CI leaves the file alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from services.http import dashboard, dashboard_page
from services.worker import service as worker_service
from taskgate import auth
from taskgate.config import ModelSpec, Settings
from taskgate.runtime import Backends
from taskgate.states import Status
from tests.support import harness, sleepy
from tests.support.factories import put_in
from tests.support.harness import ROOT, HttpStack
from tests.support.webhooks import Reply, WebhookReceiver

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SCREENSHOT = ROOT / "docs" / "dashboard.png"
SMALL = {"num_frames": 9, "width": 32, "height": 32, "num_inference_steps": 8}

needs_browser = pytest.mark.skipif(
    not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()),
    reason=f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}); .ci/run installs them when root",
)


@pytest.fixture
def settings(settings: Settings) -> Settings:
    models = {
        **settings.models,
        "later": ModelSpec(kind="sleep", sleep_seconds=1.5),  # no worker serves it until the test starts one
        "flaky": sleepy.spec(0.2, fail_times=1),  # every task's first attempt fails (retryable)
    }
    return settings.model_copy(update={
        "models": models, "default_model": "later", "progress_interval_seconds": 0.05, "submits_per_minute": 10_000,
        "webhook_schedule_seconds": [0.0, 0.2],  # a receiver answering 500 has a FAILED delivery within a second
    })


@pytest.fixture
async def stack(settings: Settings, backends: Backends) -> AsyncIterator[HttpStack]:
    async with harness.http_stack(settings, backends) as s:  # no worker: each test starts the ones it needs
        yield s


@contextlib.asynccontextmanager
async def worker(settings: Settings, worker_id: str, models: list[str], *, fixed: bool = False) -> AsyncIterator[Any]:
    """A worker with two slots serving `models`; `fixed`: the 'flaky' model's cause repaired (no attempt fails)."""
    specs = {**settings.models, "flaky": ModelSpec(kind="sleep", sleep_seconds=0.2)} if fixed else settings.models
    update = {"models": specs, "worker_models": models, "worker_id": worker_id, "worker_slots": 2}
    handle = await worker_service.start(settings.model_copy(update=update))
    try:
        yield handle
    finally:
        await handle.stop(grace=0)


async def submit(api: httpx.AsyncClient, **request: Any) -> str:
    answer = await api.post("/v1/tasks", json={"params": SMALL, **request})
    assert answer.status_code == 201, answer.text
    return str(answer.json()["task"]["id"])


class Browser:
    """A headless Chromium at 1366x768 on the dashboard; every method blocks (the test runs them in a thread, so the
    services in this event loop keep serving)."""

    def __init__(self, base: str, profile: Path) -> None:
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)  # with the driver's path below, Selenium Manager never runs
        for arg in (
            "--headless=new",
            "--no-sandbox",
            "--disable-dev-shm-usage",
            "--disable-gpu",
            "--window-size=1366,768",
            f"--user-data-dir={profile}",
            "--no-first-run",
            "--disable-extensions",
            "--disable-background-networking",
            "--force-color-profile=srgb",
            "--hide-scrollbars",
        ):
            options.add_argument(arg)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        self.driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
        self.base = base

    def quit(self) -> None:
        self.driver.quit()

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def until(self, script: str, *args: Any, within: float = 20.0) -> Any:
        """Waits for `script` to return something truthy, and returns it; on timeout, fails with the page's text."""
        try:
            return WebDriverWait(self.driver, within, poll_frequency=0.1).until(
                lambda d: d.execute_script(script, *args)
            )
        except Exception:
            raise AssertionError(
                f"never true: {script}\n--- page:\n{self.js('return document.body.innerText')}"
            ) from None

    def sign_in(self, key: str) -> None:
        self.driver.get(f"{self.base}/dashboard")
        field = self.driver.find_element(By.ID, "key")
        assert field.get_attribute("type") == "password"
        assert self.js("return document.querySelector('label[for=key]').textContent") == "Admin API key"
        field.send_keys(key)
        field.submit()
        self.until("return document.getElementById('section-queue') !== null")
        self.js("window.notReloaded = true")  # gone if anything reloads the page

    def status_of(self, task_id: str, wanted: str, within: float = 20.0) -> None:
        """Waits until the task's row (waiting, running or recently finished) says `wanted`."""
        self.until("return document.querySelector(`[data-task-id='${arguments[0]}']`)?.dataset.status === arguments[1]",
                   task_id, wanted, within=within)

    def click(self, selector: str) -> None:
        """A real click; again on the new element when a refresh swapped the section in between finding and clicking."""
        for _ in range(10):
            try:
                self.driver.find_element(By.CSS_SELECTOR, selector).click()
                return
            except StaleElementReferenceException:
                continue
        raise AssertionError(f"{selector} kept being replaced")

    def keyboard_open(self, selector: str) -> str:
        """Focuses the button (as Tab reaches it), presses Enter and waits for the dialog; returns the button's id."""
        # found and focused in one script: a refresh swapping the section in between cannot leave a stale element
        opener = str(
            self.js("const button = document.querySelector(arguments[0]); button.focus(); return button.id", selector)
        )
        self.press(Keys.ENTER)
        self.until("return document.getElementById('confirm').open")
        return opener

    def press(self, key: str) -> None:
        ActionChains(self.driver).send_keys(key).perform()

    def errors(self) -> list[str]:
        return [e["message"] for e in self.driver.get_log("browser") if e["level"] == "SEVERE"]

    def screenshot(self, path: Path) -> None:
        """The whole page at the laptop's width (the viewport is 768 high; the page scrolls)."""
        for _ in range(3):  # grow the window until the viewport holds the page (a resize may reflow it)
            height, inner, outer = self.js("return [document.documentElement.scrollHeight, innerHeight, outerHeight]")
            if inner >= height:
                break
            self.driver.set_window_size(1366, height + outer - inner)
        self.js("window.scrollTo(0, 0); document.activeElement?.blur()")
        self.driver.save_screenshot(str(path))
        self.driver.set_window_size(1366, 768)


async def in_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return await asyncio.to_thread(fn, *args, **kwargs)


@needs_browser
async def test_the_dashboard_in_a_browser(stack: HttpStack, settings: Settings, tmp_path: Path) -> None:
    async with (
        httpx.AsyncClient(base_url=stack.url, headers=stack.headers(), timeout=20) as api,
        WebhookReceiver(lambda _r: Reply(status=500, body=b"receiver down")) as receiver,
    ):
        browser: Browser = await in_thread(Browser, stack.url, tmp_path / "chromium")
        try:
            await in_thread(browser.sign_in, stack.admin_key)

            # a task nobody serves yet waits QUEUED, in the waiting list and in its model x priority row
            later = await submit(api, model_id="later", prompt="a lighthouse at dusk")
            await in_thread(browser.status_of, later, "QUEUED")
            queued = "const row = document.querySelector('#section-queue tr[data-model=later][data-priority=NORMAL]');"
            await in_thread(browser.until, queued + "return row && row.cells[3].textContent.trim() === '1'")

            # a task whose only attempt fails (no retries left) becomes a dead letter, its webhook failing
            async with worker(settings, "w-broken", ["flaky"]):
                flaky = await submit(
                    api,
                    model_id="flaky",
                    prompt="a storm <b>over</b> the sea",
                    max_retries=0,
                    callback_url=receiver.url(),
                )
                await in_thread(browser.until, "return document.getElementById(`replay-dead-${arguments[0]}`)", flaky)
            # (its failure row may come a refresh later: the sections' TaskAdmin reads run side by side)
            await in_thread(
                browser.until, "return document.querySelector(`[data-failed-id='${arguments[0]}']`) !== null", flaky
            )
            await in_thread(
                browser.until,
                "return document.querySelector(`#section-webhooks button[data-task='${arguments[0]}']`)",
                flaky,
            )
            last_answer = await in_thread(
                browser.js, "return document.querySelector('#section-webhooks tbody tr').innerText"
            )
            assert "HTTP 500" in last_answer and "receiver down" in last_answer

            # the cause fixed: a worker takes the queued task to SUCCEEDED, on the page, without a reload
            async with worker(settings, "w-fixed", ["later", "flaky"], fixed=True):
                await in_thread(
                    browser.until, "return document.querySelector(`#section-workers tr[data-worker=w-fixed]`)"
                )
                await in_thread(browser.status_of, later, "SUCCEEDED", within=30)

                # replay the dead letter: its button, the confirmation dialog, and the replay linked and run
                await in_thread(browser.click, f"#replay-dead-{flaky}")
                await in_thread(browser.until, "return document.getElementById('confirm').open")
                assert flaky in await in_thread(
                    browser.js, "return document.getElementById('confirm-text').textContent"
                )
                await in_thread(browser.click, "#confirm-ok")
                linked = (
                    "return document.querySelector(`[data-dead-id='${arguments[0]}'] "
                    "[data-replayed-as]`)?.dataset.replayedAs"
                )
                replay = await in_thread(browser.until, linked, flaky)
                assert replay != flaky
                notice = await in_thread(browser.until, "return document.getElementById('notice').textContent")
                assert f"as task {replay}" in notice, notice
                await in_thread(browser.status_of, replay, "SUCCEEDED", within=30)
                assert f"replay of {flaky}" in await in_thread(
                    browser.js, "return document.querySelector(`[data-task-id='${arguments[0]}']`).innerText", replay
                )
                link = await in_thread(
                    browser.js, "return document.querySelector(`[data-dead-id='${arguments[0]}'] a`).hash", flaky
                )
                assert link == f"#task-{replay}"

                # the other action: redeliver the failing webhook, confirmed the same way
                await in_thread(browser.click, f"#section-webhooks button[data-task='{flaky}']")
                await in_thread(browser.until, "return document.getElementById('confirm').open")
                await in_thread(browser.click, "#confirm-ok")
                await in_thread(
                    browser.until, "return document.getElementById('notice').textContent.includes('redelivering')"
                )

                # by keyboard: Enter opens the confirmation on Cancel, Escape backs out, doing nothing, focus back
                before = await in_thread(browser.js, "return document.getElementById('notice').textContent")
                opener = await in_thread(browser.keyboard_open, f"#section-webhooks button[data-task='{flaky}']")
                assert await in_thread(browser.js, "return document.activeElement.value") == "cancel"
                await in_thread(browser.press, Keys.ESCAPE)
                await in_thread(browser.until, "return !document.getElementById('confirm').open")
                await in_thread(browser.until, "return document.activeElement.id === arguments[0]", opener)
                assert await in_thread(browser.js, "return document.getElementById('notice').textContent") == before

                if os.environ.get("TASKGATE_SCREENSHOT"):
                    await busy_for_the_picture(api, browser)
                    await in_thread(browser.screenshot, SCREENSHOT)

            # every change came without a reload
            assert await in_thread(browser.js, "return window.notReloaded === true")
            assert await in_thread(browser.errors) == []  # no script error, no CSP violation, nothing failed to load
        finally:
            await in_thread(browser.quit)


@needs_browser
async def test_a_read_only_key_gets_the_dashboard_without_controls_in_a_browser(
    stack: HttpStack, backends: Backends, tmp_path: Path
) -> None:
    viewer, _ = await auth.create_admin_key(backends.pool, stack.settings.api_key_pepper, "viewer", scope=auth.READ)
    browser: Browser = await in_thread(Browser, stack.url, tmp_path / "chromium")
    try:
        await in_thread(browser.sign_in, viewer)
        assert (
            await in_thread(browser.js, "return document.getElementById('read-only').textContent")
            == "Read-only key: no actions"
        )
        failed = str(await failed_task(backends))  # arrives with the next refresh: its rows, and still no control
        await in_thread(browser.until, "return document.querySelector(`[data-dead-id='${arguments[0]}']`)", failed)
        await in_thread(browser.until, "return document.querySelector(`[data-failed-id='${arguments[0]}']`)", failed)
        assert await in_thread(browser.js, "return document.querySelectorAll('main button').length") == 0
        assert await in_thread(browser.js, "return window.notReloaded === true")
        assert await in_thread(browser.errors) == []
    finally:
        await in_thread(browser.quit)


async def busy_for_the_picture(api: httpx.AsyncClient, browser: Browser) -> None:
    """A few more tasks, so the picture has running ones with progress and a queue by priority."""
    ids = [await submit(api, model_id="later", prompt=p, priority=pr) for p, pr in (
        ("a paper boat on a river", "PRIORITY_NORMAL"), ("timelapse of clouds over mountains", "PRIORITY_NORMAL"),
        ("a cat watching rain", "PRIORITY_LOW"), ("fireworks over a harbour", "PRIORITY_LOW"),
    )]
    await in_thread(browser.until, "return document.querySelectorAll('#section-running progress').length >= 2")
    await in_thread(
        browser.until, "return [...document.querySelectorAll('#section-running progress')].every(p => p.value >= 20)"
    )
    assert ids


# ---------------------------------------------------------------- over plain HTTP


def cookie_header(response: httpx.Response) -> str:
    [cookie] = [v for k, v in response.headers.multi_items() if k == "set-cookie"]
    return cookie


async def test_sign_in_needs_an_admin_key_and_actions_need_the_csrf_token(stack: HttpStack, backends: Backends) -> None:
    async with httpx.AsyncClient(base_url=stack.url, timeout=20) as web:
        # no session: the sign-in form, and nothing else
        page = await web.get("/dashboard")
        assert page.status_code == 200 and 'action="/dashboard/login"' in page.text and "csrf-token" not in page.text
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        assert (await web.get("/dashboard/state.json")).status_code == 401
        refused = await web.post("/dashboard/actions/replay", json={"task_id": "1"})
        assert refused.status_code == 401

        # a tenant key, an unknown key and a non-key are refused with the reason, and no cookie
        tenant = await web.post("/dashboard/login", data={"key": stack.api_key})
        assert tenant.status_code == 403 and "not an admin key" in tenant.text and "set-cookie" not in tenant.headers
        unknown = await web.post("/dashboard/login", data={"key": "tg_nope"})
        assert unknown.status_code == 401 and "not valid" in unknown.text
        assert (await web.post("/dashboard/login", data={"key": "é"})).status_code == 400
        cross = await web.post("/dashboard/login", data={"key": stack.admin_key}, headers={"origin": "https://evil.example"})
        assert cross.status_code == 403 and "set-cookie" not in cross.headers

        # the admin key: a session cookie, HttpOnly and SameSite=Strict (Secure when the request came over https)
        signed = await web.post("/dashboard/login", data={"key": stack.admin_key})
        assert signed.status_code == 303 and signed.headers["location"] == "/dashboard"
        cookie = cookie_header(signed).lower()
        assert (
            "httponly" in cookie
            and "samesite=strict" in cookie
            and "path=/dashboard" in cookie
            and "secure" not in cookie
        )
        async with httpx.AsyncClient(base_url=stack.url, timeout=20) as behind_tls:
            over_tls = await behind_tls.post(
                "/dashboard/login", data={"key": stack.admin_key}, headers={"x-forwarded-proto": "https"}
            )
        assert "; secure" in cookie_header(over_tls).lower()

        page = await web.get("/dashboard")
        assert page.status_code == 200 and "Queue depth" in page.text
        match = re.search(r'<meta name="csrf-token" content="([^"]+)">', page.text)
        assert match is not None
        csrf = match.group(1)
        nonce = re.search(r"script-src 'nonce-([^']+)'", page.headers["content-security-policy"])
        assert nonce is not None and f'<script nonce="{nonce.group(1)}">' in page.text

        # a FAILED task to act on, made first: its claim is the real (fair) one, which takes its level's oldest task
        failed = await failed_task(backends)

        # user data is escaped wherever it shows
        async with httpx.AsyncClient(base_url=stack.url, headers=stack.headers(), timeout=20) as api:
            await submit(api, model_id="later", prompt="<img src=x onerror=alert(1)> & \"quotes\"")
        state = await web.get("/dashboard/state.json")
        assert state.status_code == 200 and set(state.json()["sections"]) == set(dashboard_page.SECTIONS)
        waiting = state.json()["sections"]["waiting"]
        assert "&lt;img src=x onerror=alert(1)&gt; &amp; &#34;quotes&#34;" in waiting and "<img" not in waiting

        # actions: the CSRF token, a JSON body and the same origin, or nothing happens
        body = {"task_id": str(failed)}
        no_token = await web.post("/dashboard/actions/replay", json=body)
        assert no_token.status_code == 403 and "CSRF" in no_token.json()["message"]
        wrong = await web.post("/dashboard/actions/replay", json=body, headers={"x-csrf-token": "x" + csrf[1:]})
        assert wrong.status_code == 403
        elsewhere = await web.post("/dashboard/actions/replay", json=body, headers={"x-csrf-token": csrf, "origin": "https://evil.example"})
        assert elsewhere.status_code == 403
        as_form = await web.post("/dashboard/actions/replay", data=body, headers={"x-csrf-token": csrf})
        assert as_form.status_code == 415
        assert await backends.pool.fetchval("SELECT count(*) FROM task WHERE replay_of = $1", failed) == 0
        bad_id = await web.post(
            "/dashboard/actions/replay", json={"task_id": "1; DROP"}, headers={"x-csrf-token": csrf}
        )
        assert bad_id.status_code == 400
        assert (await web.post("/dashboard/actions/nope", json=body, headers={"x-csrf-token": csrf})).status_code == 404

        done = await web.post("/dashboard/actions/replay", json=body, headers={"x-csrf-token": csrf})
        assert done.status_code == 200 and done.json()["ok"] is True, done.text
        replay = await backends.pool.fetchval("SELECT id FROM task WHERE replay_of = $1", failed)
        assert done.json()["message"] == f"Task {failed} replayed as task {replay}."
        again = await web.post("/dashboard/actions/replay", json=body, headers={"x-csrf-token": csrf})
        assert again.json()["ok"] is False and "skipped" in again.json()["message"]
        unfinished = await web.post(
            "/dashboard/actions/redeliver", json={"task_id": str(replay)}, headers={"x-csrf-token": csrf}
        )
        assert unfinished.json() == {"ok": False, "message": f"Task {replay} has no webhook to redeliver."}

        # sign-out needs the token too, then the cookie is worth nothing
        assert (await web.post("/dashboard/logout", data={"csrf": "nope"})).status_code == 403
        out = await web.post("/dashboard/logout", data={"csrf": csrf})
        assert out.status_code == 303 and 'max-age=0' in cookie_header(out).lower()
        web.cookies.set(
            dashboard.COOKIE, re.split("[=;]", cookie_header(signed))[1], domain="127.0.0.1", path="/dashboard"
        )
        assert (await web.get("/dashboard/state.json")).status_code == 401


async def failed_task(backends: Backends) -> int:
    """A FAILED task with its dead letter."""
    task = await put_in(backends.pool, Status.FAILED, model_id="later", max_retries=0)
    await backends.pool.execute("INSERT INTO dead_letter (task_id, reason) VALUES ($1, 'retries exhausted')", task.id)
    return task.id


def test_sessions_end_after_idling_or_their_lifetime() -> None:
    now = [1000.0]
    sessions = dashboard.Sessions(clock=lambda: now[0])
    sid, session = sessions.open("tg_key")
    assert sessions.get(sid) is session and sessions.get("other") is None and sessions.get(None) is None
    now[0] += dashboard.IDLE_SECONDS - 1
    assert sessions.get(sid) is session  # each request restarts the idle clock
    now[0] += dashboard.IDLE_SECONDS + 1
    assert sessions.get(sid) is None
    sid, session = sessions.open("tg_key")
    for _ in range(int(dashboard.SESSION_SECONDS // 600)):
        now[0] += 600
        assert sessions.get(sid) is session
    now[0] += 600
    assert sessions.get(sid) is None  # however busy
    other, _ = sessions.open("tg_key")
    sessions.close(other)
    assert sessions.get(other) is None


async def test_a_revoked_key_ends_its_session(stack: HttpStack, backends: Backends) -> None:
    key, _ = await auth.create_key(backends.pool, stack.settings.api_key_pepper, "ops2", admin=True)
    async with httpx.AsyncClient(base_url=stack.url, timeout=20) as web:
        assert (await web.post("/dashboard/login", data={"key": key})).status_code == 303
        assert (await web.get("/dashboard/state.json")).status_code == 200
        await backends.pool.execute("UPDATE admin_credential SET revoked_at = now() WHERE name = 'ops2'")

        async def signed_out() -> bool:
            return (await web.get("/dashboard/state.json")).status_code == 401

        await harness.wait_for(signed_out, within=15, every=0.5)  # the revocation reaches the scheduler as a NOTIFY
        page = await web.get("/dashboard")
        assert 'action="/dashboard/login"' in page.text


async def test_drain_reaches_the_worker_at_the_address_it_registered(stack: HttpStack, settings: Settings) -> None:
    async with (
        worker(stack.settings.model_copy(update={"heartbeat_seconds": 0.2}), "w-drain", ["later"]) as handle,
        httpx.AsyncClient(base_url=stack.url, timeout=20) as web,
    ):
        assert handle.worker.control_address == f"127.0.0.1:{handle.port}"
        assert (await web.post("/dashboard/login", data={"key": stack.admin_key})).status_code == 303
        page = await web.get("/dashboard")
        match = re.search(r'<meta name="csrf-token" content="([^"]+)">', page.text)
        assert match is not None
        csrf = {"x-csrf-token": match.group(1)}

        async def offered() -> bool:  # the address is registered with the worker's next beat after its server is up
            return 'id="drain-w-drain"' in (await web.get("/dashboard/state.json")).json()["sections"]["workers"]

        await harness.wait_for(offered)
        missing = await web.post("/dashboard/actions/drain", json={"worker_id": "w-nobody"}, headers=csrf)
        assert missing.json() == {"ok": False, "message": "Worker w-nobody is not registered as alive."}
        assert (await web.post("/dashboard/actions/drain", json={"task_id": "1"}, headers=csrf)).status_code == 400
        drained = await web.post("/dashboard/actions/drain", json={"worker_id": "w-drain"}, headers=csrf)
        assert drained.json() == {"ok": True, "message": "Worker w-drain is draining (0 running)."}, drained.text
        assert handle.worker.draining

        async def shown_draining() -> bool:
            workers = (await web.get("/dashboard/state.json")).json()["sections"]["workers"]
            return "draining" in workers and 'id="drain-w-drain"' not in workers

        await harness.wait_for(shown_draining)


async def test_a_read_only_key_sees_everything_and_no_control(stack: HttpStack, backends: Backends) -> None:
    viewer, _ = await auth.create_admin_key(backends.pool, stack.settings.api_key_pepper, "viewer", scope=auth.READ)
    failed = await failed_task(backends)  # a failure and a dead letter: replay buttons, for an operator
    event_id = await backends.pool.fetchval("SELECT max(id) FROM task_event WHERE task_id = $1", failed)
    await backends.pool.execute(  # a delivery that gave up: a redeliver button, for an operator
        "INSERT INTO callback_delivery (task_id, event_id, user_id, webhook_id, event_type, url, payload, status, "
        "attempts, last_status_code) VALUES ($1, $2, 'tenant', 'msg_ro', 'task.failed', 'http://127.0.0.1:9/hook', "
        "'{}', 'FAILED', 7, 500)",
        failed, event_id,
    )
    async with (
        worker(stack.settings.model_copy(update={"heartbeat_seconds": 0.2}), "w-look", ["later"]),  # a drain button
        httpx.AsyncClient(base_url=stack.url, timeout=20) as operator,
        httpx.AsyncClient(base_url=stack.url, timeout=20) as reader,
    ):
        assert (await operator.post("/dashboard/login", data={"key": stack.admin_key})).status_code == 303
        assert (await reader.post("/dashboard/login", data={"key": viewer})).status_code == 303

        async def drain_offered() -> bool:
            return 'id="drain-w-look"' in (await operator.get("/dashboard/state.json")).json()["sections"]["workers"]

        await harness.wait_for(drain_offered)
        controls = re.compile(r'data-action="(\w+)"')
        as_operator = (await operator.get("/dashboard")).text
        assert (
            set(controls.findall(as_operator)) == {"drain", "replay", "redeliver"}
            and 'id="read-only"' not in as_operator
        )

        # the read-only key: the same rows, not one control, in the page and in every refresh of its sections
        page = await reader.get("/dashboard")
        assert page.status_code == 200 and 'id="read-only"' in page.text
        sections = (await reader.get("/dashboard/state.json")).json()["sections"]
        for html in (page.text, *sections.values()):
            assert controls.findall(html) == [] and "<button type=\"button\"" not in html
        assert f'data-dead-id="{failed}"' in sections["dead"] and f'data-failed-id="{failed}"' in sections["failures"]
        assert 'data-worker="w-look"' in sections["workers"] and f"<code>{failed}</code>" in sections["webhooks"]

        # and an action it sends anyway is refused before it reaches the scheduler
        match = re.search(r'<meta name="csrf-token" content="([^"]+)">', page.text)
        assert match is not None
        for action, body in (("replay", {"task_id": str(failed)}), ("redeliver", {"task_id": str(failed)}),
                             ("drain", {"worker_id": "w-look"})):
            refused = await reader.post(
                f"/dashboard/actions/{action}", json=body, headers={"x-csrf-token": match.group(1)}
            )
            assert refused.status_code == 403 and "read-only" in refused.json()["message"], refused.text
        assert await backends.pool.fetchval("SELECT count(*) FROM task WHERE replay_of = $1", failed) == 0
        assert (
            await backends.pool.fetchval("SELECT status FROM callback_delivery WHERE webhook_id = 'msg_ro'") == "FAILED"
        )
        workers = (await reader.get("/dashboard/state.json")).json()["sections"]["workers"]
        assert "draining" not in workers
