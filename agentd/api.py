"""The HTTP+JSON control API (RFC 0000 §6) as a Starlette app over the daemon's operations.

Bodies are msgspec Structs from agentd.views; every error is ``{"error": {"code", "message"}}``.
The operations refuse with the domain errors of ``agentd.errors``; this module alone says which
HTTP status each is answered with (``STATUS``). The app is built over any ``Service`` (the
daemon's composition root, ``agentd.supervisor.daemon``, gives it the supervisor).
The unix socket listener needs no token (the socket is mode 0600); the optional TCP listener is
wrapped in ``BearerAuth``. While the daemon waits for its store at start-up the listeners serve
``build_waiting_app`` instead (alive, not ready), through a ``SwitchableApp`` that the daemon
points at ``build_app``'s once the supervisor serves.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from agentd import events
from agentd.apicommon import (
    MESSAGE_LIMIT,
    STATUS,
    JSONResponse,
    decode_bytes,
    error_response,
    is_number,
    on_service_error,
    read_body,
    status_of,
)
from agentd.apikeys import CREDENTIAL, idempotent
from agentd.door.errors import door_error, is_door_path
from agentd.door.routes import door_handlers
from agentd.errors import BadInput, ServiceError
from agentd.obs import get_logger
from agentd.service import Claim, Service
from agentd.views import (
    Accepted,
    CreateSession,
    PostMessage,
)

__all__ = [
    "ALL_ROUTES",
    "DOOR_ROUTES",
    "ROUTES",
    "STATUS",
    "BearerAuth",
    "Service",
    "SwitchableApp",
    "build_app",
    "build_waiting_app",
    "status_of",
]

log = get_logger("api")

SSE_KEEPALIVE_SECONDS = 15.0
DEFAULT_PAGE = 100  # GET /v1/sessions without ?limit=
MAX_PAGE = 10_000


#: Every route: its path, its method and the name of the handler ``build_app`` serves it with. The
#: waiting app serves the same table, so a route is found, or 404/405, alike in both.
ROUTES: tuple[tuple[str, str, str], ...] = (
    ("/v1/health", "GET", "health"),
    ("/v1/ready", "GET", "ready"),
    ("/v1/status", "GET", "status"),
    ("/v1/reload", "POST", "reload"),
    ("/v1/sessions", "POST", "create_session"),
    ("/v1/sessions", "GET", "list_sessions"),
    ("/v1/sessions/{id}", "GET", "get_session"),
    ("/v1/sessions/{id}", "DELETE", "close_session"),
    ("/v1/sessions/{id}/messages", "POST", "post_message"),
    ("/v1/sessions/{id}/events", "GET", "session_events"),
    ("/v1/sessions/{id}/cancel", "POST", "cancel"),
    ("/metrics", "GET", "metrics"),
)

#: The OpenAI-compatible door's routes (RFC 0010), served like the others, answering errors in its shape.
DOOR_ROUTES: tuple[tuple[str, str, str], ...] = (
    ("/v1/models", "GET", "list_models"),
    ("/v1/models/{id}", "GET", "get_model"),
    ("/v1/chat/completions", "POST", "chat_completion"),
    ("/v1/responses", "POST", "create_response"),
    ("/v1/responses/{id}", "GET", "get_response"),
    ("/v1/responses/{id}/cancel", "POST", "cancel_response"),
    ("/v1/conversations", "POST", "create_conversation"),
    ("/v1/conversations/{id}", "GET", "get_conversation"),
    ("/v1/conversations/{id}/items", "GET", "list_conversation_items"),
    ("/v1/conversations/{id}", "DELETE", "delete_conversation"),
)
#: Every route.
ALL_ROUTES = ROUTES + DOOR_ROUTES


async def _health(_: Request) -> Response:
    return JSONResponse({"status": "ok"})


def _not_ready(request: Request, reasons: list[str]) -> Response:
    """503 ``{"ready": false, "reasons": […]}``; a probe without the token learns ready or not,
    never why (names, store errors)."""
    shown = {"ready": False} if request.scope.get(ANONYMOUS_PROBE) else {"ready": False, "reasons": reasons}
    return JSONResponse(shown, status_code=503)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return _error(request.url.path, exc.status_code, code, str(exc.detail))


def _error(path: str, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> Response:
    """An error answered outside a route's handler, in the shape of the routes at ``path``."""
    if is_door_path(path):
        kind = "server_error" if status >= 500 else "invalid_request_error"
        kind = "authentication_error" if status == 401 else kind
        retry = {} if status >= 500 else {"x-should-retry": "false"}
        return door_error(status, message, type=kind, code=code, headers={**retry, **(headers or {})})
    response = error_response(status, code, message)
    response.headers.update(headers or {})
    return response


def build_app(supervisor: Service) -> Starlette:
    """The API application bound to ``supervisor``."""

    async def ready(request: Request) -> Response:
        reasons = supervisor.ready()
        if reasons:
            return _not_ready(request, reasons)
        return JSONResponse({"ready": True})

    async def status(_: Request) -> Response:
        return JSONResponse(await supervisor.status())

    async def reload(_: Request) -> Response:
        result = await supervisor.reload()
        return JSONResponse(result, status_code=200 if result.applied else 422)

    async def create_session(request: Request) -> Response:
        raw = await read_body(request, 1 << 20)
        body = decode_bytes(raw, CreateSession, empty_ok=True)

        async def work(claim: Claim | None) -> Response:
            created = await supervisor.create_session(
                body.assistant,
                session_id=claim.session if claim else None,
                resumed=claim.resumed if claim else False,
            )
            return JSONResponse(created, status_code=201)

        return await idempotent(supervisor, request, "/v1/sessions", raw, work)

    async def list_sessions(request: Request) -> Response:
        limit_text = request.query_params.get("limit", str(DEFAULT_PAGE))
        if not is_number(limit_text) or not 1 <= int(limit_text) <= MAX_PAGE:
            raise BadInput(f"limit must be a whole number from 1 to {MAX_PAGE}, not {limit_text!r}", code="bad_limit")
        after = request.query_params.get("after") or None
        return JSONResponse(await supervisor.list_sessions(limit=int(limit_text), after=after))

    async def get_session(request: Request) -> Response:
        return JSONResponse(await supervisor.get_session(request.path_params["id"]))

    async def post_message(request: Request) -> Response:
        raw = await read_body(request, supervisor.config.server.max_message_bytes, MESSAGE_LIMIT)
        body = decode_bytes(raw, PostMessage)

        async def work(claim: Claim | None) -> Response:
            result = await supervisor.send_message(
                request.path_params["id"],
                body,
                turn_id=claim.turn if claim else None,
                resumed=claim.resumed if claim else False,
            )
            return JSONResponse(result, status_code=202 if isinstance(result, Accepted) else 200)

        return await idempotent(supervisor, request, "/v1/sessions/{id}/messages", raw, work)

    async def cancel(request: Request) -> Response:
        turn_id = await supervisor.cancel(request.path_params["id"])
        return JSONResponse({"turn_id": turn_id, "cancelling": True}, status_code=202)

    async def close_session(request: Request) -> Response:
        return JSONResponse(await supervisor.close_session(request.path_params["id"]))

    async def session_events(request: Request) -> Response:
        session_id = request.path_params["id"]
        stream = await supervisor.subscribe(session_id)

        async def body() -> AsyncIterator[bytes]:
            try:
                yield b": connected\n\n"
                async with stream:
                    while True:
                        with anyio.move_on_after(SSE_KEEPALIVE_SECONDS) as idle:
                            try:
                                name, data = await stream.receive()
                            except anyio.EndOfStream:
                                return
                        if idle.cancelled_caught:
                            yield b": keep-alive\n\n"
                            continue
                        yield b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"
            finally:
                supervisor.unsubscribed(session_id)  # the stream is closed: the session need not stay hot

        return StreamingResponse(
            body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    async def metrics(_: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(await supervisor.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    handlers = {
        "health": _health,
        "ready": ready,
        "status": status,
        "reload": reload,
        "create_session": create_session,
        "list_sessions": list_sessions,
        "get_session": get_session,
        "close_session": close_session,
        "post_message": post_message,
        "session_events": session_events,
        "cancel": cancel,
        "metrics": metrics,
        **door_handlers(supervisor),
    }
    return Starlette(
        routes=[Route(path, handlers[name], methods=[method]) for path, method, name in ALL_ROUTES],
        middleware=[Middleware(CatchAll)],
        exception_handlers={ServiceError: on_service_error, HTTPException: _on_http_error},
    )


def build_waiting_app(waiting_for: Callable[[], str]) -> Starlette:
    """The API while the daemon starts without its store (RFC 0009 §1): alive, not ready, serving nothing.

    ``waiting_for()`` says what it waits for, e.g. ``waiting for the store: cannot open the store
    …: …``. ``GET /v1/health`` is 200, as always while the daemon runs: a liveness probe must not
    restart a replica that only waits for its database. ``GET /v1/ready`` is 503 with that reason.
    Every other route is 503 ``store_unavailable`` naming it: nothing can be stored or read yet.
    """

    async def ready(request: Request) -> Response:
        return _not_ready(request, [waiting_for()])

    async def unavailable(request: Request) -> Response:
        message = f"agentd is not serving yet ({waiting_for()}); nothing was stored"
        return _error(request.url.path, 503, "store_unavailable", message)

    def handler(name: str) -> Callable[[Request], Any]:
        return {"health": _health, "ready": ready}.get(name, unavailable)

    return Starlette(
        routes=[Route(path, handler(name), methods=[method]) for path, method, name in ALL_ROUTES],
        middleware=[Middleware(CatchAll)],
        exception_handlers={HTTPException: _on_http_error},
    )


class SwitchableApp:
    """ASGI: every request goes to ``app``, which the daemon replaces once the supervisor serves.

    The listeners are bound once, at the start of a wait for the store, and keep answering
    throughout: first with ``build_waiting_app``'s app, then with ``build_app``'s.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


class CatchAll:
    """ASGI middleware: an unexpected exception in a route is a JSON 500 ``internal`` and one
    ``api.internal_error`` log line (its type, message and where it was raised), never a plain-text
    500 or a traceback on stderr. A response already started (an event stream) is just ended."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            frame = exc.__traceback__
            while frame is not None and frame.tb_next is not None:
                frame = frame.tb_next
            where = f"{frame.tb_frame.f_code.co_filename}:{frame.tb_lineno}" if frame is not None else None
            log.error(
                events.LOG_API_INTERNAL_ERROR,
                method=scope.get("method"),
                path=scope.get("path"),
                error_type=type(exc).__name__,
                error=" ".join(str(exc).split()),
                where=where,
            )
            if scope["type"] == "http" and not started:
                message = f"internal error ({type(exc).__name__}); the daemon's log has it (api.internal_error)"
                await _error(scope.get("path", ""), 500, "internal", message)(scope, receive, send)


#: Probes answered on TCP without a token: an orchestrator's HTTP probe cannot read a Secret.
PROBE_PATHS: frozenset[str] = frozenset({"/v1/health", "/v1/ready"})
#: Set in the ASGI scope of such a probe: ``/v1/ready`` then leaves out its reasons.
ANONYMOUS_PROBE = "agentd.anonymous_probe"


class BearerAuth:
    """ASGI middleware: every request must carry ``Authorization: Bearer <token>``, else 401 —
    except a ``GET`` of ``/v1/health`` or ``/v1/ready`` (``PROBE_PATHS``), answered without one,
    readiness then without its reasons.

    The scheme name is case-insensitive (``bearer``, ``BEARER``: HTTP auth schemes are), and
    spaces around the token are not part of it; the token itself is compared exactly, in
    constant time.
    """

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._expected = token.encode()

    def _authorized(self, header: bytes) -> bool:
        scheme, _, credentials = header.strip().partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(credentials.strip(b" \t"), self._expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            presented = dict(scope["headers"]).get(b"authorization", b"")
            if not self._authorized(presented):
                if scope["method"] == "GET" and scope["path"] in PROBE_PATHS:
                    await self.app({**scope, ANONYMOUS_PROBE: True}, receive, send)
                    return
                message = "missing or wrong bearer token"
                response = _error(scope["path"], 401, "unauthorized", message, {"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
            scope = {**scope, CREDENTIAL: "token"}  # idempotency keys are scoped to it (RFC 0010 §2)
        await self.app(scope, receive, send)
