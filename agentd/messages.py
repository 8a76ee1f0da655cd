"""The canonical message model (RFC 0007 §1): the one definition of what a transcript holds.

Four kinds — user, assistant, system, tool result — as tagged, immutable msgspec Structs. Besides
the fields a provider sees, messages carry bookkeeping the transcript needs: the turn that produced
them and, for assistant messages, the model and assistant that spoke. Providers convert to and
from their wire shapes; nothing else in agentd knows about those shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

__all__ = [
    "AssistantMessage",
    "Message",
    "MessageError",
    "SystemMessage",
    "ToolCall",
    "ToolResult",
    "UserMessage",
    "is_empty_assistant",
    "system",
    "validate_request",
]


class ToolCall(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A tool the model asked for. ``arguments`` is always a JSON object.

    When the model sent argument text that is not a JSON object, ``arguments`` is empty and
    ``arguments_error`` says why; the loop answers such a call with a tool error and the invalid
    text is never sent back to a model.
    """

    id: str
    name: str
    arguments: dict[str, Any] = {}
    arguments_error: str | None = None


class _Message(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="role"):
    turn: str | None = None


class UserMessage(_Message, frozen=True, tag="user", kw_only=True):
    content: str
    images: tuple[str, ...] | None = None
    name: str | None = None


class AssistantMessage(_Message, frozen=True, tag="assistant", kw_only=True):
    content: str = ""
    thinking: str | None = None
    images: tuple[str, ...] | None = None
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    model: str | None = None
    assistant: str | None = None


class SystemMessage(_Message, frozen=True, tag="system", kw_only=True):
    """A system prompt. ``name`` is the assistant whose prompt it is (transfers rely on it)."""

    content: str
    images: tuple[str, ...] | None = None
    name: str | None = None


class ToolResult(_Message, frozen=True, tag="tool", kw_only=True):
    """The answer to one tool call; ``call_id`` pairs it with the call for providers that need ids.

    ``replayed``: the result an earlier run of the turn journaled, reused instead of running the
    tool again. ``outcome_unknown``: an earlier run started the call and never recorded a result,
    so it was not run again (RFC 0008 §5). Neither is sent to a model.
    """

    name: str
    content: str
    call_id: str = ""
    is_error: bool = False
    replayed: bool = False
    outcome_unknown: bool = False


Message = UserMessage | AssistantMessage | SystemMessage | ToolResult


class MessageError(ValueError):
    """A history that cannot be sent to a model; the message names the offending entry."""


def system(content: str, *, name: str | None = None) -> SystemMessage:
    """A system message (``name`` = the assistant whose prompt this is)."""
    return SystemMessage(content=content, name=name)


def is_empty_assistant(message: Message) -> bool:
    """An assistant message with no content, no thinking and no tool calls: it never enters history."""
    return (
        isinstance(message, AssistantMessage)
        and not message.content
        and not message.thinking
        and not message.tool_calls
    )


def validate_request(messages: Sequence[Message]) -> None:
    """Reject what no provider can take: an empty history, or a content-less user/assistant message."""
    if not messages:
        raise MessageError("cannot call a model with an empty history")
    for index, message in enumerate(messages):
        if isinstance(message, UserMessage) and not message.content and not message.images:
            raise MessageError(f"message {index} (user) has no content")
        if isinstance(message, AssistantMessage) and is_empty_assistant(message):
            raise MessageError(f"message {index} (assistant) has no content, thinking or tool calls")
