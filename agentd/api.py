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

import json
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from agentd import events
from agentd.config import Config
from agentd.errors import (
    BadInput,
    Conflict,
    NotFound,
    ServiceError,
    StoreFull,
    TooLarge,
    Unavailable,
)
from agentd.obs import get_logger
from agentd.views import (
    Accepted,
    ApprovalView,
    CreateSession,
    Decide,
    ErrorBody,
    ErrorDetail,
    MessageResult,
    PostMessage,
    ReloadResult,
    SessionSummary,
    SessionView,
    StatusView,
)

__all__ = ["ROUTES", "STATUS", "BearerAuth", "Service", "SwitchableApp", "build_app", "build_waiting_app", "status_of"]

log = get_logger("api")

SSE_KEEPALIVE_SECONDS = 15.0
DEFAULT_PAGE = 100  # GET /v1/sessions without ?limit=
MAX_PAGE = 10_000


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)


def error_response(status: int, code: str, message: str, turn: str | None = None) -> JSONResponse:
    return JSONResponse(ErrorBody(error=ErrorDetail(code=code, message=message, turn=turn)), status_code=status)


#: The HTTP status of each kind of domain error (the most specific kind listed wins).
STATUS: dict[type[ServiceError], int] = {
    BadInput: 400,
    NotFound: 404,
    Conflict: 409,
    TooLarge: 413,
    Unavailable: 503,
    StoreFull: 507,
}


def status_of(error: ServiceError) -> int:
    """The HTTP status ``error`` is answered with (500 for a kind ``STATUS`` does not list)."""
    for kind in type(error).__mro__:
        if kind in STATUS:
            return STATUS[kind]
    return 500


async def _on_service_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, ServiceError)
    return error_response(status_of(exc), exc.code, exc.message, exc.turn)


class Service(Protocol):
    """What the API serves: the daemon's operations."""

    @property
    def config(self) -> Config:
        """The running config (the message size limit)."""

    def ready(self) -> list[str]:
        """Reasons the daemon is not ready (empty = ready)."""

    async def status(self) -> StatusView: ...
    async def reload(self) -> ReloadResult: ...
    async def metrics_text(self) -> bytes: ...
    async def create_session(self, assistant_name: str | None) -> SessionView: ...
    async def list_sessions(self, *, limit: int = 100, after: str | None = None) -> list[SessionSummary]: ...
    async def get_session(self, session_id: str) -> SessionView: ...
    async def send_message(self, session_id: str, body: PostMessage) -> MessageResult | Accepted: ...
    async def subscribe(self, session_id: str) -> MemoryObjectReceiveStream[tuple[str, dict[str, Any]]]: ...
    def unsubscribed(self, session_id: str) -> None: ...
    async def cancel(self, session_id: str) -> str: ...
    async def close_session(self, session_id: str) -> SessionSummary: ...
    async def list_approvals(
        self, *, status: str | None = None, session: str | None = None, limit: int = 100, after: str | None = None
    ) -> list[ApprovalView]: ...
    async def get_approval(self, approval_id: str) -> ApprovalView: ...
    async def decide_approval(
        self, approval_id: str, decision: str, reason: str | None, arguments: object | None
    ) -> ApprovalView: ...


def _page_limit(request: Request) -> int:
    """``?limit=`` of a listing: 1 to ``MAX_PAGE`` (``DEFAULT_PAGE`` when absent)."""
    limit_text = request.query_params.get("limit", str(DEFAULT_PAGE))
    if not _is_number(limit_text) or not 1 <= int(limit_text) <= MAX_PAGE:
        raise BadInput(f"limit must be a whole number from 1 to {MAX_PAGE}, not {limit_text!r}", code="bad_limit")
    return int(limit_text)


def _is_number(text: str) -> bool:
    """ASCII digits only: ``"²".isdigit()`` is true, yet ``int("²")`` raises."""
    return text.isascii() and text.isdigit()


#: Where a body limit comes from, as a 413 names it.
MESSAGE_LIMIT = "[server] max_message_bytes"
FIXED_LIMIT = "1 MiB, the fixed limit of this route; [server] max_message_bytes is for messages"


async def _read_body(request: Request, limit: int, source: str = FIXED_LIMIT) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``limit`` (never read whole)."""
    declared = request.headers.get("content-length")
    if declared is not None and _is_number(declared) and int(declared) > limit:
        raise TooLarge(f"the request body is {int(declared)} bytes; the limit is {limit} bytes ({source})")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"the request body exceeds the limit of {limit} bytes ({source})")
        chunks.append(chunk)
    return b"".join(chunks)


async def _decode(
    request: Request, kind: type[Any], *, empty_ok: bool = False, limit: int = 1 << 20, source: str = FIXED_LIMIT
) -> Any:
    body = await _read_body(request, limit, source)
    if not body.strip() and empty_ok:
        body = b"{}"
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise BadInput(f"invalid request body: {exc}", code="invalid_body") from None
    except msgspec.DecodeError as exc:
        where = _lone_surrogate(body)
        if where is not None:
            raise BadInput(
                f"request body is not valid JSON text: the string at {where} holds a lone UTF-16 surrogate "
                "(a \\uD800-\\uDFFF escape that is not half of a pair), which is not Unicode text",
                code="malformed_json",
            ) from None
        raise BadInput(f"request body is not valid JSON: {exc}", code="malformed_json") from None


def _lone_surrogate(body: bytes) -> str | None:
    """Where (``$.content``) a string escapes a lone surrogate, if that is why msgspec refused the body.

    msgspec refuses them (rightly: they cannot be stored or sent as UTF-8) but says only "Input
    data was truncated" or "invalid utf-16 surrogate pair". Python's json module accepts them, so
    on this error path it shows where one is. None when that is not the problem.
    """
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    pending: list[tuple[str, Any]] = [("$", value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(item, dict):
            pending.extend((f"{path}.{key}", v) for key, v in reversed(item.items()))
            pending.extend((f"{path} (a key)", key) for key in item)
        elif isinstance(item, list):
            pending.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(item))))
    return None


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
    ("/v1/approvals", "GET", "list_approvals"),
    ("/v1/approvals/{id}", "GET", "get_approval"),
    ("/v1/approvals/{id}", "POST", "decide_approval"),
    ("/metrics", "GET", "metrics"),
)


async def _health(_: Request) -> Response:
    return JSONResponse({"status": "ok"})


def _not_ready(request: Request, reasons: list[str]) -> Response:
    """503 ``{"ready": false, "reasons": […]}``; a probe without the token learns ready or not,
    never why (names, store errors)."""
    shown = {"ready": False} if request.scope.get(ANONYMOUS_PROBE) else {"ready": False, "reasons": reasons}
    return JSONResponse(shown, status_code=503)


async def _on_http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return error_response(exc.status_code, code, str(exc.detail))


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
        body = await _decode(request, CreateSession, empty_ok=True)
        return JSONResponse(await supervisor.create_session(body.assistant), status_code=201)

    async def list_sessions(request: Request) -> Response:
        after = request.query_params.get("after") or None
        return JSONResponse(await supervisor.list_sessions(limit=_page_limit(request), after=after))

    async def list_approvals(request: Request) -> Response:
        query = request.query_params
        page = await supervisor.list_approvals(
            status=query.get("status") or None,
            session=query.get("session") or None,
            limit=_page_limit(request),
            after=query.get("after") or None,
        )
        return JSONResponse(page)

    async def get_approval(request: Request) -> Response:
        return JSONResponse(await supervisor.get_approval(request.path_params["id"]))

    async def decide_approval(request: Request) -> Response:
        body = await _decode(request, Decide)
        decided = await supervisor.decide_approval(
            request.path_params["id"], body.decision, body.reason, body.arguments
        )
        return JSONResponse(decided)

    async def get_session(request: Request) -> Response:
        return JSONResponse(await supervisor.get_session(request.path_params["id"]))

    async def post_message(request: Request) -> Response:
        body = await _decode(
            request, PostMessage, limit=supervisor.config.server.max_message_bytes, source=MESSAGE_LIMIT
        )
        result = await supervisor.send_message(request.path_params["id"], body)
        return JSONResponse(result, status_code=202 if isinstance(result, Accepted) else 200)

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
        "list_approvals": list_approvals,
        "get_approval": get_approval,
        "decide_approval": decide_approval,
        "metrics": metrics,
    }
    return Starlette(
        routes=[Route(path, handlers[name], methods=[method]) for path, method, name in ROUTES],
        middleware=[Middleware(CatchAll)],
        exception_handlers={ServiceError: _on_service_error, HTTPException: _on_http_error},
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

    async def unavailable(_: Request) -> Response:
        message = f"agentd is not serving yet ({waiting_for()}); nothing was stored"
        return error_response(503, "store_unavailable", message)

    def handler(name: str) -> Callable[[Request], Any]:
        return {"health": _health, "ready": ready}.get(name, unavailable)

    return Starlette(
        routes=[Route(path, handler(name), methods=[method]) for path, method, name in ROUTES],
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
                await error_response(500, "internal", message)(scope, receive, send)


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
                response = error_response(401, "unauthorized", "missing or wrong bearer token")
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
