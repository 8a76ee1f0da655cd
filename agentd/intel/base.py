"""The provider interface the child loop calls, and the factory that builds one from config.

A provider turns a history plus tool specs into one assistant message (one ``complete`` — a step's
model call, never torn). While it reads the answer it hands each piece of content and thinking to
the request's ``sink`` as it arrives (RFC 0005 §7); the whole answer is still what ``complete``
returns, validated at the end, so a stream cut short is a failed call, never a short answer. Providers are built from an ``Intelligence`` and rebuilt on every swap,
so endpoint health starts fresh with the new intelligence.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

from agentd.budget import Usage
from agentd.config import Intelligence
from agentd.messages import AssistantMessage, Message
from agentd.tools import ToolSpec

__all__ = ["Completion", "CompletionRequest", "IntelError", "IntelErrorKind", "Provider", "StreamSink"]


class StreamSink(Protocol):
    """Where a provider hands an answer's pieces as they arrive (RFC 0005 §7).

    Calls never block and never fail the model call: the sink buffers, and whoever owns it sends
    the pieces on at its own pace. ``reset`` says that the pieces handed so far are void: the call
    is retried or failed over, and the answer starts again from nothing.
    """

    def content(self, text: str) -> None:
        """A piece of the answer's content."""
        ...

    def thinking(self, text: str) -> None:
        """A piece of the answer's thinking (reasoning)."""
        ...

    def reset(self, reason: str) -> None:
        """Forget the pieces handed since the call (or the last reset) began: a new attempt starts."""
        ...


class CompletionRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One model call: the history to send, the tools offered, provider options, time left, and
    where to hand the answer's pieces as they stream (None: nobody listens)."""

    messages: Sequence[Message]
    tools: Sequence[ToolSpec] = ()
    options: dict[str, Any] = {}
    deadline: float | None = None  # anyio.current_time() by which the call must end
    sink: StreamSink | None = None


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """What one model call produced. ``message`` carries no bookkeeping (turn/model set by the loop)."""

    message: AssistantMessage
    usage: Usage = Usage()
    model: str


class IntelErrorKind(enum.StrEnum):
    """Why a model call failed; decides whether the loop waits, fails over or gives up."""

    UNAVAILABLE = "unavailable"  # every endpoint down or retries spent: wait and retry until the deadline
    REQUEST = "request"  # the request was rejected (4xx): retrying the same request cannot help
    AUTH = "auth"  # 401/403: credentials wrong
    MALFORMED = "malformed"  # the server answered something that is not the wire format


class IntelError(Exception):
    """A model call that failed. The message never contains credentials."""

    def __init__(self, kind: IntelErrorKind, message: str) -> None:
        self.kind = kind
        super().__init__(message)


class Provider(Protocol):
    """A model client bound to one intelligence (provider, endpoints, model, options)."""

    intelligence: Intelligence
    # True while the call in flight has seen only unreachable endpoints: a deadline that cuts it
    # ends the turn ``intel_unavailable``, not ``deadline`` (RFC 0007 §6).
    failing: bool

    async def complete(self, request: CompletionRequest) -> Completion:
        """Call the model once. Raises IntelError on failure."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...
