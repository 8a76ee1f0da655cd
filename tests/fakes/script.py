"""What a fake model server is told to answer: replies (a model's answer) and faults.

A fake server pops one entry per chat request from its script; when the script is empty it uses
its default (a Reply, or a callable of the recorded request). Replies are rendered in the server's
wire format, streamed or not as the request asks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "FakeCall",
    "Fault",
    "Reply",
    "drop_mid_stream",
    "malformed_chunk",
    "raw",
    "stall",
    "status",
    "stream_error",
    "truncated",
]


@dataclass(frozen=True)
class FakeCall:
    """A tool call the fake model makes. ``arguments`` as a string is sent verbatim (invalid JSON tests)."""

    name: str
    arguments: dict[str, Any] | str = field(default_factory=dict)
    id: str | None = None  # None: the server invents one (when it sends ids at all)


@dataclass(frozen=True)
class Reply:
    """A model answer. ``think_tags`` puts the thinking into content as ``<think>…</think>``."""

    content: str = ""
    thinking: str | None = None
    tool_calls: tuple[FakeCall, ...] = ()
    input_tokens: int | None = 11
    output_tokens: int | None = 5
    pieces: int = 3  # content (and thinking) arrive in about this many deltas
    think_tags: bool = False
    finish_reason: str | None = None  # default: "tool_calls" with calls, else "stop"
    # When set, the server holds its answer until the event is set (at most 30 s): lets a test act
    # (swap a model, cancel a turn) while a step is known to be in flight.
    gate: threading.Event | None = field(default=None, compare=False)
    # When set, a streamed answer stops after ``midway_after`` records until the event is set (at
    # most 30 s): lets a test see part of an answer arrive while the rest is known to be held back.
    midway: threading.Event | None = field(default=None, compare=False)
    midway_after: int = 1
    # A streamed answer waits this long before each record after the first (a model writing).
    pace_ms: float = 0.0


FaultKind = Literal["status", "drop", "truncate", "malformed", "stall", "stream_error", "raw"]


@dataclass(frozen=True)
class Fault:
    """A failure to act out instead of (or in the middle of) a reply.

    ``after`` counts the stream records sent before the fault strikes; ``reply`` is the answer
    whose records are sent first.
    """

    kind: FaultKind
    status: int = 500
    message: str = "fault"
    headers: tuple[tuple[str, str], ...] = ()
    after: int = 1
    reply: Reply = Reply(content="partial answer that will not finish", pieces=6)
    echo_auth: bool = False  # put the request's Authorization header in the error body
    body: bytes | None = None  # raw body for kind="raw" (and an override for kind="status")


def status(code: int, message: str = "fault", *, retry_after: str | None = None, echo_auth: bool = False) -> Fault:
    """An HTTP error status with the wire's error body (and ``Retry-After`` when given)."""
    headers = (("Retry-After", retry_after),) if retry_after is not None else ()
    return Fault("status", status=code, message=message, headers=headers, echo_auth=echo_auth)


def drop_mid_stream(after: int = 2) -> Fault:
    """Send ``after`` records, then close the connection without ending the HTTP body."""
    return Fault("drop", after=after)


def truncated(after: int = 2) -> Fault:
    """Send ``after`` records and end the HTTP body cleanly, without the stream's terminator."""
    return Fault("truncate", after=after)


def malformed_chunk(after: int = 1) -> Fault:
    """Send ``after`` records, then a line that is not JSON, then the rest."""
    return Fault("malformed", after=after)


def stall(after: int = 1) -> Fault:
    """Send ``after`` records, then nothing until the client gives up (or the server stops)."""
    return Fault("stall", after=after)


def stream_error(message: str = "model runner crashed", after: int = 1) -> Fault:
    """Send ``after`` records, then the wire's mid-stream error record (HTTP status stays 200)."""
    return Fault("stream_error", message=message, after=after)


def raw(code: int, body: bytes, content_type: str = "application/json") -> Fault:
    """Answer with exactly this status and body."""
    return Fault("raw", status=code, body=body, headers=(("Content-Type", content_type),))
