"""Turns as OpenAI's objects (RFC 0010 §3): pure functions over a turn's view and its entries.

``OUTCOMES`` is the status table: for every way a turn ends, the closest Response ``status``
(with ``incomplete_details`` or ``error`` saying why when it is not ``completed``) and the chat
completion's ``finish_reason`` — or, for a turn that produced no answer, the error a chat client
gets instead. No client is answered 200 with a partial answer that nothing marks as partial.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Literal

import msgspec

from agentd.budget import TurnStatus
from agentd.door.shapes import (
    ChatAnswer,
    ChatChoice,
    ChatCompletion,
    ChatUsage,
    IncompleteDetails,
    InputTextOut,
    Item,
    McpCall,
    OutputMessage,
    OutputText,
    ResponseConversation,
    ResponseError,
    ResponseObject,
    ResponseUsage,
)
from agentd.errors import Conflict, ServiceError, Unavailable
from agentd.records import PENDING
from agentd.views import Entry, TurnView

__all__ = [
    "CHAT_PREFIX",
    "OUTCOMES",
    "Outcome",
    "TurnFailed",
    "call_id",
    "chat_completion",
    "epoch",
    "items_of",
    "message_id",
    "message_ids",
    "model_of",
    "response_id",
    "response_object",
    "server_label",
    "since",
    "turn_of_response",
]

ResponseStatus = Literal["completed", "incomplete", "failed", "cancelled", "in_progress"]
RESPONSE_PREFIX = "resp_"
CHAT_PREFIX = "chatcmpl-"


class TurnFailed(ServiceError):
    """The turn ended without an answer for a reason a retry does not help (HTTP 500)."""

    default_code = "turn_failed"


class Outcome(msgspec.Struct, frozen=True, kw_only=True):
    """How a turn that ended one way is shown: as a Response, and as a chat completion."""

    status: ResponseStatus
    reason: str | None = None  # incomplete_details.reason, when status is incomplete
    error: str | None = None  # error.code, when status is failed
    finish_reason: Literal["stop", "length"] | None = None  # None: a chat client gets ``chat_error``
    chat_error: type[ServiceError] | None = None


#: Every turn status (and ``pending``) → its OpenAI shape.
OUTCOMES: dict[str, Outcome] = {
    TurnStatus.COMPLETED: Outcome(status="completed", finish_reason="stop"),
    TurnStatus.TRANSFERRED: Outcome(status="completed", finish_reason="stop"),
    TurnStatus.EXHAUSTED_TOKENS: Outcome(status="incomplete", reason="max_output_tokens", finish_reason="length"),
    TurnStatus.EXHAUSTED_STEPS: Outcome(status="incomplete", reason="max_steps", finish_reason="length"),
    TurnStatus.DEADLINE: Outcome(status="incomplete", reason="deadline", finish_reason="length"),
    TurnStatus.LOOP_DETECTED: Outcome(status="incomplete", reason="loop_detected", finish_reason="length"),
    TurnStatus.CANCELLED: Outcome(status="cancelled", chat_error=Conflict),
    TurnStatus.INTEL_UNAVAILABLE: Outcome(status="failed", error="intel_unavailable", chat_error=Unavailable),
    TurnStatus.FAILED: Outcome(status="failed", error="turn_failed", chat_error=TurnFailed),
    PENDING: Outcome(status="in_progress"),
}


def epoch(iso_time: str | None) -> int:
    """An API time (ISO 8601, ``Z``) as whole epoch seconds; 0 when there is none."""
    if not iso_time:
        return 0
    return int(dt.datetime.fromisoformat(iso_time.replace("Z", "+00:00")).timestamp())


def response_id(turn_id: str) -> str:
    return RESPONSE_PREFIX + turn_id


def turn_of_response(response: str) -> str | None:
    """The turn id a response id names, or None if it is not one."""
    return response[len(RESPONSE_PREFIX) :] if response.startswith(RESPONSE_PREFIX) else None


def server_label(tool: str) -> str:
    """``server:tool`` runs on MCP server ``server``; a built-in tool on agentd itself."""
    server, sep, _ = tool.partition(":")
    return server if sep else "agentd"


def message_id(owner: str, kind: str, who: str, index: int) -> str:
    """A message item's id: ``msg_<owner>_<kind>[_<who>]_<index>`` — the entry's turn (its session
    when it has none), its kind (``a`` assistant text, ``u`` user, ``s`` system), who said it (the
    assistant, a system prompt's name) and its place among that turn's entries of that kind and
    speaker. No seq: a transfer renumbers the transcript (RFC 0004 §9), and removes entries only
    whole groups at a time, so what it keeps keeps its id (RFC 0010 §9)."""
    return f"msg_{owner}_{kind}_{who}_{index}" if who else f"msg_{owner}_{kind}_{index}"


def _key(entry: Entry, session: str) -> tuple[str, str, str] | None:
    owner = entry.turn or session
    if entry.role == "assistant":
        return (owner, "a", entry.assistant or "") if entry.content else None
    if entry.role == "user":
        return owner, "u", ""
    if entry.role == "system":
        return owner, "s", entry.name or ""
    return None


def message_ids(entries: Sequence[Entry], *, session: str) -> dict[int, str]:
    """The message item id of every entry that is one (by seq), counted over ``entries`` — the
    whole turn (or transcript), never a part of it: the index is the entry's place in its turn."""
    counted: dict[tuple[str, str, str], int] = {}
    ids: dict[int, str] = {}
    for entry in entries:
        key = _key(entry, session)
        if key is not None:
            index = counted[key] = counted.get(key, -1) + 1
            ids[entry.seq] = message_id(*key, index)
    return ids


def since(entries: Sequence[Entry], base: int) -> list[Entry]:
    """The entries one request shows of its turn: those after seq ``base``; the entry at ``base``
    when it is the assistant message whose calls waited for approvals, by its calls only (its text
    went out with the answer that asked for them)."""
    shown: list[Entry] = []
    for entry in entries:
        if entry.seq > base:
            shown.append(entry)
        elif entry.seq == base and entry.role == "assistant" and entry.tool_calls:
            shown.append(msgspec.structs.replace(entry, content=""))
    return shown


def items_of(entries: Sequence[Entry], *, session: str, inputs: bool, base: int = -1) -> list[Item]:
    """Entries as items: assistant text as ``message`` items (``output_text``), every tool call as an
    ``mcp_call`` item with its result. ``inputs``: user (and system) messages too, as a
    conversation lists them; a response's output leaves its input out. ``entries`` is a whole
    turn (or transcript): only what follows seq ``base`` is shown (``since``), with the ids the
    whole gives it."""
    ids = message_ids(entries, session=session)
    items: list[Item] = []
    calls: dict[str, int] = {}  # call id -> its item's index, filled in by the tool's result
    for entry in since(entries, base):
        if entry.role == "assistant":
            if entry.content:
                text = [OutputText(text=entry.content)]
                items.append(OutputMessage(id=ids[entry.seq], role="assistant", content=list(text)))
            for call in entry.tool_calls or ():
                calls[call.id] = len(items)
                items.append(
                    McpCall(
                        id=call_id(entry.turn or session, call.id),
                        server_label=server_label(call.name),
                        name=call.name,
                        arguments=msgspec.json.encode(call.arguments).decode(),
                    )
                )
        elif entry.role == "tool":
            index = calls.get(entry.tool_call_id or "")
            if index is not None:
                made = items[index]
                assert isinstance(made, McpCall)
                result = {"error": entry.content} if entry.is_error else {"output": entry.content}
                items[index] = msgspec.structs.replace(made, **result)
        elif inputs:
            role: Literal["user", "system"] = "user" if entry.role == "user" else "system"
            items.append(OutputMessage(id=ids[entry.seq], role=role, content=[InputTextOut(text=entry.content)]))
    return items


def call_id(owner: str, call: str) -> str:
    """An ``mcp_call`` item's id: its turn's (or session's) and the model's call id, which no transfer changes."""
    return f"mcp_{owner}_{call}"


def model_of(entries: Sequence[Entry], asked: str) -> str:
    """The assistant that answered last (a transfer may have changed it), else the one asked for."""
    for entry in reversed(entries):
        if entry.role == "assistant" and entry.assistant:
            return entry.assistant
    return asked


def response_object(
    turn: TurnView,
    entries: Sequence[Entry],
    *,
    session: str,
    model: str,
    base: int = -1,
    previous: str | None = None,
    metadata: dict[str, str] | None = None,
) -> ResponseObject:
    """The Response a turn is (its output: the entries it added — all of them, of which it shows
    what follows seq ``base``)."""
    outcome = OUTCOMES.get(turn.status, OUTCOMES[TurnStatus.FAILED])
    usage = ResponseUsage(
        input_tokens=turn.usage.input_tokens,
        output_tokens=turn.usage.output_tokens,
        total_tokens=turn.usage.input_tokens + turn.usage.output_tokens,
    )
    error = None
    if outcome.error is not None:
        error = ResponseError(code=outcome.error, message=turn.error or f"the turn ended {turn.status}")
    return ResponseObject(
        id=response_id(turn.id),
        created_at=epoch(turn.started_at),
        status=outcome.status,
        model=model_of(since(entries, base), model),
        output=items_of(entries, session=session, inputs=False, base=base),
        usage=usage if turn.status != PENDING else None,
        incomplete_details=IncompleteDetails(reason=outcome.reason) if outcome.reason else None,
        error=error,
        conversation=ResponseConversation(id=session),
        previous_response_id=previous,
        metadata=metadata or {},
    )


def chat_completion(turn: TurnView, entries: Sequence[Entry], *, model: str) -> ChatCompletion:
    """The chat completion a turn is; the turn's error when it gave no answer (``Outcome.chat_error``)."""
    outcome = OUTCOMES.get(turn.status, OUTCOMES[TurnStatus.FAILED])
    if outcome.finish_reason is None:
        kind = outcome.chat_error or TurnFailed
        why = f": {turn.error}" if turn.error else ""
        raise kind(
            f"turn {turn.id} ended {turn.status} without an answer{why}", code=f"turn_{turn.status}", turn=turn.id
        )
    texts = [e.content for e in entries if e.role == "assistant" and e.content]
    usage = ChatUsage(
        prompt_tokens=turn.usage.input_tokens,
        completion_tokens=turn.usage.output_tokens,
        total_tokens=turn.usage.input_tokens + turn.usage.output_tokens,
    )
    choice = ChatChoice(message=ChatAnswer(content="\n\n".join(texts)), finish_reason=outcome.finish_reason)
    return ChatCompletion(
        id=CHAT_PREFIX + turn.id,
        created=epoch(turn.started_at),
        model=model_of(entries, model),
        choices=[choice],
        usage=usage,
    )
