"""What the HTTP API's routes share (RFC 0000 §6): JSON responses, request bodies read within their
limits, and the HTTP status of each domain error (``STATUS``).

``agentd.api`` (the route table, the native routes) and ``agentd.door`` (the OpenAI-compatible
routes, RFC 0010) both build on it; each answers errors in its own shape, with these statuses.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from agentd.errors import (
    BadInput,
    Conflict,
    KeyReused,
    NotFound,
    ServiceError,
    StoreFull,
    TooLarge,
    Unavailable,
)
from agentd.otel import configured as tracing_configured
from agentd.otel import trace_carrier
from agentd.views import ErrorBody, ErrorDetail

__all__ = [
    "FIXED_LIMIT",
    "MESSAGE_LIMIT",
    "STATUS",
    "JSONResponse",
    "decode",
    "decode_bytes",
    "error_response",
    "is_number",
    "on_service_error",
    "read_body",
    "status_of",
]


class JSONResponse(Response):
    """A body of msgspec Structs (or builtins) as JSON."""

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
    KeyReused: 422,
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


async def on_service_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, ServiceError)
    return error_response(status_of(exc), exc.code, exc.message, exc.turn)


def is_number(text: str) -> bool:
    """ASCII digits only: ``"²".isdigit()`` is true, yet ``int("²")`` raises."""
    return text.isascii() and text.isdigit()


#: Where a body limit comes from, as a 413 names it.
MESSAGE_LIMIT = "[server] max_message_bytes"
FIXED_LIMIT = "1 MiB, the fixed limit of this route; [server] max_message_bytes is for messages"


async def read_body(request: Request, limit: int, source: str = FIXED_LIMIT) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``limit`` (never read whole)."""
    declared = request.headers.get("content-length")
    if declared is not None and is_number(declared) and int(declared) > limit:
        raise TooLarge(f"the request body is {int(declared)} bytes; the limit is {limit} bytes ({source})")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"the request body exceeds the limit of {limit} bytes ({source})")
        chunks.append(chunk)
    return b"".join(chunks)


async def decode(
    request: Request, kind: type[Any], *, empty_ok: bool = False, limit: int = 1 << 20, source: str = FIXED_LIMIT
) -> Any:
    """The request body as ``kind``, read within ``limit``; BadInput naming what is wrong with it."""
    return decode_bytes(await read_body(request, limit, source), kind, empty_ok=empty_ok)


def decode_bytes(body: bytes, kind: type[Any], *, empty_ok: bool = False) -> Any:
    """``body`` as ``kind`` (``empty_ok``: an empty body is ``{}``); BadInput naming what is wrong with it."""
    if not body.strip() and empty_ok:
        body = b"{}"
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise BadInput(f"invalid request body: {exc}", code="invalid_body") from None
    except msgspec.DecodeError as exc:
        where = lone_surrogate(body)
        if where is not None:
            raise BadInput(
                f"request body is not valid JSON text: the string at {where} holds a lone UTF-16 surrogate "
                "(a \\uD800-\\uDFFF escape that is not half of a pair), which is not Unicode text",
                code="malformed_json",
            ) from None
        raise BadInput(f"request body is not valid JSON: {exc}", code="malformed_json") from None


def lone_surrogate(body: bytes) -> str | None:
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


def request_trace(request: Request) -> dict[str, str] | None:
    """The request's W3C trace context (``traceparent``), which the turn's spans join, when traces
    are on (RFC 0011 §4); None when they are off (nothing of it is kept)."""
    if not _TRACING_ON:
        return None
    return trace_carrier(request.headers) or None


#: Whether the ``OTEL_*`` variables ask for traces: read once (the daemon's environment is fixed).
_TRACING_ON = tracing_configured(os.environ)


_EPOCH = re.compile(r"-?[0-9]{1,12}(\.[0-9]{1,9})?")


#: The instants a ``since``/``until`` may name: those an ISO 8601 UTC time renders (years 1 to 9999).
EARLIEST_INSTANT = dt.datetime(1, 1, 1, tzinfo=dt.UTC).timestamp()
LATEST_INSTANT = dt.datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=dt.UTC).timestamp()


def instant_param(name: str, text: str | None) -> float | None:
    """A ``since``/``until`` query parameter: epoch seconds or an ISO 8601 time (UTC unless it says),
    between 0001-01-01T00:00:00Z and 9999-12-31T23:59:59.999Z (the report renders it back)."""
    if not text:
        return None
    if _EPOCH.fullmatch(text):
        instant = float(text)
    else:
        try:
            moment = dt.datetime.fromisoformat(text)
        except ValueError:
            raise BadInput(
                f"{name} must be epoch seconds or an ISO 8601 time like 2026-01-31T00:00:00Z, not {text!r}",
                code="bad_usage_query",
            ) from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=dt.UTC)
        instant = moment.timestamp()
    if not EARLIEST_INSTANT <= instant <= LATEST_INSTANT:
        raise BadInput(
            f"{name} must be between 0001-01-01T00:00:00Z and 9999-12-31T23:59:59.999Z "
            f"(epoch seconds {EARLIEST_INSTANT:.0f} to {LATEST_INSTANT:.3f}), not {text!r}",
            code="bad_usage_query",
        )
    return instant


#: Paging of the API's lists.
DEFAULT_PAGE = 100  # GET /v1/sessions without ?limit=
MAX_PAGE = 10_000
#: Groups in a page of ``GET /v1/usage`` without ``?limit=`` (a report by session at 100,000
#: sessions is paged: each page is summed in the store in well under a second, RFC 0011 §2).
USAGE_PAGE = 1000
RELOAD_HISTORY_MAX = 1000  # GET /v1/reloads?limit= at most: the history keeps no more (RELOAD_HISTORY_KEEP)
#: What ``GET /v1/usage`` groups by (RFC 0011 §2).
USAGE_GROUP_BY = ("assistant", "model", "session")
