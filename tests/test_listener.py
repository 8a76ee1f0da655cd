"""The API's listeners in process (agentd/supervisor/listener.py) and the token's one reading
(agentd/apitoken.py). tests/test_e2e_listener.py drives the same through the real daemon."""

from __future__ import annotations

import asyncio
import errno
import resource
import socket
from typing import Any

import anyio
import httpx
import pytest
from structlog.testing import capture_logs

from agentd import events
from agentd.apitoken import TOKEN_ENV, TokenError, api_token, clean_token
from agentd.client import AgentdClient
from agentd.obs import configure_logging
from agentd.supervisor import listener
from agentd.supervisor.listener import ApiServer, RateLimitedLog, Slots, connection_cap

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def warning_lines() -> None:
    configure_logging("json", "info")


# --------------------------------------------------------------------------- the token


@pytest.mark.parametrize("raw", ["s3cret\n", "s3cret\r\n", "  s3cret\t", "s3cret"])
def test_a_token_is_trimmed_of_surrounding_whitespace(raw: str) -> None:
    assert api_token({TOKEN_ENV: raw}) == "s3cret"


def test_an_unset_or_empty_token_is_none() -> None:
    assert api_token({}) is None
    assert api_token({TOKEN_ENV: ""}) is None


@pytest.mark.parametrize("raw", [" ", "\n", " \t\r\n "])
def test_a_token_of_only_whitespace_is_refused_naming_the_variable(raw: str) -> None:
    with pytest.raises(TokenError, match=f"^{TOKEN_ENV} is set but holds only whitespace"):
        api_token({TOKEN_ENV: raw})


@pytest.mark.parametrize("raw", ["ab\ncd", "ab\x00cd", "t\u00f6ken", "ab\x7fcd"])
def test_a_token_no_header_can_carry_is_refused(raw: str) -> None:
    with pytest.raises(TokenError, match=f"^{TOKEN_ENV} holds"):
        api_token({TOKEN_ENV: raw})
    assert clean_token("a b") == "a b"  # inner spaces travel in a header, as they always did


def test_the_client_sends_the_trimmed_token(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"status": "ok"})

    monkeypatch.setenv(TOKEN_ENV, "s3cret\n")
    with AgentdClient(url="http://agentd.test", transport=httpx.MockTransport(handler)) as client:
        client.health()
    assert seen == ["Bearer s3cret"]
    monkeypatch.setenv(TOKEN_ENV, " \n")
    with pytest.raises(TokenError):
        AgentdClient(url="http://agentd.test", transport=httpx.MockTransport(handler))


# --------------------------------------------------------------------------- bounds


def test_the_cap_is_at_most_half_the_open_files_limit() -> None:
    assert connection_cap(1000, 65536) == 1000
    assert connection_cap(1000, 1024) == 512
    assert connection_cap(8, 1024) == 8
    assert connection_cap(1000, 1) == 1
    assert connection_cap(1000, resource.RLIM_INFINITY) == 1000


def test_a_rate_limited_line_counts_what_it_left_out() -> None:
    now = [0.0]
    limited = RateLimitedLog("api.accept_failed", interval=10.0, clock=lambda: now[0])
    with capture_logs() as logs:
        assert limited.warning(error="EMFILE") is True
        for _ in range(1000):
            now[0] += 0.001
            assert limited.warning(error="EMFILE") is False
        now[0] = 10.5
        assert limited.warning(error="EMFILE") is True
    assert [entry["suppressed"] for entry in logs] == [0, 1000]


async def test_slots_hold_back_the_one_over_the_limit() -> None:
    slots = Slots(2)
    first, second = slots.take(), slots.take()
    assert slots.full
    waited = asyncio.ensure_future(slots.wait())
    await asyncio.sleep(0)
    assert not waited.done()
    first()
    first()  # a release counts once, whatever path the connection ends by
    await waited
    assert slots.open == 1 and not slots.full
    second()
    assert slots.open == 0


async def test_accept_failures_are_logged_once_per_interval_and_serving_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Out of descriptors, accept() fails at every try: one line (its count of the rest comes with
    the next), a pause between tries, and connections served again once it succeeds."""
    monkeypatch.setattr(listener, "ACCEPT_RETRY_DELAY", 0)
    monkeypatch.setattr(listener, "ACCEPT_LOG_INTERVAL", 1e9)  # however slow the machine: one line
    loop = asyncio.get_running_loop()
    real_accept = loop.sock_accept
    failures = [500]

    async def failing_accept(sock: socket.socket) -> Any:
        if failures[0]:
            failures[0] -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return await real_accept(sock)

    monkeypatch.setattr(loop, "sock_accept", failing_accept)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    port = sock.getsockname()[1]
    server = ApiServer(app, name="test", max_connections=4, header_timeout=30.0)
    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve, [sock])
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                answer = await client.get("/")
            assert (answer.status_code, answer.text, failures[0]) == (200, "ok", 0)
            server.should_exit = True
    failed = [entry for entry in logs if entry["event"] == events.LOG_API_ACCEPT_FAILED]
    assert len(failed) == 1 and failed[0]["suppressed"] == 0 and "Too many open files" in failed[0]["error"]
