"""The operator console (RFC 0000 §12) in a real headless Chromium, driven by Playwright.

One ``agentd run --listen 127.0.0.1:PORT`` serves the module. The browser is Debian's
``chromium-headless-shell`` (``.ci/run`` installs it), launched by path: Playwright's own browser
download is never used (this machine reaches no such host). Without the binary these tests fail,
naming it — never skip.

Every page a test opens is watched: a console error or an uncaught exception fails the test, and
so does a request to any host but the daemon's. Screenshots of each page are written to the
artifacts dir (``AGENTD_TEST_ARTIFACTS``, else the session's pytest temp dir); with
``AGENTD_UPDATE_DOCS_SCREENSHOT=1`` the session page's is also written to docs/console.png.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import playwright.sync_api as playwright_api
import pytest
from playwright.sync_api import expect

from tests.daemon_harness import REPO, TIMEOUT, Daemon, free_port, two_assistant_config, wait_until
from tests.pg_harness import PgServer

pytestmark = pytest.mark.e2e

TOKEN = "console-test-token-5f0e7d2c9b"
#: Where Debian's chromium-headless-shell package puts the browser (AGENTD_TEST_CHROMIUM overrides).
CHROMIUM_PATHS = ("/usr/bin/chromium-headless-shell", "/usr/lib/chromium/chromium-headless-shell")
#: The machine has no network: nothing in the browser may try to reach one.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-domain-reliability",
    "--no-first-run",
]
BROWSER_TIMEOUT_MS = 30_000
#: The scripted "streamer" hands its reply out a word this often: slow enough to watch (the test
#: decides nothing by it: what the page saw is recorded as it changes, see test_watch_a_reply_stream_in).
STREAM_CHUNK_MS = 120


def config(hold: Path, model: str = "echo-small") -> str:
    return f"""
[intelligence]
provider = "scripted"
model = "{model}"

[[assistants]]
name = "main"
system = "You help."
first_message = "Hello from main."
tools = ["clock"]

[[assistants]]
name = "held"
first_message_mode = "assistant-waits-for-user"
intelligence = {{ options = {{ hold_file = "{hold}" }} }}

[[assistants]]
name = "streamer"
first_message_mode = "assistant-waits-for-user"
intelligence = {{ options = {{ chunk_ms = {STREAM_CHUNK_MS} }} }}

[[assistants]]
name = "careful"
first_message_mode = "assistant-waits-for-user"
tools = ["tests.tooling:record"]
require_approval = ["tests.tooling:record"]
intelligence = {{ model = "priced-small" }}

[[prices]]
model = "priced-small"
currency = "EUR"
input_per_mtok = "2.5"
output_per_mtok = 10
"""


def chromium_path() -> str:
    """The headless Chromium to drive; the test fails naming the package when there is none."""
    override = os.environ.get("AGENTD_TEST_CHROMIUM")
    candidates = [override] if override else list(CHROMIUM_PATHS)
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail(
        f"no headless Chromium at {', '.join(c for c in candidates if c)}: install Debian's "
        "`chromium-headless-shell` (apt-get install -y chromium-headless-shell; .ci/run does) "
        "or point AGENTD_TEST_CHROMIUM at one",
        pytrace=False,
    )


# --------------------------------------------------------------------------- fixtures


class Console:
    """The daemon under test, reached over TCP with the bearer token (the test's own API client)."""

    def __init__(self, daemon: Daemon, port: int, hold: Path) -> None:
        self.daemon = daemon
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.hold = hold
        self.api = httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=TIMEOUT)

    def json(self, method: str, path: str, body: Any = None, status: int | None = None) -> Any:
        response = self.api.request(method, path, json=body)
        if status is not None:
            assert response.status_code == status, f"{method} {path} → {response.status_code}: {response.text}"
        return response.json()

    def new_session(self, assistant: str | None = None) -> str:
        return str(self.json("POST", "/v1/sessions", {"assistant": assistant} if assistant else {}, status=201)["id"])


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    tmp = tmp_path_factory.mktemp("console")
    hold = tmp / "hold"
    port = free_port()
    daemon = Daemon(tmp, config(hold), args=["--listen", f"127.0.0.1:{port}"], env={"AGENTD_API_TOKEN": TOKEN}).start()
    served = Console(daemon, port, hold)
    try:
        wait_until(lambda: served.api.get("/v1/ready").status_code == 200, "the TCP listener to be ready")
        yield served
    finally:
        served.api.close()
        daemon.stop()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the screenshots go (printed at the end of the module)."""
    chosen = os.environ.get("AGENTD_TEST_ARTIFACTS")
    path = Path(chosen) / "console" if chosen else tmp_path_factory.mktemp("console-screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    executable = chromium_path()
    with playwright_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


class Watched:
    """A browser context and page, with every console error, page error, request host and URL seen."""

    def __init__(self, browser: Any, console: Console, *, javascript: bool = True, hosts: tuple[str, ...] = ()) -> None:
        self.console = console
        self.hosts = {f"127.0.0.1:{console.port}", *hosts}  # the daemons' addresses: no other may be asked
        self.context = browser.new_context(
            java_script_enabled=javascript, timezone_id="Europe/Berlin", locale="en-GB", base_url=console.base
        )
        self.context.set_default_timeout(BROWSER_TIMEOUT_MS)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.expected: list[str] = []  # errors a test provokes on purpose (substrings)
        self.urls: list[str] = []
        self.pages_html: list[str] = []
        self.page.on(
            "console", lambda m: self.errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None
        )
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.page.on("request", lambda r: self.urls.append(r.url))
        self.page.on("requestfailed", self._failed)

    def _failed(self, request: Any) -> None:
        # A page being left cuts its event stream and aborts the script's fetch in flight: not failures.
        left = request.url.endswith("/events") or (
            urlsplit(request.url).path.endswith(("/update", "/approvals")) and request.failure == "net::ERR_ABORTED"
        )
        if not left:
            self.errors.append(f"request failed: {request.url}: {request.failure}")

    def goto(self, path: str) -> Any:
        response = self.page.goto(path)
        assert response is not None
        self.pages_html.append(self.page.content())
        return response

    def log_in(self) -> None:
        self.goto("/console/")
        expect(self.page).to_have_url(re.compile(r"/console/login\?next="))
        self.page.get_by_label("API token").fill(TOKEN)
        self.page.get_by_role("button", name="Log in").click()
        expect(self.page).to_have_url(f"{self.console.base}/console/")
        self.pages_html.append(self.page.content())

    def shot(self, artifacts: Path, name: str) -> Path:
        path = artifacts / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def check_clean(self) -> None:
        """No console error, no page error, no request to any host but the daemon's, no token anywhere."""
        hosts = {urlsplit(url).netloc for url in self.urls if not url.startswith(("data:", "about:"))}
        assert hosts <= self.hosts, f"requests to other hosts: {sorted(hosts - self.hosts)}"
        assert [e for e in self.errors if not any(part in e for part in self.expected)] == []
        assert all(TOKEN not in url for url in self.urls)
        assert all(TOKEN not in html for html in self.pages_html)
        assert all(TOKEN not in cookie["value"] for cookie in self.context.cookies())

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def watched(browser: Any, console: Console) -> Iterator[Watched]:
    session = Watched(browser, console)
    try:
        yield session
        session.check_clean()
    finally:
        session.close()


def csrf_of(page: Any) -> str:
    return str(page.locator('input[name="csrf"]').first.get_attribute("value"))


# --------------------------------------------------------------------------- the pages


def test_log_in_then_overview_sessions_and_a_session(watched: Watched, console: Console, artifacts: Path) -> None:
    session_id = console.new_session("main")
    console.json("POST", f"/v1/sessions/{session_id}/messages", {"content": "what time is it? use the clock"}, 200)
    page = watched.page

    watched.goto("/console/")
    expect(page.get_by_label("API token")).to_be_visible()
    watched.shot(artifacts, "01-login")
    watched.log_in()

    status = console.json("GET", "/v1/status", status=200)
    expect(page.locator("#generation")).to_have_text(str(status["generation"]))
    expect(page.locator("#policy")).to_contain_text(status["model_swap"]["policy"])
    expect(page.locator("#readiness")).to_contain_text("ready")
    expect(page.get_by_role("table").first).to_contain_text("active")  # a child, with its sessions
    expect(page.locator("body")).to_contain_text(status["replica"])
    watched.shot(artifacts, "02-overview")

    page.get_by_role("navigation", name="Console").get_by_role("link", name="Sessions").click()
    page.get_by_label("Assistant").first.select_option("main")
    page.get_by_role("button", name="Filter").click()
    expect(page).to_have_url(re.compile(r"assistant=main"))
    link = page.get_by_role("link", name=session_id)
    expect(link).to_be_visible()
    expect(page.locator("#sessions")).not_to_contain_text("held")  # filtered by assistant
    watched.shot(artifacts, "03-sessions")
    link.click()

    expect(page.get_by_role("heading", name=f"Session {session_id}")).to_be_visible()
    transcript = page.locator("#transcript")
    expect(transcript).to_contain_text("Hello from main.")
    expect(transcript.locator(".role-tool")).to_contain_text("clock")  # the tool result
    expect(transcript.locator(".calls")).to_contain_text("clock")  # the assistant's tool call
    expect(transcript.locator(".role-assistant .model").first).to_have_text("echo-small")
    expect(page.locator("#turns")).to_contain_text("completed")
    # Times are the browser's zone (Berlin), the UTC instant kept in the title.
    first_time = page.locator("#turns time").first
    expect(first_time).not_to_have_text(re.compile(r"Z$"))
    assert (first_time.get_attribute("title") or "").endswith("Z")
    watched.shot(artifacts, "04-session")
    if os.environ.get("AGENTD_UPDATE_DOCS_SCREENSHOT") == "1":
        shutil.copy(artifacts / "04-session.png", REPO / "docs" / "console.png")


def test_a_reply_streams_in_without_a_reload(watched: Watched, console: Console, artifacts: Path) -> None:
    session_id = console.new_session("held")
    page = watched.page
    watched.log_in()
    watched.goto(f"/console/sessions/{session_id}")
    page.evaluate("window.agentdMarker = 'same page'")  # gone if the page were reloaded
    expect(page.locator("#stream-status")).to_have_text("(live)")

    accepted = console.json(
        "POST", f"/v1/sessions/{session_id}/messages", {"content": "tell me slowly", "wait": False}, 202
    )
    turn = accepted["turn_id"]
    # The model call waits for the hold file: the page shows the turn running, as it runs.
    expect(page.locator("#live-log")).to_contain_text("turn started on echo-small")
    expect(page.locator(f'#turns tr[data-turn="{turn}"] .status')).to_have_text("pending")
    expect(page.locator("#state")).to_have_text("running")
    expect(page.locator("#cancel-form")).to_be_visible()
    expect(page.locator("#live-log")).to_contain_text("step 1 started")
    watched.shot(artifacts, "05-session-running")

    console.hold.touch()
    try:
        expect(page.locator(f'#turns tr[data-turn="{turn}"] .status')).to_have_text("completed")
        expect(page.locator("#transcript .role-assistant").last).to_contain_text("You said: tell me slowly")
        expect(page.locator("#transcript .role-assistant .model").last).to_have_text("echo-small")
        expect(page.locator("#transcript .role-user")).to_contain_text("tell me slowly")  # the turn's input too
        expect(page.locator("#entry-count")).to_have_text("2")
        # The finished row is the server's own, its times in the browser's zone.
        expect(page.locator(f'#turns tr[data-turn="{turn}"] .col-ended time')).not_to_have_text(re.compile(r"Z$"))
        expect(page.locator("#live-log")).to_contain_text("step 1 done")
        expect(page.locator("#live-log")).to_contain_text("turn done: completed")
        expect(page.locator("#cancel-form")).to_be_hidden()
        expect(page.locator("#state")).to_have_text("idle")
        # The session's totals follow the turn that ended (the page was rendered with none).
        expect(page.locator("#session-usage")).to_contain_text("in 1 model call(s)")
        expect(page.locator("#session-facts")).not_to_contain_text("not loaded")  # it ran on a child
        expect(page.locator("#usage tbody tr").first).to_contain_text("echo-small")
        assert page.evaluate("window.agentdMarker") == "same page"
        watched.shot(artifacts, "06-session-streamed")
    finally:
        console.hold.unlink()


def test_a_message_and_a_cancel_from_the_session_page(watched: Watched, console: Console) -> None:
    session_id = console.new_session("held")
    page = watched.page
    watched.log_in()
    watched.goto(f"/console/sessions/{session_id}")
    page.get_by_label("Message").fill("hold on")
    page.get_by_role("button", name="Send").click()
    expect(page.locator(".notice")).to_contain_text("Message sent")
    expect(page.locator("#transcript")).to_contain_text("hold on")
    expect(page.locator("#turns .status").first).to_have_text("pending")
    page.get_by_role("button", name="Cancel the running turn").click()
    expect(page.locator(".notice")).to_contain_text("Cancel requested")
    turns = wait_until(
        lambda: [t for t in console.json("GET", f"/v1/sessions/{session_id}")["turns"] if t["status"] != "pending"],
        "the cancelled turn to end",
    )
    assert turns[0]["status"] == "cancelled"
    watched.goto(f"/console/sessions/{session_id}")
    expect(page.locator("#turns .status").first).to_have_text("cancelled")


def test_press_reload_and_see_the_generation_change(watched: Watched, console: Console, artifacts: Path) -> None:
    page = watched.page
    watched.log_in()
    before = console.json("GET", "/v1/status", status=200)["generation"]
    watched.goto("/console/reloads")
    expect(page.locator("#generation")).to_have_text(str(before))

    console.daemon.write_config(config(console.hold, model=f"echo-gen{before + 1}"))
    page.get_by_role("button", name="Reload the config file").click()
    expect(page.locator(".notice")).to_contain_text("Reload applied.")
    expect(page.locator("#generation")).to_have_text(str(before + 1))
    newest = page.locator("#reloads tbody tr").first
    expect(newest).to_contain_text(str(before + 1))
    expect(newest).to_contain_text("applied")
    expect(newest).to_contain_text("intelligence.model")
    watched.shot(artifacts, "07-reloads")

    page.get_by_role("navigation", name="Console").get_by_role("link", name="Overview").click()
    expect(page.locator("#generation")).to_have_text(str(before + 1))

    history = console.json("GET", "/v1/reloads", status=200)
    assert history[0]["generation"] == before + 1 and history[0]["applied"] is True
    assert "intelligence.model" in history[0]["changed"] and history[0]["at"].endswith("Z")


def test_a_post_without_the_csrf_token_or_from_another_origin_is_refused(watched: Watched, console: Console) -> None:
    page = watched.page
    watched.log_in()
    watched.goto("/console/reloads")
    csrf = csrf_of(page)
    before = console.json("GET", "/v1/status", status=200)["generation"]
    origin = console.base
    request = page.request  # the context's cookies: logged in

    missing = request.post("/console/reloads", form={}, headers={"Origin": origin}, max_redirects=0)
    wrong = request.post("/console/reloads", form={"csrf": "0" * 64}, headers={"Origin": origin}, max_redirects=0)
    foreign = request.post(
        "/console/reloads", form={"csrf": csrf}, headers={"Origin": "http://evil.example"}, max_redirects=0
    )
    cross_site = request.post(
        "/console/reloads", form={"csrf": csrf}, headers={"Sec-Fetch-Site": "cross-site"}, max_redirects=0
    )
    assert [r.status for r in (missing, wrong, foreign, cross_site)] == [403, 403, 403, 403]
    assert "CSRF" in missing.text() and "another origin" in foreign.text()
    assert console.json("GET", "/v1/status", status=200)["generation"] == before  # nothing was reloaded

    # Without the login cookie even the right token is nothing; the console's logins are cookies only.
    anonymous = httpx.post(
        f"{origin}/console/reloads", data={"csrf": csrf}, headers={"Origin": origin, "Authorization": f"Bearer {TOKEN}"}
    )
    assert anonymous.status_code == 401

    # The same form with its token from the console's own origin is done.
    done = request.post("/console/reloads", form={"csrf": csrf}, headers={"Origin": origin}, max_redirects=0)
    assert done.status == 303 and done.headers["location"].startswith("/console/reloads?done=")


def test_a_wrong_token_does_not_log_in(watched: Watched, console: Console) -> None:
    page = watched.page
    watched.goto("/console/login")
    page.get_by_label("API token").fill("not-the-token")
    # Chromium reports the 401 document itself as a console error: that is the point here.
    watched.expected.append("status of 401 (Unauthorized)")
    with page.expect_response(lambda r: r.url.endswith("/console/login") and r.request.method == "POST") as answered:
        page.get_by_role("button", name="Log in").click()
    assert answered.value.status == 401
    expect(page.get_by_role("alert")).to_contain_text("not the API token")
    assert [c for c in watched.context.cookies() if c["name"] == "agentd_console"] == []
    watched.goto("/console/sessions")
    expect(page).to_have_url(re.compile(r"/console/login"))


def test_read_only_pages_render_without_javascript(browser: Any, console: Console) -> None:
    session_id = console.new_session("main")
    plain = Watched(browser, console, javascript=False)
    try:
        page = plain.page
        plain.log_in()  # the login form works without a script
        expect(page.locator("#generation")).to_have_text(re.compile(r"^\d+$"))
        plain.goto("/console/sessions?assistant=main")
        expect(page.get_by_role("link", name=session_id)).to_be_visible()
        plain.goto(f"/console/sessions/{session_id}")
        expect(page.locator("#transcript")).to_contain_text("Hello from main.")
        plain.goto("/console/reloads")
        expect(page.get_by_role("button", name="Reload the config file")).to_be_visible()
        # Without a script a time is the UTC instant itself.
        plain.goto("/console/")
        seen = page.locator("time").first
        expect(seen).to_have_text(re.compile(r"Z$"))
        assert seen.inner_text() == seen.get_attribute("datetime")
        plain.check_clean()
    finally:
        plain.close()


def test_the_console_is_not_on_the_unix_socket_and_its_cookies_are_strict(console: Console) -> None:
    assert console.daemon.api("GET", "/console/").status_code == 404
    assert console.daemon.api("GET", "/console/login").status_code == 404
    login_page = httpx.get(f"{console.base}/console/login")
    assert login_page.status_code == 200
    assert "default-src 'none'" in login_page.headers["content-security-policy"]
    pre_login = login_page.headers["set-cookie"].lower()
    assert "httponly" in pre_login and "samesite=strict" in pre_login and "path=/console" in pre_login
    csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', login_page.text)
    assert csrf is not None
    logged_in = httpx.post(
        f"{console.base}/console/login",
        data={"csrf": csrf.group(1), "token": TOKEN, "next": "/console/sessions"},
        headers={"Origin": console.base},
        cookies=login_page.cookies,
    )
    assert logged_in.status_code == 303 and logged_in.headers["location"] == "/console/sessions"
    cookie = next(
        v for k, v in logged_in.headers.multi_items() if k == "set-cookie" and v.startswith("agentd_console=")
    )
    assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower() and TOKEN not in cookie
    # A login cannot be sent on to another site.
    again = httpx.get(f"{console.base}/console/login")
    csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', again.text)
    assert csrf is not None
    away = httpx.post(
        f"{console.base}/console/login",
        data={"csrf": csrf.group(1), "token": TOKEN, "next": "//evil.example/"},
        headers={"Origin": console.base},
        cookies=again.cookies,
    )
    assert away.headers["location"] == "/console/"


def test_a_rejected_reload_is_in_the_history_with_its_errors(watched: Watched, console: Console) -> None:
    page = watched.page
    watched.log_in()
    generation = console.json("GET", "/v1/status", status=200)["generation"]
    good = console.daemon.config_path.read_text()
    console.daemon.write_config(good.replace('provider = "scripted"', 'provider = "no-such-provider"'))
    try:
        watched.goto("/console/reloads")
        page.get_by_role("button", name="Reload the config file").click()
        expect(page.locator(".notice")).to_contain_text("Reload rejected")
        newest = page.locator("#reloads tbody tr").first
        expect(newest).to_contain_text("rejected")
        expect(newest.locator(".errors")).to_contain_text("intelligence.provider")
        expect(page.locator("#generation")).to_have_text(str(generation))
    finally:
        console.daemon.config_path.write_text(good)
    history = console.json("GET", "/v1/reloads?limit=1", status=200)
    assert len(history) == 1 and history[0]["applied"] is False and history[0]["generation"] == generation
    assert any(e["path"] == "intelligence.provider" for e in history[0]["errors"])


def test_the_sessions_api_filters_and_the_history_api_check_their_arguments(console: Console) -> None:
    held = console.new_session("held")
    page = console.json("GET", "/v1/sessions?assistant=held&state=idle&limit=10000", status=200)
    assert held in [s["id"] for s in page] and {s["assistant"] for s in page} == {"held"}
    assert console.json("GET", "/v1/sessions?state=asleep", status=400)["error"]["code"] == "bad_state"
    assert console.json("GET", "/v1/reloads?limit=0", status=400)["error"]["code"] == "bad_limit"
    assert console.json("GET", "/v1/reloads?limit=1001", status=400)["error"]["code"] == "bad_limit"


def test_transcripts_and_turns_are_paged_not_rendered_whole(watched: Watched, console: Console) -> None:
    session_id = console.new_session("main")
    for index in range(30):  # the system prompt, the opener and 30 turns of two entries each: 62 entries
        console.json("POST", f"/v1/sessions/{session_id}/messages", {"content": f"message {index}"}, 200)
    page = watched.page
    watched.log_in()
    watched.goto(f"/console/sessions/{session_id}")
    expect(page.locator("#transcript .entry")).to_have_count(12)  # the last page: entries 51–62
    expect(page.locator("#transcript .entry").last).to_contain_text("You said: message 29")
    expect(page.get_by_role("navigation", name="Transcript pages").first).to_contain_text("page 2 of 2")
    expect(page.locator("#turns tbody tr")).to_have_count(20)  # the newest 20 turns
    page.get_by_role("navigation", name="Transcript pages").first.get_by_role("link", name="‹ previous").click()
    expect(page.locator("#transcript .entry")).to_have_count(50)
    expect(page.locator("#transcript .entry").first).to_contain_text("You help.")
    expect(page.locator("#transcript")).to_have_attribute("data-last-page", "false")


def test_logging_out_and_what_a_browser_without_a_login_gets(watched: Watched, console: Console) -> None:
    page = watched.page
    watched.log_in()
    page.get_by_role("button", name="Log out").click()
    expect(page).to_have_url(f"{console.base}/console/login")
    watched.goto("/console/reloads")
    expect(page).to_have_url(re.compile(r"/console/login\?next=%2Fconsole%2Freloads"))
    session_id = console.new_session("main")
    assert httpx.get(f"{console.base}/console/sessions/{session_id}/events").status_code == 401
    missing = httpx.get(f"{console.base}/console/static/nope.css")
    assert missing.status_code == 404 and TOKEN not in missing.text


def test_every_replica_serves_the_console_with_one_login_and_relayed_live_events(
    browser: Any, pg: PgServer, tmp_path: Path, artifacts: Path
) -> None:
    hold = tmp_path / "hold"
    ports = [free_port(), free_port()]
    started: list[Daemon] = []
    clients: list[httpx.Client] = []
    with pg.database() as url:
        config_text = two_assistant_config(hold, top=f'[store]\nurl = "{url}"\nlease = "2s"\n')
        try:
            for index, port in enumerate(ports):
                home = tmp_path / f"r{index}"
                home.mkdir()
                env = {"AGENTD_API_TOKEN": TOKEN, "AGENTD_REPLICA_ID": f"r{index}"}
                args = ["--listen", f"127.0.0.1:{port}"]
                started.append(Daemon(home, config_text, args=args, env=env, state_dir=home / "state").start())
            a, b = (Console(daemon, port, hold) for daemon, port in zip(started, ports, strict=True))
            clients.extend([a.api, b.api])
            session_id = a.new_session("held")
            plain = Watched(browser, a, hosts=(f"127.0.0.1:{b.port}",))
            try:
                page = plain.page
                plain.log_in()  # on replica r0: the cookie is good on r1 (the same token keys it)
                plain.goto(f"{b.base}/console/sessions?assistant=held")
                expect(page.get_by_role("link", name=session_id)).to_be_visible()
                plain.goto(f"{b.base}/console/sessions/{session_id}")
                expect(page.locator("#stream-status")).to_have_text("(live)")
                turn = a.json(
                    "POST", f"/v1/sessions/{session_id}/messages", {"content": "run on r0", "wait": False}, 202
                )["turn_id"]
                # The turn runs on r0 (it holds the session's lease); r1's page hears it through the relay.
                expect(page.locator(f'#turns tr[data-turn="{turn}"] .status')).to_have_text("pending")
                hold.touch()
                expect(page.locator(f'#turns tr[data-turn="{turn}"] .status')).to_have_text("completed")
                expect(page.locator("#transcript .role-assistant").last).to_contain_text("You said: run on r0")
                plain.goto(f"{b.base}/console/")
                expect(page.locator("#main")).to_contain_text("r0")
                expect(page.locator("#main")).to_contain_text("r1 (this one)")
                plain.shot(artifacts, "08-overview-replicas")
                plain.check_clean()
            finally:
                plain.close()
            assert a.json("GET", f"/v1/sessions/{session_id}")["turns"][0]["status"] == "completed"
        finally:
            hold.touch()
            for client in clients:
                client.close()
            for daemon in started:
                daemon.stop()


def test_the_forms_work_from_the_keyboard_alone(watched: Watched, console: Console) -> None:
    page = watched.page
    watched.goto("/console/")
    page.keyboard.type(TOKEN)  # the token field has the focus
    page.keyboard.press("Enter")
    expect(page).to_have_url(f"{console.base}/console/")
    watched.goto("/console/reloads")
    for _ in range(12):  # Tab through the page to the reload button
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.id") == "reload":
            break
    assert page.evaluate("document.activeElement.id") == "reload"
    page.keyboard.press("Enter")
    expect(page.locator(".notice")).to_contain_text("Reload applied")


# --------------------------------------------------------------------------- deltas, approvals, cost

#: Records what the streaming area held each time it changed, and the newest turn's status then:
#: whether text showed before the turn ended is read from this record, never from timing.
RECORD_STREAM = """() => {
  window.agentdStream = [];
  const area = document.getElementById("streaming");
  new MutationObserver(() => {
    const block = area.querySelector(".stream-step pre.content");
    const status = document.querySelector("#turns tbody tr .status");
    window.agentdStream.push({text: block ? block.textContent : "", status: status ? status.textContent : ""});
  }).observe(area, {childList: true, subtree: true, characterData: true});
}"""


def test_watch_a_reply_stream_in(watched: Watched, console: Console, artifacts: Path) -> None:
    session_id = console.new_session("streamer")
    page = watched.page
    watched.log_in()
    watched.goto(f"/console/sessions/{session_id}")
    expect(page.locator("#stream-status")).to_have_text("(live)")
    page.evaluate(RECORD_STREAM)
    text = "please tell me about the weather in the mountains today and tomorrow"
    turn = console.json("POST", f"/v1/sessions/{session_id}/messages", {"content": text, "wait": False}, 202)["turn_id"]
    block = page.locator(f'#streaming .stream-step[data-turn="{turn}"][data-run="0"][data-step="1"] pre.content')
    expect(block).to_contain_text("You said:")
    expect(page.locator(f'#turns tr[data-turn="{turn}"] .status')).to_have_text("completed")
    expect(page.locator("#streaming")).to_be_hidden()  # the entries replace it

    final = console.json("GET", f"/v1/sessions/{session_id}")["transcript"][-1]
    assert final["role"] == "assistant" and final["turn"] == turn
    seen: list[dict[str, str]] = page.evaluate("window.agentdStream")
    partial = [s for s in seen if s["status"] == "pending" and 0 < len(s["text"]) < len(final["content"])]
    assert partial, f"no partial text was shown while the turn ran: {seen}"
    assert all(final["content"].startswith(s["text"]) for s in seen)  # it grew by appending, nothing else
    assert block.text_content() == final["content"]  # what streamed is what was stored
    expect(page.locator("#transcript .role-assistant .content").last).to_have_text(final["content"])


def _approval_of(console: Console, session_id: str) -> dict[str, Any]:
    found = wait_until(
        lambda: console.json("GET", f"/v1/approvals?status=pending&session={session_id}", status=200),
        f"a pending approval of {session_id}",
    )
    return dict(found[0])


def test_approve_a_pending_call_and_see_its_cost(watched: Watched, console: Console, artifacts: Path) -> None:
    session_id = console.new_session("careful")
    answer = console.json("POST", f"/v1/sessions/{session_id}/messages", {"content": 'record {"label": "x"}'}, 200)
    turn = answer["turn"]["id"]
    [asked] = answer["approvals"]
    page = watched.page
    watched.log_in()
    expect(page.locator("#approvals-pending")).to_contain_text(re.compile(r"[1-9]\d* pending"))
    page.get_by_role("navigation", name="Console").get_by_role("link", name="Approvals").click()
    card = page.locator(f"#approval-{asked['id']}")
    expect(card).to_contain_text("record")
    expect(card.get_by_role("link", name=session_id)).to_be_visible()
    expect(card.get_by_role("link", name=turn)).to_be_visible()
    arguments = card.get_by_label("Arguments")
    assert json.loads(arguments.input_value()) == asked["arguments"]
    expect(card.locator("time").first).not_to_have_text(re.compile(r"Z$"))  # requested, in the browser's zone
    watched.shot(artifacts, "09-approvals")

    # Arguments that do not fit the tool's schema: 400, shown, the approval still pending, the text kept.
    watched.expected.append("status of 400")
    arguments.fill('{"label": 5}')
    card.get_by_role("button", name="Approve").click()
    expect(page.get_by_role("alert")).to_contain_text("bad_arguments")
    expect(page.get_by_role("alert")).to_contain_text("label")
    assert console.json("GET", f"/v1/approvals/{asked['id']}", status=200)["status"] == "pending"
    card = page.locator(f"#approval-{asked['id']}")
    assert json.loads(card.get_by_label("Arguments").input_value()) == {"label": 5}

    card.get_by_label("Arguments").fill('{"label": "edited"}')
    card.get_by_label("Reason").fill("looks right")
    card.get_by_role("button", name="Approve").click()
    expect(page.locator(".notice")).to_contain_text("Approved")
    expect(page).to_have_url(f"{console.base}/console/approvals?done=approved")
    decided = page.locator(f'#decided tr[data-approval="{asked["id"]}"]')
    expect(decided).to_contain_text("approved")
    expect(decided).to_contain_text("looks right")
    decided_api = console.json("GET", f"/v1/approvals/{asked['id']}", status=200)
    assert decided_api["status"] == "approved" and decided_api["reason"] == "looks right"

    # The same decision again: 409 already_decided, shown.
    csrf = csrf_of(page)
    again = page.request.post(
        f"/console/approvals/{asked['id']}",
        form={"csrf": csrf, "decision": "reject", "next": "/console/approvals"},
        headers={"Origin": console.base},
        max_redirects=0,
    )
    assert again.status == 409 and "already_decided" in again.text()

    page.get_by_role("link", name=session_id).first.click()
    row = page.locator(f'#turns tr[data-turn="{turn}"]')
    expect(row.locator(".status")).to_have_text("completed")
    expect(page.locator("#transcript .role-tool").last).to_contain_text("recorded edited")
    done = console.json("GET", f"/v1/sessions/{session_id}")
    [turn_view] = [t for t in done["turns"] if t["id"] == turn]
    cost = turn_view["usage"]["cost"]
    assert cost is not None and cost["currency"] == "EUR"
    # Every model call of the turn is priced, those before it waited for approval too (RFC 0011).
    spent = turn_view["usage"]
    expected = (Decimal(spent["input_tokens"]) * Decimal("2.5") + Decimal(spent["output_tokens"]) * 10) / 10**6
    assert spent["requests"] == 2 and Decimal(cost["amount"]) == expected > 0
    [by_model] = done["usage"]["by_model"]
    assert (by_model["input_tokens"], by_model["output_tokens"], by_model["requests"]) == (
        spent["input_tokens"],
        spent["output_tokens"],
        2,
    )
    watched.goto(f"/console/sessions/{session_id}")  # the server's own rendering of the ended turn
    expect(row.locator(".col-cost")).to_have_text(f"{cost['amount']} EUR")
    expect(row.locator(".col-input_tokens")).to_have_text(str(turn_view["usage"]["input_tokens"]))
    usage = page.locator("#usage")
    expect(usage.locator("tbody tr").first).to_contain_text("priced-small")
    expect(usage.locator("tfoot")).to_contain_text(f"{done['usage']['cost']['amount']} EUR")
    expect(page.locator("#session-usage")).to_contain_text("EUR")
    expect(page.locator("#approvals")).to_be_hidden()  # nothing of it waits any more
    watched.shot(artifacts, "10-session-cost")

    # A model without a price: "unpriced", never 0.
    unpriced = console.new_session("main")
    console.json("POST", f"/v1/sessions/{unpriced}/messages", {"content": "hello"}, 200)
    watched.goto(f"/console/sessions/{unpriced}")
    expect(page.locator("#turns tbody tr .col-cost").first).to_have_text("unpriced")


def test_reject_a_call_from_the_session_page_as_it_asks(watched: Watched, console: Console, artifacts: Path) -> None:
    session_id = console.new_session("careful")
    page = watched.page
    watched.log_in()
    watched.goto(f"/console/sessions/{session_id}")
    expect(page.locator("#stream-status")).to_have_text("(live)")
    expect(page.locator("#approvals")).to_be_hidden()
    page.evaluate("window.agentdMarker = 'same page'")
    turn = console.json("POST", f"/v1/sessions/{session_id}/messages", {"content": "record please"}, 200)["turn"]["id"]
    asked = _approval_of(console, session_id)

    # The approval appears live, with its form; the session awaits approval.
    card = page.locator(f"#approval-{asked['id']}")
    expect(card.get_by_role("button", name="Reject")).to_be_visible()
    expect(page.locator("#state")).to_have_text("awaiting_approval")
    expect(page.locator("#live-log")).to_contain_text("waits for approval")
    assert page.evaluate("window.agentdMarker") == "same page"
    watched.pages_html.append(page.content())
    watched.shot(artifacts, "11-session-awaiting-approval")

    # Edited arguments that do not fit are refused (400) and nothing is decided.
    watched.expected.append("status of 400")
    card.get_by_label("Arguments").fill('{"label": ["not", "a", "string"]}')
    card.get_by_role("button", name="Approve").click()
    expect(page.get_by_role("alert")).to_contain_text("bad_arguments")
    assert console.json("GET", f"/v1/approvals/{asked['id']}", status=200)["status"] == "pending"
    # Text that is not JSON is refused naming where it broke.
    card = page.locator(f"#approval-{asked['id']}")
    card.get_by_label("Arguments").fill('{"label": ')
    card.get_by_role("button", name="Approve").click()
    expect(page.get_by_role("alert")).to_contain_text("not JSON")
    expect(page.get_by_role("alert")).to_contain_text("line 1, column")
    # Edited arguments with a reject are refused too: a reject runs nothing.
    card = page.locator(f"#approval-{asked['id']}")
    card.get_by_label("Arguments").fill('{"label": "other"}')
    card.get_by_role("button", name="Reject").click()
    expect(page.get_by_role("alert")).to_contain_text("only be edited by an approve")
    assert console.json("GET", f"/v1/approvals/{asked['id']}", status=200)["status"] == "pending"

    # Back on the session page, from the keyboard: the reason, then Tab to Reject and Enter.
    watched.goto(f"/console/sessions/{session_id}")
    card = page.locator(f"#approval-{asked['id']}")
    card.get_by_label("Reason").focus()
    page.keyboard.type("not now")
    page.keyboard.press("Tab")  # Approve
    page.keyboard.press("Tab")  # Reject
    assert page.evaluate("document.activeElement.textContent") == "Reject"
    page.keyboard.press("Enter")
    expect(page).to_have_url(f"{console.base}/console/sessions/{session_id}?done=rejected_call")
    expect(page.locator(".notice")).to_contain_text("Rejected")
    row = page.locator(f'#turns tr[data-turn="{turn}"]')
    expect(row.locator(".status")).to_have_text("completed")
    result = [e for e in console.json("GET", f"/v1/sessions/{session_id}")["transcript"] if e["role"] == "tool"]
    assert result and result[-1]["is_error"] and "not now" in result[-1]["content"]
    decided = console.json("GET", f"/v1/approvals/{asked['id']}", status=200)
    assert decided["status"] == "rejected" and decided["reason"] == "not now"
    watched.goto(f"/console/sessions/{session_id}")
    expect(page.locator("#transcript .role-tool").last).to_contain_text("not now")


def test_deltas_resets_and_restarts_are_drawn_per_turn_run_and_step(watched: Watched, console: Console) -> None:
    """The script's handlers of §7's text events, fed a made-up sequence in the real page: deltas
    go to their (turn, run, step)'s block; step.reset empties that step's and it streams again;
    turn.restarted, or a later run's first delta, empties the earlier runs' blocks for good."""
    session_id = console.new_session("streamer")
    page = watched.page
    watched.log_in()
    watched.goto(f"/console/sessions/{session_id}")
    expect(page.locator("#stream-status")).to_have_text("(live)")
    shown = page.evaluate(
        """() => {
      const live = {stream: document.getElementById("streaming"), status: document.getElementById("run-status"),
        log: document.getElementById("live-log"), connection: document.getElementById("stream-status")};
      const text = (turn, run, step) => {
        const block = live.stream.querySelector(`[data-key="${turn}/${run}/${step}"]`);
        return block ? [block.querySelector("pre.content").textContent, block.className] : null;
      };
      const d = (turn, run, step, content) => HANDLERS.delta(live, {turn, run, step, model: "m", content});
      d("t_a", 0, 1, "Hello "); d("t_a", 0, 1, "wor");
      HANDLERS["step.reset"](live, {turn: "t_a", run: 0, step: 1, reason: "failover"});
      const resetLabel = live.stream.querySelector('[data-key="t_a/0/1"] .step-label').textContent;
      d("t_a", 0, 1, "Hello world");
      d("t_a", 0, 2, "second step");
      const afterReset = [text("t_a", 0, 1), text("t_a", 0, 2)];
      HANDLERS["turn.restarted"](live, {turn: "t_a", run: 1, restarts: 1, model_from: "m", model_to: "n"});
      const afterRestart = [text("t_a", 0, 1), text("t_a", 0, 2)];
      d("t_a", 1, 1, "From the top");
      d("t_b", 0, 1, "other turn");
      d("t_b", 2, 1, "re-run after a crash");  // no turn.restarted: the later run takes run 0 back
      return {resetLabel, afterReset, afterRestart, rerun: text("t_a", 1, 1), crashed: text("t_b", 0, 1),
        later: text("t_b", 2, 1), visible: !live.stream.hidden};
    }"""
    )
    assert shown["afterReset"] == [["Hello world", "stream-step reset"], ["second step", "stream-step"]]
    assert shown["afterRestart"] == [["", "stream-step reset discarded"], ["", "stream-step discarded"]]
    assert shown["rerun"] == ["From the top", "stream-step"]
    assert shown["crashed"] == ["", "stream-step discarded"]
    assert shown["later"] == ["re-run after a crash", "stream-step"]
    assert shown["visible"] is True
    assert shown["resetLabel"] == "step 1: text so far discarded (failover)"
    expect(page.locator('#streaming [data-key="t_b/0/1"] .step-label')).to_contain_text("a later run")


def test_an_approval_is_decided_without_javascript(browser: Any, console: Console) -> None:
    session_id = console.new_session("careful")
    turn = console.json("POST", f"/v1/sessions/{session_id}/messages", {"content": "record please"}, 200)["turn"]["id"]
    asked = _approval_of(console, session_id)
    plain = Watched(browser, console, javascript=False)
    try:
        page = plain.page
        plain.log_in()
        plain.goto("/console/approvals")
        card = page.locator(f"#approval-{asked['id']}")
        card.get_by_label("Reason").fill("fine by me")
        card.get_by_role("button", name="Approve").click()
        expect(page.locator(".notice")).to_contain_text("Approved")
        expect(page.locator(f'#decided tr[data-approval="{asked["id"]}"]')).to_contain_text("fine by me")
        plain.pages_html.append(page.content())
        wait_until(
            lambda: console.json("GET", f"/v1/sessions/{session_id}")["turns"][-1]["status"] == "completed",
            "the approved turn to complete",
        )
        plain.goto(f"/console/sessions/{session_id}")
        expect(page.locator(f'#turns tr[data-turn="{turn}"] .status')).to_have_text("completed")
        expect(page.locator("#transcript .role-tool").last).to_contain_text("recorded step 1")
        plain.check_clean()
    finally:
        plain.close()
