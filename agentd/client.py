"""A small synchronous HTTP client for the daemon's API (RFC 0000 §6), used by the CLI.

By default it talks to the daemon over the unix socket ``STATE_DIR/agentd.sock`` (the socket's
file mode is the access control, so no token is sent). Given a URL (``--url``/``AGENTD_URL``) it
talks TCP and sends ``Authorization: Bearer $AGENTD_API_TOKEN``. The token is never put into an
error message, a repr or a log line.

Bodies are decoded with msgspec into the shared ``agentd.views`` types. Server errors
(``{"error": {"code", "message"}}``) become ``ClientError``; no daemon at all becomes
``DaemonNotRunning``. ``events()`` opens a Server-Sent Events subscription eagerly, so a caller
can subscribe first and only then start the turn it wants to watch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
import msgspec

from agentd.apitoken import TOKEN_ENV, clean_token
from agentd.causes import iter_causes
from agentd.redact import redact_url
from agentd.sse import SSEEvent, SSEParser, iter_sse
from agentd.statedir import DEFAULT_STATE_DIR
from agentd.views import (
    Accepted,
    ApprovalView,
    ErrorBody,
    MessageResult,
    ReloadResult,
    SessionSummary,
    SessionView,
    StatusView,
)

__all__ = [
    "DEFAULT_STATE_DIR",
    "SOCKET_NAME",
    "AgentdClient",
    "ClientError",
    "DaemonNotRunning",
    "EventStream",
    "SSEEvent",
    "SSEParser",
    "iter_sse",
    "socket_path",
]

SOCKET_NAME = "agentd.sock"

# Ordinary calls are answered quickly; a waited message and an event stream last as long as a turn,
# whose deadline the daemon enforces, so those two have no read timeout of their own.
DEFAULT_TIMEOUT = 30.0
CONNECT_TIMEOUT = 5.0

T = TypeVar("T")


class ClientError(Exception):
    """The daemon answered with an error (or something the client cannot use).

    ``status`` is the HTTP status (0 when there was no HTTP answer, e.g. a lost connection),
    ``code`` the machine-readable error code and ``message`` the daemon's explanation.
    """

    def __init__(self, status: int, code: str, message: str) -> None:
        self.status = status
        self.code = code
        self.message = message
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"HTTP {self.status}, {self.code}" if self.status else self.code
        return f"{self.message} ({where})"


class DaemonNotRunning(Exception):
    """Nothing answers at the daemon's address (no socket, a stale socket, or a refused TCP connect)."""


def socket_path(state_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the daemon's unix socket lives for ``state_dir`` (default ``./.agentd``)."""
    return Path(state_dir if state_dir is not None else DEFAULT_STATE_DIR) / SOCKET_NAME


# --------------------------------------------------------------------------- Server-Sent Events (parsed by agentd.sse)


class EventStream:
    """An open subscription to a session's events: iterate it for ``(event_name, data)`` pairs.

    The subscription exists from the moment ``AgentdClient.events()`` returns (the daemon has
    answered with its headers), so events of a turn started afterwards are not missed. Use it as a
    context manager, or call ``close()``. Iteration ends when the daemon ends the stream.
    """

    def __init__(self, response: httpx.Response, session_id: str) -> None:
        self._response = response
        self._session_id = session_id
        self._events = self._generate()

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        return self

    def __next__(self) -> tuple[str, dict[str, Any]]:
        return next(self._events)

    def _generate(self) -> Iterator[tuple[str, dict[str, Any]]]:
        try:
            for event in iter_sse(self._response.iter_bytes()):  # the parser decodes: SSE is always UTF-8
                yield event.event, _event_data(event)
        except httpx.TransportError as exc:
            raise ClientError(0, "stream_lost", f"lost the event stream of session {self._session_id}: {exc}") from None

    def close(self) -> None:
        """Unsubscribe (close the connection)."""
        self._response.close()

    def __enter__(self) -> EventStream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _event_data(event: SSEEvent) -> dict[str, Any]:
    try:
        data = msgspec.json.decode(event.data)
    except msgspec.DecodeError:
        raise ClientError(
            200, "bad_event", f"event {event.event!r} carries data that is not JSON: {event.data[:200]!r}"
        ) from None
    if not isinstance(data, dict):
        raise ClientError(200, "bad_event", f"event {event.event!r} carries JSON that is not an object")
    return data


# --------------------------------------------------------------------------- the client


class AgentdClient:
    """One method per route of RFC 0000 §6. Use it as a context manager or call ``close()``.

    ``state_dir`` selects the unix socket (default ``./.agentd``); ``url`` selects TCP instead, in
    which case ``token`` (default ``$AGENTD_API_TOKEN``) is sent as a bearer token, trimmed of
    surrounding whitespace like the daemon trims it (``agentd.apitoken``; TokenError when it cannot
    be sent). ``transport`` replaces the network entirely (tests).
    """

    def __init__(
        self,
        state_dir: str | os.PathLike[str] | None = None,
        *,
        url: str | None = None,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.socket = socket_path(state_dir)
        self.url = url.rstrip("/") if url else None
        headers = {"Accept": "application/json", "User-Agent": "agentd-cli"}
        if self.url is not None:
            # Trimmed as the daemon trims it (a token file's trailing newline); TokenError if unusable.
            raw = os.environ.get(TOKEN_ENV) if token is None else token
            secret = clean_token(raw, TOKEN_ENV if token is None else "the token") if raw else None
            if secret:
                headers["Authorization"] = f"Bearer {secret}"
            base_url = self.url
            if transport is None:
                transport = httpx.HTTPTransport()
        else:
            base_url = "http://agentd"
            if transport is None:
                transport = httpx.HTTPTransport(uds=str(self.socket))
        self._http = httpx.Client(
            base_url=base_url,
            headers=headers,
            transport=transport,
            timeout=httpx.Timeout(timeout, connect=CONNECT_TIMEOUT),
            trust_env=False,  # proxies from the environment must never see the daemon's traffic
        )

    def __repr__(self) -> str:  # never shows the token
        return f"AgentdClient({self.where})"

    @property
    def where(self) -> str:
        """Where the daemon is expected, for messages (never containing credentials)."""
        return redact_url(self.url) if self.url is not None else str(self.socket)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> AgentdClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ routes

    def health(self) -> dict[str, Any]:
        """``GET /v1/health``: ``{"status": "ok"}`` while the supervisor loop runs."""
        return self._ok_object(self._request("GET", "/v1/health"))

    def ready(self) -> dict[str, Any]:
        """``GET /v1/ready``: the body, with ``ready`` true (200) or false (503, with the reasons).

        Not-ready is a state the caller asked about, not an error, so a 503 does not raise.
        """
        response = self._request("GET", "/v1/ready")
        if response.status_code == 503:
            try:
                body = msgspec.json.decode(response.content)
            except msgspec.DecodeError:
                body = {}
            body = body if isinstance(body, dict) else {"reasons": body}
            body["ready"] = False
            return body
        return self._ok_object(response)

    def status(self) -> StatusView:
        """``GET /v1/status``."""
        return self._decode(self._request("GET", "/v1/status"), StatusView)

    def get_json(self, path: str) -> Any:
        """Any GET route's JSON body as plain Python values (e.g. ``agentd status --json``)."""
        return self._ok_json(self._request("GET", path), allow_any=True)

    def reload(self) -> ReloadResult:
        """``POST /v1/reload``. A rejected reload (422) is a result, not an error: ``applied`` is false."""
        response = self._request("POST", "/v1/reload", timeout=httpx.Timeout(120.0, connect=CONNECT_TIMEOUT))
        if response.status_code == 422:
            try:
                return msgspec.json.decode(response.content, type=ReloadResult)
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass  # not a ReloadResult: report it like any other error
        return self._decode(response, ReloadResult)

    def create_session(self, assistant: str | None = None) -> SessionView:
        """``POST /v1/sessions``: a new session (its opener, if any, already in the transcript)."""
        body: dict[str, Any] = {} if assistant is None else {"assistant": assistant}
        return self._decode(self._request("POST", "/v1/sessions", json=body), SessionView)

    def list_sessions(self) -> list[SessionSummary]:
        """``GET /v1/sessions``."""
        return self._decode(self._request("GET", "/v1/sessions"), list[SessionSummary])

    def get_session(self, session_id: str) -> SessionView:
        """``GET /v1/sessions/{id}``: the session with its full transcript and turns."""
        return self._decode(self._request("GET", _session_path(session_id)), SessionView)

    def send_message(
        self, session_id: str, content: str, images: list[str] | None = None, wait: bool = True
    ) -> MessageResult | Accepted:
        """``POST /v1/sessions/{id}/messages``: 200 ``MessageResult`` when waited, 202 ``Accepted`` otherwise.

        ``images`` are base64 strings. A waited call lasts as long as the turn (the daemon's
        deadline bounds it), so it has no read timeout.
        """
        body: dict[str, Any] = {"content": content, "wait": wait}
        if images:
            body["images"] = images
        timeout = httpx.Timeout(DEFAULT_TIMEOUT, connect=CONNECT_TIMEOUT, read=None if wait else DEFAULT_TIMEOUT)
        response = self._request("POST", _session_path(session_id, "messages"), json=body, timeout=timeout)
        if response.status_code == 202:
            return self._decode(response, Accepted)
        return self._decode(response, MessageResult)

    def cancel(self, session_id: str) -> dict[str, Any]:
        """``POST /v1/sessions/{id}/cancel``: cancel the in-flight turn; the daemon's answer, if any."""
        return self._ok_object(self._request("POST", _session_path(session_id, "cancel")))

    def close_session(self, session_id: str) -> dict[str, Any]:
        """``DELETE /v1/sessions/{id}``: close the session (its transcript is kept)."""
        return self._ok_object(self._request("DELETE", _session_path(session_id)))

    def list_approvals(self, *, status: str | None = None, session: str | None = None) -> list[ApprovalView]:
        """``GET /v1/approvals`` (RFC 0012 §6), filtered."""
        query = "&".join(f"{k}={quote(v, safe='')}" for k, v in (("status", status), ("session", session)) if v)
        return self._decode(self._request("GET", "/v1/approvals" + (f"?{query}" if query else "")), list[ApprovalView])

    def decide(
        self, approval_id: str, decision: str, *, reason: str | None = None, arguments: Any = None
    ) -> ApprovalView:
        """``POST /v1/approvals/{id}``: approve or reject, once (409 ``already_decided`` after)."""
        body: dict[str, Any] = {"decision": decision}
        if reason is not None:
            body["reason"] = reason
        if arguments is not None:
            body["arguments"] = arguments
        path = f"/v1/approvals/{quote(approval_id, safe='')}"
        return self._decode(self._request("POST", path, json=body), ApprovalView)

    def events(self, session_id: str) -> EventStream:
        """``GET /v1/sessions/{id}/events``: subscribe now; iterate the result for ``(name, data)``."""
        request = self._http.build_request(
            "GET",
            _session_path(session_id, "events"),
            headers={"Accept": "text/event-stream", "Cache-Control": "no-cache"},
            timeout=httpx.Timeout(DEFAULT_TIMEOUT, connect=CONNECT_TIMEOUT, read=None),
        )
        response = self._transport_call(lambda: self._http.send(request, stream=True), "GET", request.url.path)
        if response.status_code != 200:
            try:
                response.read()
            except httpx.TransportError:
                pass  # the status alone still says what went wrong
            finally:
                response.close()
            raise self._error(response)
        return EventStream(response, session_id)

    def metrics(self) -> str:
        """``GET /metrics``: Prometheus text."""
        response = self._request("GET", "/metrics")
        if response.status_code != 200:
            raise self._error(response)
        return response.text

    # ------------------------------------------------------------------ plumbing

    def _request(
        self, method: str, path: str, *, json: Any = None, timeout: httpx.Timeout | None = None
    ) -> httpx.Response:
        content = msgspec.json.encode(json) if json is not None else None
        headers = {"Content-Type": "application/json"} if content is not None else None
        kwargs: dict[str, Any] = {"content": content, "headers": headers}
        if timeout is not None:
            kwargs["timeout"] = timeout
        return self._transport_call(lambda: self._http.request(method, path, **kwargs), method, path)

    def _transport_call(self, call: Any, method: str, path: str) -> httpx.Response:
        try:
            response: httpx.Response = call()
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise self._not_running(exc) from None
        except httpx.TimeoutException:
            raise ClientError(0, "timeout", f"agentd at {self.where} did not answer {method} {path} in time") from None
        except httpx.TransportError as exc:
            raise ClientError(0, "transport_error", f"lost the connection to agentd at {self.where}: {exc}") from None
        return response

    def _not_running(self, exc: Exception) -> DaemonNotRunning:
        if self.url is not None:
            return DaemonNotRunning(f"agentd is not reachable at {self.where}: {_reason(exc)}")
        if not self.socket.exists():
            return DaemonNotRunning(f"agentd is not running: no socket at {self.socket} (start it with `agentd run`)")
        # A refused connect on an existing socket file means the daemon that made it is gone.
        hint = "a stale socket? " if _caused_by(exc, ConnectionRefusedError) else ""
        return DaemonNotRunning(
            f"agentd is not running: {self.socket} does not accept connections ({_reason(exc)}; "
            f"{hint}start it with `agentd run`)"
        )

    def _error(self, response: httpx.Response) -> ClientError:
        status = response.status_code
        try:
            detail = msgspec.json.decode(response.content, type=ErrorBody).error
            return ClientError(status, detail.code, detail.message)
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
        text = response.text.strip() if response.content else ""
        message = text[:200] if text else response.reason_phrase or "error"
        if status == 401:
            message = f"{message}: the daemon refused the credentials (is {TOKEN_ENV} set?)"
        return ClientError(status, f"http_{status}", message)

    def _decode(self, response: httpx.Response, type_: type[T]) -> T:
        if not response.is_success:
            raise self._error(response)
        try:
            return msgspec.json.decode(response.content, type=type_)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ClientError(
                response.status_code,
                "bad_response",
                f"unexpected answer to {response.request.method} {response.request.url.path}: {exc}",
            ) from None

    def _ok_object(self, response: httpx.Response) -> dict[str, Any]:
        body: dict[str, Any] = self._ok_json(response)  # _ok_json has checked that it is an object
        return body

    def _ok_json(self, response: httpx.Response, allow_any: bool = False) -> Any:
        if not response.is_success:
            raise self._error(response)
        if not response.content:
            return {}
        try:
            body = msgspec.json.decode(response.content)
        except msgspec.DecodeError as exc:
            raise ClientError(response.status_code, "bad_response", f"answer is not JSON: {exc}") from None
        if not allow_any and not isinstance(body, dict):
            raise ClientError(response.status_code, "bad_response", "answer is not a JSON object")
        return body


def _session_path(session_id: str, action: str | None = None) -> str:
    # Quote the id fully: an id with "/" or ".." must never address another route.
    base = f"/v1/sessions/{quote(session_id, safe='')}"
    return f"{base}/{action}" if action else base


def _caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    """Whether ``kind`` is anywhere in ``exc``'s cause chain (httpx wraps httpcore wraps OSError)."""
    return any(isinstance(cause, kind) for cause in iter_causes(exc))


def _reason(exc: Exception) -> str:
    """The OS-level reason behind an httpx connect error, e.g. 'Connection refused'."""
    for cause in iter_causes(exc):
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror
    return str(exc) or type(exc).__name__
