"""Client tokens on the HTTP face (#35): a backend mints one over HTTP (or offline with the SDK), a page of another
origin (CORS, a setting) holds only it and polls its task, follows its events over SSE (the token as ?access_token=,
since EventSource sends no headers) and cannot read another end user's task. The browser test runs a real headless
Chromium, as the dashboard's does."""

from __future__ import annotations

import asyncio
import functools
import http.server
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from taskgate.config import ModelSpec, Settings
from taskgate.runtime import Backends
from tests.support import harness
from tests.support.harness import HttpStack

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
needs_browser = pytest.mark.skipif(
    not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()),
    reason=f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}); .ci/run installs them when root",
)

# The front end: it holds a client token and nothing else. It polls its task at the suggested interval, follows every
# event of its end user over SSE until its task SUCCEEDED, and tries another end user's task; window.seen says what
# happened.
PAGE = """<!doctype html><meta charset="utf-8"><title>my videos</title><body><pre id="log"></pre><script>
async function follow(base, token, mine, theirs) {
  const seen = {polls: [], events: [], other: null, error: null};
  window.seen = seen;
  const auth = {headers: {Authorization: "Bearer " + token}};
  try {
    const first = await fetch(base + "/v1/tasks/" + mine, auth);
    const body = await first.json();
    const interval = parseFloat(first.headers.get("x-suggested-poll-interval"));
    seen.polls.push({status: first.status, state: body.task.status, interval: interval, end_user: body.task.end_user});
    await new Promise(r => setTimeout(r, interval * 1000));
    const second = await fetch(base + "/v1/tasks/" + mine, auth);
    seen.polls.push({status: second.status, state: (await second.json()).task.status});
    seen.other = (await fetch(base + "/v1/tasks/" + theirs, auth)).status;
    const events = new EventSource(base + "/v1/events?cursor=0&access_token=" + encodeURIComponent(token));
    events.addEventListener("transition", e => {
      const event = JSON.parse(e.data);
      seen.events.push([event.task_id, event.to_status, event.end_user || ""]);
      if (event.task_id === mine && event.to_status === "TASK_STATUS_SUCCEEDED") { events.close(); seen.done = true; }
    });
  } catch (err) { seen.error = String(err); }
}
</script>"""


@pytest.fixture
def page_server(tmp_path: Path) -> Iterator[str]:
    """The front end's own origin: a static server on another port."""
    (tmp_path / "index.html").write_text(PAGE)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def settings(settings: Settings, page_server: str) -> Settings:
    models = {**settings.models, "slow": ModelSpec(kind="sleep", sleep_seconds=3.0)}
    return settings.model_copy(update={
        "models": models, "default_model": "slow", "progress_interval_seconds": 0.2, "http_cors_origins": [page_server],
    })


@pytest.fixture
async def stack(settings: Settings, backends: Backends) -> AsyncIterator[HttpStack]:
    async with harness.http_stack(settings, backends, worker_models=["slow"]) as s:
        yield s


async def _mint(api: httpx.AsyncClient, end_user: str, **body: Any) -> str:
    answer = await api.post("/v1/client-tokens", json={"end_user": end_user, **body})
    assert answer.status_code == 200, answer.text
    return str(answer.json()["token"])


async def _submit(api: httpx.AsyncClient, end_user: str) -> str:
    answer = await api.post("/v1/tasks", json={"prompt": f"for {end_user}", "end_user": end_user,
                                               "params": {"num_frames": 9, "width": 32, "height": 32}})
    assert answer.status_code == 201, answer.text
    return str(answer.json()["task"]["id"])


async def test_cors_access_token_and_minting_over_http(stack: HttpStack, page_server: str) -> None:
    async with httpx.AsyncClient(base_url=stack.url, headers=stack.headers(), timeout=20) as api:
        mine, theirs = await _submit(api, "ann"), await _submit(api, "bob")
        token = await _mint(api, "ann", scopes=["read", "watch"])
        secret = (await api.post("/v1/client-token-secret")).json()["secret"]
        assert secret.startswith("tgcs.tenant-a.")
    async with httpx.AsyncClient(base_url=stack.url, timeout=20) as browser:
        # a preflight from the page's origin is allowed; from another, not
        asked = {"origin": page_server, "access-control-request-method": "GET",
                 "access-control-request-headers": "authorization"}
        ok = await browser.options(f"/v1/tasks/{mine}", headers=asked)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == page_server
        other = await browser.options(f"/v1/tasks/{mine}", headers={**asked, "origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        got = await browser.get(
            f"/v1/tasks/{mine}", headers={"authorization": f"Bearer {token}", "origin": page_server}
        )
        assert got.status_code == 200 and got.json()["task"]["end_user"] == "ann"
        assert "x-suggested-poll-interval" in got.headers["access-control-expose-headers"].lower()
        assert (await browser.get(f"/v1/tasks/{mine}", params={"access_token": token})).status_code == 200
        assert (await browser.get(f"/v1/tasks/{theirs}", params={"access_token": token})).status_code == 404
        # a token is no API key: it cannot submit, list or mint
        as_token = {"authorization": f"Bearer {token}"}
        assert (await browser.post("/v1/tasks", json={"prompt": "x"}, headers=as_token)).status_code == 403
        assert (await browser.get("/v1/tasks", headers=as_token)).status_code == 403
        assert (await browser.post("/v1/client-tokens", json={}, headers=as_token)).status_code == 403
        assert (await browser.post(f"/v1/tasks/{mine}:cancel", headers=as_token)).status_code == 403  # no cancel scope


async def test_no_cors_headers_unless_configured(settings: Settings, backends: Backends, page_server: str) -> None:
    unset = settings.model_copy(update={"http_cors_origins": []})
    async with (
        harness.http_stack(unset, backends) as plain,
        httpx.AsyncClient(base_url=plain.url, timeout=20) as browser,
    ):
        answer = await browser.options(
            "/v1/tasks/1", headers={"origin": page_server, "access-control-request-method": "GET"}
        )
        assert "access-control-allow-origin" not in answer.headers


@needs_browser
async def test_a_page_of_another_origin_polls_and_follows_its_task_with_only_a_client_token(
    stack: HttpStack, page_server: str, tmp_path: Path
) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    async with httpx.AsyncClient(base_url=stack.url, headers=stack.headers(), timeout=20) as api:
        mine, theirs = await _submit(api, "ann"), await _submit(api, "bob")
        token = await _mint(api, "ann", scopes=["read", "watch"], task_ids=[mine])  # the backend's part

    def in_browser() -> dict[str, Any]:
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                    f"--user-data-dir={tmp_path / 'chromium'}", "--no-first-run", "--disable-extensions"):
            options.add_argument(arg)
        driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
        try:
            driver.get(f"{page_server}/index.html")
            driver.execute_script("follow(arguments[0], arguments[1], arguments[2], arguments[3])",
                                  stack.url, token, mine, theirs)
            WebDriverWait(driver, 60, poll_frequency=0.2).until(
                lambda d: d.execute_script("return window.seen && (window.seen.done || window.seen.error)"))
            seen: dict[str, Any] = driver.execute_script("return window.seen")
            return seen
        finally:
            driver.quit()

    seen = await asyncio.to_thread(in_browser)  # the services keep serving in this event loop meanwhile
    assert seen["error"] is None, seen
    first, second = seen["polls"]
    assert first["status"] == 200 and first["end_user"] == "ann" and first["interval"] > 0
    assert second["status"] == 200
    assert seen["other"] == 404  # another end user's task, as if it did not exist
    assert seen["events"] and {task for task, _, _ in seen["events"]} == {mine}
    assert seen["events"][-1][1] == "TASK_STATUS_SUCCEEDED" and {who for _, _, who in seen["events"]} == {"ann"}
