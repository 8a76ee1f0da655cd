"""The console's pure parts (agentd/console/auth.py, pages.py): logins, CSRF tokens, the Origin
rule, paging — without a daemon or a browser (tests/test_e2e_console.py drives the whole)."""

from __future__ import annotations

import tomllib
from fnmatch import fnmatch
from pathlib import Path
from typing import cast

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.testclient import TestClient

from agentd.api import CONSOLE_LISTENER, CONSOLE_PATH, BearerAuth, Service, build_waiting_app
from agentd.console import build_console
from agentd.console.auth import CLOCK_SKEW, SESSION_MAX_AGE, ConsoleKeys, same_origin
from agentd.console.pages import environment, page_number, paginate
from agentd.console.routes import _local_next

TOKEN = "unit-test-token-0123456789"
NOW = 1_800_000_000.0


def test_a_login_cookie_is_good_on_any_replica_with_the_token_and_never_shows_it() -> None:
    issued = ConsoleKeys(TOKEN).issue(NOW)
    assert TOKEN not in issued
    other_replica = ConsoleKeys(TOKEN)
    login = other_replica.login(issued, NOW + 60)
    assert login is not None and login.issued_at == int(NOW)
    assert ConsoleKeys("another-token-9876543210").login(issued, NOW) is None  # a new token logs everyone out


@pytest.mark.parametrize("age", [SESSION_MAX_AGE + 1, -CLOCK_SKEW - 1], ids=["expired", "issued in the future"])
def test_a_login_cookie_expires(age: float) -> None:
    keys = ConsoleKeys(TOKEN)
    assert keys.login(keys.issue(NOW), NOW + age) is None


@pytest.mark.parametrize(
    "forge",
    [
        lambda c: None,
        lambda c: "",
        lambda c: c + "0",
        lambda c: "9" + c,  # another issue time under the same MAC
        lambda c: c.replace(".", "", 1),
        lambda c: "x." + c.split(".", 1)[1],
        lambda c: "²." + c.split(".", 1)[1],
        lambda c: ".".join(c.split(".")[:2]),
    ],
)
def test_a_forged_or_malformed_cookie_is_no_login(forge: object) -> None:
    keys = ConsoleKeys(TOKEN)
    assert callable(forge)
    assert keys.login(forge(keys.issue(NOW)), NOW) is None


def test_csrf_tokens_belong_to_one_login_and_are_compared_exactly() -> None:
    keys = ConsoleKeys(TOKEN)
    first, second = keys.login(keys.issue(NOW), NOW), keys.login(keys.issue(NOW), NOW)
    assert first is not None and second is not None
    token = keys.csrf(first)
    assert TOKEN not in token
    assert keys.csrf_ok(first, token)
    assert not keys.csrf_ok(second, token)
    assert not keys.csrf_ok(first, None) and not keys.csrf_ok(first, "") and not keys.csrf_ok(first, token.upper())
    nonce = keys.login_nonce()
    assert keys.login_csrf_ok(nonce, keys.login_csrf(nonce))
    assert not keys.login_csrf_ok(None, keys.login_csrf(nonce))
    assert not keys.login_csrf_ok(keys.login_nonce(), keys.login_csrf(nonce))


def test_the_token_matches_exactly() -> None:
    keys = ConsoleKeys(TOKEN)
    assert keys.token_matches(TOKEN) and keys.token_matches(f" {TOKEN}\n")
    assert not keys.token_matches(TOKEN[:-1]) and not keys.token_matches(TOKEN + "x") and not keys.token_matches("")


@pytest.mark.parametrize(
    ("headers", "allowed"),
    [
        ({"origin": "http://127.0.0.1:8080", "host": "127.0.0.1:8080"}, True),
        ({"origin": "https://127.0.0.1:8080", "host": "127.0.0.1:8080"}, False),
        ({"origin": "http://evil.example", "host": "127.0.0.1:8080"}, False),
        ({"origin": "null", "host": "127.0.0.1:8080"}, False),
        ({"origin": "http://127.0.0.1:8080"}, False),
        ({"host": "127.0.0.1:8080"}, True),  # not a browser: the CSRF token decides
        ({"host": "127.0.0.1:8080", "sec-fetch-site": "cross-site"}, False),
        ({"host": "127.0.0.1:8080", "sec-fetch-site": "same-site"}, False),
    ],
)
def test_the_origin_rule(headers: dict[str, str], allowed: bool) -> None:
    assert same_origin(headers, "http") is allowed


def test_paging_shows_the_last_page_by_default_and_clamps() -> None:
    items = list(range(120))
    last = paginate(items, None, 50)
    assert (last.number, last.count, last.items[0], last.first_index, last.next, last.previous) == (
        3,
        3,
        100,
        100,
        None,
        2,
    )
    assert paginate(items, 1, 50).items == list(range(50))
    assert paginate(items, 99, 50).number == 3
    assert paginate(items, 0, 50).number == 1
    empty = paginate([], None, 50)
    assert (empty.number, empty.count, empty.items) == (1, 1, [])
    assert [page_number(t) for t in ("2", "0", "-1", "x", "²", None)] == [2, None, None, None, None, None]


@pytest.mark.parametrize(
    ("target", "landing"),
    [
        ("/console/sessions", "/console/sessions"),
        ("//evil.example/console/", "/console/"),
        ("https://evil.example/", "/console/"),
        ("/console\\@evil", "/console/"),
        ("/consolexyz", "/console/"),
        (None, "/console/"),
    ],
)
def test_a_login_goes_on_only_to_a_console_page(target: str | None, landing: str) -> None:
    assert _local_next(target) == landing


def test_templates_escape_what_they_show() -> None:
    html = (
        environment()
        .get_template("error.html")
        .render(csrf="", logged_in=False, notice=None, active="", status_code=400, message="<script>alert(1)</script>")
    )
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;" in html


# --------------------------------------------------------------------------- where the console is served


def _console_probe() -> Starlette:
    """An app that says whether a request reached it marked as the TCP listener's console request."""

    async def probe(request: Request) -> Response:
        return PlainTextResponse("tcp" if request.scope.get(CONSOLE_LISTENER) else "unmarked")

    return Starlette(routes=[Route("/{rest:path}", probe, methods=["GET", "POST"])])


def test_bearer_auth_passes_only_console_paths_without_the_token_and_marks_them() -> None:
    inner = Starlette(routes=[Mount(CONSOLE_PATH, app=_console_probe())])
    with TestClient(BearerAuth(inner, TOKEN)) as client:
        assert client.get("/console/").text == "tcp"
        assert client.post("/console/reloads").text == "tcp"
        assert client.get("/v1/status").status_code == 401
        assert client.get("/consolex").status_code == 401  # only the console's own prefix
    with TestClient(inner) as unix:  # the unix socket's app: no BearerAuth, so never marked
        assert unix.get("/console/").text == "unmarked"


def test_the_console_refuses_requests_that_did_not_come_through_the_tcp_listener() -> None:
    with TestClient(build_console(cast(Service, object()), TOKEN)) as client:
        answer = client.get("/login")
        assert answer.status_code == 404 and "csrf" not in answer.text


def test_while_the_daemon_waits_for_its_store_the_console_answers_503() -> None:
    app = BearerAuth(build_waiting_app(lambda: "waiting for the store: down"), TOKEN)
    with TestClient(app) as client:
        for path in ("/console/", "/console/login", "/console/sessions/s_1"):
            answer = client.get(path)
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "store_unavailable"


def test_every_console_asset_ships_in_the_wheel() -> None:
    """pyproject's package-data globs cover every template and static file (none is fetched from elsewhere)."""
    root = Path(__file__).resolve().parent.parent
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["agentd"]
    package = root / "agentd"
    assets = [p for d in ("templates", "static") for p in (package / "console" / d).iterdir() if p.is_file()]
    assert assets
    unshipped = [p for p in assets if not any(fnmatch(str(p.relative_to(package)), g) for g in globs)]
    assert unshipped == []
