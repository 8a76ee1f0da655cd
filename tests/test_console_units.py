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
from agentd.console.pages import (
    NAV,
    TURN_COLUMNS,
    cost_text,
    edited_arguments,
    environment,
    newest_decided,
    page_number,
    paginate,
)
from agentd.console.routes import _local_next
from agentd.errors import BadInput
from agentd.records import Cost
from agentd.views import ApprovalView, DiscardedView, TurnView, UsageView

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


# --------------------------------------------------------------------------- usage, cost and approvals


def test_a_cost_is_its_amount_and_currency_and_an_unknown_price_is_never_zero() -> None:
    assert cost_text(UsageView(requests=2, cost=Cost(amount="0.0000125", currency="EUR"))) == "0.0000125 EUR"
    assert cost_text(UsageView(input_tokens=10, requests=1, cost=None)) == "unpriced"
    assert cost_text(UsageView()) == "—"  # no model call: nothing to price


def test_edited_arguments_are_none_when_unchanged_and_bad_json_is_refused_naming_where() -> None:
    original = {"label": "a", "n": 1}
    assert edited_arguments(None, original) is None
    assert edited_arguments("  \n", original) is None
    assert edited_arguments('{\n  "n": 1,\n  "label": "a"\n}', original) is None  # the form's own pretty text
    assert edited_arguments('{"label": "b"}', original) == {"label": "b"}
    assert edited_arguments("[1]", original) == [1]  # the operation says it is not an object
    with pytest.raises(BadInput) as refused:
        edited_arguments('{"label": ', original)
    assert refused.value.code == "bad_arguments" and "not JSON" in refused.value.message
    assert "line 1, column" in refused.value.message


def _approval(n: int, status: str) -> ApprovalView:
    return ApprovalView(
        id=f"ap_{n}", session="s_1", turn="t_1", call_id=f"c{n}", tool="record", arguments={}, status=status
    )


def test_the_newest_decided_approvals_newest_first() -> None:
    given = [_approval(1, "approved"), _approval(2, "pending"), _approval(3, "rejected"), _approval(4, "expired")]
    assert [a.id for a in newest_decided(given, 2)] == ["ap_4", "ap_3"]
    assert [a.id for a in newest_decided(given, 10)] == ["ap_4", "ap_3", "ap_1"]
    assert newest_decided([_approval(1, "pending")], 5) == []


def test_a_turn_row_has_a_cell_per_column_with_its_cost_and_the_discarded_runs_cost() -> None:
    turn = TurnView(
        id="t_1",
        status="completed",
        models=["m"],
        steps=1,
        restarts=1,
        discarded=[DiscardedView(model="old", steps=1, reason="swap", usage=UsageView(input_tokens=3, requests=1))],
        usage=UsageView(input_tokens=7, output_tokens=2, requests=2, cost=Cost(amount="0.25", currency="USD")),
    )
    html = environment().get_template("turn_row.html").render(t=turn)
    assert all(f'class="col-{name}' in html for name, _ in TURN_COLUMNS)
    assert "0.25 USD" in html and "unpriced" in html  # the turn priced; its discarded run not


def test_the_approval_form_is_labelled_carries_the_csrf_token_and_escapes_arguments() -> None:
    approval = ApprovalView(
        id="ap_1",
        session="s_1",
        turn="t_1",
        call_id="c1",
        tool="record",
        arguments={"label": "</textarea><script>x</script>"},
        status="pending",
    )
    html = (
        environment()
        .get_template("approval.html")
        .render(a=approval, csrf="c5rf", back="/console/approvals", submitted={})
    )
    assert 'name="csrf" value="c5rf"' in html and 'action="/console/approvals/ap_1"' in html
    assert '<label for="arguments-ap_1">' in html and '<label for="reason-ap_1">' in html
    assert 'id="arguments-ap_1"' in html and 'id="reason-ap_1"' in html
    assert "<script>x" not in html and "&lt;/textarea&gt;" in html
    assert [n.key for n in NAV].count("approvals") == 1


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
