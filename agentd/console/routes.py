"""The console's routes (RFC 0000 §12): server-rendered pages over the API's operations.

Every page reads through the ``agentd.api.Service`` the API serves (the same operations, the
same views); every form posts here, is checked (login cookie, ``Origin``, CSRF token) and
answered with a redirect (303) to the page that shows its outcome, so each works without
JavaScript. The one script (``static/console.js``) localizes times and streams a running
session's events from ``/console/sessions/{id}/events``, the console's own, cookie-authorized
copy of the API's event stream.

The console serves only requests that came through the TCP listener's ``BearerAuth``
(``CONSOLE_LISTENER`` in the scope); on the unix socket it is not found.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlencode

from starlette.applications import Starlette
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentd import events
from agentd.api import CONSOLE_LISTENER, CONSOLE_PATH, Service, event_stream, status_of
from agentd.console.auth import (
    COOKIE,
    LOGIN_COOKIE,
    LOGIN_MAX_AGE,
    SESSION_MAX_AGE,
    ConsoleKeys,
    ConsoleLogin,
    same_origin,
)
from agentd.console.pages import (
    APPROVALS_PAGE,
    RECENT_DECIDED,
    SESSION_PAGE,
    SESSION_STATES,
    TRANSCRIPT_PAGE,
    TURNS_PAGE,
    edited_arguments,
    environment,
    newest_decided,
    page_number,
    paginate,
)
from agentd.errors import BadInput, ServiceError
from agentd.obs import get_logger
from agentd.views import ApprovalView, PostMessage

__all__ = ["FORM_LIMIT", "HEADERS", "build_console"]

log = get_logger("console")

#: A console form's body at most (a message's own limit, ``[server] max_message_bytes``, applies too).
FORM_LIMIT = 4 << 20
#: Sent with every console response: only the package's own assets, no framing, no referrer to other sites.
HEADERS: dict[str, str] = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    # Not no-referrer: under it a browser sends `Origin: null` with its form posts, which the Origin check refuses.
    "Referrer-Policy": "same-origin",
    "X-Frame-Options": "DENY",
}
#: What a redirect's ``?done=`` says on the page it lands on (fixed texts: nothing from the URL is shown).
NOTICES: dict[str, str] = {
    "sent": "Message sent; the reply appears below as it runs.",
    "cancelled": "Cancel requested; the turn ends cancelled.",
    "created": "Session created.",
    "reloaded": "Reload applied.",
    "rejected": "Reload rejected: the config file has errors (see the newest row).",
    "unchanged": "Reload applied: nothing changed.",
    "approved": "Approved: the call runs and the turn goes on once its step's calls are all decided.",
    "rejected_call": "Rejected: the model is told so and the turn goes on once its step's calls are all decided.",
}
#: The ``?done=`` of a decision, by the approval's new status.
DECIDED_NOTICE = {"approved": "approved", "rejected": "rejected_call"}

#: A page's handler: the request, the login, and the form it posted (empty for a GET).
Handler = Callable[[Request, ConsoleLogin, FormData], Awaitable[Response]]


class _ConsoleOnly:
    """ASGI: the console answers only requests from the TCP listener, with ``HEADERS`` on each."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not scope.get(CONSOLE_LISTENER):
            await HTMLResponse("<h1>404 Not Found</h1>", status_code=404)(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                present = {name.lower() for name, _ in message.get("headers", [])}
                extra = [
                    (k.lower().encode(), v.encode()) for k, v in HEADERS.items() if k.lower().encode() not in present
                ]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, with_headers)


def build_console(service: Service, token: str) -> ASGIApp:
    """The console app over ``service``, its logins keyed by the API ``token``; mounted at ``CONSOLE_PATH``."""
    keys = ConsoleKeys(token)
    env = environment()

    def render(request: Request, name: str, *, code: int = 200, login: ConsoleLogin | None, **context: Any) -> Response:
        notice = NOTICES.get(request.query_params.get("done", ""))
        html = env.get_template(name).render(
            csrf=keys.csrf(login) if login is not None else "",
            logged_in=login is not None,
            notice=notice,
            **context,
        )
        return HTMLResponse(html, status_code=code, headers={"Cache-Control": "no-store"})

    def refuse(request: Request, status: int, message: str, login: ConsoleLogin | None) -> Response:
        log.warning(
            events.LOG_CONSOLE_REFUSED, method=request.method, path=request.url.path, status=status, why=message
        )
        return render(request, "error.html", code=status, login=login, active="", status_code=status, message=message)

    def page(handler: Handler, *, script: bool = False) -> Callable[[Request], Awaitable[Response]]:
        """A route behind the login; a POST also behind the Origin and CSRF checks. Without a login
        a page redirects to the login form; a POST or what the ``script`` reads is 401."""

        async def guarded(request: Request) -> Response:
            login = keys.login(request.cookies.get(COOKIE), time.time())
            if login is None:
                if request.method == "GET" and not script:
                    asked = request.url.path + (f"?{request.url.query}" if request.url.query else "")
                    return RedirectResponse(f"{CONSOLE_PATH}/login?{urlencode({'next': asked})}", 303)
                return refuse(request, 401, "not logged in (or the login expired): log in again", None)
            form = FormData()
            if request.method == "POST":
                if not same_origin(request.headers, request.url.scheme):
                    return refuse(request, 403, "refused: the request came from another origin", login)
                form = await _form(request)
                if not keys.csrf_ok(login, _field(form, "csrf")):
                    return refuse(request, 403, "refused: missing or wrong CSRF token; reload the page", login)
            try:
                return await handler(request, login, form)
            except ServiceError as exc:
                status = status_of(exc)
                return render(
                    request, "error.html", code=status, login=login, active="", status_code=status, message=exc.message
                )

        return guarded

    # ------------------------------------------------------------------ login

    async def login_form(request: Request) -> Response:
        if keys.login(request.cookies.get(COOKIE), time.time()) is not None:
            return RedirectResponse(f"{CONSOLE_PATH}/", 303)
        nonce = keys.login_nonce()
        response = render(
            request,
            "login.html",
            login=None,
            active="",
            login_csrf=keys.login_csrf(nonce),
            next=_local_next(request.query_params.get("next")),
            error=None,
        )
        _set_cookie(response, request, LOGIN_COOKIE, nonce, LOGIN_MAX_AGE)
        return response

    async def login_submit(request: Request) -> Response:
        if not same_origin(request.headers, request.url.scheme):
            return refuse(request, 403, "refused: the request came from another origin", None)
        form = await _form(request)
        if not keys.login_csrf_ok(request.cookies.get(LOGIN_COOKIE), _field(form, "csrf")):
            return refuse(request, 403, "refused: missing or wrong CSRF token; reload the login page", None)
        target = _local_next(_field(form, "next"))
        if not keys.token_matches(_field(form, "token") or ""):
            log.warning(events.LOG_CONSOLE_LOGIN_REFUSED, client=request.client.host if request.client else None)
            nonce = keys.login_nonce()
            response = render(
                request,
                "login.html",
                code=401,
                login=None,
                active="",
                login_csrf=keys.login_csrf(nonce),
                next=target,
                error="That is not the API token.",
            )
            _set_cookie(response, request, LOGIN_COOKIE, nonce, LOGIN_MAX_AGE)
            return response
        response = RedirectResponse(target, 303)
        _set_cookie(response, request, COOKIE, keys.issue(time.time()), SESSION_MAX_AGE)
        _drop_cookie(response, LOGIN_COOKIE)
        return response

    async def logout(request: Request, _: ConsoleLogin, form: FormData) -> Response:
        response = RedirectResponse(f"{CONSOLE_PATH}/login", 303)
        _drop_cookie(response, COOKIE)
        return response

    # ------------------------------------------------------------------ pages

    async def overview(request: Request, login: ConsoleLogin, form: FormData) -> Response:
        status = await service.status()
        return render(request, "overview.html", login=login, active="overview", status=status, reasons=service.ready())

    async def sessions(request: Request, login: ConsoleLogin, form: FormData) -> Response:
        query = request.query_params
        state = query.get("state") or None
        assistant = query.get("assistant") or None
        after = query.get("after") or None
        if state is not None and state not in SESSION_STATES:
            raise BadInput(f"state must be one of {', '.join(SESSION_STATES)}, not {state!r}", code="bad_state")
        rows = await service.list_sessions(limit=SESSION_PAGE + 1, after=after, state=state, assistant=assistant)
        shown = rows[:SESSION_PAGE]
        filters = {k: v for k, v in (("state", state), ("assistant", assistant)) if v}
        more = urlencode({**filters, "after": shown[-1].id}) if len(rows) > SESSION_PAGE else None
        return render(
            request,
            "sessions.html",
            login=login,
            active="sessions",
            sessions=shown,
            states=SESSION_STATES,
            assistants=[a.name for a in service.config.assistants],
            state=state or "",
            assistant=assistant or "",
            paged=after is not None,
            first=urlencode(filters),
            more=more,
        )

    async def create_session(request: Request, login: ConsoleLogin, form: FormData) -> Response:
        name = _field(form, "assistant") or None
        view = await service.create_session(name)
        log.info(events.LOG_CONSOLE_ACTION, action="create_session", session=view.id)
        return RedirectResponse(f"{CONSOLE_PATH}/sessions/{view.id}?done=created", 303)

    async def session(request: Request, login: ConsoleLogin, form: FormData) -> Response:
        view = await service.get_session(request.path_params["id"])
        query = request.query_params
        transcript = paginate(view.transcript, page_number(query.get("page")), TRANSCRIPT_PAGE)
        turns = paginate(view.turns[::-1], page_number(query.get("turns")) or 1, TURNS_PAGE)  # newest first
        running = next((t.id for t in view.turns if t.status == "pending"), None)
        waiting = await session_pending(view.id)
        return render(
            request,
            "session.html",
            login=login,
            active="sessions",
            session=view,
            transcript=transcript,
            turns=turns,
            running=running,
            live=view.state != "closed",
            approvals=waiting,
            back=f"{CONSOLE_PATH}/sessions/{view.id}",
            submitted={},
        )

    async def send_message(request: Request, login: ConsoleLogin, form: FormData) -> Response:
        session_id = request.path_params["id"]
        content = _field(form, "content") or ""
        if len(content.encode()) > service.config.server.max_message_bytes:
            raise BadInput("the message is over [server] max_message_bytes", code="too_large")
        accepted = await service.send_message(session_id, PostMessage(content=content, wait=False))
        log.info(
            events.LOG_CONSOLE_ACTION, action="message", session=session_id, turn=getattr(accepted, "turn_id", None)
        )
        return RedirectResponse(f"{CONSOLE_PATH}/sessions/{session_id}?done=sent", 303)

    async def cancel(request: Request, login: ConsoleLogin, form: FormData) -> Response:
        session_id = request.path_params["id"]
        turn = await service.cancel(session_id)
        log.info(events.LOG_CONSOLE_ACTION, action="cancel", session=session_id, turn=turn)
        return RedirectResponse(f"{CONSOLE_PATH}/sessions/{session_id}?done=cancelled", 303)

    async def session_events(request: Request, login: ConsoleLogin, form: FormData) -> Response:
        return await event_stream(service, request.path_params["id"])

    async def session_update(request: Request, login: ConsoleLogin, form: FormData) -> Response:
        """What a session page's script adds when a turn ends: the entries after ``?after=`` (a seq)
        and the row of ``?turn=``, rendered by the page's own templates."""
        view = await service.get_session(request.path_params["id"])
        query = request.query_params
        after = page_number(query.get("after")) or 0
        new = [e for e in view.transcript if e.seq > after]
        shown = new[:TRANSCRIPT_PAGE]
        turn = next((t for t in view.turns if t.id == query.get("turn")), None)
        entry, row = env.get_template("entry.html"), env.get_template("turn_row.html")
        return JSONResponse(
            {
                "entries": "".join(entry.render(e=e) for e in shown),
                "more": len(new) > len(shown),
                "total": len(view.transcript),
                "turn": row.render(t=turn) if turn is not None else "",
                "state": view.state,
                # The session's totals changed with the turn: the page's own partials again.
                "facts": env.get_template("session_facts.html").render(session=view),
                "usage_table": env.get_template("usage_table.html").render(session=view),
            },
            headers={"Cache-Control": "no-store"},
        )

    # ------------------------------------------------------------------ approvals (RFC 0012)

    async def session_pending(session_id: str) -> list[ApprovalView]:
        return await service.list_approvals(status="pending", session=session_id, limit=APPROVALS_PAGE)

    async def recent_decided() -> list[ApprovalView]:
        """The newest decided approvals. The listing is oldest first, so it is read to its end in
        pages of ``DECIDED_SCAN`` (the price of no newest-first listing in the store)."""
        kept: list[ApprovalView] = []  # newest first
        after: str | None = None
        while True:
            batch = await service.list_approvals(limit=DECIDED_SCAN, after=after)
            kept = newest_decided([*kept[::-1], *batch], RECENT_DECIDED)
            if len(batch) < DECIDED_SCAN:
                return kept
            after = batch[-1].id

    async def approvals_page(
        request: Request, login: ConsoleLogin, *, code: int = 200, failure: str = "", submitted: dict[str, str]
    ) -> Response:
        after = request.query_params.get("after") or None
        rows = await service.list_approvals(status="pending", limit=APPROVALS_PAGE + 1, after=after)
        shown = rows[:APPROVALS_PAGE]
        return render(
            request,
            "approvals.html",
            code=code,
            login=login,
            active="approvals",
            pending=shown,
            more=shown[-1].id if len(rows) > APPROVALS_PAGE else None,
            paged=after is not None,
            decided=await recent_decided(),
            failure=failure,
            back=f"{CONSOLE_PATH}/approvals",
            submitted=submitted,
        )

    async def approvals(request: Request, login: ConsoleLogin, form: FormData) -> Response:
        return await approvals_page(request, login, submitted={})

    async def decide(request: Request, login: ConsoleLogin, form: FormData) -> Response:
        """Approve or reject through the API's own operation; a refusal (400 bad arguments, 409
        decided already, 404) is shown on the approvals page with what was sent kept in its form."""
        approval_id = request.path_params["id"]
        back = _local_next(_field(form, "next")).split("?")[0].split("#")[0]
        text = _field(form, "arguments")
        try:
            asked = await service.get_approval(approval_id)
            arguments = edited_arguments(text, asked.arguments)
            decided = await service.decide_approval(
                approval_id, _field(form, "decision") or "", (_field(form, "reason") or "").strip() or None, arguments
            )
        except ServiceError as exc:
            log.info(events.LOG_CONSOLE_ACTION, action="decide", approval=approval_id, refused=exc.code)
            return await approvals_page(
                request,
                login,
                code=status_of(exc),
                failure=f"Approval {approval_id}: {exc.message} ({exc.code})",
                submitted={approval_id: text} if text is not None else {},
            )
        log.info(events.LOG_CONSOLE_ACTION, action="decide", approval=approval_id, status=decided.status)
        return RedirectResponse(f"{back}?done={DECIDED_NOTICE.get(decided.status, '')}", 303)

    async def session_approvals(request: Request, login: ConsoleLogin, form: FormData) -> Response:
        """A session's pending approvals with their forms, as its page renders them (for the script)."""
        session_id = request.path_params["id"]
        waiting = await session_pending(session_id)
        html = env.get_template("approvals_list.html").render(
            approvals=waiting, csrf=keys.csrf(login), back=f"{CONSOLE_PATH}/sessions/{session_id}", submitted={}
        )
        return JSONResponse({"approvals": html, "count": len(waiting)}, headers={"Cache-Control": "no-store"})

    async def reloads(request: Request, login: ConsoleLogin, form: FormData) -> Response:
        history = await service.reloads(RELOADS_SHOWN)
        status = await service.status()
        return render(
            request,
            "reloads.html",
            login=login,
            active="reloads",
            reloads=paginate(history, page_number(request.query_params.get("page")) or 1, RELOADS_PAGE),
            generation=status.generation,
            config_path=status.config_path,
        )

    async def reload(request: Request, login: ConsoleLogin, form: FormData) -> Response:
        result = await service.reload()
        log.info(events.LOG_CONSOLE_ACTION, action="reload", generation=result.generation, applied=result.applied)
        done = "rejected" if not result.applied else "reloaded" if result.changed else "unchanged"
        return RedirectResponse(f"{CONSOLE_PATH}/reloads?done={done}", 303)

    async def not_found(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        login = keys.login(request.cookies.get(COOKIE), time.time())
        message = {404: "No such page.", 405: "That method is not allowed here."}.get(exc.status_code, str(exc.detail))
        return render(
            request,
            "error.html",
            code=exc.status_code,
            login=login,
            active="",
            status_code=exc.status_code,
            message=message,
        )

    routes = [
        Route("/", page(overview), methods=["GET"]),
        Route("/login", login_form, methods=["GET"]),
        Route("/login", login_submit, methods=["POST"]),
        Route("/logout", page(logout), methods=["POST"]),
        Route("/sessions", page(sessions), methods=["GET"]),
        Route("/sessions", page(create_session), methods=["POST"]),
        Route("/sessions/{id}", page(session), methods=["GET"]),
        Route("/sessions/{id}/messages", page(send_message), methods=["POST"]),
        Route("/sessions/{id}/cancel", page(cancel), methods=["POST"]),
        Route("/sessions/{id}/events", page(session_events, script=True), methods=["GET"]),
        Route("/sessions/{id}/update", page(session_update, script=True), methods=["GET"]),
        Route("/sessions/{id}/approvals", page(session_approvals, script=True), methods=["GET"]),
        Route("/approvals", page(approvals), methods=["GET"]),
        Route("/approvals/{id}", page(decide), methods=["POST"]),
        Route("/reloads", page(reloads), methods=["GET"]),
        Route("/reloads", page(reload), methods=["POST"]),
        Mount("/static", app=StaticFiles(packages=[("agentd.console", "static")]), name="static"),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: not_found})
    return _ConsoleOnly(app)


#: The reloads page reads this many of the history (all it keeps) and shows them in pages.
RELOADS_SHOWN = 1000
RELOADS_PAGE = 50
#: The approvals page reads the approval listing in pages of this many to find the newest decided.
DECIDED_SCAN = 500


async def _form(request: Request) -> FormData:
    """The request's form, bounded by ``FORM_LIMIT`` (a body that says nothing of its size is refused)."""
    declared = request.headers.get("content-length")
    if declared is None or not declared.isascii() or not declared.isdigit():
        raise HTTPException(411, "a form must say its length")
    if int(declared) > FORM_LIMIT:
        raise HTTPException(413, f"the form is over {FORM_LIMIT} bytes")
    return await request.form(max_files=0, max_fields=20)


def _field(form: FormData, name: str) -> str | None:
    value = form.get(name)
    return value if isinstance(value, str) else None


def _local_next(target: str | None) -> str:
    """Where a login goes on to: a console page, never another site (``//host`` or a scheme)."""
    if target and target.startswith(CONSOLE_PATH + "/") and not target.startswith("//") and "\\" not in target:
        return target
    return f"{CONSOLE_PATH}/"


def _set_cookie(response: Response, request: Request, name: str, value: str, max_age: int) -> None:
    response.set_cookie(
        name,
        value,
        max_age=max_age,
        path=CONSOLE_PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def _drop_cookie(response: Response, name: str) -> None:
    response.delete_cookie(name, path=CONSOLE_PATH, httponly=True, samesite="strict")
