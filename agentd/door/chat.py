"""``POST /v1/chat/completions`` (RFC 0010 §1, streamed: §7): a turn of an ordinary session.

With ``X-Agentd-Session: ID`` the request's last (user) message is posted to that session, which
keeps the conversation (the earlier messages of the request are not read). Without it a session
is created, seeded with the request's earlier messages, and its id is answered in the
``X-Agentd-Session`` header, for the client to continue it. A turn that waits for approvals
(RFC 0012) is 409 ``approval_required`` naming them: a chat completion has no item to show them.
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from agentd.apicommon import MESSAGE_LIMIT, JSONResponse, decode_bytes, read_body, request_trace
from agentd.apikeys import idempotent
from agentd.door.chatstream import chat_stream
from agentd.door.inputs import assistant_of, include_usage, last_user, message_of, refuse_unserved, said
from agentd.door.outcome import chat_completion
from agentd.door.parked import approval_required
from agentd.door.shapes import ChatRequest
from agentd.door.stream import begin, session_for, sse_response
from agentd.service import Claim, Service
from agentd.views import MessageResult, PostMessage

__all__ = ["SESSION_HEADER", "create"]

SESSION_HEADER = "x-agentd-session"
ROUTE = "/v1/chat/completions"


async def create(service: Service, request: Request) -> Response:
    """Answer a chat completion request with the turn it is."""
    raw = await read_body(request, service.config.server.max_message_bytes, MESSAGE_LIMIT)
    body: ChatRequest = decode_bytes(raw, ChatRequest)
    refuse_unserved(body.tools)
    usage_chunk = include_usage(body.stream, body.stream_options)
    assistant = assistant_of(service.config, body.model)
    spoken = [(m.role, said(m.content, f"messages[{i}].content")) for i, m in enumerate(body.messages)]
    last = last_user(spoken, "messages")
    continued = request.headers.get(SESSION_HEADER)
    seeded = (
        []
        if continued is not None
        else [message_of(m.role, m.content, f"messages[{i}].content") for i, m in enumerate(body.messages[:-1])]
    )

    async def work(claim: Claim | None) -> Response:
        session = await session_for(service, continued, assistant, seeded, claim)
        post = PostMessage(content=last.text, images=last.images or None)
        if body.stream:
            turn = await begin(
                service, session, post, turn_id=claim.turn if claim else None, resumed=claim.resumed if claim else False
            )
            chunks = chat_stream(service, turn, model=body.model, include_usage=usage_chunk)
            return sse_response(service, turn, chunks, headers={SESSION_HEADER: session})
        result = await service.send_message(
            session,
            post,
            turn_id=claim.turn if claim else None,
            resumed=claim.resumed if claim else False,
            trace=request_trace(request),
        )
        assert isinstance(result, MessageResult)  # wait=True
        if result.approvals is not msgspec.UNSET:  # the turn waits for approvals: no answer to give
            raise approval_required(result.turn.id, result.approvals)
        completion = chat_completion(result.turn, result.messages, model=body.model)
        return JSONResponse(completion, headers={SESSION_HEADER: session})

    return await idempotent(service, request, ROUTE, raw, work)
