"""Start-up while the store cannot be opened yet (RFC 0009 §1), without the real daemon process.

The API a waiting daemon serves (agentd/api.py ``build_waiting_app``, ``SwitchableApp``).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from agentd.api import ROUTES, BearerAuth, SwitchableApp, build_waiting_app

pytestmark = pytest.mark.anyio

LOCATION = "postgresql://db.internal:5432/agentd"
REASON = f"waiting for the store: cannot open the store {LOCATION}: Connection refused"


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
