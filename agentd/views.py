"""The HTTP API's bodies (RFC 0000 §6): the one definition shared by the server and the CLI client.

Request bodies reject unknown fields so a typo is a 400, not a silently ignored option.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from agentd.approvals import Approval
from agentd.budget import Usage
from agentd.config import ConfigIssue
from agentd.messages import AssistantMessage, Message, SystemMessage, ToolResult, UserMessage
from agentd.records import PENDING, Cost, Discarded, SessionState, StartedTurn, TurnRecord

__all__ = [
    "Accepted",
    "ApprovalCounts",
    "ApprovalView",
    "Cancelling",
    "ChildView",
    "CreateSession",
    "Decide",
    "DiscardedView",
    "Entry",
    "ErrorBody",
    "ErrorDetail",
    "Health",
    "MessageResult",
    "ParkedTurn",
    "PolicyView",
    "PostMessage",
    "Readiness",
    "ReloadResult",
    "ReloadView",
    "ReplicaView",
    "SessionCounts",
    "SessionSummary",
    "SessionView",
    "StatusView",
    "ToolCallView",
    "TurnView",
    "UsageGroup",
    "UsageReport",
    "UsageView",
    "approval_view",
    "entry_from_message",
    "iso",
    "turn_done_event",
    "turn_view",
    "usage_view",
]

#: The fields of a turn's view that the ``turn.done`` event carries (with the turn's new ``messages``).
_TURN_DONE_EVENT_FIELDS = ("status", "models", "steps", "restarts", "discarded", "usage", "error")


def iso(timestamp: float | None) -> str | None:
    """Epoch seconds → ISO 8601 UTC (None stays None)."""
    if timestamp is None:
        return None
    return dt.datetime.fromtimestamp(timestamp, dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class _Body(msgspec.Struct, kw_only=True):
    pass


class ToolCallView(_Body, kw_only=True):
    id: str
    name: str
    arguments: dict[str, Any] = {}


class Entry(_Body, kw_only=True, omit_defaults=True):
    """One transcript entry as the API shows it (unset optional fields are left out).

    ``model`` is set on every assistant entry.
    """

    seq: int
    turn: str | None = None
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    thinking: str | None = None
    images: list[str] | None = None
    name: str | None = None
    tool_calls: list[ToolCallView] | None = None
    tool_call_id: str | None = None
    is_error: bool | None = None
    replayed: bool | None = None
    outcome_unknown: bool | None = None
    model: str | None = None
    assistant: str | None = None


def entry_from_message(seq: int, message: Message) -> Entry:
    """The API view of a stored message."""
    raw_images: tuple[str, ...] | None = getattr(message, "images", None)  # every kind but a tool result
    images = list(raw_images) if raw_images else None
    match message:
        case UserMessage():
            return Entry(
                seq=seq, turn=message.turn, role="user", content=message.content, images=images, name=message.name
            )
        case SystemMessage():
            return Entry(
                seq=seq, turn=message.turn, role="system", content=message.content, images=images, name=message.name
            )
        case AssistantMessage():
            calls = [ToolCallView(id=c.id, name=c.name, arguments=c.arguments) for c in message.tool_calls] or None
            return Entry(
                seq=seq,
                turn=message.turn,
                role="assistant",
                content=message.content,
                thinking=message.thinking,
                images=images,
                name=message.name,
                tool_calls=calls,
                model=message.model,
                assistant=message.assistant,
            )
        case ToolResult():
            return Entry(
                seq=seq,
                turn=message.turn,
                role="tool",
                content=message.content,
                name=message.name,
                tool_call_id=message.call_id or None,
                is_error=message.is_error or None,
                replayed=message.replayed or None,
                outcome_unknown=message.outcome_unknown or None,
            )
    raise TypeError(f"not a message: {message!r}")


class UsageView(_Body, kw_only=True):
    """What model calls spent and cost (RFC 0011 §1–§2): every count always present; ``cost``
    null when a part of the spend has no price (never 0)."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    reasoning_tokens: int = 0
    requests: int = 0
    unreported: int = 0
    cost: Cost | None = None


def usage_view(usage: Usage, cost: Cost | None) -> UsageView:
    """The API view of a usage and its cost."""
    return UsageView(**msgspec.structs.asdict(usage), cost=cost)


class ModelUsageView(UsageView, kw_only=True, gc=False):  # numbers, strings, a Cost: not GC-tracked
    """A model's part of a session's usage (``Session.usage.by_model``)."""

    model: str


class SessionUsageView(UsageView, kw_only=True):
    """``Session.usage``: the totals of its turns (discarded attempts included), and per model."""

    by_model: list[ModelUsageView] = []


class DiscardedView(_Body, kw_only=True):
    """A turn attempt thrown away by restart-turn, with what it spent and cost (counted in the turn's usage)."""

    model: str
    steps: int
    reason: str
    usage: UsageView = msgspec.field(default_factory=UsageView)


def _discarded_view(attempt: Discarded) -> DiscardedView:
    return DiscardedView(
        model=attempt.model, steps=attempt.steps, reason=attempt.reason, usage=usage_view(attempt.usage, attempt.cost)
    )


class TurnView(_Body, kw_only=True):
    """A turn: ``status`` is a TurnStatus value, or ``pending`` while it runs."""

    id: str
    status: str
    models: list[str] = []
    steps: int = 0
    restarts: int = 0
    discarded: list[DiscardedView] = []
    usage: UsageView = msgspec.field(default_factory=UsageView)
    started_at: str | None = None
    ended_at: str | None = None
    error: str | None = None


def turn_view(turn: TurnRecord | StartedTurn) -> TurnView:
    """The API view of a turn: a finished turn's record, or a started one as ``pending``."""
    if isinstance(turn, StartedTurn):
        return TurnView(id=turn.id, status=PENDING, started_at=iso(turn.started_at))
    return TurnView(
        id=turn.id,
        status=turn.status.value,
        models=list(turn.models),
        steps=turn.steps,
        restarts=turn.restarts,
        discarded=[_discarded_view(attempt) for attempt in turn.discarded],
        usage=usage_view(turn.usage, turn.cost),
        started_at=iso(turn.started_at),
        ended_at=iso(turn.ended_at),
        error=turn.error,
    )


def turn_done_event(record: TurnRecord, messages: Sequence[Entry]) -> dict[str, Any]:
    """The data of the ``turn.done`` event: the finished turn as ``turn_view`` renders it, and its new entries.

    The turn's id travels in the event envelope and its times are left out.
    """
    view: dict[str, Any] = msgspec.to_builtins(turn_view(record))
    return {name: view[name] for name in _TURN_DONE_EVENT_FIELDS} | {"messages": msgspec.to_builtins(list(messages))}


class SessionSummary(_Body, kw_only=True):
    id: str
    assistant: str
    state: SessionState
    generation: int
    model: str
    turns: int = 0


class SessionView(_Body, kw_only=True):
    id: str
    assistant: str
    state: SessionState
    generation: int
    model: str
    transcript: list[Entry] = []
    turns: list[TurnView] = []
    child: int | None = None  # pid of the child it is loaded on; None while not loaded
    created_at: str | None = None
    usage: SessionUsageView = msgspec.field(default_factory=SessionUsageView)


class UsageGroup(UsageView, kw_only=True):
    """One group of ``GET /v1/usage``: its key (an assistant, a model or a session), its totals, per model."""

    key: str
    by_model: list[ModelUsageView] = []


class UsageReport(_Body, kw_only=True):
    """``GET /v1/usage``: what turns that ended in [since, until) spent, by ``group_by`` (RFC 0011 §2)."""

    group_by: Literal["assistant", "model", "session"]
    since: str | None = None
    until: str | None = None
    groups: list[UsageGroup] = []
    # The last group's key when the page is full: ``?after=`` it for the next page (None: the last page).
    next: str | None = None


class ChildView(_Body, kw_only=True):
    pid: int | None
    sessions: int  # how many sessions are loaded on it
    in_flight: int = 0  # how many of them have a turn running there
    state: str  # its role in the pool: starting, spare, active, draining, quarantine
    generation: int
    restarts: int = 0  # how many crashed children its place in the pool has seen


class ReplicaView(_Body, kw_only=True):
    id: str
    generation: int
    sessions: int  # how many sessions it owned at its last beat
    seen_at: float  # its last beat, epoch seconds by the store's clock


class PolicyView(_Body, kw_only=True):
    policy: str
    source: str


class SessionCounts(_Body, kw_only=True):
    open: int = 0  # not closed (failed ones included)
    loaded: int = 0  # loaded on a child
    running: int = 0  # with a turn in flight
    failed: int = 0


class ApprovalCounts(_Body, kw_only=True):
    pending: int = 0  # tool calls waiting for a human's decision (RFC 0012)


class StatusView(_Body, kw_only=True):
    pid: int
    version: str
    generation: int
    model_swap: PolicyView
    config_path: str | None
    children: list[ChildView] = []
    sessions: SessionCounts = msgspec.field(default_factory=SessionCounts)
    draining: bool = False
    replica: str = ""  # this replica's id (RFC 0009 §7)
    replicas: list[ReplicaView] = []  # the live replicas on the store, this one included
    approvals: ApprovalCounts = msgspec.field(default_factory=ApprovalCounts)


class ReloadResult(_Body, kw_only=True):
    generation: int
    applied: bool
    errors: list[ConfigIssue] = []
    changed: list[str] = []
    restart_required: list[str] = []
    swapped_sessions: list[str] = []  # at most 100 ids; swapped_total counts them all
    swapped_total: int = 0


class ApprovalView(_Body, kw_only=True):
    """A tool call waiting for (or given) a human's decision (RFC 0012 §6)."""

    id: str
    session: str
    turn: str
    call_id: str
    tool: str
    arguments: dict[str, Any]
    status: str
    reason: str | None = None
    requested_at: str | None = None
    decided_at: str | None = None
    expires_at: str | None = None


def approval_view(approval: Approval) -> ApprovalView:
    """The API view of an approval (times as ISO 8601, like turns)."""
    return ApprovalView(
        id=approval.id,
        session=approval.session,
        turn=approval.turn,
        call_id=approval.call_id,
        tool=approval.tool,
        arguments=approval.arguments,
        status=approval.status.value,
        reason=approval.reason,
        requested_at=iso(approval.requested_at),
        decided_at=iso(approval.decided_at),
        expires_at=iso(approval.expires_at),
    )


class Decide(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/approvals/{id}``."""

    decision: str
    reason: str | None = None
    arguments: Any = None


class ReloadView(_Body, kw_only=True):
    """One reload of the history (``GET /v1/reloads``): the generation it left running, when (ISO
    8601 UTC), whether it was applied or refused with ``errors``, the changed field paths, how
    many sessions it swapped, and the replica that ran it."""

    generation: int
    at: str
    applied: bool
    errors: list[ConfigIssue] = []
    changed: list[str] = []
    swapped_total: int = 0
    replica: str = ""


class MessageResult(_Body, kw_only=True):
    turn: TurnView
    messages: list[Entry] = []
    # The turn waits for these (its status is ``pending``): decide them to let it go on (RFC 0012).
    approvals: list[ApprovalView] | msgspec.UnsetType = msgspec.UNSET


class ParkedTurn(_Body, kw_only=True):
    """A pending turn whose run stopped for approvals (RFC 0012 §3), as the door shows it: what the
    parked run added (``entries``, numbered as they will be committed after the turn's user
    message), the calls that wait (``calls``), and every approval of the turn."""

    turn: str
    entries: list[Entry]
    calls: list[str]
    approvals: list[ApprovalView]


class Accepted(_Body, kw_only=True):
    turn_id: str


class CreateSession(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    assistant: str | None = None


class PostMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    content: str
    images: list[str] | None = None
    wait: bool = True


class Health(_Body, kw_only=True):
    status: Literal["ok"] = "ok"


class Readiness(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``reasons`` is left out when ready, and for a probe without the token (RFC 0000 §6)."""

    ready: bool
    reasons: list[str] | None = None


class Cancelling(_Body, kw_only=True):
    turn_id: str
    cancelling: bool = True


class ErrorDetail(_Body, kw_only=True):
    code: str
    message: str
    turn: str | None = None  # the turn concerned, when one was accepted (e.g. cut by a shutdown)


class ErrorBody(_Body, kw_only=True):
    error: ErrorDetail
