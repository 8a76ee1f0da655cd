"""What a child's turn puts on its spans (RFC 0011 §4): the GenAI attributes of a finished model
call, tool call and turn, and message content when (and only when) capture is on.

Pure functions of agentd's own records over ``agentd.otel.Span``, so they cost nothing when
tracing is off (they are not even called: ``Tracing.capture`` is False and the span a no-op).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import msgspec

from agentd import events
from agentd.budget import TurnStatus, Usage
from agentd.intel.base import Completion
from agentd.messages import AssistantMessage, Message, SystemMessage, ToolResult, UserMessage
from agentd.otel import Span
from agentd.records import TurnRecord
from agentd.redact import SECRETS
from agentd.tools import ToolOutcome

__all__ = ["SPAN_EVENT_KEYS", "chat_done", "event_attributes", "input_messages", "tool_done", "turn_done"]

#: The statuses that end a turn well; any other is the span's ``error.type``.
_GOOD: Final = frozenset({TurnStatus.COMPLETED, TurnStatus.TRANSFERRED})
#: The session-event fields a span event keeps: names and numbers, never free text (an error
#: message may quote anything).
SPAN_EVENT_KEYS: Final = frozenset(
    {
        "model",
        "model_from",
        "model_to",
        "from",
        "to",
        "mode",
        "kind",
        "policy",
        "generation",
        "restarts",
        "discarded_steps",
    }
)


def _content(value: Any) -> str:
    """Message content as a span attribute: JSON, scrubbed of every secret this process holds."""
    return SECRETS.scrub(msgspec.json.encode(value).decode())


def _message(message: Message) -> dict[str, Any]:
    role = (
        "user" if isinstance(message, UserMessage) else "system" if isinstance(message, SystemMessage) else "assistant"
    )
    if isinstance(message, ToolResult):
        return {
            "role": "tool",
            "parts": [{"type": "tool_call_response", "id": message.call_id, "response": message.content}],
        }
    parts: list[dict[str, Any]] = [{"type": "text", "content": message.content}] if message.content else []
    if isinstance(message, AssistantMessage):
        parts += [
            {"type": "tool_call", "id": c.id, "name": c.name, "arguments": c.arguments} for c in message.tool_calls
        ]
    return {"role": role, "parts": parts}


def input_messages(messages: Sequence[Message]) -> dict[str, str]:
    """``gen_ai.input.messages``: the history a model call sends (capture on only)."""
    return {"gen_ai.input.messages": _content([_message(m) for m in messages])}


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "gen_ai.usage.input_tokens": usage.input_tokens,
        "gen_ai.usage.output_tokens": usage.output_tokens,
        "gen_ai.usage.cache_read.input_tokens": usage.cached_input_tokens or None,
        "gen_ai.usage.reasoning.output_tokens": usage.reasoning_tokens or None,
    }


def chat_done(span: Span, completion: Completion, *, capture: bool) -> None:
    """A model call answered: the response model, finish reason and usage as its server reported it."""
    attributes: dict[str, Any] = {
        "gen_ai.response.model": completion.response_model or completion.model,
        "gen_ai.response.finish_reasons": [completion.finish_reason] if completion.finish_reason else None,
        "agentd.usage.unreported": not completion.usage_reported or None,
    }
    if completion.usage_reported:
        attributes.update(_usage(completion.usage))
    if capture:
        attributes["gen_ai.output.messages"] = _content([_message(completion.message)])
    span.set(attributes)


def tool_done(
    span: Span, arguments: Mapping[str, Any], outcome: ToolOutcome, how: str | None, *, capture: bool
) -> None:
    """A tool call ended: an error result is the span's ``error.type`` (``tool_error``); the content only with capture on."""
    if how is not None:  # the journal answered it: replayed, or its outcome unknown (RFC 0008 §5)
        span.event(events.SPAN_TOOL_REPLAYED, {"agentd.tool.how": how})
    if outcome.is_error:
        span.fail("tool_error")
    if capture:
        span.set(
            {
                "gen_ai.tool.call.arguments": _content(dict(arguments)),
                "gen_ai.tool.call.result": SECRETS.scrub(outcome.content),
            }
        )


def turn_parked(span: Span, waiting: int) -> None:
    """The run stopped for ``waiting`` approvals (RFC 0012): the turn goes on later, in a run of its
    own, so this run's span ends neither completed nor failed."""
    span.set({"agentd.turn.status": "awaiting_approval", "agentd.approvals": waiting})


def turn_done(span: Span, record: TurnRecord) -> None:
    """The turn (run) ended: its status (``error.type`` unless it ended well) and what it spent."""
    span.set({"agentd.turn.status": record.status.value, "agentd.turn.steps": record.steps, **_usage(record.usage)})
    if record.status not in _GOOD:
        span.fail(record.status.value)


def event_attributes(data: Mapping[str, Any]) -> dict[str, Any]:
    """A session event's fields fit for a span event (``SPAN_EVENT_KEYS``, scalars only)."""
    return {
        f"agentd.{key}": value
        for key, value in data.items()
        if key in SPAN_EVENT_KEYS and isinstance(value, str | int | float | bool)
    }
