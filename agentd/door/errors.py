"""Errors in the door's shape (RFC 0010 §4): ``{"error": {"message", "type", "param", "code"}}``.

The same domain errors as the native routes (``agentd.errors``), with the same HTTP statuses
(``agentd.apicommon.STATUS``), mapped a second time: to OpenAI's error ``type`` (``DOOR_TYPE``)
and to the headers the official SDKs read before retrying on their own — ``x-should-retry:
false`` where a retry cannot help or would do the work again, ``Retry-After`` where waiting helps.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from agentd.apicommon import JSONResponse, status_of
from agentd.door.shapes import DoorError, DoorErrorBody
from agentd.errors import (
    BadInput,
    Conflict,
    Draining,
    KeyInUse,
    KeyReused,
    NotFound,
    ServiceError,
    StoreFull,
    TooLarge,
    Unavailable,
)

__all__ = [
    "DOOR_PATHS",
    "DOOR_TYPE",
    "DRAINING_RETRY_AFTER",
    "KEY_IN_USE_RETRY_AFTER",
    "ParamError",
    "Unsupported",
    "door_error",
    "door_route",
    "error_of",
    "is_door_path",
    "type_of",
]

#: The door's paths (its routes are these or under them).
DOOR_PATHS = ("/v1/models", "/v1/chat/completions", "/v1/responses", "/v1/conversations")

#: OpenAI's error ``type`` of each kind of domain error (the most specific kind listed wins).
DOOR_TYPE: dict[type[ServiceError], str] = {
    BadInput: "invalid_request_error",
    NotFound: "invalid_request_error",
    Conflict: "invalid_request_error",
    KeyReused: "invalid_request_error",
    TooLarge: "invalid_request_error",
    Unavailable: "server_error",
    StoreFull: "server_error",
}

#: Seconds a client waits before asking a draining replica's address again (another replica, or
#: this one restarted, answers then).
DRAINING_RETRY_AFTER = 5
#: Seconds before asking again about a key whose request is being answered.
KEY_IN_USE_RETRY_AFTER = 1

_AT_FIELD = re.compile(r"at `\$\.([^`\[]+)")
_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]+)`")


class ParamError(BadInput):
    """A request parameter is wrong: the parameter is named (``param``)."""

    default_code = "invalid_value"

    def __init__(self, param: str, message: str, *, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.param = param


class Unsupported(ParamError):
    """A parameter agentd does not serve (or not with these others)."""

    default_code = "unsupported_parameter"


def is_door_path(path: str) -> bool:
    """Whether ``path`` is one of the door's (its errors then take the door's shape)."""
    return any(path == p or path.startswith(p + "/") for p in DOOR_PATHS)


def type_of(error: ServiceError) -> str:
    """OpenAI's error ``type`` of a domain error."""
    for kind in type(error).__mro__:
        if kind in DOOR_TYPE:
            return DOOR_TYPE[kind]
    return "server_error"


def _param_and_code(error: ServiceError) -> tuple[str | None, str]:
    """The parameter an error is about, when it names one, and its code."""
    if isinstance(error, ParamError):
        return error.param, error.code
    unknown = _UNKNOWN_FIELD.search(error.message)
    if unknown is not None and error.code == "invalid_body":
        return unknown.group(1), "unknown_parameter"
    at = _AT_FIELD.search(error.message)
    return (at.group(1) if at else None), error.code


def _retry_headers(error: ServiceError, status: int, keyed: bool) -> dict[str, str]:
    """``Retry-After``/``x-should-retry`` for an error: whether asking again the same way may help."""
    if isinstance(error, KeyInUse):
        return {"retry-after": str(KEY_IN_USE_RETRY_AFTER), "x-should-retry": "true"}
    if isinstance(error, Draining):
        return {"retry-after": str(DRAINING_RETRY_AFTER), "x-should-retry": "true"}
    if status < 500 or isinstance(error, StoreFull):
        return {"x-should-retry": "false"}
    if error.turn is not None and not keyed:
        return {"x-should-retry": "false"}  # its turn was stored and runs: a retry would be a second
    return {}


def door_error(
    status: int,
    message: str,
    *,
    type: str,
    code: str | None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An error response in the door's shape."""
    body = DoorErrorBody(error=DoorError(message=message, type=type, param=param, code=code))
    return JSONResponse(body, status_code=status, headers=headers)


def error_of(error: ServiceError, request: Request) -> JSONResponse:
    """``error`` as the door answers it."""
    status = status_of(error)
    param, code = _param_and_code(error)
    headers = _retry_headers(error, status, keyed="idempotency-key" in request.headers)
    return door_error(status, error.message, type=type_of(error), code=code, param=param, headers=headers)


def door_route(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """``handler`` answering its domain errors in the door's shape."""

    async def route(request: Request) -> Response:
        try:
            return await handler(request)
        except ServiceError as exc:
            return error_of(exc, request)

    route.__name__ = handler.__name__
    return route
