"""A turn that waits for approvals, as the door shows it (RFC 0010 §8, RFC 0012 §9): pure functions.

A Responses request whose turn parks (RFC 0012 §3) is answered as OpenAI's hosted MCP answers a
call that needs approval: a ``completed`` Response whose output ends with an
``mcp_approval_request`` item per call that waits (its ``id`` the approval's). A request that
decides them (``mcp_approval_response`` items, with ``previous_response_id``) is answered with the
rest of the turn only — what it added after the parked step, starting with that step's calls as
``mcp_call`` items — so a client that collects each answer's items sees every item once. A chat
completion has no such item: its turn's wait is the error ``approval_required``.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from agentd.door.outcome import call_id, epoch, items_of, model_of, response_id, since
from agentd.door.shapes import Item, McpApprovalRequest, McpCall, ResponseConversation, ResponseObject
from agentd.errors import Conflict
from agentd.views import ApprovalView, ParkedTurn, TurnView

__all__ = [
    "APPROVAL_REQUIRED",
    "ApprovalRequired",
    "Parked",
    "approval_required",
    "parked_response",
    "since",
    "waiting",
]

APPROVAL_REQUIRED = "approval_required"


class ApprovalRequired(Conflict):
    """A chat completion's turn waits for approvals: a chat completion cannot show them (409)."""

    default_code = APPROVAL_REQUIRED


class Parked(msgspec.Struct, frozen=True, kw_only=True):
    """The followed turn stopped to wait for approvals (it is still ``pending``)."""

    turn: TurnView
    parked: ParkedTurn
    assistant: str


def waiting(parked: ParkedTurn) -> list[ApprovalView]:
    """The approvals of the parked step that are still pending, in the order of its calls."""
    pending = {a.call_id: a for a in parked.approvals if a.status == "pending"}
    return [pending[call] for call in parked.calls if call in pending]


def approval_required(turn: str, approvals: Sequence[ApprovalView]) -> ApprovalRequired:
    """The error a chat completion answers for a turn that waits for ``approvals``."""
    named = ", ".join(f"{a.id} ({a.tool})" for a in approvals) or "none pending now"
    return ApprovalRequired(
        f"turn {turn} waits for approval of its tool calls: {named}; decide each with"
        " POST /v1/approvals/{id} (or a Responses request with mcp_approval_response items,"
        f" previous_response_id resp_{turn}), then read the answer (GET /v1/responses/resp_{turn})",
        turn=turn,
    )


def _requests(items: list[Item], pending: dict[str, ApprovalView]) -> list[Item]:
    """A parked run's items: a call that did not run yet is its approval request, or — a call of the
    waiting step that needs none — left out (it runs, and shows, once the step's calls are decided)."""
    out: list[Item] = []
    for item in items:
        if isinstance(item, McpCall) and item.output is None and item.error is None:
            approval = pending.get(item.id)
            if approval is not None:
                out.append(
                    McpApprovalRequest(
                        id=approval.id, server_label=item.server_label, name=item.name, arguments=item.arguments
                    )
                )
            continue
        out.append(item)
    return out


def parked_response(
    turn: TurnView,
    parked: ParkedTurn,
    *,
    session: str,
    model: str,
    base: int,
    previous: str | None = None,
    metadata: dict[str, str] | None = None,
) -> ResponseObject:
    """The Response of a request whose turn waits: what it added after ``base``, then a request
    per pending approval. ``completed``, as OpenAI's hosted MCP answers; ``usage`` null (the turn
    has not ended: its usage is counted once it does)."""
    pending = {call_id(turn.id, a.call_id): a for a in waiting(parked)}  # by the mcp_call item's id
    return ResponseObject(
        id=response_id(turn.id),
        created_at=epoch(turn.started_at),
        status="completed",
        model=model_of(since(parked.entries, base), model),
        output=_requests(items_of(parked.entries, session=session, inputs=False, base=base), pending),
        usage=None,
        conversation=ResponseConversation(id=session),
        previous_response_id=previous,
        metadata=metadata or {},
    )
