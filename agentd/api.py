"""The HTTP+JSON control API (RFC 0000 §6) as a Starlette app over the daemon's operations.

This module is the one route table: the native routes (``ROUTES``), the OpenAI-compatible door's
(``DOOR_ROUTES``, handled in ``agentd.door``, RFC 0010), and what each takes and answers
(``DOCS``: the OpenAPI document, ``agentd.openapi``, is generated from them).
Bodies are msgspec Structs from agentd.views; every error is ``{"error": {"code", "message"}}``
(the door's: OpenAI's shape, RFC 0010 §4). The operations refuse with the domain errors of
``agentd.errors``; one table says which HTTP status each is answered with (``STATUS``, in
``agentd.apicommon``, which the door shares). The app is built over any ``Service``
(``agentd.service``; the daemon's composition root, ``agentd.supervisor.daemon``, gives it the
supervisor). Creating POSTs take an ``Idempotency-Key`` (``agentd.apikeys``, RFC 0010 §2).
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
from starlette.routing import BaseRoute, Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from agentd import __version__, events
from agentd.apiapprovals import approval_handlers
from agentd.apicommon import (
    DEFAULT_PAGE,
    MAX_PAGE,
    MESSAGE_LIMIT,
    RELOAD_HISTORY_MAX,
    STATUS,
    USAGE_GROUP_BY,
    USAGE_PAGE,
    JSONResponse,
    decode_bytes,
    error_response,
    instant_param,
    is_number,
    on_service_error,
    read_body,
    request_trace,
    status_of,
)
from agentd.apidocs import DOCS
from agentd.apikeys import CREDENTIAL, idempotent
from agentd.door.errors import door_error, is_door_path
from agentd.door.routes import door_handlers
from agentd.errors import BadInput, ServiceError
from agentd.obs import get_logger
from agentd.openapi import document
from agentd.service import Claim, Service
from agentd.views import (
    Accepted,
    Cancelling,
    CreateSession,
    Health,
    PostMessage,
    Readiness,
)

__all__ = [
    "ALL_ROUTES",
    "CONSOLE_LISTENER",
    "CONSOLE_PATH",
    "DOOR_ROUTES",
    "ROUTES",
    "STATUS",
    "BearerAuth",
    "Service",
    "SwitchableApp",
    "build_app",
    "build_waiting_app",
    "event_stream",
    "page_limit",
    "status_of",
]

log = get_logger("api")

SSE_KEEPALIVE_SECONDS = 15.0
# Events already waiting for a subscriber go out in one write, up to this many: a burst (deltas of
# many sessions' turns) costs one send instead of one per event.
SSE_BATCH = 64


#: Every route: its path, its method and the name of the handler ``build_app`` serves it with. The
#: waiting app serves the same table, so a route is found, or 404/405, alike in both.
ROUTES: tuple[tuple[str, str, str], ...] = (
    ("/v1/health", "GET", "health"),
    ("/v1/ready", "GET", "ready"),
    ("/v1/status", "GET", "status"),
    ("/v1/reload", "POST", "reload"),
    ("/v1/reloads", "GET", "reloads"),
    ("/v1/sessions", "POST", "create_session"),
    ("/v1/sessions", "GET", "list_sessions"),
    ("/v1/sessions/{id}", "GET", "get_session"),
    ("/v1/sessions/{id}", "DELETE", "close_session"),
    ("/v1/sessions/{id}/messages", "POST", "post_message"),
    ("/v1/sessions/{id}/events", "GET", "session_events"),
    ("/v1/sessions/{id}/cancel", "POST", "cancel"),
    ("/v1/usage", "GET", "usage"),
    ("/v1/approvals", "GET", "list_approvals"),
    ("/v1/approvals/{id}", "GET", "get_approval"),
    ("/v1/approvals/{id}", "POST", "decide_approval"),
    ("/metrics", "GET", "metrics"),
    ("/v1/openapi.json", "GET", "openapi"),
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
#: The route serving the OpenAPI document of every route (RFC 0010 §5).
OPENAPI_PATH = "/v1/openapi.json"


async def _health(_: Request) -> Response:
    return JSONResponse(Health())


def _not_ready(request: Request, reasons: list[str]) -> Response:
    """503 ``{"ready": false, "reasons": […]}``; a probe without the token learns ready or not,
    never why (names, store errors)."""
    shown = Readiness(ready=False, reasons=None if request.scope.get(ANONYMOUS_PROBE) else reasons)
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


def page_limit(request: Request, default: int, maximum: int) -> int:
    """The request's ``?limit=`` (``default`` without one); BadInput unless it is 1 to ``maximum``."""
    text = request.query_params.get("limit", str(default))
    if not is_number(text) or not 1 <= int(text) <= maximum:
        raise BadInput(f"limit must be a whole number from 1 to {maximum}, not {text!r}", code="bad_limit")
    return int(text)


async def event_stream(service: Service, session_id: str) -> StreamingResponse:
    """The session's events as ``text/event-stream`` (RFC 0000 §7), while the client listens.

    The session stays hot while subscribed; NotFound (raised before the response starts) if it is
    not open. Shared by ``GET /v1/sessions/{id}/events`` and the console's own stream.
    """
    stream = await service.subscribe(session_id)

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
                    batch = [_sse_event(name, data)]
                    ended = False
                    while len(batch) < SSE_BATCH:  # what waits already goes out in one write
                        try:
                            name, data = stream.receive_nowait()
                        except anyio.WouldBlock:
                            break
                        except anyio.EndOfStream:
                            ended = True
                            break
                        batch.append(_sse_event(name, data))
                    yield b"".join(batch)
                    if ended:
                        return
        finally:
            service.unsubscribed(session_id)  # the stream is closed: the session need not stay hot

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


#: Where the operator console is mounted (agentd/console), on the TCP listener only.
CONSOLE_PATH = "/console"
#: Set in the ASGI scope of a request under ``CONSOLE_PATH`` that came through ``BearerAuth`` (the
#: TCP listener): the console serves only such requests, authorizing them itself with its cookie.
CONSOLE_LISTENER = "agentd.console_listener"


def build_app(supervisor: Service, console: ASGIApp | None = None) -> Starlette:
    """The API application bound to ``supervisor``; ``console`` (the operator console's app, RFC
    0000 §12) is mounted at ``CONSOLE_PATH`` when given."""

    async def ready(request: Request) -> Response:
        reasons = supervisor.ready()
        if reasons:
            return _not_ready(request, reasons)
        return JSONResponse(Readiness(ready=True))

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

    async def reloads(request: Request) -> Response:
        limit = page_limit(request, DEFAULT_PAGE, RELOAD_HISTORY_MAX)
        return JSONResponse(await supervisor.reloads(limit))

    async def list_sessions(request: Request) -> Response:
        limit = page_limit(request, DEFAULT_PAGE, MAX_PAGE)
        query = request.query_params
        page = await supervisor.list_sessions(
            limit=limit,
            after=query.get("after") or None,
            state=query.get("state") or None,
            assistant=query.get("assistant") or None,
        )
        return JSONResponse(page)

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
                trace=request_trace(request),
            )
            return JSONResponse(result, status_code=202 if isinstance(result, Accepted) else 200)

        return await idempotent(supervisor, request, "/v1/sessions/{id}/messages", raw, work)

    async def cancel(request: Request) -> Response:
        turn_id = await supervisor.cancel(request.path_params["id"])
        return JSONResponse(Cancelling(turn_id=turn_id), status_code=202)

    async def close_session(request: Request) -> Response:
        return JSONResponse(await supervisor.close_session(request.path_params["id"]))

    async def session_events(request: Request) -> Response:
        return await event_stream(supervisor, request.path_params["id"])

    async def usage(request: Request) -> Response:
        group_by = request.query_params.get("group_by", "model")
        if group_by not in USAGE_GROUP_BY:
            raise BadInput(
                f"group_by must be one of {', '.join(USAGE_GROUP_BY)}, not {group_by!r}", code="bad_usage_query"
            )
        since = instant_param("since", request.query_params.get("since"))
        until = instant_param("until", request.query_params.get("until"))
        limit = page_limit(request, USAGE_PAGE, MAX_PAGE)
        after = request.query_params.get("after") or None
        return JSONResponse(await supervisor.usage(group_by, since=since, until=until, limit=limit, after=after))

    async def metrics(_: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(await supervisor.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    schema = msgspec.json.encode(document(ALL_ROUTES, DOCS, version=__version__))

    async def openapi(_: Request) -> Response:
        return Response(schema, media_type="application/json")

    handlers = {
        "health": _health,
        "ready": ready,
        "status": status,
        "reload": reload,
        "reloads": reloads,
        "create_session": create_session,
        "list_sessions": list_sessions,
        "get_session": get_session,
        "close_session": close_session,
        "post_message": post_message,
        "session_events": session_events,
        "cancel": cancel,
        "usage": usage,
        **approval_handlers(supervisor, lambda request: page_limit(request, DEFAULT_PAGE, MAX_PAGE)),
        "metrics": metrics,
        "openapi": openapi,
        **door_handlers(supervisor),
    }
    routes: list[BaseRoute] = [Route(path, handlers[name], methods=[method]) for path, method, name in ALL_ROUTES]
    if console is not None:
        routes.append(Mount(CONSOLE_PATH, app=console))
    return Starlette(
        routes=routes,
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

    routes: list[BaseRoute] = [Route(path, handler(name), methods=[method]) for path, method, name in ALL_ROUTES]
    # The console, too, waits (it is the TCP listener's only; on the socket it is not found later either).
    routes.append(Mount(CONSOLE_PATH, routes=[Route("/{rest:path}", unavailable, methods=["GET", "POST"])]))
    return Starlette(
        routes=routes,
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


def _under_console(path: str) -> bool:
    return path == CONSOLE_PATH or path.startswith(CONSOLE_PATH + "/")


class BearerAuth:
    """ASGI middleware: every request must carry ``Authorization: Bearer <token>``, else 401 —
    except a ``GET`` of ``/v1/health`` or ``/v1/ready`` (``PROBE_PATHS``), answered without one,
    readiness then without its reasons, and a request under ``CONSOLE_PATH``, passed on marked
    ``CONSOLE_LISTENER``: the console authorizes its requests itself (its login cookie), and a
    browser never holds the token.

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
        if scope["type"] == "http" and _under_console(scope["path"]):
            await self.app({**scope, CONSOLE_LISTENER: True}, receive, send)
            return
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


def _sse_event(name: str, data: object) -> bytes:
    """One session event as SSE bytes (RFC 0000 §7)."""
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"
