"""``Idempotency-Key`` on the creating POSTs (RFC 0010 §2), as HTTP sees it.

A creating route hands its work to ``idempotent`` with the request's body: without the header the
work just runs; with it, the key is claimed first (``agentd.supervisor.idempotency``), and the
work runs with the ids the claim chose — or the kept answer is given again, or the request is
refused (409 ``idempotency_in_progress``, 422 ``idempotency_key_reused``). A successful answer
is kept; an error is not (the key is released, and asking again does the request again, with the
same ids, so it never creates a second session or turn).
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from agentd.errors import BadInput
from agentd.service import Claim, Replay, Service

__all__ = ["CREDENTIAL", "HEADER", "KEPT_HEADERS", "REPLAYED", "idempotent"]

HEADER = "idempotency-key"
#: Set on an answer given again from a kept one.
REPLAYED = "idempotent-replayed"
#: Response headers kept with an answer (the rest are the server's own, made anew).
KEPT_HEADERS = ("x-agentd-session",)
#: Request headers that are part of what a request asks, beyond its path and body.
ASKING_HEADERS = ("x-agentd-session",)
#: The ASGI scope key naming the credential a request was let in with (``BearerAuth`` sets it).
CREDENTIAL = "agentd.credential"
MAX_KEY = 255


def _checked_key(value: str) -> str:
    if not 1 <= len(value) <= MAX_KEY or not all(" " < char <= "~" for char in value):
        raise BadInput(
            f"Idempotency-Key must be 1 to {MAX_KEY} printable ASCII characters without spaces, not {value[:300]!r}",
            code="bad_idempotency_key",
        )
    return value


def fingerprint(request: Request, body: bytes) -> str:
    """What a request asks, as a hash: its method, path, asking headers and body."""
    digest = hashlib.sha256()
    for part in (request.method, request.url.path, *(request.headers.get(h, "") for h in ASKING_HEADERS)):
        digest.update(part.encode() + b"\0")
    digest.update(body)
    return digest.hexdigest()


class _KeyHeld(Response):
    """A streamed answer holding its key until it was sent (or failed to be): a stream is not a kept
    answer (RFC 0010 §7), so the key is then released."""

    def __init__(self, stream: StreamingResponse, service: Service, claim: Claim) -> None:
        self.stream = stream
        self.service = service
        self.claim = claim
        self.status_code = stream.status_code
        self.raw_headers = stream.raw_headers
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.stream(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.service.release_key(self.claim)


async def idempotent(
    service: Service, request: Request, route: str, body: bytes, work: Callable[[Claim | None], Awaitable[Response]]
) -> Response:
    """``work``'s answer to the request, under the request's ``Idempotency-Key`` if it has one.

    ``route`` names the route (its path template): a key is scoped to the credential the request
    came with and the route.
    """
    presented = request.headers.get(HEADER)
    if presented is None:
        return await work(None)
    key = _checked_key(presented)
    scope = f"{request.scope.get(CREDENTIAL, 'unix')} {request.method} {route}"
    found = await service.claim_key(scope, key, fingerprint(request, body))
    if isinstance(found, Replay):
        headers = {**found.headers, REPLAYED: "true"}
        return Response(found.answer, status_code=found.status, headers=headers, media_type="application/json")
    answered = False
    try:
        response = await work(found)
        if isinstance(response, StreamingResponse):  # the key is held while it streams, then released
            answered = True
            return _KeyHeld(response, service, found)
        elif 200 <= response.status_code < 300 and hasattr(response, "body"):
            kept = {name: response.headers[name] for name in KEPT_HEADERS if name in response.headers}
            await service.answer_key(found, response.status_code, bytes(response.body), kept)
            answered = True
        return response
    finally:
        if not answered:
            with anyio.CancelScope(shield=True):
                await service.release_key(found)
