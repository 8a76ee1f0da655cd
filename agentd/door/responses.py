"""``/v1/responses`` (RFC 0010 §1, streamed: §7): a Response is a turn, ``resp_<turn id>``.

``conversation`` names a session; ``previous_response_id`` continues the session of that
response, which must be its latest turn; neither: a new session, seeded with the input's earlier
messages and ``instructions``. The output lists the assistant's text (``message`` items) and
every tool agentd ran (``mcp_call`` items); the status says how the turn ended (RFC 0010 §3).
A turn that waits for approvals answers its ``mcp_approval_request`` items; a request with
``mcp_approval_response`` items decides them and answers the rest of the turn (RFC 0010 §8).
"""

from __future__ import annotations

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from agentd.apicommon import MESSAGE_LIMIT, JSONResponse, decode_bytes, read_body, request_trace
from agentd.apikeys import idempotent
from agentd.door.approve import APPROVAL_RESPONSE, decide_and_answer
from agentd.door.errors import ParamError, Unsupported
from agentd.door.inputs import assistant_of, last_user, message_of, refuse_unserved, said
from agentd.door.outcome import response_object, turn_of_response
from agentd.door.parked import Parked, parked_response
from agentd.door.responsestream import response_stream
from agentd.door.shapes import ConversationRef, Part, ResponseInputItem, ResponsesRequest
from agentd.door.stream import begin, session_for, settled, settled_now, sse_response
from agentd.errors import Conflict, NotFound
from agentd.messages import Message, SystemMessage
from agentd.records import PENDING
from agentd.service import Claim, Service
from agentd.views import MessageResult, PostMessage, SessionView, TurnView

__all__ = ["cancel", "create", "retrieve"]

ROUTE = "/v1/responses"
#: How long a cancel waits for the turn to end before answering it ``in_progress``.
CANCEL_WAIT = 10.0
CANCEL_POLL = 0.05


def _items(body: ResponsesRequest) -> list[ResponseInputItem]:
    if isinstance(body.input, str):
        return [ResponseInputItem(role="user", content=body.input)]
    return body.input


def _message(item: ResponseInputItem, index: int) -> tuple[str, str | list[Part]]:
    """A message item's role and content (both needed, nothing of an approval response)."""
    where = f"input[{index}]"
    for name in ("approval_request_id", "approve", "reason"):
        if getattr(item, name) is not None:
            raise ParamError(f"{where}.{name}", f"{where}.{name}: only an {APPROVAL_RESPONSE} item has it")
    if item.role is None or item.content is None:
        missing = "role" if item.role is None else "content"
        raise ParamError(f"{where}.{missing}", f"{where}: a message item needs {missing}")
    return item.role, item.content


async def _continued(service: Service, body: ResponsesRequest) -> str | None:
    """The session the request continues (its ``conversation`` or ``previous_response_id``, which
    must be its latest turn), else None."""
    session = await _named(service, body)
    if session is not None and body.previous_response_id is not None:
        await _check_latest(service, session, body.previous_response_id)
    return session


async def _named(service: Service, body: ResponsesRequest) -> str | None:
    """The session the request names (its ``conversation`` or ``previous_response_id``), else None:
    nothing that depends on the session's state, so a retry under an ``Idempotency-Key`` finds it
    the same after the first attempt added its turn."""
    if body.conversation is not None and body.previous_response_id is not None:
        raise Unsupported(
            "previous_response_id",
            "previous_response_id and conversation cannot be used together: each names the conversation to continue",
            code="conflicting_parameters",
        )
    if body.conversation is not None:
        return body.conversation.id if isinstance(body.conversation, ConversationRef) else body.conversation
    if body.previous_response_id is None:
        return None
    turn = turn_of_response(body.previous_response_id)
    if turn is None:
        raise ParamError("previous_response_id", f"no response {body.previous_response_id!r}", code="not_found")
    return await service.session_of_turn(turn)


async def _check_latest(service: Service, session: str, previous: str, claim: Claim | None = None) -> None:
    """Refuse a ``previous_response_id`` that is not its conversation's latest turn (a turn the
    claim itself made, by a request before this one with the same key, does not count)."""
    turn = turn_of_response(previous)
    view = await service.get_session(session)
    turns = [t.id for t in view.turns if claim is None or not claim.resumed or t.id != claim.turn]
    latest = turns[-1] if turns else None
    if latest != turn:
        raise ParamError(
            "previous_response_id",
            f"response {previous!r} is not the latest of its conversation {session}"
            f" (resp_{latest} is): a conversation continues from its latest response",
            code="previous_response_not_latest",
        )


async def create(service: Service, request: Request) -> Response:
    """Answer a Responses request with the turn it is."""
    raw = await read_body(request, service.config.server.max_message_bytes, MESSAGE_LIMIT)
    body: ResponsesRequest = decode_bytes(raw, ResponsesRequest)
    refuse_unserved(body.tools)
    assistant = assistant_of(service.config, body.model)
    items = _items(body)
    if any(item.type == APPROVAL_RESPONSE for item in items):
        return await decide_and_answer(service, request, raw, body, await _continued(service, body))
    messages = [_message(item, i) for i, item in enumerate(items)]
    spoken = [(role, said(content, f"input[{i}].content")) for i, (role, content) in enumerate(messages)]
    last = last_user(spoken, "input")
    # Whether previous_response_id is still the latest is checked in ``work``, after the key was
    # looked up: a retry of a request that was answered gets its kept answer, not a refusal.
    continued = await _named(service, body)
    if continued is not None and (len(items) > 1 or body.instructions is not None):
        param = "instructions" if body.instructions is not None else "input"
        raise Unsupported(
            param,
            f"{param}: a response that continues a conversation takes one user message and no instructions"
            " (the conversation keeps its own); start a new conversation to give more",
        )

    seeded: list[Message] = [SystemMessage(content=body.instructions)] if body.instructions else []
    seeded += [message_of(role, content, f"input[{i}].content") for i, (role, content) in enumerate(messages[:-1])]

    async def work(claim: Claim | None) -> Response:
        session = continued
        if session is not None and body.previous_response_id is not None:
            await _check_latest(service, session, body.previous_response_id, claim)
        session = await session_for(service, session, assistant, seeded, claim)
        post = PostMessage(content=last.text, images=last.images or None)
        if body.stream:
            turn = await begin(
                service, session, post, turn_id=claim.turn if claim else None, resumed=claim.resumed if claim else False
            )
            events = response_stream(
                service, turn, model=body.model, previous=body.previous_response_id, metadata=body.metadata
            )
            return sse_response(service, turn, events)
        result = await service.send_message(
            session,
            post,
            turn_id=claim.turn if claim else None,
            resumed=claim.resumed if claim else False,
            trace=request_trace(request),
        )
        assert isinstance(result, MessageResult)  # wait=True
        if result.approvals is not msgspec.UNSET:  # it waits for approvals: their requests are the answer
            found = await settled(service, session, result.turn.id)
            if isinstance(found, Parked):
                return JSONResponse(
                    parked_response(
                        found.turn,
                        found.parked,
                        session=session,
                        model=body.model,
                        base=-1,
                        previous=body.previous_response_id,
                        metadata=body.metadata,
                    )
                )
            result = MessageResult(turn=found.turn, messages=found.entries)  # decided meanwhile, and ended
        shown = response_object(
            result.turn,
            result.messages,
            session=session,
            model=body.model,
            previous=body.previous_response_id,
            metadata=body.metadata,
        )
        return JSONResponse(shown)

    return await idempotent(service, request, ROUTE, raw, work)


async def _find(service: Service, response: str) -> tuple[SessionView, TurnView]:
    turn_id = turn_of_response(response)
    if turn_id is None:
        raise NotFound(f"no response {response!r}", code="not_found")
    view = await service.get_session(await service.session_of_turn(turn_id))
    for turn in view.turns:
        if turn.id == turn_id:
            return view, turn
    raise NotFound(f"no response {response!r}", code="not_found")


def _shown(view: SessionView, turn: TurnView) -> JSONResponse:
    # The turn's entries, but its input: what it added.
    entries = [e for e in view.transcript if e.turn == turn.id and e.role != "user"]
    return JSONResponse(response_object(turn, entries, session=view.id, model=view.assistant))


async def retrieve(service: Service, request: Request) -> Response:
    """``GET /v1/responses/{id}``: the turn as it is now (``in_progress`` while it runs; its
    approval requests while it waits for them)."""
    view, turn = await _find(service, request.path_params["id"])
    if turn.status == PENDING:
        found = await settled_now(service, view.id, turn.id)
        if isinstance(found, Parked):
            return JSONResponse(
                parked_response(found.turn, found.parked, session=view.id, model=view.assistant, base=-1)
            )
    return _shown(view, turn)


async def cancel(service: Service, request: Request) -> Response:
    """``POST /v1/responses/{id}/cancel``: cancel the turn, and answer it once it ended (or after ``CANCEL_WAIT``)."""
    response = request.path_params["id"]
    view, turn = await _find(service, response)
    if turn.status != PENDING:
        raise Conflict(f"response {response!r} is not in progress (it ended {turn.status})", code="not_in_progress")
    await service.cancel(view.id)
    with anyio.move_on_after(CANCEL_WAIT):
        while turn.status == PENDING:
            await anyio.sleep(CANCEL_POLL)
            view, turn = await _find(service, response)
    return _shown(view, turn)
