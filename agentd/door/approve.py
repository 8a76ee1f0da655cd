"""Approvals decided through ``POST /v1/responses`` (RFC 0010 §8): ``mcp_approval_response`` items.

A Response whose turn waits lists an ``mcp_approval_request`` per call (its ``id`` the
approval's). The client answers with a request naming that response (``previous_response_id``,
or its ``conversation``) whose ``input`` is ``mcp_approval_response`` items: each is decided
exactly as ``POST /v1/approvals/{id}`` decides it (404 ``not_found``, 409 ``already_decided``),
and the answer is the rest of the turn — what it added after the parked step, streamed with
``stream`` — or, when it parks again (or an approval still waits), its new requests.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from agentd.apicommon import JSONResponse
from agentd.apikeys import idempotent
from agentd.door.errors import ParamError, Unsupported
from agentd.door.outcome import response_object
from agentd.door.parked import Parked, parked_response
from agentd.door.responsestream import response_stream
from agentd.door.shapes import ResponseInputItem, ResponsesRequest
from agentd.door.stream import Ended, Followed, followed, let_go, sse_response, watch
from agentd.service import Claim, Service
from agentd.views import ApprovalView

__all__ = ["APPROVAL_RESPONSE", "decide_and_answer"]

APPROVAL_RESPONSE = "mcp_approval_response"
ROUTE = "/v1/responses"


def _decision(item: ResponseInputItem, index: int) -> tuple[str, bool, str | None]:
    """An approval response item's (approval id, approve, reason); ParamError naming what is wrong."""
    where = f"input[{index}]"
    if item.type != APPROVAL_RESPONSE:
        raise Unsupported(
            where,
            f"{where}: a response that decides approvals takes only {APPROVAL_RESPONSE} items"
            " (the turn goes on with them; send a new message once it answered)",
        )
    if item.role is not None or item.content is not None:
        raise ParamError(f"{where}.role", f"{where}: an {APPROVAL_RESPONSE} item has no role or content")
    if item.approval_request_id is None or item.approve is None:
        missing = "approval_request_id" if item.approval_request_id is None else "approve"
        raise ParamError(f"{where}.{missing}", f"{where}: an {APPROVAL_RESPONSE} item needs {missing}")
    return item.approval_request_id, item.approve, item.reason


async def _turn_and_base(service: Service, session: str, turn_id: str) -> tuple[int, int]:
    """The seq of the parked step's assistant message: what the answer shows follows it (-1: all);
    and how many texts the turn's assistant said up to it."""
    view = await service.get_session(session)
    user_seq = next((e.seq for e in view.transcript if e.turn == turn_id and e.role == "user"), -1)
    parked = await service.parked_turn(session, turn_id, user_seq + 1)
    if parked is None or not parked.entries:
        return -1, 0  # no parked run now (a restart-turn re-run): the whole turn is shown
    texts = sum(1 for e in parked.entries if e.role == "assistant" and e.content and e.assistant == view.assistant)
    return parked.entries[-1].seq, texts


async def _checked(service: Service, session: str, decisions: list[tuple[str, bool, str | None]]) -> str:
    """The turn the decisions are about: the conversation's latest, which each approval is of."""
    view = await service.get_session(session)
    latest = view.turns[-1] if view.turns else None
    approvals: list[ApprovalView] = [await service.get_approval(approval) for approval, _, _ in decisions]
    for index, approval in enumerate(approvals):
        if latest is None or approval.turn != latest.id:  # decided already: 409 when it is decided again
            raise ParamError(
                f"input[{index}].approval_request_id",
                f"approval {approval.id} is not one the conversation's latest response waits for"
                f" (it is of resp_{approval.turn})",
            )
    assert latest is not None  # there is a decision at least, and it is of the latest turn
    return latest.id


async def decide_and_answer(
    service: Service, request: Request, raw: bytes, body: ResponsesRequest, session: str | None
) -> Response:
    """Decide the request's ``mcp_approval_response`` items, then answer the turn's rest."""
    if session is None:
        raise ParamError(
            "previous_response_id",
            f"{APPROVAL_RESPONSE} items answer the approval requests of a response: name it with"
            " previous_response_id (or its conversation)",
        )
    if body.instructions is not None:
        raise Unsupported("instructions", "instructions: a response that decides approvals takes none")
    assert not isinstance(body.input, str)
    decisions = [_decision(item, i) for i, item in enumerate(body.input)]
    turn_id = await _checked(service, session, decisions)

    async def work(_claim: Claim | None) -> Response:
        base, texts = await _turn_and_base(service, session, turn_id)
        turn = await watch(service, session, turn_id, base, texts)  # before deciding: the first delta is heard
        try:
            for approval, approve, reason in decisions:
                await service.decide_approval(approval, "approve" if approve else "reject", reason, None)
        except BaseException:
            let_go(service, turn)
            raise
        if body.stream:
            events = response_stream(
                service, turn, model=body.model, previous=body.previous_response_id, metadata=body.metadata
            )
            return sse_response(service, turn, events)
        try:
            found = await _settled(service, turn)
        finally:
            let_go(service, turn)
        if isinstance(found, Parked):
            shown = parked_response(
                found.turn,
                found.parked,
                session=session,
                model=body.model,
                base=base,
                previous=body.previous_response_id,
                metadata=body.metadata,
            )
        else:
            shown = response_object(
                found.turn,
                found.entries,
                session=session,
                model=body.model,
                base=base,
                previous=body.previous_response_id,
                metadata=body.metadata,
            )
        return JSONResponse(shown)

    return await idempotent(service, request, ROUTE, raw, work)


async def _settled(service: Service, turn: Followed) -> Ended | Parked:
    """Follow the turn (hearing its end, or its next park, as it happens) until it ended or waits."""
    async for happening in followed(service, turn, shows_tools=True):
        if isinstance(happening, Ended | Parked):
            return happening
    raise AssertionError("followed ends with how the turn ended")  # pragma: no cover
