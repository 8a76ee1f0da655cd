"""Start-up while the store cannot be opened yet (RFC 0009 §1), without the real daemon process.

The retry schedule, the API a waiting daemon serves (agentd/api.py ``build_waiting_app``,
``SwitchableApp``), and the daemon's wait itself (agentd/supervisor/daemon.py ``_open_patiently``,
``_open_store``) with a fake ``open_store``. tests/test_e2e_postgres.py runs the real thing against
a database that comes up after the daemon; tests/test_store_postgres.py has what counts as "yet".
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import anyio
import httpx
import pytest
from structlog.testing import capture_logs

from agentd import events
from agentd.api import ROUTES, BearerAuth, SwitchableApp, build_waiting_app
from agentd.config import StoreSettings
from agentd.obs import configure_logging
from agentd.store import Store, StoreError, StoreUnavailable
from agentd.supervisor import daemon

pytestmark = pytest.mark.anyio

LOCATION = "postgresql://db.internal:5432/agentd"
SETTINGS = StoreSettings(url="postgresql://agentd@db.internal:5432/agentd")
REASON = f"waiting for the store: cannot open the store {LOCATION}: Connection refused"


@pytest.fixture(autouse=True)
def info_lines() -> None:
    """capture_logs sees only what the configured level lets through; another test may have left it at warning."""
    configure_logging("json", "info")


def test_the_retry_delay_doubles_from_half_a_second_to_ten() -> None:
    assert [daemon.store_retry_delay(n) for n in range(1, 9)] == [0.5, 1, 2, 4, 8, 10, 10, 10]
    assert daemon.store_retry_delay(10**9) == 10  # a wait of years does not overflow


# --------------------------------------------------------------------------- the waiting app


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://agentd")


def concrete(path: str) -> str:
    return path.replace("{id}", "s_1")


async def test_a_waiting_daemon_is_alive_not_ready_and_serves_nothing_else() -> None:
    async with client(build_waiting_app(lambda: REASON)) as api:
        health = await api.get("/v1/health")
        assert (health.status_code, health.json()) == (200, {"status": "ok"})
        ready = await api.get("/v1/ready")
        assert (ready.status_code, ready.json()) == (503, {"ready": False, "reasons": [REASON]})
        served = {"/v1/health", "/v1/ready"}
        for path, method, _ in ROUTES:
            if path in served:
                continue
            answer = await api.request(method, concrete(path), json={} if method == "POST" else None)
            assert answer.status_code == 503, (method, path)
            assert answer.json() == {
                "error": {
                    "code": "store_unavailable",
                    "message": f"agentd is not serving yet ({REASON}); nothing was stored",
                    "turn": None,
                }
            }
        # Routes that do not exist, or a method a route does not have, answer as when serving.
        assert (await api.get("/v1/nowhere")).json()["error"]["code"] == "not_found"
        assert (await api.put("/v1/health")).json()["error"]["code"] == "method_not_allowed"


async def test_a_waiting_daemon_on_tcp_wants_the_token_except_for_the_probes() -> None:
    async with client(BearerAuth(build_waiting_app(lambda: REASON), "t0ken")) as api:
        assert (await api.get("/v1/health")).status_code == 200
        anonymous = await api.get("/v1/ready")
        assert (anonymous.status_code, anonymous.json()) == (503, {"ready": False})  # never why
        assert (await api.get("/v1/status")).json()["error"]["code"] == "unauthorized"
        authorized = await api.get("/v1/ready", headers={"Authorization": "Bearer t0ken"})
        assert authorized.json()["reasons"] == [REASON]


async def test_the_switchable_app_serves_the_app_it_was_last_given() -> None:
    front = SwitchableApp(build_waiting_app(lambda: REASON))
    async with client(front) as api:
        assert (await api.get("/v1/ready")).status_code == 503
        front.app = build_waiting_app(lambda: "starting: the store is open")
        assert (await api.get("/v1/ready")).json()["reasons"] == ["starting: the store is open"]


# --------------------------------------------------------------------------- the wait


class FakeOpen:
    """``open_store`` failing with the given errors in turn, then opening (or blocking, with ``block``)."""

    def __init__(self, *failures: StoreError, block: bool = False) -> None:
        self.failures = list(failures)
        self.block = block
        self.attempts = 0
        self.store = cast(Store, object())
        self.on_attempt: list[Any] = []

    async def __call__(self, settings: StoreSettings, state_dir: Path, environ: Any) -> Store:
        self.attempts += 1
        for hook in self.on_attempt:
            await hook(self.attempts)
        if self.failures:
            raise self.failures.pop(0)
        if self.block:
            await anyio.sleep_forever()
        return self.store


def unavailable(n: int) -> StoreUnavailable:
    return StoreUnavailable(f"cannot open the store {LOCATION}: Connection refused ({n})")


def logged(logs: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [entry for entry in logs if entry["event"] == event]


async def test_the_store_is_tried_again_while_unavailable_and_the_wait_is_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(daemon, "STORE_RETRY_FIRST", 0.01)
    fake = FakeOpen(unavailable(1), unavailable(2))
    answers: list[httpx.Response] = []

    async def ask_the_socket(attempt: int) -> None:  # from the second attempt on, the socket answers
        if attempt == 3:
            transport = httpx.AsyncHTTPTransport(uds=str(tmp_path / daemon.SOCKET_FILE))
            async with httpx.AsyncClient(transport=transport, base_url="http://agentd") as api:
                answers.extend([await api.get("/v1/health"), await api.get("/v1/ready")])

    fake.on_attempt.append(ask_the_socket)
    monkeypatch.setattr(daemon, "open_store", fake)
    api = daemon._Listeners(tmp_path, None, "")
    try:
        with capture_logs() as logs:
            async with anyio.create_task_group() as tg:
                assert await daemon._open_patiently(SETTINGS, tmp_path, api, tg) is fake.store
                await api.stop()
                tg.cancel_scope.cancel()
    finally:
        api.close()
    assert fake.attempts == 3
    waiting = logged(logs, events.LOG_STORE_WAITING)
    assert [(w["attempt"], w["retry_in"]) for w in waiting] == [(1, 0.01), (2, 0.02)]
    assert {w["store"] for w in waiting} == {LOCATION}  # without the user
    assert [w["error"] for w in waiting] == [str(unavailable(1)), str(unavailable(2))]
    [opened] = logged(logs, events.LOG_STORE_OPENED)
    assert opened["attempts"] == 3 and opened["store"] == LOCATION
    health, ready = answers
    assert health.status_code == 200
    assert ready.status_code == 503 and ready.json()["reasons"] == [f"waiting for the store: {unavailable(2)}"]
    assert not (tmp_path / daemon.SOCKET_FILE).exists()


async def test_a_store_that_opens_at_once_binds_nothing_early_and_logs_no_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeOpen()
    monkeypatch.setattr(daemon, "open_store", fake)
    api = daemon._Listeners(tmp_path, None, "")
    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            assert await daemon._open_patiently(SETTINGS, tmp_path, api, tg) is fake.store
    assert not api.bound and not (tmp_path / daemon.SOCKET_FILE).exists()
    assert not logged(logs, events.LOG_STORE_WAITING) and not logged(logs, events.LOG_STORE_OPENED)


async def test_a_refusal_for_good_ends_the_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon, "STORE_RETRY_FIRST", 0.01)
    refused = StoreError(f"cannot open the store {LOCATION}: password authentication failed")
    fake = FakeOpen(unavailable(1), refused)
    monkeypatch.setattr(daemon, "open_store", fake)
    api = daemon._Listeners(tmp_path, None, "")
    raised: list[StoreError] = []
    try:
        with capture_logs() as logs:
            async with anyio.create_task_group() as tg:
                try:
                    await daemon._open_patiently(SETTINGS, tmp_path, api, tg)
                except StoreError as exc:
                    raised.append(exc)
                await api.stop()
                tg.cancel_scope.cancel()
    finally:
        api.close()
    assert raised == [refused] and fake.attempts == 2
    assert len(logged(logs, events.LOG_STORE_WAITING)) == 1  # the refusal is not a wait


async def signals_from(stream: anyio.abc.ObjectReceiveStream[int]) -> AsyncIterator[int]:
    async for signum in stream:
        yield signum


async def test_sigterm_while_waiting_stops_the_start_and_a_sighup_waits_for_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeOpen(block=True)  # an attempt that never ends: mid-connect
    monkeypatch.setattr(daemon, "open_store", fake)
    send, receive = anyio.create_memory_object_stream[int](10)
    api = daemon._Listeners(tmp_path, None, "")
    deferred: list[int] = []

    async def signal_once_attempting(attempt: int) -> None:
        await send.send(signal.SIGHUP)
        await send.send(signal.SIGTERM)

    fake.on_attempt.append(signal_once_attempting)
    with send, receive, capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(10):
                opened = await daemon._open_store(SETTINGS, tmp_path, [], signals_from(receive), api, tg, deferred)
    assert opened is None and fake.attempts == 1
    assert deferred == [signal.SIGHUP]
    assert [(s["signal"], s["action"]) for s in logged(logs, events.LOG_SIGNAL)] == [
        ("SIGHUP", "deferred"),
        ("SIGTERM", "stop"),
    ]


async def test_a_sigterm_from_before_the_loop_listened_stops_the_start_before_any_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeOpen()
    monkeypatch.setattr(daemon, "open_store", fake)
    send, receive = anyio.create_memory_object_stream[int](1)
    deferred: list[int] = []
    with send, receive:
        async with anyio.create_task_group() as tg:
            early = [signal.SIGHUP, signal.SIGTERM]
            api = daemon._Listeners(tmp_path, None, "")
            assert await daemon._open_store(SETTINGS, tmp_path, early, signals_from(receive), api, tg, deferred) is None
    assert fake.attempts == 0 and deferred == [signal.SIGHUP]


async def test_an_attempt_that_takes_long_serves_the_wait_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: an attempt that neither opens nor fails for a while — a server that answers slowly or
    not at all, a migration running or waiting for another replica's — must not keep the probes
    unanswered until it ends (up to the migrations' bound). SQLite binds nothing early."""
    monkeypatch.setattr(daemon, "STORE_SLOW_OPEN", 0.01)
    released = anyio.Event()
    answers: list[httpx.Response] = []

    class SlowOpen(FakeOpen):
        async def __call__(self, settings: StoreSettings, state_dir: Path, environ: Any) -> Store:
            self.attempts += 1
            await released.wait()
            return self.store

    fake = SlowOpen()
    monkeypatch.setattr(daemon, "open_store", fake)
    api = daemon._Listeners(tmp_path, None, "")

    async def ask_the_socket() -> None:
        with anyio.fail_after(10):
            while not (tmp_path / daemon.SOCKET_FILE).exists():
                await anyio.sleep(0.01)
            transport = httpx.AsyncHTTPTransport(uds=str(tmp_path / daemon.SOCKET_FILE))
            async with httpx.AsyncClient(transport=transport, base_url="http://agentd") as client:
                answers.extend([await client.get("/v1/health"), await client.get("/v1/ready")])
        released.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ask_the_socket)
            assert await daemon._open_patiently(SETTINGS, tmp_path, api, tg) is fake.store
            await api.stop()
            tg.cancel_scope.cancel()
    finally:
        api.close()
    assert fake.attempts == 1
    health, ready = answers
    assert health.status_code == 200
    assert ready.status_code == 503 and ready.json()["reasons"] == [f"waiting for the store: opening {LOCATION}"]

    released = anyio.Event()
    released.set()
    sqlite = daemon._Listeners(tmp_path, None, "")
    async with anyio.create_task_group() as tg:
        assert await daemon._open_patiently(StoreSettings(), tmp_path, sqlite, tg) is fake.store
    assert not sqlite.bound


class ClosableStore:
    """A store whose first read fails as ``reads`` says (an error, or None: it answers), and that counts its closes."""

    def __init__(self, *reads: StoreError | None, block: bool = False) -> None:
        self.reads, self.block, self.closed = list(reads), block, 0

    async def open_sessions_by_assistant(self) -> dict[str, int]:
        if self.block:
            await anyio.sleep_forever()
        failure = self.reads.pop(0) if self.reads else None
        if failure is not None:
            raise failure
        return {"main": 2}

    async def close(self) -> None:
        self.closed += 1


async def test_a_store_lost_at_the_first_read_is_closed_and_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: the store opens and the start's first read fails because the database went away just
    then: that attempt failed (the store closed), the wait goes on — it is not an exit 1."""
    monkeypatch.setattr(daemon, "STORE_RETRY_FIRST", 0.01)
    lost, kept = (
        ClosableStore(StoreUnavailable("count sessions by assistant: server closed the connection")),
        ClosableStore(),
    )
    stores = [lost, kept]
    counts: list[dict[str, int]] = []

    async def fake_open(settings: StoreSettings, state_dir: Path, environ: Any) -> Store:
        return cast(Store, stores.pop(0))

    async def first_read(store: Store) -> None:
        counts.append(await store.open_sessions_by_assistant())

    monkeypatch.setattr(daemon, "open_store", fake_open)
    api = daemon._Listeners(tmp_path, None, "")
    try:
        with capture_logs() as logs:
            async with anyio.create_task_group() as tg:
                assert await daemon._open_patiently(SETTINGS, tmp_path, api, tg, first_read) is kept
                await api.stop()
                tg.cancel_scope.cancel()
    finally:
        api.close()
    assert (lost.closed, kept.closed) == (1, 0) and counts == [{"main": 2}]
    [waiting] = logged(logs, events.LOG_STORE_WAITING)
    assert (
        waiting["error"]
        == f"cannot open the store {LOCATION}: count sessions by assistant: server closed the connection"
    )

    refused = ClosableStore(StoreError("count sessions by assistant: permission denied"))
    stores[:] = [refused]
    async with anyio.create_task_group() as tg:
        with pytest.raises(StoreError, match="permission denied") as raised:
            await daemon._open_patiently(SETTINGS, tmp_path, daemon._Listeners(tmp_path, None, ""), tg, first_read)
    assert not isinstance(raised.value, StoreUnavailable) and refused.closed == 1


async def test_a_sigterm_during_the_first_read_closes_the_store_it_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = ClosableStore(block=True)

    async def fake_open(settings: StoreSettings, state_dir: Path, environ: Any) -> Store:
        return cast(Store, held)

    async def first_read(store: Store) -> None:
        await store.open_sessions_by_assistant()

    monkeypatch.setattr(daemon, "open_store", fake_open)
    send, receive = anyio.create_memory_object_stream[int](1)
    api = daemon._Listeners(tmp_path, None, "")
    try:
        with send, receive:
            async with anyio.create_task_group() as tg:

                async def stop_soon() -> None:
                    await anyio.sleep(0.05)
                    await send.send(signal.SIGTERM)

                tg.start_soon(stop_soon)
                with anyio.fail_after(10):
                    opened = await daemon._open_store(
                        SETTINGS, tmp_path, [], signals_from(receive), api, tg, [], first_read
                    )
                await api.stop()
                tg.cancel_scope.cancel()
    finally:
        api.close()
    assert opened is None and held.closed == 1
